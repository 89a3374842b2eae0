"""Progress displays that need no dependency.

tqdm is an optional dependency (the ``tools`` extra, also pulled in by ``train`` and ``backend``):
the proxy never shows a progress bar, so a plain ``pip install .`` may lack it, and the commands that
work after a plain install run without it.

* ``progress_bar(**tqdm_kwargs)``: tqdm when it is installed, else a silent stand-in.
* ``progress(total, desc=...)``: for a person or for a log. On a terminal, tqdm's bar (or, without
  tqdm, one line rewritten in place); anywhere else (a pipe, a file, CI's log) one plain line per
  step, ``desc: done/total``, with no carriage returns to garble it.
"""

from __future__ import annotations

import importlib.util
import sys
from types import TracebackType
from typing import IO, Any

__all__ = ["progress", "progress_bar"]


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


class _Counter(_Silent):
    """``desc: done/total``: one line per update (``in_place=False``), or one line rewritten in place
    (a terminal without tqdm), ended with a newline when the block exits."""

    def __init__(self, total: int, desc: str, file: IO[str], *, in_place: bool) -> None:
        self.total, self.desc, self.file, self.in_place = total, desc, file, in_place
        self.done = 0

    def update(self, n: int = 1) -> None:
        self.done += n
        text = f"{self.desc}: {self.done}/{self.total}"
        self.file.write(f"\r{text}" if self.in_place else f"{text}\n")
        self.file.flush()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.in_place and self.done:
            self.file.write("\n")
            self.file.flush()


def progress(total: int, *, desc: str, unit: str = "it", file: IO[str] | None = None) -> Any:
    """A context manager with ``update(n=1)`` that shows ``total`` steps on ``file`` (default
    standard error): a bar on a terminal, plain lines elsewhere (module docstring)."""
    file = sys.stderr if file is None else file
    isatty = getattr(file, "isatty", None)
    if not (callable(isatty) and isatty()):
        return _Counter(total, desc, file, in_place=False)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total, desc, file, in_place=True)
    return tqdm(total=total, desc=desc, unit=unit, file=file)


def progress_bar(**kwargs: Any) -> Any:
    """``tqdm(**kwargs)`` when tqdm is installed, else an object that accepts the same calls and shows nothing."""
    if importlib.util.find_spec("tqdm") is None:
        return _Silent()
    from tqdm import tqdm

    return tqdm(**kwargs)
