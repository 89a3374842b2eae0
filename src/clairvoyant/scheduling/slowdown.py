"""The starvation guard's slowdown factor, fixed or following the measured service-time spread.

A request is overdue after ``tau + slowdown x predicted_s``. Under FCFS the mean wait in mean
services is ``rho (1 + CV^2) / (2 (1 - rho))`` (Pollaczek-Khinchine), so ``AdaptiveSlowdown`` is
``base x (1 + CV^2)``, CV^2 over the last ``window`` measured service times (``prior_cv2`` until
``min_samples``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

__all__ = ["AdaptiveSlowdown", "SlowdownRule"]


class SlowdownRule(Protocol):
    def value(self) -> float:
        """The slowdown factor to use for a request queued now (>= 0)."""
        ...


class AdaptiveSlowdown:
    def __init__(self, base: float, *, window: int = 512, prior_cv2: float = 0.25, min_samples: int = 20) -> None:
        if not base >= 0:
            raise ValueError("base must be >= 0")
        self.base = base
        self.prior_cv2 = prior_cv2
        self.min_samples = min_samples
        self._window: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self._sumsq = 0.0

    def observe(self, service_s: float) -> None:
        if not (service_s > 0 and math.isfinite(service_s)):
            return
        if len(self._window) == self._window.maxlen:
            old = self._window[0]
            self._sum -= old
            self._sumsq -= old * old
        self._window.append(service_s)
        self._sum += service_s
        self._sumsq += service_s * service_s

    def cv2(self) -> float:
        """Squared coefficient of variation of the recent service times (the prior until enough data)."""
        n = len(self._window)
        if n < self.min_samples:
            return self.prior_cv2
        mean = self._sum / n
        var = max(self._sumsq / n - mean * mean, 0.0)
        return var / (mean * mean) if mean > 0 else self.prior_cv2

    def value(self) -> float:
        return self.base * (1.0 + self.cv2())

    def describe(self) -> dict[str, float]:
        return {"base": self.base, "cv2": self.cv2(), "slowdown": self.value(), "samples": float(len(self._window))}
