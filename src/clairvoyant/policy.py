"""Scheduling policies: how a waiting request's heap key is computed, once, when it is queued.

A policy is one method, ``key(score, arrival_s)``; the queue orders by ``(key, seq)`` ascending and
applies the starvation rule itself, so every policy gets it. Keys never depend on "now": a heap
whose keys change with time is not a heap. Policies whose priority ages with time (HRRN, EWSJF)
would need a scanning queue and are deliberately not expressible here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["POLICIES", "FcfsPolicy", "SchedulingPolicy", "SjfPolicy", "make_policy"]


class SchedulingPolicy(Protocol):
    name: str

    def key(self, score: float, arrival_s: float) -> float:
        """Heap key for a request; lower is dispatched earlier. ``score`` is the predictor's
        scheduling score (P(Long), or the true length under the benchmark's oracle)."""
        ...


@dataclass(frozen=True, slots=True)
class FcfsPolicy:
    """First come, first served: the same proxy, arrival order. The baseline for every benchmark."""

    name: str = "fcfs"

    def key(self, score: float, arrival_s: float) -> float:
        return arrival_s


@dataclass(frozen=True, slots=True)
class SjfPolicy:
    """Shortest predicted job first (paper 3.4): ascending continuous score, ties by arrival."""

    name: str = "sjf"

    def key(self, score: float, arrival_s: float) -> float:
        return score


POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "fcfs": FcfsPolicy,
    "sjf": SjfPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
