"""The waiting queue is the policy unit (the shape of vLLM's ``RequestQueue``): every queue here
has the interface ``JobQueue``, and a ``pop`` says whether a starvation rule, not the policy's
order, chose the job (``promoted``).

- ``HeapQueue``: keys fixed at push (fcfs, sjf, gamma-boost). O(log n) push and pop.
- ``ScanQueue``: priorities that change with time (HRRN). ``pop`` scans every waiting job: O(n),
  about 0.4 ms at 1,000 waiting requests (benchmarks/bench_queue_cost.py prints the measured cost).
- ``StarvationGuard``: a wrapper any queue can wear: an overdue job goes before any later arrival.
- ``FairShareQueue``: one inner queue (policy + guard) per tenant, shared in predicted service
  seconds (start-time fair queuing), so a tenant's batch of 500 requests cannot starve another
  tenant's interactive ones.

Synchronous and clock-free: callers pass ``now`` in, so the proxy (monotonic clock) and the
discrete-event simulator (virtual time) drive this very code. Capacity limits and HTTP errors are
not here: the dispatcher owns them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from clairvoyant.scheduling.slowdown import SlowdownRule

__all__ = [
    "FairShareQueue",
    "HeapQueue",
    "Job",
    "JobQueue",
    "Lane",
    "LaneBackend",
    "ScanQueue",
    "StarvationGuard",
    "add_counts",
]

T = TypeVar("T")

_seq = itertools.count()  # process-wide arrival order: ties break the same way in every queue


class LaneModels(Protocol):
    """What a lane's backend holds (``routing.ModelsHeld`` is one)."""

    @property
    def switched_s(self) -> float: ...  # clock seconds of its last switch (since when it holds what it holds)

    @property
    def holds(self) -> Callable[[str | None], bool]: ...  # it has this model loaded now: no load to pay


class LaneBackend(Protocol):
    """What a lane's backend holds and serves (``routing.Backend`` is one)."""

    @property
    def held(self) -> LaneModels: ...

    @property
    def serves(self) -> Callable[[str | None], bool]: ...  # it may run this model at all


@dataclass(frozen=True, slots=True)
class Lane:
    """One backend with a free slot, as the affinity rule (and any queue's ``pop_for``) sees it."""

    backend: LaneBackend
    load_s: Callable[[str | None], float]  # predicted seconds it takes to load a model it does not hold


@dataclass(slots=True, eq=False)
class Job(Generic[T]):
    """One waiting request: everything a policy may read, one unit per field. Queues compare
    ``(key, seq)``; jobs themselves compare by deadline (``__lt__``: the starvation guard's heap)."""

    payload: T  # the caller's object (the dispatcher's ticket, the simulator's row index)
    arrival_s: float  # clock seconds when the request arrived
    score: float = 0.0  # the predictor's queue key: unitless, lower = sooner (paper SJF)
    predicted_tokens: float = 0.0  # predicted output tokens (already capped by cap_tokens)
    predicted_s: float = 1.0  # predicted service seconds (service-time model), > 0
    priority: int = 0  # client priority class, already clamped; lower = sooner
    tenant: str = ""  # who sent it (fair share); "" = the default tenant
    model: str | None = None  # the model it asks for (model affinity); None = the backend's default
    expires_s: float = math.inf  # clock seconds from which it must not be dispatched (the client's queue deadline)
    deadline_s: float = math.inf  # overdue after this, on its guard's clock (set by a StarvationGuard at push)
    seq: int = -1  # arrival order, set at construction; breaks key ties
    waiting: bool = False  # True between push and pop/remove

    def __post_init__(self) -> None:
        if self.seq < 0:
            self.seq = next(_seq)

    def __lt__(self, other: Job[Any]) -> bool:
        """Deadline, then arrival order: ``StarvationGuard``'s deadline heap holds the jobs
        themselves (a ``(deadline, seq, job)`` tuple there cost a waiting request 72 bytes)."""
        mine, theirs = self.deadline_s, other.deadline_s
        return mine < theirs or (mine == theirs and self.seq < other.seq)


