"""Model affinity: a backend serves the model it holds first, and puts a switch off for at most a bound.

A backend that loads models on demand (Ollama, llama-swap) holds one model, or a few, and pays a
load of seconds to minutes for a request whose model it does not hold. Ordered as if switching were
free, the queue interleaves models and can make every request pay a load; and once the starvation
guard has made a burst overdue it serves arrival order, which alternates models.

``ModelAffinity`` keeps one queue per model, each built by ``make_queue`` (the policy's order, its
starvation guard, fair share between tenants: ``policy.build_queue``), and decides between them when
a backend's slot frees: ``pop_for(now, lanes)``, a ``Lane`` per backend with a free slot saying what
it holds, when it last switched, and what a load costs it. For each lane:

1. **A switch is due** once a request for a model the backend does not hold has been *put off* for
   ``bound_s`` seconds: waiting since the backend's last switch (or since it arrived, if later).
   The backend then switches to the model whose oldest request has been put off longest.
2. Otherwise it serves the models it **holds** (their heads in the policy's order, an overdue head
   first). A model whose load costs the backend less than ``FREE_LOAD_S`` counts as held: nothing is
   put off for a switch that costs nothing (a backend that holds both models, or a server that
   answers every model name with the one model it has).
3. Nothing held waits: it **switches** to the model with the oldest waiting request.

Inside a model its own queue decides, so the per-request starvation rule (an overdue request goes
before every later arrival) holds among the requests for one model; across models the switch bound
replaces it. That is the point: applied across models, the overdue rule serves a burst in arrival
order and undoes the grouping.

Bound: on a backend, no request for a model it holds is dispatched once a request for another model
(one the backend serves) has been put off ``bound_s`` seconds. With two models that means: a request
whose model the backend does not hold waits at most ``bound_s`` from its arrival (or from the
backend's last switch, if later) plus the requests in flight then, before its model is switched to.
With k models a switch goes to the model put off longest, so a model waits at most k - 1 such turns.
``tests/test_affinity.py`` checks the bound under adversarial arrivals and pop times.

``pop(now)`` (no lane) and ``peek`` take the policy's order across models (an overdue head first);
``ordered_for(now, lane)`` replays the rule on one lane in predicted seconds (for positions and
ETAs). Synchronous and clock-free, like every queue here: the simulator drives this same code.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from clairvoyant.scheduling.job_queue import Job, JobQueue, add_counts
from clairvoyant.scheduling.service_time import FREE_LOAD_S

__all__ = ["FREE_LOAD_S", "Lane", "ModelAffinity"]

T = TypeVar("T")

# Retired model queues kept for reuse, at most (as FairShareQueue keeps retired tenants).
_SPARE_GROUPS = 8

Rank = Callable[[Job[Any], float], Any]  # (job, now) -> comparable; the policy's order, lower first


@dataclass(frozen=True, slots=True)
class Lane:
    """One backend with a free slot, as the affinity rule sees it."""

    holds: Callable[[str | None], bool]  # it has this model loaded now: no load to pay
    serves: Callable[[str | None], bool]  # it may run this model at all
    load_s: Callable[[str | None], float]  # predicted seconds it takes to load a model it does not hold
    switched_s: float = -math.inf  # clock seconds of its last switch (since when it holds what it holds)


def _key(model: str | None) -> str | None:
    """One queue per model as backends name it: Ollama's ``llama3.2`` is ``llama3.2:latest``."""
    return None if model is None else model.removesuffix(":latest")


@dataclass(slots=True, eq=False)
class _Group(Generic[T]):
    """The requests for one model."""

    model: str | None  # as the first of its requests named it
    queue: JobQueue[T]
    arrivals: deque[Job[T]] = field(default_factory=deque)  # in arrival order; left ones not waiting dropped lazily
    waiting: int = 0
    in_flight: set[int] = field(default_factory=set)  # seqs of its popped jobs not yet done

    def oldest(self) -> Job[T]:
        """Its oldest waiting job (it has one)."""
        arrivals = self.arrivals
        while not arrivals[0].waiting:
            arrivals.popleft()
        return arrivals[0]


