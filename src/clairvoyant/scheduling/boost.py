"""gamma-boost (paper 002, digest section 2): key = arrival_s - b, with b in seconds; the reasons
and figures are in docs/scheduling.md ("Policies").

``b_gamma(S) = (1/gamma) ln(1 / (1 - exp(-gamma S)))``: gamma -> inf is FCFS, gamma -> 0 is SJF.
Per prediction bucket l, ``b(l) = (1/gamma) ln(M_l / (M_l - 1))`` with ``M_l = mean(exp(gamma S))``
over the *measured* service times of the bucket's completed requests (blended with the predicted
seconds until it has data): a bucket whose real sizes are dispersed gets a small boost, so a weak
predictor degrades toward FCFS.

Every boost is capped at ``max_boost_s``: a later arrival j passes a waiting i only if ``a_j - a_i <
b_j - b_i <= max_boost_s``, so after waiting that long nobody new passes i (within its class),
whatever gamma is. Automatic gamma (digest 2b): the positive root of ``gamma = lambda
(mean(exp(gamma S)) - 1)``; at rho >= 1 there is none and the manual gamma stays.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BoostTable", "bucket_for", "solve_gamma"]

_BUCKETS_PER_OCTAVE = 2
_BUCKET_BASE_S = 0.25  # bucket 0 holds predictions up to this many seconds
_MAX_BUCKET = 31
_PRIOR_WEIGHT = 5.0  # a bucket's predicted seconds count as this many measurements


def bucket_for(predicted_s: float) -> int:
    """The prediction bucket of a predicted service time: half-octaves from 0.25 s."""
    if not predicted_s > _BUCKET_BASE_S:
        return 0
    return min(_MAX_BUCKET, 1 + int(_BUCKETS_PER_OCTAVE * math.log2(predicted_s / _BUCKET_BASE_S)))


def solve_gamma(rate_per_s: float, services_s: Sequence[float]) -> float | None:
    """Positive root of gamma = rate (mean(exp(gamma S)) - 1), or None when rho >= 1 (no root)."""
    if rate_per_s <= 0 or not services_s:
        return None
    n = len(services_s)
    mean = sum(services_s) / n
    if rate_per_s * mean >= 1.0:
        return None

    def f(g: float) -> float:
        return rate_per_s * (sum(math.exp(min(g * s, 700.0)) for s in services_s) / n - 1.0) - g

    lo, hi = 1e-9, 1.0 / max(mean, 1e-9)
    while f(hi) < 0:  # f < 0 just above 0 (rho < 1) and grows without bound
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return None
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


@dataclass(slots=True)
class _Bucket:
    exp_sum: float = 0.0  # sum of exp(gamma S) over the window (recomputed when gamma changes)
    measured_s: deque[float] = field(default_factory=lambda: deque(maxlen=256))


class BoostTable:
    """Boosts per prediction bucket, learned from completed requests; gamma manual or automatic.

    ``boost(job_bucket, predicted_s)`` is read at push; ``observe(bucket, measured_s, arrival_s)``
    at completion. Everything is in seconds.
    """

    def __init__(
        self,
        gamma_per_s: float = 0.05,
        *,
        max_boost_s: float = 60.0,
        auto_gamma: bool = False,
        window: int = 512,
    ) -> None:
        if not gamma_per_s > 0:
            raise ValueError("gamma must be > 0")
        if not max_boost_s > 0:
            raise ValueError("max_boost_s must be > 0")
        self.gamma_per_s = gamma_per_s
        self.max_boost_s = max_boost_s
        self.auto_gamma = auto_gamma
        self._buckets: dict[int, _Bucket] = {}
        self._recent_s: deque[float] = deque(maxlen=window)
        self._arrivals_s: deque[float] = deque(maxlen=window)
        self._since_refit = 0

    def boost(self, bucket: int, predicted_s: float) -> float:
        """The boost in seconds for a job of ``bucket`` predicted to take ``predicted_s``."""
        g = self.gamma_per_s
        prior = math.exp(min(g * max(predicted_s, 1e-9), 700.0))
        data = self._buckets.get(bucket)
        if data is None or not data.measured_s:
            m = prior
        else:
            m = (data.exp_sum + _PRIOR_WEIGHT * prior) / (len(data.measured_s) + _PRIOR_WEIGHT)
        b = math.log(m / (m - 1.0)) / g if m > 1.0 else self.max_boost_s
        return min(b, self.max_boost_s)

    def note_arrival(self, arrival_s: float) -> None:
        """Record an arrival time (the arrival rate for automatic gamma)."""
        self._arrivals_s.append(arrival_s)

    def observe(self, bucket: int, measured_s: float) -> None:
        """A completed request of ``bucket`` took ``measured_s`` seconds of service."""
        data = self._buckets.get(bucket)
        if data is None:
            data = self._buckets[bucket] = _Bucket()
        if len(data.measured_s) == data.measured_s.maxlen:
            data.exp_sum -= math.exp(min(self.gamma_per_s * data.measured_s[0], 700.0))
        data.measured_s.append(measured_s)
        data.exp_sum += math.exp(min(self.gamma_per_s * measured_s, 700.0))
        self._recent_s.append(measured_s)
        self._since_refit += 1
        if self.auto_gamma and self._since_refit >= 32:
            self._since_refit = 0
            self.refit_gamma()

    def refit_gamma(self) -> None:
        """Set gamma from the fixed-point rule when it has a root (over the recent arrival rate)."""
        a = self._arrivals_s
        rate_per_s = (len(a) - 1) / (a[-1] - a[0]) if len(a) >= 2 and a[-1] > a[0] else 0.0
        g = solve_gamma(rate_per_s, list(self._recent_s))
        if g is not None and g > 0:
            self.gamma_per_s = g
            for data in self._buckets.values():
                data.exp_sum = sum(math.exp(min(g * s, 700.0)) for s in data.measured_s)

    def describe(self) -> dict[str, float | bool]:
        return {
            "gamma_per_s": self.gamma_per_s,
            "auto_gamma": self.auto_gamma,
            "starvation_bound_s": self.max_boost_s,
            "buckets_learned": len(self._buckets),
        }
