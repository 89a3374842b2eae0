"""The dispatcher: capacity, routing to the pool's backends, and the lease that holds a (backend, slot).

A scheduled request's life, all of it visible here:

    dispatcher.submit(ticket)                   queued (or QueueFull with a Retry-After from the ETA)
    async with dispatcher.lease(ticket) as slot:  waits for its turn, then holds a backend slot
        ... relay the backend's answer ...
    (leaving the block)                         withdrawn if still queued, else released, exactly once

Dispatching is one synchronous step, ``_pump``, run when work arrives, a slot frees or a backend
comes back (coalesced to once per event-loop turn, so a burst that arrives together is ordered by
the policy before the first of it is dispatched). It routes the policy's next request
(scheduling/routing.py) at dispatch, with the freshest state. A request whose model only busy
backends serve is held back, first in line, until one of them frees a slot.

Invariants, each enforced in this file:
- never more leases on a backend than its slots; a slot is granted only to a waiting ticket;
- every ticket leaves exactly once: ``_end`` (idempotent) withdraws it or releases its slot;
- a request whose backend refused the connection (nothing was sent) may be rerouted once per
  refusal: its slot is given back and it waits first in line for another healthy backend;
- nothing is sent at or after its queue deadline (``Job.expires_s``);
- detached tasks are strongly referenced and their failures logged.

The service-time model and the policy learn from each completed lease. A request sent to a backend
that does not hold its model (scheduling/affinity.py) is charged that backend's learned load
(``Placement.switch_load_s``: in its ETA and its tenant's fair share, never in the service-time
model's inputs), learned from Ollama's ``load_duration`` or else from the first byte (``first_byte``).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clairvoyant.clock import Clock
from clairvoyant.errors import QueueDeadline, QueueFull, RequestError
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.predictor import Prediction
from clairvoyant.prediction.usage import Usage
from clairvoyant.scheduling.affinity import Lane
from clairvoyant.scheduling.cluster.shared import ClusterSide, ServiceObservation
from clairvoyant.scheduling.expiry import Expiry, expired
from clairvoyant.scheduling.job_queue import Job, JobQueue, add_counts
from clairvoyant.scheduling.policy import SchedulingPolicy
from clairvoyant.scheduling.request import ID_PREFIX, Placement, RequestStatus, Ticket, status_counts
from clairvoyant.scheduling.routing import Backend, Load, choose
from clairvoyant.scheduling.service_time import FREE_LOAD_S, ServiceTimeModel, write_state
from clairvoyant.scheduling.slowdown import AdaptiveSlowdown

__all__ = [
    "ID_PREFIX", "Backend", "ClusterHooks", "Dispatcher", "Lease", "ModelNotServed", "QueueLimits", "RequestStatus",
    "ShuttingDown", "Ticket",
]  # fmt: skip

logger = logging.getLogger(__name__)

_SAVE_EVERY = 50  # service-time observations between state-file writes
RECENT_REQUESTS = 100  # finished requests kept for /queue's timeline (the live page)
# An in-flight request past its prediction is not near its end: it is taken to run this fraction of
# what it has run (or produced) so far again (not 0, which would tell the requests behind it "now").
OVERRUN_GROWTH = 0.5
# Streamed tokens before the answer's own pace is trusted over its prediction (the first ones carry
# the prompt's processing).
LIVE_PACE_MIN_TOKENS = 8
SHUTDOWN_RETRY_AFTER_S = 5  # a restarted proxy is usually back within seconds

_FINISHED = RequestStatus.COMPLETED  # the first finished status


def remainder_s(ticket: Ticket, now: float, slowness: float = 1.0) -> float:
    """Predicted seconds an in-flight request still holds its slot.

    Where the backend streams, from its own pace: the tokens still expected (its predicted tokens,
    or, once it has produced more, ``OVERRUN_GROWTH`` of what it has produced) at the seconds per
    token it has shown. Otherwise its predicted seconds (at the backend's slowness, plus the load it
    was charged) less what it has run; past them, ``OVERRUN_GROWTH`` of what it has run."""
    placement = ticket.placement
    assert placement is not None  # it runs: it was granted
    running_s = now - placement.dispatched_s
    produced = placement.live_tokens
    if produced >= LIVE_PACE_MIN_TOKENS and running_s > 0:
        expected = ticket.predicted_tokens if produced < ticket.predicted_tokens else produced * (1 + OVERRUN_GROWTH)
        return (expected - produced) * running_s / produced
    predicted_s = ticket.predicted_s * slowness + placement.switch_load_s
    return max(predicted_s - running_s, OVERRUN_GROWTH * running_s)


class ShuttingDown(RequestError):
    status_code = 503
    error_type = "server_error"
    code = "shutting_down"
    retry_after_s = SHUTDOWN_RETRY_AFTER_S


class ModelNotServed(RequestError):
    """No backend of the pool lists the request's model."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


def _deadline_error(ticket: Ticket, retry_in_s: float) -> QueueDeadline:
    deadline_s = ticket.expires_s - ticket.arrival_s
    return QueueDeadline(
        f"the request could not be sent within its queue deadline of {deadline_s:g} s",
        retry_after_s=max(1, min(3600, math.ceil(retry_in_s))),
    )


