"""Atomic state files: what the learner and the service-time model keep across restarts.

A reader never sees a half-written file: the new state goes to a temporary file in the same folder,
is fsynced, then renamed over the old one (``os.replace`` is atomic on one filesystem). A failure
removes the temporary file and leaves the old state as it was.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_writer"]


@contextmanager
def atomic_writer(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A file object to write the new contents of ``path`` into (``mode`` "w" or "wb"); replaces
    ``path`` when the block ends without an error, and never otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
