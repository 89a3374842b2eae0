"""A progress bar that needs no dependency: tqdm when it is installed, else a silent stand-in.

tqdm is an optional dependency (the ``tools`` extra, also pulled in by ``train`` and ``backend``):
the proxy never shows a progress bar, so a plain ``pip install .`` does not carry it, and the
commands that work after a plain install (``clairvoyant simulate``) run without it, silently.
"""

from __future__ import annotations

import importlib.util
from types import TracebackType
from typing import Any

__all__ = ["progress_bar"]


class _Silent:
    """The part of tqdm's interface the commands use: a context manager with ``update(n)``."""

    def __enter__(self) -> _Silent:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def progress_bar(**kwargs: Any) -> Any:
    """``tqdm(**kwargs)`` when tqdm is installed, else an object that accepts the same calls and shows nothing."""
    if importlib.util.find_spec("tqdm") is None:
        return _Silent()
    from tqdm import tqdm

    return tqdm(**kwargs)
