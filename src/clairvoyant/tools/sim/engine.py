"""The event loop: a non-preemptive ``slots``-server queue in virtual time.

It drives the proxy's own queue (``policy.build_queue``: policy, starvation guard, fair share;
no simulator-side SJF): every dispatch decision is ``queue.pop(now)`` at the moment a slot frees, exactly as a dispatcher worker
calls ``pop(clock.now())`` when its slot is released, and the starvation rule fires inside that
pop; each completion is ``queue.done(job)``, as the dispatcher reports a released slot. A running request is never interrupted.

Event order at equal times: every arrival at time t is queued before the dispatch decision at t
(a burst at t = 0 is therefore ordered by the policy from the first pop on). Slots free at the
same time are served lowest index first. Work-conserving: a slot is never idle while a request
waits.

Models (a workload with a ``model`` column): each slot is a backend that holds one model. A request
for another model first pays ``switch_s`` seconds of load. The decision is the proxy's:
``queue.pop_for(now, [Lane])`` (scheduling/affinity.py) with what the slot holds, its last switch and
the load cost it believes (``ServiceTimeModel.load_s``, taught each load as Ollama's
``load_duration`` teaches the proxy), and a request sent to a slot without its model is charged
that load in fair share, as the dispatcher charges it.

Queue deadlines (a workload with ``max_wait_s``): at each decision the jobs whose deadline has come
are withdrawn first (``scheduling.expiry.Expiry``, as the dispatcher does), so no request is ever
dispatched at or after its deadline; a withdrawn request is never served.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from clairvoyant.scheduling.affinity import Lane
from clairvoyant.scheduling.boost import bucket_for
from clairvoyant.scheduling.expiry import Expiry
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
    """What happened to each request of a workload (arrays indexed like the workload). A request
    withdrawn at its queue deadline has NaN start, end and slot -1."""

    start_s: np.ndarray  # virtual seconds when a slot was granted (the request is sent)
    end_s: np.ndarray  # virtual seconds when the backend finished (after any load)
    slot: np.ndarray  # which slot served it
    order: np.ndarray  # request indices in dispatch order
    promoted: np.ndarray  # bool: dispatched by a starvation rule against the policy's order
    promotions: int  # number of promoted dispatches
    load_s: np.ndarray | None = None  # float64 seconds of model load paid before its service (models only)
    switches: int = 0  # dispatches to a slot that held another model
    expired: np.ndarray | None = None  # bool: withdrawn at its queue deadline, never sent (deadlines only)

    def wait_s(self, workload: Workload) -> np.ndarray:
        """Queueing delay: slot granted minus arrival."""
        return self.start_s - workload.arrival_s

    def sojourn_s(self, workload: Workload) -> np.ndarray:
        """End-to-end latency: wait + load + service."""
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
    model_switch_bound_s: float = 0.0,
    switch_s: float = 0.0,
    model_switch_rule: str = "weighed",
) -> Schedule:
    """Run ``workload`` through the proxy's queue (``policy.build_queue``) with ``slots`` servers.

    ``scores`` is a ``Beliefs`` (score, predicted seconds, bucket per request) or plain scores
    (then predicted seconds = scores). A fresh policy is built per run (its learned state, e.g.
    boost's bucket table, starts empty) and told each completion at its virtual end time, as the
    dispatcher tells it when a request ends. An ``AdaptiveSlowdown`` is told each completion too. ``priority`` (int per request, lower = sooner) and
    the workload's tenants feed the job record. With ``service_time`` (and predicted tokens in the
    beliefs) predicted seconds come from that online model as in the proxy: predicted at arrival,
    taught each completion's measured seconds with the predicted tokens (as the dispatcher does: see
    ``Dispatcher._learn``). ``model_switch_bound_s`` > 0 groups requests by model (``ModelAffinity``, its rule
    ``model_switch_rule``);
    ``switch_s`` is the true load a slot pays for a request whose model it does not hold (the
    workload's models; the first load of a slot too). Raises ValueError on mismatched lengths,
    ``slots`` < 1 or a non-positive timeout.
    """
    n = len(workload)
    beliefs = scores if isinstance(scores, Beliefs) else Beliefs.from_scores(scores)
    if len(beliefs.score) != n:
        raise ValueError("one score per request is needed")
    if slots < 1:
        raise ValueError("slots must be >= 1")
    if not (switch_s >= 0 and math.isfinite(switch_s)):
        raise ValueError("switch_s must be a finite number of seconds >= 0")
    pol = make_policy(policy, params) if isinstance(policy, str) else policy
    queue = build_queue(
        pol, starvation_timeout_s=starvation_timeout_s, starvation_slowdown=starvation_slowdown, fair_share=fair_share,
        model_switch_bound_s=model_switch_bound_s, model_switch_rule=model_switch_rule,
    )  # fmt: skip

    arrival = workload.arrival_s.tolist()
    service = workload.service_s.tolist()
    score = beliefs.score.tolist()
    pred = beliefs.predicted_s.tolist()
    tokens = None if beliefs.predicted_tokens is None else beliefs.predicted_tokens.tolist()
    learn = service_time is not None and tokens is not None
    prio = [0] * n if priority is None else [int(p) for p in priority]
    tenant = [""] * n if workload.tenant is None else [str(t) for t in workload.tenant.tolist()]
    model: list[str | None] = [None] * n if workload.model is None else [f"m{m}" for m in workload.model.tolist()]
    expires = [math.inf] * n
    if workload.max_wait_s is not None:
        expires = [a + w for a, w in zip(arrival, workload.max_wait_s.tolist())]
    jobs: list[Job[int] | None] = [None] * n
    start = [math.nan] * n
    end = [math.nan] * n
    slot_of = [-1] * n
    promoted = [False] * n
    paid = [0.0] * n
    gone = [False] * n
    order: list[int] = []
    promotions = 0
    switches = 0

    # Each slot is a backend that holds one model: what it holds, since when, what it believes a load costs.
    models = workload.model is not None
    loads = (service_time or ServiceTimeModel()) if models else None
    held: list[str | None] = [None] * slots
    switched_s = [-math.inf] * slots
    names = [f"slot{s}" for s in range(slots)]
    pop_for = getattr(queue, "pop_for", None)
    expiry: Expiry[int] | None = Expiry() if workload.max_wait_s is not None else None

    free: list[tuple[float, int]] = [(-math.inf, s) for s in range(slots)]  # (free at, slot)
    running: list[tuple[float, int]] = []  # (end, request) not yet reported to the policy
    now = -math.inf  # decision times never go backwards
    nxt = 0  # next request to arrive
    settled = 0  # requests dispatched or withdrawn
    push, pop, done, observe = queue.push, queue.pop, queue.done, pol.observe
    spread = starvation_slowdown if isinstance(starvation_slowdown, AdaptiveSlowdown) else None
    while settled < n:
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
                    nxt, arrival[nxt], score[nxt], tokens[nxt], p_s, prio[nxt], tenant[nxt],
                    model[nxt], expires[nxt],
                )  # type: ignore[index]  # fmt: skip
            else:
                job = Job(
                    nxt, arrival[nxt], score[nxt], 0.0, pred[nxt], prio[nxt], tenant[nxt],
                    model[nxt], expires[nxt],
                )  # fmt: skip
            jobs[nxt] = job
            push(job)
            if expiry is not None:
                expiry.add(job)
            nxt += 1
        if expiry is not None:
            for job in expiry.due(t):  # withdrawn at its deadline, before anything is sent at t
                queue.remove(job)
                gone[job.payload] = True
                settled += 1
            if not len(queue):
                heapq.heappush(free, (t, slot))  # everything waiting expired: wait for the next arrival
                now = t
                continue
        if pop_for is not None and loads is not None:
            name, holding = names[slot], held[slot]
            lane = Lane(_Slot(_Holding(holding, switched_s[slot])), lambda m, b=name: loads.load_s(b, m))  # type: ignore[misc]
            got = pop_for(t, [lane])
        else:
            got = pop(t)
        assert got is not None  # the queue holds at least one job at t
        job, was_promoted = got
        i = job.payload
        begin = t
        if loads is not None and model[i] != held[slot]:  # a load before the service
            switches += held[slot] is not None
            charged = loads.load_s(names[slot], model[i])
            queue.repriced(job, job.predicted_s - charged)  # its tenant pays the load, as in the proxy
            loads.observe_load(names[slot], model[i], switch_s)  # measured, as Ollama reports it
            held[slot], switched_s[slot] = model[i], t
            paid[i] = switch_s
            begin = t + switch_s
        start[i] = t
        end[i] = begin + service[i]
        slot_of[i] = slot
        promoted[i] = was_promoted
        promotions += was_promoted
        order.append(i)
        heapq.heappush(free, (end[i], slot))
        heapq.heappush(running, (end[i], i))
        now = t
        settled += 1
    return Schedule(
        start_s=np.asarray(start),
        end_s=np.asarray(end),
        slot=np.asarray(slot_of, dtype=np.int32),
        order=np.asarray(order, dtype=np.int64),
        promoted=np.asarray(promoted, dtype=bool),
        promotions=promotions,
        load_s=np.asarray(paid) if models else None,
        switches=switches,
        expired=np.asarray(gone, dtype=bool) if expiry is not None else None,
    )


@dataclass(frozen=True, slots=True)
class _Holding:
    """What a simulated slot holds: the model it ran last."""

    model: str | None
    switched_s: float

    def holds(self, model: str | None) -> bool:
        return model == self.model


@dataclass(frozen=True, slots=True)
class _Slot:
    """A simulated slot as a lane's backend: it serves any model."""

    held: _Holding

    def serves(self, model: str | None) -> bool:
        return True
