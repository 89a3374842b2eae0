"""Scheduling policies: each one builds the queue that orders requests (the queue is the policy unit).

    fcfs   arrival order                                       HeapQueue, key (priority, arrival_s)
    sjf    the paper's rule (3.4): ascending predictor score    HeapQueue, key (priority, score)
    boost  gamma-boost (paper 002): arrival_s - b(bucket)       HeapQueue, key (priority, arrival_s - b)
    hrrn   highest response ratio next (wait + S) / S           ScanQueue, rank (priority, -ratio)

Ordering is always (priority class, then the policy inside the class), ties by arrival. Starvation
protection is not in the keys but in the wrappers ``build_queue`` adds. Bounds, in seconds: the
guard's tau (no later arrival passes a request that has waited tau, whatever its class); boost's
own cap ``max_boost_s`` (inside a class, no request arriving ``max_boost_s`` after a waiting one
passes it); the model switch bound (a backend serves the model it holds while no request for
another model has been put off that long).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from clairvoyant.scheduling.affinity import ModelAffinity
from clairvoyant.scheduling.boost import BoostTable, bucket_for
from clairvoyant.scheduling.job_queue import FairShareQueue, HeapQueue, Job, JobQueue, ScanQueue, StarvationGuard
from clairvoyant.scheduling.slowdown import SlowdownRule

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "BoostPolicy",
    "FcfsPolicy",
    "HrrnPolicy",
    "PolicyParams",
    "SchedulingPolicy",
    "SjfPolicy",
    "build_queue",
    "make_policy",
]


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Every policy parameter (each one is a setting)."""

    boost_gamma_per_s: float = 0.05  # gamma, 1/s: jobs shorter than ~1/gamma s get a real boost
    boost_auto_gamma: bool = False  # fit gamma online by the fixed-point rule (digest 2b)
    boost_max_s: float = 600.0  # cap on any boost: boost's own starvation bound, seconds


class SchedulingPolicy(Protocol):
    name: str

    def make_queue(self) -> JobQueue[Any]:
        """A fresh queue ordered by this policy (no starvation guard, no fair share)."""
        ...

    def observe(self, job: Job[Any], measured_s: float) -> None:
        """A job of this policy finished after ``measured_s`` seconds of service."""
        ...

    def describe(self) -> dict[str, Any]:
        """Name, parameters and built-in bounds (for /queue and reports)."""
        ...


class _Unlearned:
    """A policy that learns nothing from finished jobs and has no parameters to describe."""

    __slots__ = ()
    name: str

    def observe(self, job: Job[Any], measured_s: float) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


@dataclass(slots=True)
class FcfsPolicy(_Unlearned):
    """First come, first served: the baseline for every benchmark."""

    name: str = "fcfs"

    def make_queue(self) -> JobQueue[Any]:
        return HeapQueue(lambda j: (j.priority, j.arrival_s))


@dataclass(slots=True)
class SjfPolicy(_Unlearned):
    """Shortest predicted job first (paper 3.4): ascending predictor score, ties by arrival."""

    name: str = "sjf"

    def make_queue(self) -> JobQueue[Any]:
        return HeapQueue(lambda j: (j.priority, j.score))


@dataclass(slots=True)
class BoostPolicy:
    """gamma-boost: key = arrival_s - b(bucket), b learned per prediction bucket (see BoostTable)."""

    table: BoostTable
    name: str = "boost"

    def key(self, job: Job[Any]) -> tuple[int, float]:
        return job.priority, job.arrival_s - self.table.boost(bucket_for(job.predicted_s), job.predicted_s)

    def make_queue(self) -> JobQueue[Any]:
        return _NotingHeap(self)

    def observe(self, job: Job[Any], measured_s: float) -> None:
        self.table.observe(bucket_for(job.predicted_s), measured_s)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.table.describe()}


class _NotingHeap(HeapQueue[Any]):
    """A boost heap that also records arrivals (the arrival rate for automatic gamma)."""

    def __init__(self, policy: BoostPolicy) -> None:
        super().__init__(policy.key)
        self.table = policy.table

    def push(self, job: Job[Any]) -> None:
        self.table.note_arrival(job.arrival_s)
        super().push(job)

    def take_now(self, job: Job[Any], now: float) -> None:
        self.table.note_arrival(job.arrival_s)
        super().take_now(job, now)


@dataclass(slots=True)
class HrrnPolicy(_Unlearned):
    """Highest response ratio next (paper 001's parameter-free aging): (wait + S) / S, S = predicted_s."""

    name: str = "hrrn"

    @staticmethod
    def rank(job: Job[Any], now: float) -> tuple[int, float]:
        s = max(job.predicted_s, 1e-6)
        return job.priority, -(now - job.arrival_s + s) / s

    def make_queue(self) -> JobQueue[Any]:
        return ScanQueue(self.rank)


POLICIES: dict[str, Callable[[PolicyParams], SchedulingPolicy]] = {
    "fcfs": lambda p: FcfsPolicy(),
    "sjf": lambda p: SjfPolicy(),
    "boost": lambda p: BoostPolicy(
        BoostTable(p.boost_gamma_per_s, max_boost_s=p.boost_max_s, auto_gamma=p.boost_auto_gamma)
    ),
    "hrrn": lambda p: HrrnPolicy(),
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str, params: PolicyParams | None = None) -> SchedulingPolicy:
    """The policy called ``name``. Raises ValueError naming the known ones."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return factory(params or PolicyParams())


def build_queue(
    policy: SchedulingPolicy,
    *,
    starvation_timeout_s: float = math.inf,
    starvation_slowdown: float | SlowdownRule = 0.0,
    fair_share: bool = False,
    tenant_weights: dict[str, float] | None = None,
    model_switch_bound_s: float = 0.0,
    model_switch_rule: str = "weighed",
) -> JobQueue[Any]:
    """The queue the dispatcher and the simulator drive: policy order, starvation guard (a job is
    overdue after ``starvation_timeout_s + starvation_slowdown * predicted_s``), optionally one
    such queue per tenant under fair share (a tenant's weight from ``tenant_weights``, else 1), and
    with ``model_switch_bound_s`` > 0 one of those per model under ``ModelAffinity`` (a backend
    serves the model it holds while no request for another model has been put off that many
    seconds, and before that while it is worth more than a switch: ``model_switch_rule``, one of
    ``affinity.SWITCH_RULES``). fcfs ignores the bound: it stays pure arrival order, the baseline."""
    if not starvation_timeout_s > 0:
        raise ValueError("starvation_timeout_s must be > 0 (math.inf disables it)")
    if not (model_switch_bound_s >= 0 and math.isfinite(model_switch_bound_s)):
        raise ValueError("model_switch_bound_s must be a finite number of seconds >= 0 (0 disables it)")

    def one() -> JobQueue[Any]:
        inner = policy.make_queue()
        if math.isinf(starvation_timeout_s):
            return inner
        return StarvationGuard(inner, starvation_timeout_s, starvation_slowdown)

    def shared() -> JobQueue[Any]:
        if not fair_share:
            return one()
        weights = tenant_weights or {}
        return FairShareQueue(one, weight_of=lambda tenant: weights.get(tenant, 1.0))

    if model_switch_bound_s == 0 or policy.name == "fcfs":
        return shared()
    ranker = policy.make_queue().sort_key  # the policy's order, for heads of several models
    return ModelAffinity(shared, model_switch_bound_s, ranker, model_switch_rule)
