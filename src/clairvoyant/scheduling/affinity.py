"""Model affinity: a backend serves the model it holds while that is worth more than a switch, and
puts a switch off for at most a bound (docs/scheduling.md, "Model switches", gives the reasons and
the measurements). Ordered as if switching were free, the queue would interleave models, and the
starvation guard would serve a burst in arrival order, which alternates them.

``ModelAffinity`` keeps one queue per model (``make_queue``: the policy's order, guard and fair
share) and decides between them when a slot frees, ``pop_for(now, lanes)``; for each lane:

1. **A switch is due** once a request for a model the lane does not hold has been *put off*
   ``bound_s`` (since the lane's last switch, or its arrival if later): switch to the model put
   off longest. A model that loads in under ``FREE_LOAD_S`` counts as held.
2. Otherwise, while a held model has requests waiting (rule ``"weighed"``): a model's *rate* is
   min over k of (load + its next k requests' predicted seconds) / k (``_rate_s``); the held one
   counts no load, another its load and the load back. Switch to the lowest rate if it wins by
   ``_SWITCH_MARGIN``, else serve the held models (weighted shortest job first over stretches).
3. Nothing held waits: switch to the lowest rate (load counted), ties to the one put off longest.

Rule ``"bound"`` is the rule before weighing: step 2 always stays, step 3 takes the oldest request.
Inside a model its own queue decides; across models the switch bound replaces the guard. Under
``"weighed"`` each model's guard runs on its own clock, stopped while the model is put off for a
switch, so waiting for a load the bound accounts for does not make its requests overdue.

``pop``/``peek`` take the policy's order across models; ``ordered_for`` replays the rule on one
lane in predicted seconds (positions, ETAs). Clock-free: the simulator drives this same code.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Generic, Protocol, TypeVar

from clairvoyant.scheduling.job_queue import FairShareQueue, Job, JobQueue, Lane, StarvationGuard, add_counts
from clairvoyant.scheduling.routing import Backend
from clairvoyant.scheduling.service_time import FREE_LOAD_S

__all__ = ["FREE_LOAD_S", "SWITCH_RULES", "Lane", "ModelAffinity"]

T = TypeVar("T")

SWITCH_RULES: tuple[str, ...] = ("weighed", "bound")  # the default first; see the module

_SPARE_GROUPS = 8  # retired model queues kept for reuse, at most (as FairShareQueue keeps retired tenants)

_STRETCH_JOBS = 64  # requests a stretch is weighed over, at most: a decision stays O(this) however long the queue

# A switch the rates favour must win by this factor: they weigh the requests waiting now, not those a
# load delays later (``clairvoyant simulate swaps``: at 1.0 the backend switched 11% more often than
# the rule before weighing and the mean rose 2-5%; at 1.5 it is 0.5-5% below that rule's).
_SWITCH_MARGIN = 1.5

Rank = Callable[[Job[Any], float], Any]  # (job, now) -> comparable; the policy's order, lower first


def _key(model: str | None) -> str | None:
    """One queue per model as backends name it: Ollama's ``llama3.2`` is ``llama3.2:latest``."""
    return None if model is None else model.removesuffix(":latest")


def _rate_s(load_s: float, head_s: float, rest_s: Iterable[float]) -> float:
    """Seconds per request of a model's best next stretch: min over k of (``load_s`` + its next k
    requests' predicted seconds) / k, ``head_s`` first, then ``rest_s`` (ascending)."""
    total, k = load_s + head_s, 1
    if not math.isfinite(total):  # a load never paid (``ordered``'s lane that holds nothing)
        return total
    for s in islice(rest_s, _STRETCH_JOBS - 1):
        if s * k >= total:  # no shorter than the stretch's mean: it, and every longer one after it, raise it
            break
        total += s
        k += 1
    return total / k


@dataclass(slots=True, eq=False)
class _GuardClock:
    """A model's guard clock: clock seconds, stopped while the model is put off for a switch."""

    lag_s: float = 0.0  # seconds stopped before ``stopped_s``
    stopped_s: float | None = None  # stopped since (None: running)

    def __call__(self, now: float) -> float:
        stopped = self.stopped_s
        return (now if stopped is None or now < stopped else stopped) - self.lag_s

    def set(self, now: float, stopped: bool) -> None:
        if not math.isfinite(now):  # pop(math.inf) drains at shutdown: nothing to count
            return
        if stopped and self.stopped_s is None:
            self.stopped_s = now
        elif not stopped and self.stopped_s is not None:
            self.lag_s += max(0.0, now - self.stopped_s)
            self.stopped_s = None


