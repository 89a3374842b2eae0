"""The event loop: a non-preemptive ``slots``-server queue in virtual time.

It drives the proxy's own queue (``policy.build_queue``: policy, starvation guard, fair share;
no simulator-side SJF): every dispatch decision is ``queue.pop(now)`` at the moment a slot frees, exactly as a dispatcher worker
calls ``pop(clock.now())`` when its slot is released, and the starvation rule fires inside that
pop; each completion is ``queue.done(job)``, as the dispatcher reports a released slot. A running request is never interrupted.

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

from clairvoyant.scheduling.boost import bucket_for
from clairvoyant.scheduling.job_queue import Job
from clairvoyant.scheduling.policy import PolicyParams, SchedulingPolicy, build_queue, make_policy
from clairvoyant.scheduling.service_time import ServiceTimeModel
from clairvoyant.scheduling.slowdown import AdaptiveSlowdown
from clairvoyant.tools.sim.workload import Workload

__all__ = ["Beliefs", "Schedule", "simulate"]


@dataclass(frozen=True, slots=True)
class Beliefs:
    """What the scheduler believes about each request (arrays indexed like the workload)."""

    score: np.ndarray  # float64 predictor score, unitless, lower = shorter (sjf's key)
    predicted_s: np.ndarray  # float64 predicted service seconds (boost, hrrn, fair share)
    bucket: np.ndarray  # int64 prediction bucket (boost's bucket-conditioned table)
    predicted_tokens: np.ndarray | None = None  # float64 predicted output tokens, when the predictor has them

    @classmethod
    def from_scores(cls, scores: np.ndarray, predicted_s: np.ndarray | None = None) -> Beliefs:
        """Scores only: predicted seconds default to the scores themselves (an oracle's scores are seconds)."""
        score = np.asarray(scores, dtype=np.float64)
        pred = np.maximum(score if predicted_s is None else np.asarray(predicted_s, dtype=np.float64), 1e-3)
        return cls(score, pred, np.array([bucket_for(float(v)) for v in pred], dtype=np.int64))


@dataclass(frozen=True, slots=True)
class Schedule:
    """What happened to each request of a workload (arrays indexed like the workload)."""

    start_s: np.ndarray  # virtual seconds when a slot was granted
    end_s: np.ndarray  # virtual seconds when the backend finished
    slot: np.ndarray  # which slot served it
    order: np.ndarray  # request indices in dispatch order
    promoted: np.ndarray  # bool: dispatched by a starvation rule against the policy's order
    promotions: int  # number of promoted dispatches

    def wait_s(self, workload: Workload) -> np.ndarray:
        """Queueing delay: slot granted minus arrival."""
        return self.start_s - workload.arrival_s

    def sojourn_s(self, workload: Workload) -> np.ndarray:
        """End-to-end latency: wait + service."""
        return self.end_s - workload.arrival_s


def simulate(
    workload: Workload,
    scores: np.ndarray | Beliefs,
    *,
    policy: str | SchedulingPolicy = "sjf",
    starvation_timeout_s: float = math.inf,
    starvation_slowdown: float | AdaptiveSlowdown = 0.0,
    slots: int = 1,
    fair_share: bool = False,
    params: PolicyParams | None = None,
    priority: np.ndarray | None = None,
    service_time: ServiceTimeModel | None = None,
) -> Schedule:
    """Run ``workload`` through the proxy's queue (``policy.build_queue``) with ``slots`` servers.

    ``scores`` is a ``Beliefs`` (score, predicted seconds, bucket per request) or plain scores
    (then predicted seconds = scores). A fresh policy is built per run (its learned state, e.g.
    boost's bucket table, starts empty) and told each completion at its virtual end time, as the
    dispatcher tells it when a request ends. An ``AdaptiveSlowdown`` is told each completion too. ``priority`` (int per request, lower = sooner) and
    the workload's tenants feed the job record. With ``service_time`` (and predicted tokens in the
    beliefs) predicted seconds come from that online model as in the proxy: predicted at arrival,
    taught each completion's measured seconds with the predicted tokens (as the dispatcher does: see
    ``Dispatcher._learn``). Raises ValueError on mismatched lengths,
    ``slots`` < 1 or a non-positive timeout.
    """
    n = len(workload)
    beliefs = scores if isinstance(scores, Beliefs) else Beliefs.from_scores(scores)
    if len(beliefs.score) != n:
        raise ValueError("one score per request is needed")
    if slots < 1:
        raise ValueError("slots must be >= 1")
    pol = make_policy(policy, params) if isinstance(policy, str) else policy
    queue = build_queue(
        pol, starvation_timeout_s=starvation_timeout_s, starvation_slowdown=starvation_slowdown, fair_share=fair_share
    )

    arrival = workload.arrival_s.tolist()
    service = workload.service_s.tolist()
    score = beliefs.score.tolist()
    pred = beliefs.predicted_s.tolist()
    bucket = beliefs.bucket.tolist()
    tokens = None if beliefs.predicted_tokens is None else beliefs.predicted_tokens.tolist()
    learn = service_time is not None and tokens is not None
    prio = [0] * n if priority is None else [int(p) for p in priority]
    tenant = [""] * n if workload.tenant is None else [str(t) for t in workload.tenant.tolist()]
    jobs: list[Job[int] | None] = [None] * n
    start = [0.0] * n
    end = [0.0] * n
    slot_of = [0] * n
    promoted = [False] * n
    order: list[int] = []
    promotions = 0

    free: list[tuple[float, int]] = [(-math.inf, s) for s in range(slots)]  # (free at, slot)
    running: list[tuple[float, int]] = []  # (end, request) not yet reported to the policy
    now = -math.inf  # decision times never go backwards
    nxt = 0  # next request to arrive
    push, pop, done, observe = queue.push, queue.pop, queue.done, pol.observe
    spread = starvation_slowdown if isinstance(starvation_slowdown, AdaptiveSlowdown) else None
    for _ in range(n):
        free_at, slot = heapq.heappop(free)
        t = free_at if free_at > now else now
        if not len(queue) and arrival[nxt] > t:
            t = arrival[nxt]  # idle until the next arrival
        while running and running[0][0] <= t:  # completions reach the policy before the decision
            _, finished = heapq.heappop(running)
            done(jobs[finished])  # type: ignore[arg-type]
            observe(jobs[finished], service[finished])  # type: ignore[arg-type]
            if spread is not None:
                spread.observe(service[finished])
            if learn:
                service_time.observe(None, 0, round(tokens[finished]), service[finished])  # type: ignore[union-attr,index]
        while nxt < n and arrival[nxt] <= t:
            if learn:
                p_s = service_time.predict_s(None, 0, tokens[nxt])  # type: ignore[union-attr,index]
                job = Job(
                    nxt, arrival[nxt], score[nxt], tokens[nxt], p_s, bucket_for(p_s), None, prio[nxt], tenant[nxt]
                )  # type: ignore[index]
            else:
                job = Job(nxt, arrival[nxt], score[nxt], 0.0, pred[nxt], bucket[nxt], None, prio[nxt], tenant[nxt])
            jobs[nxt] = job
            push(job)
            nxt += 1
        got = pop(t)
        assert got is not None  # the queue holds at least the arrival at t
        job, was_promoted = got
        i = job.payload
        start[i] = t
        end[i] = t + service[i]
        slot_of[i] = slot
        promoted[i] = was_promoted
        promotions += was_promoted
        order.append(i)
        heapq.heappush(free, (end[i], slot))
        heapq.heappush(running, (end[i], i))
        now = t
    return Schedule(
        start_s=np.asarray(start),
        end_s=np.asarray(end),
        slot=np.asarray(slot_of, dtype=np.int32),
        order=np.asarray(order, dtype=np.int64),
        promoted=np.asarray(promoted, dtype=bool),
        promotions=promotions,
    )
