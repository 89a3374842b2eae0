"""Queue deadlines: the waiting jobs that carry one (``Job.expires_s``), soonest first.

A job whose deadline has come (``now >= expires_s``) must never be sent: it is withdrawn and
answered at once. ``Expiry`` finds those without looking at the others: a min-heap of
``(expires_s, seq, job)``, O(log n) per job with a deadline, nothing for one without. Entries of
jobs that left the queue are dropped lazily; the heap is rebuilt when they outnumber the waiting.

Clock-free like the queues. The caller withdraws what ``due(now)`` returns (``JobQueue.remove``),
and checks a job it has already taken from the queue (held back for a busy backend) itself.
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

from clairvoyant.scheduling.job_queue import Job

__all__ = ["Expiry", "expired"]

T = TypeVar("T")


def expired(job: Job[T], now: float) -> bool:
    """True once ``job``'s queue deadline has come: it may not be dispatched at ``now``."""
    return now >= job.expires_s


class Expiry(Generic[T]):
    """Waiting jobs with a queue deadline, by deadline (then arrival order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Job[T]]] = []
        self._limit = 64  # rebuilt past this many entries: twice the waiting ones at the last rebuild

    def __len__(self) -> int:  # entries held, lingering ones included
        return len(self._heap)

    def add(self, job: Job[T]) -> None:
        if math.isinf(job.expires_s):
            return
        heap = self._heap
        heapq.heappush(heap, (job.expires_s, job.seq, job))
        if len(heap) > self._limit:  # amortised O(1): each rebuild follows as many adds as it keeps
            self._heap = heap = [entry for entry in heap if entry[2].waiting]
            heapq.heapify(heap)
            self._limit = max(64, 2 * len(heap))

    def due(self, now: float) -> list[Job[T]]:
        """The waiting jobs whose deadline has come by ``now``, soonest first, no longer tracked."""
        heap = self._heap
        out = []
        while heap and heap[0][0] <= now:
            job = heapq.heappop(heap)[2]
            if job.waiting:
                out.append(job)
        return out

    def next_s(self) -> float:
        """The soonest deadline of a waiting job (clock seconds), ``math.inf`` if none."""
        heap = self._heap
        while heap and not heap[0][2].waiting:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf
