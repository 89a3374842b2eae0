"""The waiting queue: a min-heap of ``(key, seq, job)`` plus an arrival index and the starvation rule.

Synchronous and clock-free: callers pass ``now`` in, so the proxy (monotonic clock) and the
discrete-event simulator (virtual time) drive this very code. Keys are fixed at push; the
starvation rule (paper 3.4) is applied when popping: if the longest-waiting job has waited longer
than ``starvation_timeout_s``, it goes next regardless of its key.

Removal is lazy in the heap (a removed job is skipped when it surfaces) and eager in the arrival
index; the heap is rebuilt when dead entries outnumber live ones, so memory stays bounded.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from clairvoyant.errors import QueueFull
from clairvoyant.policy import SchedulingPolicy

__all__ = ["JobQueue", "QueuedJob"]

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class QueuedJob(Generic[T]):
    """One waiting request. Never compared: the heap compares (key, seq) only."""

    payload: T
    score: float  # the predictor's scheduling score (lower = shorter)
    arrival_s: float  # clock seconds when the request arrived
    seq: int  # arrival order; breaks key ties
    key: float  # the policy's key, computed once at push
    waiting: bool = field(default=True)  # False once popped or removed


class JobQueue(Generic[T]):
    def __init__(
        self,
        policy: SchedulingPolicy,
        *,
        starvation_timeout_s: float = math.inf,
        max_size: int | None = None,
        retry_after_s: int = 5,
    ) -> None:
        if starvation_timeout_s <= 0:
            raise ValueError("starvation_timeout_s must be > 0 (math.inf disables it)")
        self.policy = policy
        self.starvation_timeout_s = starvation_timeout_s
        self.max_size = max_size
        self.retry_after_s = retry_after_s
        self.promotions = 0  # pops decided by the starvation rule against the key order
        self._heap: list[tuple[float, int, QueuedJob[T]]] = []
        self._by_arrival: OrderedDict[int, QueuedJob[T]] = OrderedDict()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._by_arrival)

    def push(self, payload: T, score: float, arrival_s: float) -> QueuedJob[T]:
        """Queue a job. Raises ``QueueFull`` at capacity. ``arrival_s`` must not decrease between calls."""
        if self.max_size is not None and len(self._by_arrival) >= self.max_size:
            raise QueueFull(
                f"the scheduling queue is full ({self.max_size} requests waiting); retry later",
                retry_after_s=self.retry_after_s,
            )
        seq = next(self._seq)
        job = QueuedJob(payload, score, arrival_s, seq, self.policy.key(score, arrival_s))
        heapq.heappush(self._heap, (job.key, seq, job))
        self._by_arrival[seq] = job
        return job

    def remove(self, job: QueuedJob[T]) -> bool:
        """Withdraw a waiting job (its client left). Returns False if it was no longer waiting."""
        if not job.waiting:
            return False
        job.waiting = False
        del self._by_arrival[job.seq]
        self._maybe_compact()
        return True

    def pop(self, now: float) -> QueuedJob[T] | None:
        """The next job to dispatch at time ``now``, or None if nothing waits."""
        if not self._by_arrival:
            return None
        self._drop_dead_top()
        oldest = next(iter(self._by_arrival.values()))
        head = self._heap[0][2]
        job = head
        if oldest is not head and now - oldest.arrival_s > self.starvation_timeout_s:
            job = oldest
            self.promotions += 1
        if job is head:
            heapq.heappop(self._heap)
        job.waiting = False
        del self._by_arrival[job.seq]
        self._maybe_compact()
        return job

    def __iter__(self) -> Iterator[QueuedJob[T]]:
        """Waiting jobs in key order (the order they would go in if no starvation fired)."""
        return iter(sorted(self._by_arrival.values(), key=lambda j: (j.key, j.seq)))

    def _drop_dead_top(self) -> None:
        heap = self._heap
        while heap and not heap[0][2].waiting:
            heapq.heappop(heap)

    def _maybe_compact(self) -> None:
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._by_arrival):
            self._heap = [entry for entry in self._heap if entry[2].waiting]
            heapq.heapify(self._heap)