class ModelAffinity(Generic[T]):
    """One queue per model; a backend whose slot frees serves the models it holds, and switches
    once a request for another model has been put off ``bound_s`` seconds (see the module)."""

    def __init__(self, make_queue: Callable[[], JobQueue[T]], bound_s: float, rank: Rank | None = None) -> None:
        """``make_queue`` builds one model's queue (equal empty queues at every call); ``rank`` is
        the policy's order across models' heads (default: priority, then arrival)."""
        if not (bound_s > 0 and math.isfinite(bound_s)):
            raise ValueError("bound_s must be a positive number of seconds (a switch may not wait forever)")
        self.make_queue = make_queue
        self.bound_s = bound_s
        self.rank: Rank = rank or (lambda job, now: (job.priority, job.arrival_s))
        self._groups: dict[str | None, _Group[T]] = {}  # models with a request waiting or in flight
        self._spare: list[JobQueue[T]] = []
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Job[T]]:
        return (job for group in list(self._groups.values()) for job in group.queue)

    def waiting_by_model(self) -> dict[str | None, int]:
        """Requests waiting per model."""
        return {group.model: group.waiting for group in self._groups.values() if group.waiting}

    def describe(self) -> dict[str, Any]:
        return {"bound_s": self.bound_s, "free_load_s": FREE_LOAD_S}

    def retained(self) -> dict[str, int]:
        counts = {"model_groups": len(self._groups), "model_spare": len(self._spare)}
        for group in self._groups.values():
            counts = add_counts(
                counts,
                group.queue.retained(),
                {"model_arrivals": len(group.arrivals), "model_in_flight": len(group.in_flight)},
            )
        return counts

    # -- groups ----------------------------------------------------------------------------------
    def _group(self, job: Job[T]) -> _Group[T]:
        key = _key(job.model)
        group = self._groups.get(key)
        if group is None:
            queue = self._spare.pop() if self._spare else self.make_queue()
            group = self._groups[key] = _Group(job.model, queue)
        return group

    def _retire_if_idle(self, group: _Group[T]) -> None:
        if group.waiting or group.in_flight:
            return
        del self._groups[_key(group.model)]
        reset = getattr(group.queue, "reset", None)
        if len(self._spare) < _SPARE_GROUPS and reset is not None and reset():
            self._spare.append(group.queue)

    # -- the queue interface ---------------------------------------------------------------------
    def push(self, job: Job[T]) -> None:
        group = self._group(job)
        group.queue.push(job)
        group.arrivals.append(job)
        group.waiting += 1
        self._live += 1

    def take_now(self, job: Job[T], now: float) -> None:
        if self._live:
            raise RuntimeError("take_now while jobs wait: push and pop instead")
        group = self._group(job)
        group.queue.take_now(job, now)
        group.in_flight.add(job.seq)

    def remove(self, job: Job[T]) -> bool:
        group = self._groups.get(_key(job.model))
        if group is None or not group.queue.remove(job):
            return False
        self._left(group)
        self._retire_if_idle(group)
        return True

    def _left(self, group: _Group[T]) -> None:
        """One of ``group``'s jobs left the waiting queue."""
        group.waiting -= 1
        self._live -= 1
        arrivals = group.arrivals
        if len(arrivals) > 64 and len(arrivals) > 2 * group.waiting:
            group.arrivals = deque(job for job in arrivals if job.waiting)

    def done(self, job: Job[T]) -> None:
        group = self._groups.get(_key(job.model))
        if group is None or job.seq not in group.in_flight:
            return  # not one of ours in service (or reported twice)
        group.in_flight.discard(job.seq)
        group.queue.done(job)
        self._retire_if_idle(group)

    def repriced(self, job: Job[T], old_predicted_s: float) -> None:
        group = self._groups.get(_key(job.model))
        if group is not None:
            group.queue.repriced(job, old_predicted_s)

    def rekeyed(self, job: Job[T]) -> None:
        group = self._groups.get(_key(job.model))
        if group is not None:
            group.queue.rekeyed(job)

    def peek(self, now: float) -> tuple[Job[T], bool] | None:
        group = self._best([g for g in self._groups.values() if g.waiting], now)
        return None if group is None else group.queue.peek(now)

    def pop(self, now: float) -> tuple[Job[T], bool] | None:
        """The policy's next job across models (an overdue head first): what a backend that holds
        nothing in particular would take. ``pop_for`` is the rule for a backend whose slot frees."""
        return self._pop(self._best([g for g in self._groups.values() if g.waiting], now), now)

    def pop_for(self, now: float, lanes: Sequence[Lane]) -> tuple[Job[T], bool] | None:
        """The next job for one of ``lanes`` (backends with a free slot) at ``now``: a lane's choice
        that needs no switch first, else the first lane's switch (see the module's rule). None if
        nothing waits or no lane serves any waiting model."""
        return self._pop(self._choose(now, lanes), now)

    def _pop(self, group: _Group[T] | None, now: float) -> tuple[Job[T], bool] | None:
        if group is None:
            return None
        got = group.queue.pop(now)
        assert got is not None  # the group has a job waiting
        group.in_flight.add(got[0].seq)
        self._left(group)
        return got

    # -- the rule ----------------------------------------------------------------------------------
    def _head_rank(self, group: _Group[T], now: float) -> tuple[Any, ...]:
        """A model's head in the policy's order across models: an overdue head first, oldest first."""
        head = group.queue.peek(now)
        assert head is not None
        job, promoted = head
        return (0, job.arrival_s, job.seq) if promoted else (1, self.rank(job, now), job.seq)

    def _best(self, groups: list[_Group[T]], now: float) -> _Group[T] | None:
        if len(groups) < 2:
            return groups[0] if groups else None
        return min(groups, key=lambda g: self._head_rank(g, now))

    def _choose(self, now: float, lanes: Sequence[Lane]) -> _Group[T] | None:
        groups = [g for g in self._groups.values() if g.waiting]
        if len(groups) < 2:
            return groups[0] if groups else None
        switch: _Group[T] | None = None
        for lane in lanes:
            served = [g for g in groups if lane.serves(g.model)]
            if served:
                group, switches = self._for_lane(now, lane, served)
                if not switches:
                    return group
                switch = switch or group
        return switch

    def _for_lane(self, now: float, lane: Lane, served: list[_Group[T]]) -> tuple[_Group[T], bool]:
        """What ``lane`` takes next among ``served`` (models waiting that it serves), and whether
        that is a switch."""
        held: list[_Group[T]] = []
        others: list[_Group[T]] = []
        for group in served:
            model = group.model
            (held if lane.holds(model) or lane.load_s(model) < FREE_LOAD_S else others).append(group)
        if others:
            # put off since max(oldest arrival, last switch): the earliest of those is switched to
            due = min(others, key=lambda g: (max(g.oldest().arrival_s, lane.switched_s), g.oldest().seq))
            if not held or now - max(due.oldest().arrival_s, lane.switched_s) >= self.bound_s:
                return due, True
        best = self._best(held, now)
        assert best is not None
        return best, False

    # -- positions ---------------------------------------------------------------------------------
    def ordered(self, now: float) -> list[Job[T]]:
        """Waiting jobs as a backend that holds nothing would take them (``ordered_for``)."""
        return self.ordered_for(now, Lane(lambda model: False, lambda model: True, lambda model: math.inf))

    def ordered_for(self, now: float, lane: Lane, free_in_s: float = 0.0) -> list[Job[T]]:
        """Waiting jobs in the order ``lane`` would take them if nothing else arrived, its slot free
        in ``free_in_s`` seconds: the rule replayed in predicted seconds (each job its
        ``predicted_s``, each switch its load), each model's jobs in that model's own order at
        ``now``. After a replayed switch the lane holds only the model it switched to. O(n log n)."""
        groups = [g for g in self._groups.values() if g.waiting]
        if len(groups) < 2:
            return groups[0].queue.ordered(now) if groups else []
        plays = [_Play(g.model, g.queue.ordered(now)) for g in groups]
        holds, switched_s, t = lane.holds, lane.switched_s, now + free_in_s
        out: list[Job[T]] = []
        while plays:
            held = [p for p in plays if holds(p.model) or lane.load_s(p.model) < FREE_LOAD_S]
            others = [p for p in plays if p not in held]
            pick = None
            if others:
                due = min(others, key=lambda p: (max(p.oldest().arrival_s, switched_s), p.oldest().seq))
                if not held or t - max(due.oldest().arrival_s, switched_s) >= self.bound_s:
                    pick, switched_s = due, t
                    holds = _holding(due.model)
                    t += lane.load_s(due.model)
            if pick is None:  # the held models' next jobs in the policy's order
                pick = min(held, key=lambda p: (self.rank(p.next(), now), p.next().seq))
            job = pick.take()
            out.append(job)
            t += job.predicted_s
            if pick.done():
                plays.remove(pick)
        return out


def _holding(model: str | None) -> Callable[[str | None], bool]:
    key = _key(model)
    return lambda other: _key(other) == key


class _Play(Generic[T]):
    """One model's waiting jobs while ``ordered_for`` replays the rule: taken in its own order,
    its oldest untaken one at hand."""

    __slots__ = ("model", "jobs", "by_arrival", "at", "oldest_at", "taken")

    def __init__(self, model: str | None, jobs: list[Job[T]]) -> None:
        self.model = model
        self.jobs = jobs  # in the model's own order
        self.by_arrival = sorted(jobs, key=lambda j: (j.arrival_s, j.seq))
        self.at = 0  # the next job in its own order
        self.oldest_at = 0  # its oldest job, unless taken already
        self.taken: set[int] = set()  # seqs taken

    def next(self) -> Job[T]:
        return self.jobs[self.at]

    def take(self) -> Job[T]:
        job = self.jobs[self.at]
        self.at += 1
        self.taken.add(job.seq)
        return job

    def done(self) -> bool:
        return self.at == len(self.jobs)

    def oldest(self) -> Job[T]:
        while self.by_arrival[self.oldest_at].seq in self.taken:
            self.oldest_at += 1
        return self.by_arrival[self.oldest_at]
