"""Time as an injected dependency: the proxy uses the monotonic clock, tests and the simulator a manual one."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "MonotonicClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences are meaningful)."""
        ...


class MonotonicClock:
    now = staticmethod(time.monotonic)  # the C function itself: no Python frame per reading (several a request)


class ManualClock:
    """A clock that moves only when told to (unit tests, discrete-event simulation)."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._t += seconds

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError("time cannot go backwards")
        self._t = t
