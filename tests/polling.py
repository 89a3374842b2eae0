"""Waiting in tests: poll a condition until it holds, or fail naming what never happened.

A test that waits for something it cannot be told about (a queue's length, a metric, a file, a
process gone, a port open) polls it here. It never sleeps a fixed time in the hope that the event
has happened by then: that is slow where the machine is fast and flaky where it is loaded.
``wait_until`` blocks its thread; ``until`` is the same for a coroutine and keeps its event loop
running between polls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

INTERVAL_S = 0.005  # between polls: short against every wait in the suite, long against a poll


def wait_until(
    predicate: Callable[[], object], timeout_s: float = 5.0, what: str = "condition", interval_s: float = INTERVAL_S
) -> None:
    """Return once ``predicate()`` is true; raise AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


async def until(
    predicate: Callable[[], object], timeout_s: float = 5.0, what: str = "condition", interval_s: float = INTERVAL_S
) -> None:
    """``wait_until`` for a coroutine: the event loop runs other tasks between polls."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)


async def settle(turns: int = 5) -> None:
    """Let the event loop run the tasks that are ready, ``turns`` times over. No time passes and no
    I/O is waited for: for code that only passes control between tasks on one loop (the dispatcher
    under a manual clock) the same turns always suffice, and a test can then assert what did *not*
    happen, which polling cannot."""
    for _ in range(turns):
        await asyncio.sleep(0)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