def add_counts(*counts: dict[str, int]) -> dict[str, int]:
    """``retained()`` figures summed by key (a composite queue's own and its parts')."""
    out: Counter[str] = Counter()
    for one in counts:
        out.update(one)  # (update keeps zero counts, where ``+`` drops them)
    return dict(out)


class JobQueue(Protocol[T]):
    """Every method a queue's caller may use: the first ones each queue implements, the others
    have defaults here, so that a caller never asks a queue whether it has a method."""

    def push(self, job: Job[T]) -> None:
        """Queue ``job``. ``job.arrival_s`` must not decrease between calls."""
        ...

    def remove(self, job: Job[T]) -> bool:
        """Withdraw a waiting job. False if it was not waiting (already popped or removed)."""
        ...

    def pop(self, now: float) -> tuple[Job[T], bool] | None:
        """The next job at ``now`` and whether a starvation rule chose it; None if empty."""
        head = self.peek(now)
        if head is not None:
            self.remove(head[0])
        return head

    def peek(self, now: float) -> tuple[Job[T], bool] | None:
        """What ``pop(now)`` would return, without removing it."""
        ...

    def take_now(self, job: Job[T], now: float) -> None:
        """``push(job)`` then ``pop(now)``, which gives ``job``, when no job waits: the same state,
        without the work (a request that finds a slot free and nobody waiting)."""
        job.waiting = False

    def done(self, job: Job[T]) -> None:
        """A job this queue popped has left the backend (finished, failed, or was never run)."""
        return None

    def repriced(self, job: Job[T], old_predicted_s: float) -> None:
        """A job this queue popped got its predicted seconds after dispatch (dispatched before its
        prediction): account the difference wherever service is charged."""
        return None

    def rekeyed(self, job: Job[T]) -> None:
        """A waiting job's prediction changed (a second opinion came while it waited): order it by
        its new fields from now on. Its starvation deadline stays the one fixed at push."""
        ...

    def ordered(self, now: float) -> list[Job[T]]:
        """Waiting jobs in the order they would go if nothing else arrived (for positions and ETAs)."""
        ...

    def retained(self) -> dict[str, int]:
        """Entries this queue holds, by structure (waiting jobs, lingering ones not yet dropped,
        tenants, groups): what a long-lived process watches to see that nothing accumulates."""
        ...

    # -- what a queue need not do itself: the defaults (every queue here subclasses JobQueue) --
    bound_s: float = 0.0  # seconds a request for a model no backend holds may be put off (0: no affinity)

    def pop_for(self, now: float, lanes: Sequence[Lane]) -> tuple[Job[T], bool] | None:
        """``pop(now)`` told what each backend with a free slot holds (model affinity)."""
        return self.pop(now)

    def ordered_for(self, now: float, lane: Lane, free_in_s: float = 0.0) -> list[Job[T]]:
        """``ordered(now)`` as one backend (``lane``, free in ``free_in_s`` seconds) would take them."""
        return self.ordered(now)

    def waiting_by_model(self) -> dict[str | None, int]:
        """Jobs waiting per model, where the queue keeps them apart (else empty)."""
        return {}

    def sort_key(self, job: Job[T], now: float) -> Any:
        """The job's place in this queue's own order at ``now`` (lower = sooner)."""
        return job.arrival_s, job.seq

    def is_overdue(self, job: Job[T], now: float) -> bool:
        """A starvation rule would put ``job`` first at ``now``."""
        return False

    def reset(self) -> bool:
        """With no job waiting, make the queue as new; False (nothing changed) if it cannot."""
        return False

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Job[T]]: ...


Key = Callable[[Job[Any]], Any]  # fixed at push; must be comparable (a float or a tuple of floats)
Rank = Callable[[Job[Any], float], Any]  # (job, now) -> comparable; lower goes sooner


