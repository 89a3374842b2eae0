"""The two C extensions: the feature extractor's term sum (src/clairvoyant/prediction/_term_sum.c; docs/benchmarks.md
section 20) and the model's tree walk (_forest.c; section 28). pyproject.toml holds everything else. Both optional:
where no C compiler is found the install goes on, features.py computes the same sum in Python, and ONNX Runtime runs
the model, both slower."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("clairvoyant.prediction._term_sum", ["src/clairvoyant/prediction/_term_sum.c"], optional=True),
        Extension("clairvoyant.prediction._forest", ["src/clairvoyant/prediction/_forest.c"], optional=True),
    ]
)