@dataclass(slots=True)
class Lease:
    ticket: Ticket
    completed: bool = False  # the answer ended normally (only those durations teach the service-time model)
    usage: Usage | None = None  # what the backend reported producing (None: not read)


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """How many requests may wait; a waiting one is overdue after ``starvation_timeout_s +
    starvation_slowdown * predicted_s``."""

    max_queue: int
    min_retry_after_s: int = 1  # the least Retry-After of a full queue's refusal
    starvation_timeout_s: float = math.inf
    starvation_slowdown: float | AdaptiveSlowdown = 0.0


@dataclass(slots=True)
class ClusterHooks:
    """With replicas (scheduling/cluster/): with ``side`` set the shared store grants the slots,
    and the backends' free lists hold only what this replica may grant itself."""

    side: ClusterSide | None = None
    # Told each completed request's service-time observation (replicas share them).
    on_observed: Callable[[ServiceObservation], None] | None = None


@dataclass(slots=True, eq=False)
class DispatchStats:
    """What the dispatcher counts. Each backend's gauge and counter is looked up once (a
    ``labels()`` lookup per request costs µs)."""

    status: list[int]  # entries into each status, by ``RequestStatus`` value (``status_counts``)
    in_flight: list[Any]  # per backend
    switches: list[Any]  # per backend
    grants: int = 0  # slots granted so far (a ticket's queue position is a difference of these)
    observed: int = 0  # service-time observations
    # (ticket, ended clock seconds, outcome, output tokens or None), newest last
    recent: deque[tuple[Ticket, float, str, int | None]] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))


class _Lifecycle:
    """The dispatcher on the event loop: started, closing, its scheduled dispatch step, the
    shutdown's grace timer and its detached tasks."""

    __slots__ = ("started", "closing", "pump_scheduled", "grace_timer", "tasks", "cancel_at_stop")

    def __init__(self) -> None:
        self.started = self.closing = self.pump_scheduled = False
        self.grace_timer: asyncio.TimerHandle | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.cancel_at_stop: set[asyncio.Task[Any]] = set()  # of those, loops and checks ``stop`` does not wait for

    def run(self, coro: Coroutine[Any, Any, Any], name: str, cancel_at_stop: bool) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        if cancel_at_stop:
            self.cancel_at_stop.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        self.cancel_at_stop.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("detached task %s failed", task.get_name(), exc_info=task.exception())


class _Deadlines:
    """Waiting tickets with a queue deadline, and one timer at the soonest."""

    __slots__ = ("expiry", "timer", "timer_s")

    def __init__(self) -> None:
        self.expiry: Expiry[Ticket] = Expiry()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_s = math.inf  # the clock reading the timer is set for

    def arm(self, clock: Clock, callback: Callable[[], None]) -> None:
        soonest = self.expiry.next_s()
        if math.isinf(soonest) or soonest >= self.timer_s:
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer_s = soonest
        self.timer = asyncio.get_running_loop().call_later(max(0.0, soonest - clock.now()), callback)