class HeapQueue(JobQueue[T]):
    """Keys fixed at push: a min-heap of ``(key, seq, job)``, a tuple key flattened into the entry
    (``(*key, seq, job)``: the same order, one tuple a waiting job instead of two)."""

    def __init__(self, key: Key) -> None:
        self.key = key
        self._heap: list[tuple[Any, ...]] = []  # (*key, seq, job)
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Job[T]]:
        return (entry[-1] for entry in self._heap if entry[-1].waiting)

    def push(self, job: Job[T]) -> None:
        job.waiting = True
        heapq.heappush(self._heap, self._entry(job))
        self._live += 1

    def _entry(self, job: Job[T]) -> tuple[Any, ...]:
        key = self.key(job)
        return (*key, job.seq, job) if type(key) is tuple else (key, job.seq, job)

    def remove(self, job: Job[T]) -> bool:
        if not job.waiting:
            return False
        job.waiting = False  # lazily dropped when it surfaces
        self._live -= 1
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:
            self._heap = [entry for entry in self._heap if entry[-1].waiting]
            heapq.heapify(self._heap)
        return True

    def peek(self, now: float) -> tuple[Job[T], bool] | None:
        heap = self._heap
        while heap and not heap[0][-1].waiting:
            heapq.heappop(heap)
        return (heap[0][-1], False) if heap else None

    def pop(self, now: float) -> tuple[Job[T], bool] | None:
        head = self.peek(now)
        if head is not None:
            heapq.heappop(self._heap)
            head[0].waiting = False
            self._live -= 1
        return head

    def rekeyed(self, job: Job[T]) -> None:
        if not job.waiting:
            return
        heap = self._heap
        # O(n): a job is re-keyed at most once (the encoder's pace), and a lazy second entry
        # would need a version on every entry. heapify restores the order around the new key.
        for i, entry in enumerate(heap):
            if entry[-1] is job:
                heap[i] = self._entry(job)
                heapq.heapify(heap)
                return

    def ordered(self, now: float) -> list[Job[T]]:
        return [entry[-1] for entry in sorted(e for e in self._heap if e[-1].waiting)]

    def sort_key(self, job: Job[T], now: float) -> tuple[Any, int]:
        return self.key(job), job.seq

    def retained(self) -> dict[str, int]:
        return {"queue_entries": len(self._heap)}

    def reset(self) -> bool:
        if self._live:
            return False
        self._heap.clear()
        return True