@dataclass(slots=True, eq=False)
class _Seconds:
    """A model's waiting requests' predicted seconds, ascending (its stretches are weighed on them)."""

    ascending: list[tuple[float, int]] = field(default_factory=list)  # (predicted_s, seq)
    of: dict[int, float] = field(default_factory=dict)  # seq -> the predicted seconds it is filed under

    def add(self, job: Job[Any]) -> None:
        self.of[job.seq] = job.predicted_s
        bisect.insort(self.ascending, (job.predicted_s, job.seq))

    def discard(self, job: Job[Any]) -> None:
        s = self.of.pop(job.seq, None)
        if s is not None:
            del self.ascending[bisect.bisect_left(self.ascending, (s, job.seq))]


@dataclass(slots=True, eq=False)
class _Group(Generic[T]):
    """The requests for one model."""

    model: str | None  # as the first of its requests named it
    queue: JobQueue[T]
    clock: _GuardClock  # its guard's clock (runs as the wall clock under rule "bound")
    arrivals: deque[Job[T]] = field(default_factory=deque)  # in arrival order; left ones not waiting dropped lazily
    seconds: _Seconds = field(default_factory=_Seconds)
    waiting: int = 0
    in_flight: set[int] = field(default_factory=set)  # seqs of its popped jobs not yet done

    def oldest(self) -> Job[T]:
        """Its oldest waiting job (it has one)."""
        arrivals = self.arrivals
        while not arrivals[0].waiting:
            arrivals.popleft()
        return arrivals[0]

    def head(self, now: float) -> Job[T]:
        got = self.queue.peek(now)
        assert got is not None  # it has a job waiting
        return got[0]

    def rest_s(self, head: Job[T]) -> Iterator[float]:
        return (s for s, seq in self.seconds.ascending if seq != head.seq)


class _Side(Protocol[T]):
    """A model waiting, as the rule weighs it (a live ``_Group``, or a ``_Play`` in a replay)."""

    model: str | None

    def oldest(self) -> Job[T]: ...

    def head(self, now: float) -> Job[T]: ...

    def rest_s(self, head: Job[T]) -> Iterator[float]: ...


S = TypeVar("S", bound=_Side[Any])


