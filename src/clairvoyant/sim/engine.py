"""The event loop: a non-preemptive ``slots``-server queue in virtual time.

It drives the proxy's own ``JobQueue`` and ``SchedulingPolicy`` (no simulator-side SJF): every
dispatch decision is ``queue.pop(now)`` at the moment a slot frees, exactly as a dispatcher worker
calls ``pop(clock.now())`` when its slot is released, and the starvation rule fires inside that
pop. A running request is never interrupted.

Event order at equal times: every arrival at time t is queued before the dispatch decision at t
(a burst at t = 0 is therefore ordered by the policy from the first pop on). Slots free at the
same time are served lowest index first. Work-conserving: a slot is never idle while a request
waits.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from clairvoyant.job_queue import JobQueue
from clairvoyant.policy import SchedulingPolicy, make_policy
from clairvoyant.sim.workload import Workload

__all__ = ["Schedule", "simulate"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """What happened to each request of a workload (arrays indexed like the workload)."""

    start_s: np.ndarray  # virtual seconds when a slot was granted
    end_s: np.ndarray  # virtual seconds when the backend finished
    slot: np.ndarray  # which slot served it
    order: np.ndarray  # request indices in dispatch order
    promoted: np.ndarray  # bool: dispatched by the starvation rule against the key order
    promotions: int  # JobQueue.promotions at the end

    def wait_s(self, workload: Workload) -> np.ndarray:
        """Queueing delay: slot granted minus arrival."""
        return self.start_s - workload.arrival_s

    def sojourn_s(self, workload: Workload) -> np.ndarray:
        """End-to-end latency: wait + service."""
        return self.end_s - workload.arrival_s


def simulate(
    workload: Workload,
    scores: np.ndarray,
    *,
    policy: str | SchedulingPolicy = "sjf",
    starvation_timeout_s: float = math.inf,
    slots: int = 1,
) -> Schedule:
    """Run ``workload`` through a fresh ``JobQueue(policy, starvation_timeout_s)`` with ``slots`` servers.

    ``scores[i]`` is what request i is pushed with (the policy turns it into the heap key).
    Raises ValueError on mismatched lengths, ``slots`` < 1 or a non-positive timeout (the queue's rule).
    """
    n = len(workload)
    if len(scores) != n:
        raise ValueError("one score per request is needed")
    if slots < 1:
        raise ValueError("slots must be >= 1")
    pol = make_policy(policy) if isinstance(policy, str) else policy
    queue: JobQueue[int] = JobQueue(pol, starvation_timeout_s=starvation_timeout_s)

    arrival = workload.arrival_s.tolist()
    service = workload.service_s.tolist()
    score = np.asarray(scores, dtype=np.float64).tolist()
    start = [0.0] * n
    end = [0.0] * n
    slot_of = [0] * n
    promoted = [False] * n
    order: list[int] = []

    free: list[tuple[float, int]] = [(-math.inf, s) for s in range(slots)]  # (free at, slot)
    now = -math.inf  # decision times never go backwards
    nxt = 0  # next request to arrive
    push, pop = queue.push, queue.pop
    for _ in range(n):
        free_at, slot = heapq.heappop(free)
        t = free_at if free_at > now else now
        if not queue and arrival[nxt] > t:
            t = arrival[nxt]  # idle until the next arrival
        while nxt < n and arrival[nxt] <= t:
            push(nxt, score[nxt], arrival[nxt])
            nxt += 1
        before = queue.promotions
        job = pop(t)
        assert job is not None  # the queue holds at least the arrival at t
        i = job.payload
        start[i] = t
        end[i] = t + service[i]
        slot_of[i] = slot
        promoted[i] = queue.promotions != before
        order.append(i)
        heapq.heappush(free, (end[i], slot))
        now = t
    return Schedule(
        start_s=np.asarray(start),
        end_s=np.asarray(end),
        slot=np.asarray(slot_of, dtype=np.int32),
        order=np.asarray(order, dtype=np.int64),
        promoted=np.asarray(promoted, dtype=bool),
        promotions=queue.promotions,
    )