class ScanQueue(JobQueue[T]):
    """Priorities that change with time: ``rank(job, now)`` is evaluated for every waiting job at
    each pop (lowest rank first, ties by arrival)."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self._jobs: dict[int, Job[T]] = {}  # by seq, in arrival order

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Job[T]]:
        return iter(list(self._jobs.values()))

    def push(self, job: Job[T]) -> None:
        job.waiting = True
        self._jobs[job.seq] = job

    def remove(self, job: Job[T]) -> bool:
        if not job.waiting:
            return False
        job.waiting = False
        del self._jobs[job.seq]
        return True

    def peek(self, now: float) -> tuple[Job[T], bool] | None:
        if not self._jobs:
            return None
        rank = self.rank
        return min(self._jobs.values(), key=lambda j: (rank(j, now), j.seq)), False

    def rekeyed(self, job: Job[T]) -> None:
        pass  # ranks are computed at each pop from the job's current fields

    def ordered(self, now: float) -> list[Job[T]]:
        rank = self.rank
        return sorted(self._jobs.values(), key=lambda j: (rank(j, now), j.seq))

    def sort_key(self, job: Job[T], now: float) -> tuple[Any, int]:
        return self.rank(job, now), job.seq

    def retained(self) -> dict[str, int]:
        return {"queue_entries": len(self._jobs)}

    def reset(self) -> bool:
        return not self._jobs  # it keeps nothing else


class StarvationGuard(JobQueue[T]):
    """Wraps any queue: an overdue job goes before every job that arrived after it.

    Job i is overdue once ``clock(now) > clock(arrival_s) + timeout_s + slowdown * predicted_s``
    (its deadline; ``slowdown`` = 0 is the paper's rule 3.4 with tau = ``timeout_s``, strict ``>``
    included). ``clock`` is the wall clock unless a ``FairShareQueue`` sets its share clock, so a
    tenant's requests age in the tenant's own share of the backend. When the inner queue's head
    arrived after the oldest overdue job, that job goes instead (overdue jobs go oldest first; jobs
    of the same instant in the inner queue's order).

    Bound: once job i is overdue, no job that arrived after it is dispatched before it. Its wait is
    therefore at most ``timeout_s + slowdown * predicted_s_i`` plus the service of the jobs that
    arrived before it (plus the one in flight). Jobs that arrived at the same instant (a burst) are
    equally old: the policy keeps ordering them, where the paper's rule would make the whole burst
    FIFO after tau.

    Cost: each job moves once from the deadline heap to the overdue heap (O(log n)); a pop is
    O(log n) plus the size of a same-instant group of overdue jobs (capped at 64).
    """

    def __init__(self, inner: JobQueue[T], timeout_s: float, slowdown: float | SlowdownRule = 0.0) -> None:
        if not timeout_s > 0:
            raise ValueError("timeout_s must be > 0 (math.inf disables it)")
        if isinstance(slowdown, (int, float)) and not slowdown >= 0:
            raise ValueError("slowdown must be >= 0")
        self.inner = inner
        self.timeout_s = timeout_s
        self.slowdown = slowdown
        self.clock: Callable[[float], float] | None = None  # wall seconds -> the guard's (None: the wall clock)
        # Both heaps are lazy: popped or removed jobs linger until they surface or a compaction.
        self._pending: list[Job[T]] = []  # not yet overdue, by deadline (``Job.__lt__``)
        self._overdue: list[tuple[float, int, Job[T]]] = []  # (arrival_s, seq, job), overdue

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Job[T]]:
        return iter(self.inner)

    def _clock_s(self, now: float) -> float:
        return now if self.clock is None else self.clock(now)

    def is_overdue(self, job: Job[T], now: float) -> bool:
        return self._clock_s(now) > job.deadline_s

    def push(self, job: Job[T]) -> None:
        if not math.isinf(job.deadline_s) and any(j is job for j in self._pending):
            # Pushed again while it lingers in the heap: its new deadline must not move under it.
            self._pending = [j for j in self._pending if j is not job]
            heapq.heapify(self._pending)
        job.deadline_s = self._new_deadline_s(job)
        self.inner.push(job)
        if not math.isinf(self.timeout_s):
            heapq.heappush(self._pending, job)

    def take_now(self, job: Job[T], now: float) -> None:
        job.deadline_s = self._new_deadline_s(job)  # as if it had waited; no heap entry (it would only linger)
        self.inner.take_now(job, now)

    def _new_deadline_s(self, job: Job[T]) -> float:
        slowdown = self.slowdown  # fixed, or the rule's value now
        factor = float(slowdown) if isinstance(slowdown, (int, float)) else slowdown.value()
        # Summed left to right as before the clock existed: wall-clock deadlines are bit-identical.
        return self._clock_s(job.arrival_s) + self.timeout_s + factor * job.predicted_s

    def remove(self, job: Job[T]) -> bool:
        removed = self.inner.remove(job)
        self._compact()
        return removed

    def _advance(self, now: float) -> None:
        pending, overdue = self._pending, self._overdue
        clock_now = self._clock_s(now)
        while pending and pending[0].deadline_s < clock_now:
            job = heapq.heappop(pending)
            if job.waiting:
                heapq.heappush(overdue, (job.arrival_s, job.seq, job))
        while overdue and not overdue[0][2].waiting:
            heapq.heappop(overdue)

    def _compact(self) -> None:
        # Runs at every pop and removal: the inner queue's length is read only when a heap is
        # large enough to be compacted at all.
        pending, overdue = self._pending, self._overdue
        if len(pending) <= 64 and len(overdue) <= 64:
            return
        live = len(self.inner)
        if len(pending) > 64 and len(pending) > 2 * live:
            self._pending = pending = [j for j in pending if j.waiting]
            heapq.heapify(pending)
        if len(overdue) > 64 and len(overdue) > 2 * live:
            self._overdue = overdue = [e for e in overdue if e[2].waiting]
            heapq.heapify(overdue)

    def _promotion(self, head: Job[T], now: float) -> Job[T] | None:
        """The oldest overdue job if it arrived strictly before ``head``; of a same-instant group,
        the one the inner queue prefers."""
        self._advance(now)
        overdue = self._overdue
        if not overdue or overdue[0][0] >= head.arrival_s:
            return None
        first = overdue[0][2]
        sort_key = self.inner.sort_key
        group: list[tuple[float, int, Job[T]]] = []
        while overdue and overdue[0][0] == first.arrival_s and len(group) < 64:
            entry = heapq.heappop(overdue)
            if entry[2].waiting:
                group.append(entry)
        for entry in group:
            heapq.heappush(overdue, entry)
        return min((e[2] for e in group), key=lambda j: sort_key(j, now))

    def peek(self, now: float) -> tuple[Job[T], bool] | None:
        head = self.inner.peek(now)
        if head is None or math.isinf(self.timeout_s):
            return head
        promoted = self._promotion(head[0], now)
        return (promoted, True) if promoted is not None and promoted is not head[0] else head

    def pop(self, now: float) -> tuple[Job[T], bool] | None:
        head = self.peek(now)
        return None if head is None else self.take(head, now)

    def take(self, head: tuple[Job[T], bool], now: float) -> tuple[Job[T], bool]:
        """``pop(now)`` when ``head`` is what ``peek(now)`` has just returned, nothing changed since:
        the same removal without a second peek (``FairShareQueue`` peeks every tenant to choose)."""
        job, promoted = head
        if promoted:
            self.inner.remove(job)
        else:
            self.inner.pop(now)  # the head peeked above
        self._compact()
        return job, promoted

    def done(self, job: Job[T]) -> None:
        self.inner.done(job)

    def retained(self) -> dict[str, int]:
        return add_counts(self.inner.retained(), {"guard_entries": len(self._pending) + len(self._overdue)})

    def reset(self) -> bool:
        """As new: no entries left in both heaps, the inner queue reset (same timeout, slowdown, clock)."""
        if len(self.inner) or not self.inner.reset():
            return False
        self._pending.clear()
        self._overdue.clear()
        return True

    def repriced(self, job: Job[T], old_predicted_s: float) -> None:
        self.inner.repriced(job, old_predicted_s)

    def rekeyed(self, job: Job[T]) -> None:
        self.inner.rekeyed(job)  # the deadline stays: the bound promised at arrival holds

    def ordered(self, now: float) -> list[Job[T]]:
        inner = self.inner.ordered(now)
        self._advance(now)
        place = {j.seq: i for i, j in enumerate(inner)}
        overdue = sorted((e[2] for e in self._overdue if e[2].waiting), key=lambda j: (j.arrival_s, place[j.seq]))
        if not overdue:
            return inner
        # Replay the pops at a fixed ``now``.
        out: list[Job[T]] = []
        taken: set[int] = set()
        i = k = 0
        while len(out) < len(inner):
            while inner[i].seq in taken:
                i += 1
            while k < len(overdue) and overdue[k].seq in taken:
                k += 1
            head = inner[i]
            pick = overdue[k] if k < len(overdue) and overdue[k].arrival_s < head.arrival_s else head
            out.append(pick)
            taken.add(pick.seq)
        return out


@dataclass(slots=True)
class _Tenant(Generic[T]):
    queue: JobQueue[T]
    served_s: float  # start tag of its next job: predicted service seconds received while active (virtual time)
    weight: float  # weight_of(its name), read when it became active
    in_flight: set[int] = field(default_factory=set)  # seqs of its popped jobs not yet done: active until empty
    waiting: int = 0  # its jobs waiting: len(queue), kept here (len() of a guard is two Python calls)


# Retired tenants kept for reuse, at most (a request that finds the backend idle activates its
# tenant and retires it at done: reusing its emptied queues saves building them per request).
_SPARE_TENANTS = 8


def _best_class(queue: JobQueue[T], head: tuple[Job[T], bool], now: float) -> int:
    """The best priority class waiting in one tenant's queue whose ``peek(now)`` is ``head``, even
    when a promotion hides it behind an older job."""
    if not isinstance(queue, StarvationGuard):
        return head[0].priority
    if head[1]:
        inner_head = queue.inner.peek(now)
    else:  # a guard that promoted nothing returned its inner queue's own peek
        inner_head = head
    return min(head[0].priority, inner_head[0].priority) if inner_head is not None else head[0].priority


class FairShareQueue(JobQueue[T]):
    """One inner queue per tenant; tenants share the backend in predicted service seconds.

    Start-time fair queuing (SFQ) with predicted seconds as the cost. A tenant is *active* while it
    has a request waiting or in service (popped, not yet ``done``). At each pop the candidate heads
    are those of the best priority class among tenants with a request waiting (an overdue head, by
    its tenant's starvation guard, joins the best class); among them the tenant with the least
    ``served_s`` (its next start tag) goes, and its ``served_s`` grows by the job's
    ``predicted_s``. Equal tags go to the tenant with fewer requests waiting (the lighter user),
    then by arrival. The system's virtual time is the start tag of the last dispatched job; a
    tenant that becomes active starts there, so idling banks no credit and a newcomer is not queued
    behind another tenant's backlog. A tenant whose request is still in service keeps its tag
    (at least the virtual time): sending the next request while the last one runs buys no place.
    With one tenant this is exactly its inner queue.

    ``make_queue`` must build equal empty queues at every call: a retired tenant's queue that can
    ``reset()`` is kept for the next tenant that becomes active. ``weight_of`` is read once per activation.

    Each tenant's ``StarvationGuard`` runs on the share clock (``share_clock_s``): wall seconds
    divided by the number of tenants with requests waiting, so the guard bounds waiting *within* a
    tenant in that tenant's own share, and fair share bounds waiting *across* tenants. A flooding
    tenant's overdue backlog therefore never competes with another tenant's requests beyond its
    share, and the other tenant's guard does not turn its queue FIFO merely because it shares.

    Bound across tenants (one priority class): from when tenant A has a request waiting, until A's
    next dispatch, each other tenant B is dispatched at most P_A + P_B predicted seconds per
    activation of B (P_A: the predicted seconds of A's last dispatched job, 0 if A has just become
    active; P_B: B's largest in between), since B goes only while its start tag does not exceed A's
    and every tag is at least the virtual time. B re-activates only after all its requests have
    left the backend: with one slot and two tenants A's head waits at most the job in flight plus
    P_A + P_max <= 2 x P_max predicted seconds.
    """

    def __init__(self, make_queue: Callable[[], JobQueue[T]], weight_of: Callable[[str], float] | None = None) -> None:
        self.make_queue = make_queue
        # A tenant of weight w is charged predicted_s / w: it gets w times the backend seconds of a
        # weight-1 tenant (weighted fair queuing). The share clock still divides by the count.
        self.weight_of = weight_of or (lambda tenant: 1.0)
        self._tenants: dict[str, _Tenant[T]] = {}  # active tenants (waiting or in service)
        self._spare: list[_Tenant[T]] = []  # retired tenants whose queues were reset to as-new
        self._waiting_tenants = 0  # active tenants with a request waiting (k of the share clock)
        self._live = 0
        self._virtual_s = 0.0  # start tag of the last dispatched job
        # The share clock is wall time minus the accumulated (1 - 1/k) dt, so with one tenant it is
        # the wall clock exactly (single-tenant schedules do not change by a rounding error).
        self._share_lag_s = 0.0  # wall seconds minus share seconds, as of _share_at_s
        self._share_at_s = -math.inf  # wall time of the last update
        # The seconds the share clock divides: the wall clock unless set (``ModelAffinity`` sets a
        # model's clock, which stops while the model is put off for a switch).
        self.clock: Callable[[float], float] | None = None

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Job[T]]:
        return itertools.chain.from_iterable(list(t.queue) for t in self._tenants.values())

    def retained(self) -> dict[str, int]:
        counts = {"fair_share_tenants": len(self._tenants), "fair_share_spare": len(self._spare)}
        for tenant in self._tenants.values():
            counts = add_counts(counts, tenant.queue.retained(), {"fair_share_in_flight": len(tenant.in_flight)})
        return counts

    @property
    def tenants(self) -> dict[str, float]:
        """Active tenants (waiting or in service) and their start tags in predicted seconds."""
        return {name: t.served_s for name, t in self._tenants.items()}

    def share_clock_s(self, now: float) -> float:
        """The share clock at wall time ``now``: it advances 1/k s per second while k tenants have
        requests waiting (1 s per second with one or none). ``now`` before the last update counts
        as the last update. A withdrawal (``remove``) takes effect from the last push or pop, which
        can only make the clock run faster (deadlines come sooner, never later)."""
        if self.clock is not None:
            now = self.clock(now)
        k = self._waiting_tenants
        lag_s = self._share_lag_s
        if k > 1 and now > self._share_at_s:
            lag_s += (now - self._share_at_s) * (1.0 - 1.0 / k)
        return (now if now > self._share_at_s else self._share_at_s) - lag_s

    def _tick(self, now: float) -> None:
        """Fold the share clock up to ``now`` (before the number of waiting tenants changes)."""
        if self.clock is not None:
            now = self.clock(now)
        if now > self._share_at_s and math.isfinite(now):  # pop(math.inf) drains at shutdown
            k = self._waiting_tenants
            if k > 1:
                self._share_lag_s += (now - self._share_at_s) * (1.0 - 1.0 / k)
            self._share_at_s = now

    def push(self, job: Job[T]) -> None:
        self._tick(job.arrival_s)
        tenant = self._tenants.get(job.tenant) or self._activate(job.tenant)
        if not tenant.waiting:
            self._waiting_tenants += 1
            tenant.served_s = max(tenant.served_s, self._virtual_s)  # in service only: keeps its tag
        tenant.queue.push(job)
        tenant.waiting += 1
        self._live += 1

    def take_now(self, job: Job[T], now: float) -> None:
        """``push`` then ``pop``: the tenant active, charged from the virtual time, the job in service."""
        if self._live:
            raise RuntimeError("take_now while jobs wait: push and pop instead")
        # Push's tick, then pop's, come to pop's alone: with no tenant waiting the share clock runs
        # at the wall clock's (or the set clock's) pace, so only the later reading counts.
        self._tick(now)
        tenant = self._tenants.get(job.tenant) or self._activate(job.tenant)
        tenant.served_s = max(tenant.served_s, self._virtual_s)  # in service only: keeps its tag
        tenant.queue.take_now(job, now)
        self._virtual_s = tenant.served_s
        tenant.served_s += job.predicted_s / tenant.weight
        tenant.in_flight.add(job.seq)

    def _activate(self, name: str) -> _Tenant[T]:
        """The tenant ``name`` becomes active: a spare one's queues (as new), else new ones."""
        weight = self.weight_of(name)
        if self._spare:
            tenant = self._spare.pop()
            tenant.served_s, tenant.weight = self._virtual_s, weight
        else:
            queue = self.make_queue()
            if isinstance(queue, StarvationGuard):
                queue.clock = self.share_clock_s
            tenant = _Tenant(queue, self._virtual_s, weight)
        self._tenants[name] = tenant
        return tenant

    def reset(self) -> bool:
        """As new, with no tenant active (a model-affinity group reuses it, not a new one per request)."""
        if self._tenants:
            return False
        self._virtual_s = 0.0
        self._share_lag_s = 0.0
        self._share_at_s = -math.inf
        return True

    def _retire(self, name: str, tenant: _Tenant[T]) -> None:
        """``tenant`` has nothing waiting and nothing in service: no longer active."""
        del self._tenants[name]
        if len(self._spare) < _SPARE_TENANTS:
            if tenant.queue.reset():
                self._spare.append(tenant)  # in_flight is empty, waiting 0

    def _dequeued(self, name: str, tenant: _Tenant[T]) -> None:
        """One of ``tenant``'s waiting jobs left its queue."""
        self._live -= 1
        tenant.waiting -= 1
        if not tenant.waiting:
            self._waiting_tenants -= 1
            if not tenant.in_flight:
                self._retire(name, tenant)

    def remove(self, job: Job[T]) -> bool:
        tenant = self._tenants.get(job.tenant)
        if tenant is None or not tenant.queue.remove(job):
            return False
        self._dequeued(job.tenant, tenant)
        return True

    def repriced(self, job: Job[T], old_predicted_s: float) -> None:
        """Its tenant was charged ``old_predicted_s`` at the pop: charge the true prediction."""
        tenant = self._tenants.get(job.tenant)
        if tenant is not None and job.seq in tenant.in_flight:
            tenant.served_s += (job.predicted_s - old_predicted_s) / tenant.weight

    def rekeyed(self, job: Job[T]) -> None:
        tenant = self._tenants.get(job.tenant)
        if tenant is not None:
            tenant.queue.rekeyed(job)  # tenants are charged at the pop, from the job's fields then

    def done(self, job: Job[T]) -> None:
        tenant = self._tenants.get(job.tenant)
        if tenant is None or job.seq not in tenant.in_flight:
            return  # not one of ours in service (or reported twice)
        tenant.queue.done(job)
        tenant.in_flight.discard(job.seq)
        if not tenant.in_flight and not tenant.waiting:
            self._retire(job.tenant, tenant)

    def _choose(self, now: float) -> tuple[str, Job[T], bool, tuple[Job[T], bool]] | None:
        """The tenant to serve, its head job, whether a starvation rule chose it, and its queue's
        ``peek(now)`` (for ``StarvationGuard.take``)."""
        if self._waiting_tenants == 1:  # one tenant waiting: its head, its own class the best
            for name, tenant in self._tenants.items():  # usually just this one
                if tenant.waiting:
                    head = tenant.queue.peek(now)
                    assert head is not None
                    job, promoted = head
                    return name, job, promoted or job.priority > _best_class(tenant.queue, head, now), head
        heads = []
        for name, tenant in self._tenants.items():
            queue = tenant.queue
            head = queue.peek(now)
            if head is None:
                continue
            job, promoted = head
            overdue = promoted or queue.is_overdue(job, now)
            best_here = _best_class(queue, head, now)
            heads.append((job.priority, overdue, tenant.served_s, tenant.waiting, name, job, promoted, best_here, head))
        if not heads:
            return None
        # The best class waiting anywhere, including one hidden behind a tenant's own promotion: a
        # head that is not overdue never goes before it.
        best = min(h[7] for h in heads)
        # An overdue head joins the best class, where fair share still decides: lifting it above
        # every tenant would let a flooding tenant's overdue backlog starve the others. Equal start
        # tags (common when predictions take a few values) go to the tenant with less waiting.
        _, _, _, _, name, job, promoted, _, head = min(
            heads, key=lambda h: (best if h[1] else h[0], h[2], h[3], h[5].seq)
        )
        # A starvation decision if a better class waits anywhere (possibly hidden behind a promotion).
        return name, job, promoted or job.priority > best, head

    def peek(self, now: float) -> tuple[Job[T], bool] | None:
        chosen = self._choose(now)
        return None if chosen is None else (chosen[1], chosen[2])

    def pop(self, now: float) -> tuple[Job[T], bool] | None:
        self._tick(now)
        chosen = self._choose(now)
        if chosen is None:
            return None
        name, _, lifted, head = chosen
        tenant = self._tenants[name]
        queue = tenant.queue
        got = queue.take(head, now) if isinstance(queue, StarvationGuard) else queue.pop(now)
        assert got is not None
        job, promoted = got[0], got[1] or lifted
        self._virtual_s = tenant.served_s
        tenant.served_s += job.predicted_s / tenant.weight
        tenant.in_flight.add(job.seq)
        self._dequeued(name, tenant)
        return job, promoted

    def ordered(self, now: float) -> list[Job[T]]:
        waiting = [t for t in self._tenants.values() if len(t.queue)]
        if len(waiting) <= 1:
            return [j for t in waiting for j in t.queue.ordered(now)]
        # Merge the tenants' own orders by the virtual time each job would start at (then the
        # tenant's remaining count, as ``_choose`` breaks ties).
        merged: list[tuple[tuple[Any, ...], Job[T]]] = []
        for tenant in waiting:
            served = tenant.served_s
            own = tenant.queue.ordered(now)
            for i, job in enumerate(own):
                merged.append(((job.priority, served, len(own) - i, job.seq), job))
                served += job.predicted_s
        merged.sort(key=lambda item: item[0])
        return [job for _, job in merged]