class ModelAffinity(JobQueue[T]):
    """One queue per model, and the switch rule between them (see the module)."""

    def __init__(
        self, make_queue: Callable[[], JobQueue[T]], bound_s: float, rank: Rank | None = None, rule: str = "weighed"
    ) -> None:
        """``make_queue`` builds equal empty queues; ``rank``: the policy's order across models' heads."""
        if not (bound_s > 0 and math.isfinite(bound_s)):
            raise ValueError("bound_s must be a positive number of seconds (a switch may not wait forever)")
        if rule not in SWITCH_RULES:
            raise ValueError(f"unknown model switch rule {rule!r}; known: {', '.join(SWITCH_RULES)}")
        self.make_queue = make_queue
        self.bound_s = bound_s
        self.rule = rule
        self.rank: Rank = rank or (lambda job, now: (job.priority, job.arrival_s))
        self._groups: dict[str | None, _Group[T]] = {}  # models with a request waiting or in flight
        self._spare: list[tuple[JobQueue[T], _GuardClock]] = []
        self._lanes: Sequence[Lane] = ()  # the lanes of the last decision: who loads a model for free
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Job[T]]:
        return (job for group in list(self._groups.values()) for job in group.queue)

    def waiting_by_model(self) -> dict[str | None, int]:
        return {group.model: group.waiting for group in self._groups.values() if group.waiting}

    def describe(self) -> dict[str, Any]:
        return {"bound_s": self.bound_s, "free_load_s": FREE_LOAD_S, "rule": self.rule}

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
            if self._spare:
                queue, clock = self._spare.pop()
            else:
                queue, clock = self.make_queue(), _GuardClock()
                # the guard (each tenant's, under fair share) runs on the model's clock
                if self.rule == "weighed" and isinstance(queue, (StarvationGuard, FairShareQueue)):
                    queue.clock = clock
            group = self._groups[key] = _Group(job.model, queue, clock)
        return group

    def _retire_if_idle(self, group: _Group[T]) -> None:
        if group.waiting or group.in_flight:
            return
        del self._groups[_key(group.model)]
        if len(self._spare) < _SPARE_GROUPS and group.queue.reset():
            self._spare.append((group.queue, group.clock))

    def _free_on(self, lane: Lane, model: str | None, held: Callable[[str | None], bool]) -> bool:
        return lane.backend.serves(model) and (held(model) or lane.load_s(model) < FREE_LOAD_S)

    # -- the queue interface ---------------------------------------------------------------------
    def push(self, job: Job[T]) -> None:
        group = self._group(job)
        if self.rule == "weighed" and not group.waiting and not group.in_flight:
            # A model that starts waiting while another one runs is put off (until a decision says
            # otherwise), unless a backend loads it for free.
            others_run = any(g.in_flight for g in self._groups.values() if g is not group)
            free = any(lane.backend.serves(job.model) and lane.load_s(job.model) < FREE_LOAD_S for lane in self._lanes)
            group.clock.set(job.arrival_s, others_run and not free)
        group.queue.push(job)
        group.arrivals.append(job)
        group.seconds.add(job)
        group.waiting += 1
        self._live += 1

    def take_now(self, job: Job[T], now: float) -> None:
        if self._live:
            raise RuntimeError("take_now while jobs wait: push and pop instead")
        group = self._group(job)
        group.clock.set(now, False)
        group.queue.take_now(job, now)
        group.in_flight.add(job.seq)

    def remove(self, job: Job[T]) -> bool:
        group = self._groups.get(_key(job.model))
        if group is None or not group.queue.remove(job):
            return False
        self._left(group, job)
        self._retire_if_idle(group)
        return True

    def _left(self, group: _Group[T], job: Job[T]) -> None:
        group.waiting -= 1
        group.seconds.discard(job)
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
            if job.waiting:  # weighed by its new predicted seconds
                group.seconds.discard(job)
                group.seconds.add(job)

    def peek(self, now: float) -> tuple[Job[T], bool] | None:
        group = self._best([g for g in self._groups.values() if g.waiting], now)
        return None if group is None else group.queue.peek(now)

    def pop(self, now: float) -> tuple[Job[T], bool] | None:
        """The policy's next job across models (an overdue head first), for a lane that holds nothing."""
        group = self._best([g for g in self._groups.values() if g.waiting], now)
        if group is not None:
            group.clock.set(now, False)
        return self._pop(group, now)

    def pop_for(self, now: float, lanes: Sequence[Lane]) -> tuple[Job[T], bool] | None:
        """The next job for one of ``lanes`` (backends with a free slot): a lane's choice that needs no
        switch first, else the first lane's switch. None if no lane serves a waiting model."""
        group, switched = self._choose(now, lanes)
        got = self._pop(group, now)
        if self.rule == "weighed" and group is not None:
            self._set_clocks(now, lanes, group, switched)
        return got

    def _pop(self, group: _Group[T] | None, now: float) -> tuple[Job[T], bool] | None:
        if group is None:
            return None
        got = group.queue.pop(now)
        assert got is not None  # the group has a job waiting
        group.in_flight.add(got[0].seq)
        self._left(group, got[0])
        return got

    def _set_clocks(self, now: float, lanes: Sequence[Lane], chosen: _Group[T], switched: Lane | None) -> None:
        """Stop the clock of each model now put off (waiting, nothing in service, not held or loaded
        for free by a lane that asked: the one that switched holds only ``chosen``), run the others'."""
        self._lanes = lanes
        holds_chosen = _holding(chosen.model)
        for group in self._groups.values():
            if not group.waiting:
                continue
            model = group.model
            put_off = not group.in_flight and not any(
                self._free_on(lane, model, holds_chosen if lane is switched else lane.backend.held.holds)
                for lane in lanes
            )
            group.clock.set(now, put_off)

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

    def _choose(self, now: float, lanes: Sequence[Lane]) -> tuple[_Group[T] | None, Lane | None]:
        """The model to serve next and the lane that switches to it (None: no switch)."""
        groups = [g for g in self._groups.values() if g.waiting]
        if len(groups) < 2:
            if not groups:
                return None, None
            group = groups[0]
            for lane in lanes:
                if lane.backend.serves(group.model):
                    return group, None if self._free_on(lane, group.model, lane.backend.held.holds) else lane
            return group, None
        switch: tuple[_Group[T], Lane] | None = None
        for lane in lanes:
            served = [g for g in groups if lane.backend.serves(g.model)]
            if served:
                group, switches = self._decide(
                    now, lane, lane.backend.held.switched_s, lane.backend.held.holds, served, self._best
                )
                if not switches:
                    return group, None
                switch = switch or (group, lane)
        return switch if switch is not None else (None, None)

    def _decide(
        self,
        now: float,
        lane: Lane,
        switched_s: float,
        holds: Callable[[str | None], bool],
        served: list[S],
        best_held: Callable[[list[S], float], S | None],
    ) -> tuple[S, bool]:
        """The module's rule: what ``lane`` (holding ``holds`` since ``switched_s``) takes next among
        ``served``, and whether that is a switch."""
        held: list[S] = []
        others: list[S] = []
        for side in served:
            (held if self._free_on(lane, side.model, holds) else others).append(side)
        if others:
            since = {id(side): max(side.oldest().arrival_s, switched_s) for side in others}
            due = min(others, key=lambda s: (since[id(s)], s.oldest().seq))
            if now - since[id(due)] >= self.bound_s or (not held and self.rule == "bound"):
                return due, True  # a due switch goes to the model put off longest
            if not held:
                return min(others, key=lambda s: (self._rate(now, lane, s, 0.0), since[id(s)], s.oldest().seq)), True
        stay = best_held(held, now)
        assert stay is not None
        if others and self.rule == "weighed":
            head = stay.head(now)
            stay_rate = _rate_s(0.0, head.predicted_s, stay.rest_s(head))
            back_s = lane.load_s(stay.model)
            rates = {id(s): self._rate(now, lane, s, back_s) for s in others}
            go = min(others, key=lambda s: (rates[id(s)], since[id(s)], s.oldest().seq))
            if rates[id(go)] * _SWITCH_MARGIN < stay_rate:
                return go, True
        return stay, False

    @staticmethod
    def _rate(now: float, lane: Lane, side: _Side[Any], back_s: float) -> float:
        head = side.head(now)
        return _rate_s(lane.load_s(side.model) + back_s, head.predicted_s, side.rest_s(head))

    # -- positions ---------------------------------------------------------------------------------
    def ordered(self, now: float) -> list[Job[T]]:
        """Waiting jobs as a backend that holds nothing would take them (``ordered_for``)."""
        return self.ordered_for(now, Lane(Backend("", 1), lambda model: math.inf))

    def ordered_for(self, now: float, lane: Lane, free_in_s: float = 0.0) -> list[Job[T]]:
        """Waiting jobs in the order ``lane`` (free in ``free_in_s``) would take them if nothing else
        arrived: the rule replayed in predicted seconds, each switch costing its load."""
        groups = [g for g in self._groups.values() if g.waiting]
        if len(groups) < 2:
            return groups[0].queue.ordered(now) if groups else []
        plays = [_Play(g.model, g.queue.ordered(now)) for g in groups]
        holds, switched_s, t = lane.backend.held.holds, lane.backend.held.switched_s, now + free_in_s
        rank = self.rank

        def best_held(held: list[_Play[T]], at: float) -> _Play[T] | None:  # the policy's order
            return min(held, key=lambda p: (rank(p.head(now), now), p.head(now).seq)) if held else None

        out: list[Job[T]] = []
        while plays:
            pick, switches = self._decide(t, lane, switched_s, holds, plays, best_held)
            if switches:
                switched_s = t
                holds = _holding(pick.model)
                t += lane.load_s(pick.model)
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
    """One model's waiting jobs while ``ordered_for`` replays the rule, taken in its own order."""

    __slots__ = ("model", "jobs", "by_arrival", "by_seconds", "at", "oldest_at", "shortest_at", "taken")

    def __init__(self, model: str | None, jobs: list[Job[T]]) -> None:
        self.model = model
        self.jobs = jobs  # in the model's own order
        self.by_arrival = sorted(jobs, key=lambda j: (j.arrival_s, j.seq))
        self.by_seconds = sorted((j.predicted_s, j.seq) for j in jobs)
        self.at = 0  # the next job in its own order
        self.oldest_at = 0  # its oldest job, unless taken already
        self.shortest_at = 0  # its shortest job, unless taken already
        self.taken: set[int] = set()  # seqs taken

    def head(self, now: float) -> Job[T]:
        return self.jobs[self.at]

    def rest_s(self, head: Job[T]) -> Iterator[float]:
        while self.by_seconds[self.shortest_at][1] in self.taken:
            self.shortest_at += 1
        taken = self.taken
        return (s for s, seq in islice(self.by_seconds, self.shortest_at, None) if seq != head.seq and seq not in taken)

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
