"""The C extension: the feature extractor's term sum (src/clairvoyant/prediction/_term_sum.c; docs/benchmarks.md
section 20). pyproject.toml holds everything else. Optional: where no C compiler is found the install goes on, and
features.py computes the same sum in Python, slower."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("clairvoyant.prediction._term_sum", ["src/clairvoyant/prediction/_term_sum.c"], optional=True),
    ]
)