class Dispatcher:
    def __init__(
        self,
        queue: JobQueue[Ticket],
        policy: SchedulingPolicy,
        *,
        slots: int = 1,
        backends: Sequence[Backend] | None = None,
        clock: Clock,
        metrics: Metrics,
        max_queue: int,
        service_time: ServiceTimeModel | None = None,
        min_retry_after_s: int = 1,
        starvation_timeout_s: float = math.inf,
        starvation_slowdown: float | AdaptiveSlowdown = 0.0,
    ) -> None:
        """``backends``: the pool; None = one backend with ``slots`` slots."""
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.queue = queue
        self.policy = policy
        self.backends: list[Backend] = list(backends) if backends else [Backend("default", slots)]
        self.clock = clock
        self.metrics = metrics
        self.limits = QueueLimits(max_queue, min_retry_after_s, starvation_timeout_s, starvation_slowdown)
        self.service_time = service_time or ServiceTimeModel()
        self.cluster = ClusterHooks()
        self.stats = DispatchStats(
            status_counts(metrics),
            [metrics.backends.in_flight[b.name] for b in self.backends],
            [metrics.backends.model_switches[b.name] for b in self.backends],
        )
        self._held_back: deque[Ticket] = deque()  # chosen (or rerouted), waiting for a backend: first in line
        self._lifecycle = _Lifecycle()
        self._deadlines = _Deadlines()
        metrics.queue.starvation_timeout.set(starvation_timeout_s)
        for backend in self.backends:
            metrics.backends.healthy[backend.name].set(1 if backend.healthy else 0)
            metrics.backends.in_flight[backend.name].set(0)
            metrics.backends.slots[backend.name].set(backend.slots)
            metrics.backends.declare(backend.name)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._lifecycle.started = True
        self._schedule_pump()

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new work and every waiting request (503 ``shutting_down``); in-flight answers may
        finish for ``grace_s`` seconds, then each is interrupted. Idempotent."""
        if self._lifecycle.closing:
            return
        self._lifecycle.closing = True
        refused = len(self._held_back)
        while self._held_back:
            self._refuse(self._held_back.popleft())
        while (got := self.queue.pop(math.inf)) is not None:
            self._refuse(got[0].payload)
            refused += 1
        logger.info(
            "shutting down: refused %d waiting request(s); %d in flight get %.1f s", refused, self.in_flight, grace_s
        )
        self._lifecycle.grace_timer = asyncio.get_running_loop().call_later(grace_s, self._interrupt_running)

    def _refuse(self, ticket: Ticket) -> None:
        """A popped or held-back ticket, refused: shutting down."""
        ticket.held_back = False
        self.queue.done(ticket)
        self._end_waiting(ticket, RequestStatus.REFUSED, ShuttingDown("the proxy is shutting down; retry"))

    def _interrupt_running(self) -> None:
        error = ShuttingDown("the proxy shut down before the answer was complete")
        for ticket in self.running():
            interrupt = None if ticket.placement is None else ticket.placement.interrupt
            if interrupt is not None and interrupt(RequestStatus.SHUTDOWN, error):
                logger.warning("request_id=%s: shutdown grace period over; ended its answer", ticket.request_id)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Refuse new work, let in-flight requests finish for up to ``timeout_s``, then cancel."""
        self.begin_shutdown(timeout_s)
        lifecycle = self._lifecycle
        deadline = time.monotonic() + timeout_s
        while (self.in_flight or lifecycle.tasks - lifecycle.cancel_at_stop) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for timer in (lifecycle.grace_timer, self._deadlines.timer):
            if timer is not None:
                timer.cancel()
        for task in list(lifecycle.tasks):
            task.cancel()
        await asyncio.gather(*lifecycle.tasks, return_exceptions=True)
        lifecycle.started = False
        self._save_state()

    @property
    def slots(self) -> int:
        return sum(b.slots for b in self.backends)

    @property
    def in_flight(self) -> int:
        """Slots held now, on every backend."""
        return sum(len(b.running) for b in self.backends)

    def in_flight_on(self, backend: int) -> int:
        return len(self.backends[backend].running)

    def running(self) -> list[Ticket]:
        return [t for b in self.backends for t in b.running.values()]

    @property
    def healthy(self) -> bool:
        return self._lifecycle.started

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot: in the queue or held back."""
        return len(self.queue) + len(self._held_back)

    # -- backends --------------------------------------------------------------------------
    def set_health(self, backend: int, healthy: bool, loaded: Sequence[str] | None = None) -> None:
        """What a health check (or a refused connection) found; ``loaded``: Ollama's /api/ps."""
        record = self.backends[backend]
        if loaded is not None:
            record.held.report(loaded)
        if record.healthy == healthy:
            return
        record.healthy = healthy
        self.metrics.backends.healthy[record.name].set(1 if healthy else 0)
        if healthy:
            logger.info("backend %s is healthy again", record.name)
            self._schedule_pump()
        else:
            fallback = (
                "skipped while another backend serves its requests"
                if len(self.backends) > 1
                else "its requests wait for it"
            )
            logger.warning("backend %s is unhealthy: %s", record.name, fallback)

    def resize(self, backend: int, slots: int) -> None:
        """The backend runs ``slots`` requests at once from now on (e.g. llama.cpp's ``total_slots``,
        learned once it answers). A removed slot that is busy is not reused when its request ends."""
        if slots < 1:
            raise ValueError("slots must be >= 1")
        record = self.backends[backend]
        old = record.slots
        if slots == old:
            return
        record.slots = slots
        if self.cluster.side is not None:  # the store grants the slots: it is told, and the free lists stay its
            self.cluster.side.pool_changed()
        elif slots > old:
            record.free[:0] = range(slots - 1, old - 1, -1)  # popped from the end: the old ones first
        else:
            record.free = [slot for slot in record.free if slot < slots]
        self.metrics.backends.slots[record.name].set(slots)
        logger.info("backend %s runs %d requests at once (was %d)", record.name, slots, old)
        self._schedule_pump()

    def _check_model(self, model: str | None) -> None:
        if not any(b.serves(model) for b in self.backends):
            raise ModelNotServed(f"the model {model!r} is not served by any backend of this proxy", param="model")

    def remaining_s(self, backend: Backend) -> float:
        """Predicted seconds of work left on ``backend`` (its in-flight requests' remainders, at its
        measured slowness; one that overran its prediction still counts: ``remainder_s``)."""
        now = self.clock.now()
        return sum(remainder_s(t, now, backend.slowness) for t in backend.running.values())

    def _route(self, ticket: Ticket) -> int | None:
        placement = ticket.placement
        refused_by = () if placement is None else placement.refused_by
        return choose(
            self.backends, ticket.model, self.remaining_s, refused_by, ticket.predicted_s, self.service_time.load_s
        )

    def reroute(self, ticket: Ticket) -> bool:
        """The ticket's backend refused the connection (nothing was sent): that backend is marked
        unhealthy. True: the slot is given back and the ticket waits first in line for another
        healthy backend (await ``regranted``). False: none serves its model; it keeps its slot."""
        placement = ticket.placement
        assert placement is not None and placement.backend is not None and placement.slot is not None
        self.set_health(placement.backend, False)
        others = [b for i, b in enumerate(self.backends) if i != placement.backend and b.serves(ticket.model)]
        # (With replicas the store routes: the request keeps its slot and waits for its backend.)
        if self._lifecycle.closing or self.cluster.side is not None or not any(b.healthy for b in others):
            return False
        placement.refused_by = (*placement.refused_by, placement.backend)
        self._free_slot(ticket)
        placement.backend = placement.slot = None
        ticket._future = None  # a new wait
        self.move(ticket, RequestStatus.WAITING)
        ticket.held_back = True
        self._held_back.appendleft(ticket)
        self._schedule_pump()
        return True

    # -- requests --------------------------------------------------------------------------
    def predicted_s(self, model: str | None, prompt_tokens: float, output_tokens: float) -> float:
        return self.service_time.predict_s(model, prompt_tokens, output_tokens)

    def check_room(self) -> None:
        """Raise what ``submit`` would refuse any request for now: ``ShuttingDown``, or ``QueueFull``
        with a Retry-After computed from the predicted time until the queue's tail is dispatched."""
        if self._lifecycle.closing:
            raise ShuttingDown("the proxy is shutting down; retry")
        limits = self.limits
        if self.waiting >= limits.max_queue:
            tail_eta_s = self.etas(self.clock.now())[1]
            raise QueueFull(
                f"the scheduling queue is full ({limits.max_queue} requests waiting); retry later",
                retry_after_s=max(limits.min_retry_after_s, min(3600, math.ceil(tail_eta_s))),
            )

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket, its predicted fields filled in. Raises ``ShuttingDown``,
        ``ModelNotServed``, ``QueueFull`` (``check_room``), and ``QueueDeadline`` when its ETA is
        already past its queue deadline (it is not queued: answered at once, never sent)."""
        self.check_room()
        self._check_model(ticket.model)
        self.queue.push(ticket)
        self.stats.status[RequestStatus.WAITING] += 1  # its first status: counted as it is admitted
        self.metrics.queue.depth[ticket.predicted_class].inc()
        # O(1) on purpose: ordering the whole queue per arrival would cost O(n log n) at depth n.
        ticket.grants_before_arrival = self.stats.grants
        if not math.isinf(ticket.expires_s):
            # O(waiting) for a request with a deadline: where it would stand, played forward.
            now = self.clock.now()
            eta_s = next((eta for job, eta in self.etas(now)[0] if job is ticket), 0.0)
            if now + eta_s >= ticket.expires_s:
                self.queue.remove(ticket)
                error = _deadline_error(ticket, eta_s)
                self._end_waiting(ticket, RequestStatus.EXPIRED, error)
                raise error
            self._deadlines.expiry.add(ticket)
            self._arm_expiry()
        if self.cluster.side is not None:
            self.cluster.side.enqueued(ticket, ticket.expires_s - self.clock.now())
        self._schedule_pump()

    def dispatch_at_once(self, ticket: Ticket) -> bool:
        """Grant ``ticket`` a slot now, before its prediction, when a backend for it has a free
        slot and nobody waits: there is no order to decide. False otherwise (then predict it and
        ``submit``). Raises as ``submit`` does. The caller predicts while the backend works, fills
        in the ticket's predicted fields and calls ``predicted_at_once``."""
        waiting = self.waiting
        if self._lifecycle.closing or waiting >= self.limits.max_queue:
            self.check_room()  # raises
        # (``_route`` finds only a backend that serves its model)
        backend = None if waiting or not self._lifecycle.started else self._route(ticket)
        if backend is None:
            self._check_model(ticket.model)
            return False
        ticket.grants_before_arrival = self.stats.grants
        self.stats.status[RequestStatus.WAITING] += 1  # its first status, if only for this instant
        # Through the queue all the same (its tenant's accounting, and done() at release): pushed and
        # popped at once, which take_now does without the heaps.
        self.queue.take_now(ticket, self.clock.now())
        self._grant(backend, ticket, queued=False)
        return True

    def predicted_at_once(self, ticket: Ticket, charged_s: float) -> None:
        """A ticket dispatched at once has its prediction: its tenant is charged the predicted
        seconds (it was charged ``charged_s`` at dispatch), and its wait is observed under its class."""
        assert ticket.placement is not None
        self.queue.repriced(ticket, charged_s)
        self.metrics.queue.wait[ticket.predicted_class].observe(ticket.placement.dispatched_s - ticket.arrival_s)

    def expire(self, now: float | None = None) -> int:
        """Withdraw every waiting ticket whose queue deadline has come, held back ones too, and
        refuse each with ``QueueDeadline``; how many. Run by the dispatch step first, and by a timer."""
        now = self.clock.now() if now is None else now
        count = 0
        tail_s: float | None = None  # the queue's tail ETA: a retry's wait, at worst (computed once)
        for job in self._deadlines.expiry.due(now):
            ticket = job.payload
            if not ticket.ended and self.queue.remove(ticket):
                tail_s = self.etas(now)[1] if tail_s is None else tail_s
                self._expired(ticket, now, tail_s)
                count += 1
        for ticket in [t for t in self._held_back if expired(t, now)]:
            self._unhold(ticket)
            self._expired(ticket, now, 0.0)  # first in line: a retry would be too
            count += 1
        return count

    def _expired(self, ticket: Ticket, now: float, retry_in_s: float) -> None:
        """``ticket``'s queue deadline came while it waited (out of the queue already): refused."""
        self.stats.recent.append((ticket, now, "expired", None))
        self._end_waiting(ticket, RequestStatus.EXPIRED, _deadline_error(ticket, retry_in_s))

    def _arm_expiry(self) -> None:
        if self._lifecycle.started:
            self._deadlines.arm(self.clock, self._on_expiry_timer)

    def _on_expiry_timer(self) -> None:
        self._deadlines.timer, self._deadlines.timer_s = None, math.inf
        if self._lifecycle.closing:
            return
        if self.expire():
            self._schedule_pump()  # a withdrawn held-back ticket may have been first in line
        self._arm_expiry()

    def repredicted(self, ticket: Ticket, prediction: Prediction) -> bool:
        """A waiting ticket's prediction was refined (the encoder's second opinion): the queue
        re-orders it. False (nothing changes) if it no longer waits in the queue."""
        if ticket.ended or not ticket.waiting or ticket.prediction is None:
            return False
        old_class = ticket.predicted_class
        ticket.prediction = prediction
        ticket.score = prediction.score
        ticket.predicted_tokens = prediction.predicted_tokens
        ticket.predicted_s = self.predicted_s(ticket.model, ticket.prompt_tokens, prediction.predicted_tokens)
        self.queue.rekeyed(ticket)
        if self.cluster.side is not None:
            self.cluster.side.rekeyed(ticket)
        if ticket.predicted_class != old_class:
            self.metrics.queue.depth[old_class].dec()
            self.metrics.queue.depth[ticket.predicted_class].inc()
        return True

    def lease(self, ticket: Ticket) -> _LeaseScope:
        """``async with dispatcher.lease(ticket) as lease``: wait for the ticket's turn, hold its
        slot for the block, then give it back exactly once. Raises what refused the ticket.
        Cancel-safe: cancelled while waiting, the ticket is withdrawn and never sent."""
        return _LeaseScope(self, ticket)

    def first_byte(self, ticket: Ticket, *, streamed: bool, at_s: float | None = None) -> None:
        """The first byte of ``ticket``'s answer arrived at ``at_s`` (default now). A streamed
        answer's delay since dispatch teaches the backend's load cost: after a switch, its excess
        over the backend's usual first-byte delay (then the load this answer paid); otherwise that
        usual delay. Ignored for an answer not streamed (its first byte comes after the whole
        answer) and for Ollama, whose ``load_duration`` (``Usage.load_s``) is exact."""
        placement = ticket.placement
        if not streamed or placement is None or placement.backend is None or placement.load == Load.UNKNOWN:
            return  # (the first request a backend gets may have paid a load of unknown origin: no baseline)
        backend = self.backends[placement.backend]
        if backend.held.tracks_loaded:
            return
        delay_s = (self.clock.now() if at_s is None else at_s) - placement.dispatched_s
        after_switch = placement.load == Load.SWITCH
        measured = self.service_time.observe_first_byte(backend.name, ticket.model, delay_s, after_switch=after_switch)
        if measured is not None:
            placement.switch_load_s = measured

    async def regranted(self, ticket: Ticket) -> None:
        """After ``reroute``: wait for the new grant (cancel-safe: the lease's exit withdraws it)."""
        await asyncio.shield(ticket.granted)

    def _end(self, ticket: Ticket, lease: Lease | None) -> None:
        """Every ticket's one exit: withdraw it if still waiting, else release its slot. Idempotent."""
        if ticket.ended:
            return
        if self._withdraw(ticket):
            self.metrics.requests.disconnects["queued"].inc()
            self.stats.recent.append((ticket, self.clock.now(), "left_queued", None))
            self._end_waiting(ticket, RequestStatus.CLIENT_LEFT_QUEUED)
            return
        ticket.ended = True
        placement = ticket.placement
        if placement is None or placement.slot is None:
            return  # refused (shutting down): nothing held
        completed = lease is not None and lease.completed
        usage = None if lease is None else lease.usage
        tokens = None if usage is None else usage.output_tokens
        self.stats.recent.append((ticket, self.clock.now(), "completed" if completed else "ended", tokens))
        if completed:
            self._learn(ticket, placement, self.clock.now() - placement.dispatched_s, usage)
        self._free_slot(ticket)
        self.queue.done(ticket)  # its tenant stays active for fair share until here
        if self.waiting:
            self._schedule_pump()

    def move(self, ticket: Ticket, status: RequestStatus) -> bool:
        """The one place a request's status changes: logged (debug) and counted. A finished
        request keeps its first ending: False then, and nothing changes."""
        old = ticket.status
        if old == status or old >= _FINISHED:  # (``is_finished``, without its call: this runs 4 times a request)
            return False
        ticket.status = status
        self.stats.status[status] += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request_id=%s %s -> %s", ticket.request_id, old.name, status.name)
        return True

    def _free_slot(self, ticket: Ticket) -> None:
        placement = ticket.placement
        assert placement is not None and placement.backend is not None and placement.slot is not None
        backend = self.backends[placement.backend]
        if backend.running.pop(placement.slot, None) is not None:
            side = self.cluster.side
            mine = side is None or side.slot_freed(ticket, self.clock.now())
            if mine and placement.slot < backend.slots:  # not a slot ``resize`` removed
                backend.free.append(placement.slot)
            self.metrics.queue.in_flight.dec()
            self.stats.in_flight[placement.backend].dec()

    def _unhold(self, ticket: Ticket) -> None:
        """A held-back ticket leaves the line unserved (popped already: done for its queue)."""
        ticket.held_back = False
        self._held_back.remove(ticket)
        self.queue.done(ticket)

    def _withdraw(self, ticket: Ticket) -> bool:
        """Take a waiting ticket out of the line (the queue, or held back): False if it is not there."""
        if ticket.ended:
            return False
        if ticket.held_back:
            self._unhold(ticket)
            return True
        return ticket.waiting and self.queue.remove(ticket)

    def _end_waiting(self, ticket: Ticket, status: RequestStatus | None, refusal: RequestError | None = None) -> None:
        """A waiting ticket, out of the line, ends ``status`` (unless its client left first; None:
        its status moved on already), and its wait's future is settled at once."""
        ticket.ended = True
        if self.cluster.side is not None:
            self.cluster.side.withdrawn(ticket)
        if ticket.placement is None:  # a rerouted ticket left the depth gauge at its first grant
            self.metrics.queue.depth[ticket.predicted_class].dec()
        if status is None:
            return
        if ticket.status == RequestStatus.WAITING:
            ticket.refusal = refusal
            self.move(ticket, status)
        ticket.settle()

    def _learn(self, ticket: Ticket, placement: Placement, service_s: float, usage: Usage | None) -> None:
        # The slot's measured seconds against the inputs the model predicts from: the prompt's
        # tokens (the backend's count when it reported one) and the PREDICTED output tokens. Fitting
        # on predicted rather than produced output tokens makes predicted seconds the conditional
        # mean of the slot time: the predictor's tokens are a median (log-space regression), and
        # seconds must add up to an ETA. The produced tokens teach the length learner instead.
        prompt_tokens = ticket.prompt_tokens
        if usage is not None and usage.prompt_tokens is not None:
            prompt_tokens = usage.prompt_tokens
        # A model load is not service: the load it paid (Ollama's load_duration, else the first byte's
        # measure or the learned one after a switch) comes off. Ollama's load also teaches the load cost:
        # after a switch, or when a load happened anyway (its keep_alive ran out).
        load_s = placement.switch_load_s
        learned_load_s = None
        backend = None if placement.backend is None else self.backends[placement.backend]
        if usage is not None and usage.load_s is not None and backend is not None:
            if placement.load == Load.SWITCH or usage.load_s >= FREE_LOAD_S:
                self.service_time.observe_load(backend.name, ticket.model, usage.load_s)
                learned_load_s = usage.load_s
            load_s = usage.load_s
        service_s -= load_s
        predicted = round(ticket.predicted_tokens)  # output tokens
        if self.cluster.on_observed is not None and backend is not None:
            self.cluster.on_observed(
                ServiceObservation(
                    ticket.model, backend.name, prompt_tokens, predicted, service_s, ticket.predicted_s, learned_load_s
                )
            )
        if not service_s > 0:
            return  # a load learned longer than this one was: no service seconds to learn from
        self.service_time.observe(ticket.model, prompt_tokens, predicted, service_s)
        if backend is not None:
            backend.observe_service(ticket.predicted_s, service_s)
        self.policy.observe(ticket, service_s)
        if isinstance(self.limits.starvation_slowdown, AdaptiveSlowdown):
            self.limits.starvation_slowdown.observe(service_s)
        self.stats.observed += 1
        if self.stats.observed % _SAVE_EVERY == 0 and self.service_time.path is not None:
            # Written in a worker thread (fsync can take milliseconds); the snapshot is taken here.
            self.run_detached(
                asyncio.to_thread(self._write_state, self.service_time.path, self.service_time.snapshot()),
                name="service-time-save",
            )

    def _save_state(self) -> None:
        if self.service_time.path is not None:
            self._write_state(self.service_time.path, self.service_time.snapshot())

    @staticmethod
    def _write_state(path: Path, state: dict[str, Any]) -> None:
        try:
            write_state(path, state)
        except OSError as exc:
            logger.warning("cannot save the service-time state: %s", exc)

    def run_detached(
        self, coro: Coroutine[Any, Any, Any], name: str, *, cancel_at_stop: bool = False
    ) -> asyncio.Task[Any]:
        """Run ``coro`` as a tracked background task, which ``stop`` lets finish within its grace
        period; a ``cancel_at_stop`` one (a periodic loop, a wait for the backend) it cancels at once."""
        return self._lifecycle.run(coro, name, cancel_at_stop)

    # -- dispatch ----------------------------------------------------------------------------
    def _schedule_pump(self) -> None:
        """Dispatch what can go, once, at the end of this event-loop turn."""
        lifecycle = self._lifecycle
        if not lifecycle.pump_scheduled and lifecycle.started:
            lifecycle.pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        """Grant free slots: first to held-back tickets (chosen earlier), then in the policy's
        order; a popped ticket no free backend can take is held back."""
        self._lifecycle.pump_scheduled = False
        if self._lifecycle.closing:
            return
        try:
            now = self.clock.now()
            self.expire(now)  # nothing is sent at or after its queue deadline
            for ticket in list(self._held_back):
                if not any(b.free for b in self.backends):
                    return
                backend = self._route(ticket)
                if backend is not None:
                    self._held_back.remove(ticket)
                    ticket.held_back = False
                    self._grant(backend, ticket)
            while any(b.free for b in self.backends):
                got = self.queue.pop_for(now, [self._lane(b) for b in self.backends if b.free])
                if got is None:
                    return
                job, promoted = got
                ticket = job.payload
                if promoted:
                    self.metrics.queue.starvation_promotions.inc()
                if ticket.status != RequestStatus.WAITING:  # withdrawn in between: nothing to run
                    self._end_waiting(ticket, None)
                    self.queue.done(job)
                elif expired(ticket, now):  # its deadline was set or moved after it was queued
                    self.queue.done(job)
                    self._expired(ticket, now, 0.0)  # popped: it was next in line
                elif (backend := self._route(ticket)) is None:
                    ticket.held_back = True  # its backends are busy: first in line for them
                    self._held_back.append(ticket)
                else:
                    self._grant(backend, ticket)
        except Exception:  # dispatching must never stop: log, and try again next turn
            logger.exception("dispatcher: unexpected error")

    def _lane(self, backend: Backend) -> Lane:
        """``backend`` as the model-affinity rule sees it: what it holds, its last switch, its learned loads."""
        return Lane(backend, functools.partial(self.service_time.load_s, backend.name))

    def _grant(self, index: int, ticket: Ticket, *, queued: bool = True, slot: int | None = None) -> None:
        """``queued``: it waited in the queue (False: dispatched at once, before its prediction).
        ``slot``: the one the shared store granted (None: a free one of this dispatcher's)."""
        self.move(ticket, RequestStatus.DISPATCHED)
        backend = self.backends[index]
        if slot is None:
            slot = backend.free.pop()
        # Service starts now: a rerouted request's wait for its second backend is queue wait (its
        # header and the wait figures), not service time (the service-time model learns from it).
        now = self.clock.now()
        load = backend.held.dispatched(ticket.model, now)
        placement = ticket.placement
        if placement is None:  # its first grant (a reroute's is not: counted once)
            position = self.stats.grants - ticket.grants_before_arrival
            placement = ticket.placement = Placement(index, slot, now, position, load)
            if queued:
                self.metrics.queue.depth[ticket.predicted_class].dec()
                self.metrics.queue.wait[ticket.predicted_class].observe(now - ticket.arrival_s)
        else:
            placement.backend, placement.slot, placement.dispatched_s = index, slot, now
            placement.load, placement.switch_load_s = load, 0.0
        if load == Load.SWITCH:  # it loads the model first: charged the learned load
            load_s = placement.switch_load_s = self.service_time.load_s(backend.name, ticket.model)
            self.queue.repriced(ticket, ticket.predicted_s - load_s)  # its tenant pays for it too
            self.stats.switches[index].inc()
        backend.running[slot] = ticket
        self.metrics.queue.in_flight.inc()
        self.stats.in_flight[index].inc()
        self.stats.grants += 1
        ticket.settle()

    # -- positions and ETAs -------------------------------------------------------------------
    def _slot_free_in_s(self, now: float) -> list[list[float]]:
        """Per backend, a heap of the predicted seconds until each of its slots is free (idle: 0)."""
        heaps = []
        for backend in self.backends:
            slowness = backend.slowness
            idle = max(len(backend.free), backend.slots - len(backend.running))  # (shared: any not running here)
            free = [0.0] * idle + [remainder_s(t, now, slowness) for t in backend.running.values()]
            heapq.heapify(free)
            heaps.append(free)
        return heaps

    def etas(self, now: float) -> tuple[list[tuple[Job[Ticket], float]], float]:
        """Waiting jobs in dispatch order (held back first) with the predicted seconds until each
        is dispatched, and until the last of them is (with nobody waiting: the first slot to free).

        Played forward as routing does it: each job takes the first slot to free among the backends
        that serve its model (the healthy ones, or all when none is), and holds it for its predicted
        seconds times that backend's slowness, plus the backend's learned load when the job's model
        is not the one it holds. With one backend the order is the queue's for it (``ordered_for``:
        the affinity rule replayed). Routing's model-loaded preference and its ties are not played."""
        heaps = self._slot_free_in_s(now)
        healthy = [i for i, b in enumerate(self.backends) if b.healthy]
        usable = healthy or list(range(len(self.backends)))
        # per model: (heap, slowness, index) of each backend it may take
        by_model: dict[str | None, list[tuple[list[float], float, int]]] = {}
        holding: dict[int, str | None] = {}  # backend index -> the model it holds, as played forward
        out = []
        heapreplace = heapq.heapreplace
        if len(self.backends) == 1:
            order = self.queue.ordered_for(now, self._lane(self.backends[0]), heaps[0][0])
        else:
            order = self.queue.ordered(now)
        for job in itertools.chain(self._held_back, order):
            model = job.payload.model
            choices = by_model.get(model)
            if choices is None:
                serving = [i for i, b in enumerate(self.backends) if b.serves(model)]
                chosen = [i for i in serving if i in healthy] or serving or usable
                choices = by_model[model] = [(heaps[i], self.backends[i].slowness, i) for i in chosen]
            heap, slowness, index = choices[0] if len(choices) == 1 else min(choices, key=lambda c: c[0][0])
            start = heap[0]
            busy_s = job.predicted_s * slowness
            backend = self.backends[index]
            holds = holding[index] == model if index in holding else backend.held.holds(model)
            if not holds and backend.held.last_model is not None:
                busy_s += self.service_time.load_s(backend.name, model)
                holding[index] = model
            heapreplace(heap, start + busy_s)  # its slot, busy until it is done
            out.append((job, start))
        tail = max(eta for _, eta in out) if out else min(heaps[i][0] for i in usable)
        return out, tail

    def where(self, ticket: Ticket, now: float | None = None) -> tuple[int, float] | None:
        """(position in dispatch order, predicted seconds until dispatch) of a waiting ticket."""
        now = self.clock.now() if now is None else now
        for position, (job, eta) in enumerate(self.etas(now)[0]):
            if job is ticket:
                return position, eta
        return None

    def tenant_free_in_s(self, tenant: str) -> float:
        """Predicted seconds until one of ``tenant``'s requests ends: the soonest in flight, else
        the soonest of its waiting ones (its dispatch plus its own seconds); 1 when it has none."""
        now = self.clock.now()
        running = [
            remainder_s(t, now, b.slowness) for b in self.backends for t in b.running.values() if t.tenant == tenant
        ]
        if running:
            return min(running)
        return min((eta + job.predicted_s for job, eta in self.etas(now)[0] if job.tenant == tenant), default=1.0)

    def waiting_ticket(self, request_id: str) -> Ticket | None:
        """The waiting ticket with ``request_id``. A scan, not an index: an index would cost every
        waiting request ~46 bytes, and where it stands (``where``) is O(waiting) anyway."""
        made = request_id[len(ID_PREFIX) :] if request_id.startswith(ID_PREFIX) else ""
        seq = int(made) if made.isdigit() else -1  # a made id names its job's seq
        for ticket in self.waiting_tickets():
            if ticket.given_id == request_id if ticket.given_id else ticket.seq == seq:
                return ticket
        return None

    def waiting_tickets(self) -> list[Ticket]:
        """Every ticket waiting here: held back, then the queue's."""
        return [*self._held_back, *(job.payload for job in self.queue)]

    # -- with replicas (scheduling/cluster/replica.py) -------------------------------------------
    def backend_index(self, name: str) -> int | None:
        return next((i for i, b in enumerate(self.backends) if b.name == name), None)

    def grant_shared(self, ticket: Ticket, index: int, slot: int) -> bool:
        """The shared store granted ``ticket`` a slot. False, with nothing changed, when the ticket
        no longer waits here or this replica runs that slot."""
        backend = self.backends[index]
        if slot in backend.running:
            logger.error("the shared store granted %s slot %d, which this replica runs", backend.name, slot)
            return False
        if ticket.ended or ticket.status != RequestStatus.WAITING:
            return False
        if ticket.held_back:
            ticket.held_back = False
            self._held_back.remove(ticket)
        elif not self.queue.remove(ticket):  # (the store did the popping: the local queue forgets it)
            return False
        self._grant(index, ticket, slot=slot)
        return True

    def refuse_waiting(self, ticket: Ticket, status: RequestStatus, refusal: RequestError) -> bool:
        """End a waiting ticket with ``refusal`` (a newer request superseded it on another
        replica). False if it no longer waits."""
        if not self._withdraw(ticket):
            return False
        self._end_waiting(ticket, status, refusal)
        return True

    def expire_waiting(self, ticket: Ticket, eta_s: float) -> bool:
        """Refuse a waiting ticket whose ETA in the whole cluster's queue is past its deadline."""
        if not self._withdraw(ticket):
            return False
        self._expired(ticket, self.clock.now(), eta_s)
        return True

    def guard_s(self, ticket: Ticket) -> float:
        """Seconds of waiting after which ``ticket`` is overdue: its starvation guard's bound."""
        slowdown = self.limits.starvation_slowdown
        factor = slowdown.value() if isinstance(slowdown, AdaptiveSlowdown) else slowdown
        return self.limits.starvation_timeout_s + factor * ticket.predicted_s

    def slots_changed(self) -> None:
        """The free lists changed (this replica may grant more, or fewer, slots itself)."""
        self._schedule_pump()

    # -- introspection (the queue's view: scheduling/queue_view.py) ----------------------------
    def retained(self) -> dict[str, int]:
        """Entries the dispatcher and its queue hold, by structure (``JobQueue.retained``)."""
        return add_counts(
            self.queue.retained(),
            {
                "held_back": len(self._held_back),
                "running": self.in_flight,
                "detached_tasks": len(self._lifecycle.tasks),
                "expiry_entries": len(self._deadlines.expiry),
                "recent": len(self.stats.recent),
            },
        )


class _LeaseScope:
    """The ``async with`` of ``Dispatcher.lease``: a plain class, not ``@asynccontextmanager``
    (the generator and its context manager cost ~2 frames and an object per request; the same
    exits: ``_end`` runs once, whether the wait raised or the block ended, and never swallows)."""

    __slots__ = ("_dispatcher", "_ticket", "_lease")

    def __init__(self, dispatcher: Dispatcher, ticket: Ticket) -> None:
        self._dispatcher = dispatcher
        self._ticket = ticket
        self._lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        ticket = self._ticket
        try:
            await ticket.granted  # cancelled with its waiter: the ticket is withdrawn below
        except BaseException:
            self._dispatcher._end(ticket, None)
            raise
        lease = self._lease = Lease(ticket)
        return lease

    async def __aexit__(self, *exc_info: object) -> bool:
        self._dispatcher._end(self._ticket, self._lease)
        return False
