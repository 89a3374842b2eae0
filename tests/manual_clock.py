"""A clock that moves only when told to: the unit tests' ``clairvoyant.clock.Clock``."""

from __future__ import annotations

__all__ = ["ManualClock"]


class ManualClock:
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
