"""Time as an injected dependency: the proxy reads the monotonic clock, the tests a manual one
(tests/manual_clock.py)."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences are meaningful)."""
        ...


class MonotonicClock:
    now = staticmethod(time.monotonic)  # the C function itself: no Python frame per reading (several a request)
