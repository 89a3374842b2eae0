"""The dispatcher: capacity, one asyncio worker per backend slot, and the lease that holds a slot.

A scheduled request's life, all of it visible here:

    dispatcher.submit(ticket)                   queued (or QueueFull with a Retry-After from the ETA)
    async with dispatcher.lease(ticket) as slot:  waits for its turn, then holds a backend slot
        ... relay the backend's answer ...
    (leaving the block)                         withdrawn if still queued, else released, exactly once

Invariants, each enforced in this file:
- never more than ``slots`` leases hold a slot; a worker grants a slot only to a waiting ticket;
- every ticket leaves the system exactly once: ``lease.__aexit__`` either withdraws it from the
  queue (client left or cancelled while waiting) or releases its slot, and ``_end`` is idempotent;
- a worker never dies of an unexpected error (it logs and goes on); detached tasks are strongly
  referenced and their failures logged.

The service-time model and the policy learn from each completed lease (measured service seconds).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clairvoyant.clock import Clock
from clairvoyant.errors import QueueFull, RequestError
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.predictor import Prediction
from clairvoyant.prediction.usage import Usage
from clairvoyant.scheduling.job_queue import Job, JobQueue
from clairvoyant.scheduling.policy import SchedulingPolicy
from clairvoyant.scheduling.service_time import ServiceTimeModel, write_state
from clairvoyant.scheduling.slowdown import AdaptiveSlowdown

__all__ = ["Dispatcher", "Lease", "ShuttingDown", "Ticket"]

logger = logging.getLogger(__name__)

_SAVE_EVERY = 50  # service-time observations between state-file writes
RECENT_REQUESTS = 100  # finished requests kept for /queue's timeline (the live page)


class ShuttingDown(RequestError):
    status_code = 503
    error_type = "server_error"
    code = "shutting_down"

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)}


SHUTDOWN_RETRY_AFTER_S = 5  # a restarted proxy is usually back within seconds


@dataclass(slots=True, eq=False)
class Ticket:
    """One scheduled request, from arrival to release. Its queue record is ``job``. Slotted and
    lean: thousands may wait (``bench/queue_cost.py`` measures the bytes per waiting request)."""

    request_id: str
    endpoint: str  # the scheduled path, e.g. /v1/chat/completions
    dialect: str
    model: str | None
    prediction: Prediction | None  # None only between an at-once dispatch and its prediction (see dispatch_at_once)
    prompt_tokens: int  # estimated prompt tokens (service-time model input)
    job: Job[Ticket] = field(init=False)
    granted: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    released: asyncio.Future[None] | None = None  # created at dispatch; set when the slot is given back
    slot: int | None = None
    dispatched_s: float | None = None  # clock seconds when a slot was granted
    grants_before_arrival: int = 0  # the dispatcher's slot grants so far when this ticket was queued
    queue_position: int | None = None  # set at dispatch: requests dispatched ahead of it while it waited
    ended: bool = False  # withdrawn or released: set exactly once
    interrupt: Callable[[], None] | None = None  # set by its relay once dispatched: end the answer now (shutdown)
    lent_by: asyncio.Future[None] | None = None  # dispatched at once: the parked idle worker whose slot it holds

    @property
    def predicted_class(self) -> str:
        return "pending" if self.prediction is None else self.prediction.predicted_class

    @property
    def arrival_s(self) -> float:
        return self.job.arrival_s

    def queue_wait_s(self) -> float | None:
        return None if self.dispatched_s is None else self.dispatched_s - self.job.arrival_s


@dataclass(slots=True)
class Lease:
    """A held slot. ``completed`` is set by the relay when the backend's answer ended normally
    (only those durations teach the service-time model)."""

    ticket: Ticket
    slot: int
    completed: bool = False
    usage: Usage | None = None  # what the backend reported producing (None: not read)


class Dispatcher:
    def __init__(
        self,
        queue: JobQueue[Ticket],
        policy: SchedulingPolicy,
        *,
        slots: int,
        clock: Clock,
        metrics: Metrics,
        max_queue: int,
        service_time: ServiceTimeModel | None = None,
        min_retry_after_s: int = 1,
        starvation_timeout_s: float = math.inf,
        starvation_slowdown: float | AdaptiveSlowdown = 0.0,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.queue = queue
        self.policy = policy
        self.slots = slots
        self.clock = clock
        self.metrics = metrics
        self.max_queue = max_queue
        self.service_time = service_time or ServiceTimeModel()
        self.min_retry_after_s = min_retry_after_s
        self.starvation_timeout_s = starvation_timeout_s
        self.starvation_slowdown = starvation_slowdown
        # Idle workers, each waiting on its own future: an arrival wakes exactly one (an Event
        # would wake every idle worker per request: 63 task switches for nothing at 64 slots).
        # An idle worker's slot may also be lent to a request dispatched at once (dispatch_at_once):
        # the worker stays parked, and the release hands the slot back without waking it.
        self._idle: deque[tuple[int, asyncio.Future[None]]] = deque()  # (slot, its wake-up)
        self._workers: list[asyncio.Task[None]] = []
        self._detached: set[asyncio.Task[Any]] = set()
        self._running: dict[int, Ticket] = {}
        self._by_id: dict[str, Ticket] = {}  # waiting tickets by request id (for /queue/{id})
        self._closing = False
        self._grace_timer: asyncio.TimerHandle | None = None
        self._ids = itertools.count()
        self._observed = 0
        self._grants = 0  # slots granted so far (a ticket's queue position is a difference of these)
        # (ticket, ended clock seconds, outcome, output tokens or None), newest last
        self._recent: deque[tuple[Ticket, float, str, int | None]] = deque(maxlen=RECENT_REQUESTS)
        metrics.starvation_timeout.set(starvation_timeout_s)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._workers = [
            asyncio.create_task(self._worker(slot), name=f"dispatcher-slot-{slot}") for slot in range(self.slots)
        ]

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new work and every waiting request (503 ``shutting_down`` at once); in-flight
        answers may finish for ``grace_s`` seconds, then each is interrupted (its stream ends with
        an error event). Idempotent."""
        if self._closing:
            return
        self._closing = True
        refused = 0
        while (got := self.queue.pop(math.inf)) is not None:
            self.queue.done(got[0])  # refused: it never reaches the backend
            ticket = got[0].payload
            self._end_waiting(ticket)
            if not ticket.granted.done():
                ticket.granted.set_exception(ShuttingDown("the proxy is shutting down; retry"))
                ticket.granted.exception()  # marked retrieved: a lease that still waits raises it anyway
            refused += 1
        logger.info(
            "shutting down: refused %d waiting request(s); %d in flight get %.1f s",
            refused,
            len(self._running),
            grace_s,
        )
        self._grace_timer = asyncio.get_running_loop().call_later(grace_s, self._interrupt_running)

    def _interrupt_running(self) -> None:
        for ticket in list(self._running.values()):
            if ticket.interrupt is not None:
                logger.warning("request_id=%s: shutdown grace period over; ending its answer", ticket.request_id)
                ticket.interrupt()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Refuse new work, let in-flight requests finish for up to ``timeout_s``, then cancel."""
        self.begin_shutdown(timeout_s)
        deadline = time.monotonic() + timeout_s
        while (self._running or self._detached) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        for task in [*self._workers, *self._detached]:
            task.cancel()
        await asyncio.gather(*self._workers, *self._detached, return_exceptions=True)
        self._workers.clear()
        self._save_state()

    @property
    def in_flight(self) -> int:
        """Slots held now."""
        return len(self._running)

    @property
    def healthy(self) -> bool:
        return bool(self._workers) and not any(t.done() for t in self._workers)

    # -- requests --------------------------------------------------------------------------
    def predicted_s(self, model: str | None, prompt_tokens: float, output_tokens: float) -> float:
        """Predicted service seconds of a request (the service-time model)."""
        return self.service_time.predict_s(model, prompt_tokens, output_tokens)

    def submit(self, ticket: Ticket, job: Job[Ticket]) -> None:
        """Queue a ticket with its job record.

        Raises ``ShuttingDown`` after ``stop`` and ``QueueFull`` at capacity, with a Retry-After
        computed from the predicted time until the queue's tail is dispatched.
        """
        if self._closing:
            raise ShuttingDown("the proxy is shutting down; retry")
        if len(self.queue) >= self.max_queue:
            tail_eta_s = self._etas(self.clock.now())[1]
            retry = max(self.min_retry_after_s, min(3600, math.ceil(tail_eta_s)))
            raise QueueFull(
                f"the scheduling queue is full ({self.max_queue} requests waiting); retry later",
                retry_after_s=retry,
            )
        ticket.job = job
        self.queue.push(job)
        self._by_id[ticket.request_id] = ticket
        self.metrics.depth_by_class[ticket.predicted_class].inc()
        # O(1) on purpose: ordering the whole queue per arrival would cost O(n log n) at depth n.
        ticket.grants_before_arrival = self._grants
        self._wake_one()

    def dispatch_at_once(self, ticket: Ticket, job: Job[Ticket]) -> bool:
        """Grant ``ticket`` a slot now, before its prediction, if a slot is idle and nobody waits
        (there is no order to decide); False otherwise (then predict and ``submit``). The caller
        predicts while the backend works, fills in ``job``'s predicted fields and calls
        ``observe_wait`` (the wait histogram is by predicted class)."""
        if self._closing or len(self.queue) > 0:
            return False
        while self._idle:
            slot, wake = self._idle.popleft()
            if wake.done():
                continue
            ticket.job = job
            ticket.grants_before_arrival = self._grants
            self.queue.push(job)  # through the queue all the same: its tenant accounting, and done() at release
            got = self.queue.pop(self.clock.now())
            assert got is not None and got[0] is job, "an empty queue popped another job"
            ticket.lent_by = wake  # the worker stays parked: no task switch to grant or to release
            self._grant(slot, ticket, observe_wait=False)
            return True
        return False

    def predicted_at_once(self, ticket: Ticket, old_predicted_s: float) -> None:
        """A ticket dispatched at once has its prediction: charge its tenant's fair share the
        predicted seconds (it was charged ``old_predicted_s``, the job's default, at dispatch) and
        observe its queue wait, now that its class is known."""
        self.queue.repriced(ticket.job, old_predicted_s)
        self.observe_wait(ticket)

    def observe_wait(self, ticket: Ticket) -> None:
        """The queue-wait observation of a ticket dispatched at once, once its class is known."""
        wait_s = ticket.queue_wait_s()
        if wait_s is not None:
            self.metrics.wait_by_class[ticket.predicted_class].observe(wait_s)

    def _wake_one(self) -> None:
        """Wake one idle worker, if any; it pops the queue's best job when it runs."""
        while self._idle:
            _, wake = self._idle.popleft()
            if not wake.done():
                wake.set_result(None)
                return

    @asynccontextmanager
    async def lease(self, ticket: Ticket) -> AsyncIterator[Lease]:
        """Wait for the ticket's turn, hold its slot for the block, then give it back exactly once.

        Raises what refused the ticket (``ShuttingDown``). Cancel-safe: cancelled while waiting,
        the ticket is withdrawn and never sent.
        """
        lease: Lease | None = None
        try:
            slot = await asyncio.shield(ticket.granted)
            lease = Lease(ticket, slot)
            yield lease
        finally:
            self._end(ticket, lease)

    def _end(self, ticket: Ticket, lease: Lease | None) -> None:
        """The single exit of every ticket: withdraw it if still queued, else release its slot."""
        if ticket.ended:
            return
        if ticket.job.waiting and self.queue.remove(ticket.job):
            self._end_waiting(ticket)
            self.metrics.disconnects_by_stage["queued"].inc()
            self._recent.append((ticket, self.clock.now(), "left_queued", None))
            if not ticket.granted.done():
                ticket.granted.cancel()
            return
        granted = ticket.granted
        if granted.done() and not granted.cancelled() and granted.exception() is None:
            ticket.ended = True
            completed = lease is not None and lease.completed
            usage = None if lease is None else lease.usage
            self._recent.append(
                (
                    ticket,
                    self.clock.now(),
                    "completed" if completed else "ended",
                    None if usage is None else usage.output_tokens,
                )
            )
            if completed and ticket.dispatched_s is not None:
                self._learn(ticket, self.clock.now() - ticket.dispatched_s, usage)
            if ticket.released is not None and not ticket.released.done():
                ticket.released.set_result(None)  # the worker frees the slot (none waits on a lent one)
            if ticket.lent_by is not None:
                self._return_lent_slot(ticket, ticket.lent_by)
            return
        ticket.ended = True  # refused (shutting down) or withdrawn by the worker's race: nothing held

    def _return_lent_slot(self, ticket: Ticket, wake: asyncio.Future[None]) -> None:
        """A slot lent by a parked worker is free again: idle once more, or, when requests wait,
        its worker is woken to pop the next one."""
        ticket.lent_by = None
        assert ticket.slot is not None
        self._running.pop(ticket.slot, None)
        self.metrics.in_flight.dec()
        self.queue.done(ticket.job)
        if wake.done():  # its worker was cancelled (stopping)
            return
        if len(self.queue) > 0:
            wake.set_result(None)
        else:
            self._idle.append((ticket.slot, wake))

    def _end_waiting(self, ticket: Ticket) -> None:
        ticket.ended = True
        self._by_id.pop(ticket.request_id, None)
        self.metrics.depth_by_class[ticket.predicted_class].dec()

    def _learn(self, ticket: Ticket, service_s: float, usage: Usage | None) -> None:
        # The slot's measured seconds against the inputs the model predicts from: the prompt's
        # tokens (the backend's count when it reported one) and the PREDICTED output tokens. Fitting
        # on predicted rather than produced output tokens makes predicted seconds the conditional
        # mean of the slot time: the predictor's tokens are a median (log-space regression), and
        # seconds must add up to an ETA. The produced tokens teach the length learner instead.
        job = ticket.job
        prompt_tokens = ticket.prompt_tokens
        if usage is not None and usage.prompt_tokens is not None:
            prompt_tokens = usage.prompt_tokens
        self.service_time.observe(ticket.model, prompt_tokens, round(job.predicted_tokens), service_s)
        self.policy.observe(job, service_s)
        if isinstance(self.starvation_slowdown, AdaptiveSlowdown):
            self.starvation_slowdown.observe(service_s)
        self._observed += 1
        if self._observed % _SAVE_EVERY == 0 and self.service_time.path is not None:
            # Written in a worker thread (fsync can take milliseconds); the snapshot is taken here.
            self.run_detached(
                asyncio.to_thread(self._write_state, self.service_time.path, self.service_time.snapshot()),
                name="service-time-save",
            )

    def _save_state(self) -> None:
        try:
            self.service_time.save()
        except OSError as exc:
            logger.warning("cannot save the service-time state: %s", exc)

    @staticmethod
    def _write_state(path: Path, state: dict[str, Any]) -> None:
        try:
            write_state(path, state)
        except OSError as exc:
            logger.warning("cannot save the service-time state: %s", exc)

    def run_detached(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a tracked background task (state saves, the start-up backend check):
        referenced until done, its failure logged, cancelled by ``stop``."""
        task = asyncio.create_task(coro, name=name)
        self._detached.add(task)
        task.add_done_callback(self._detached_done)
        return task

    def _detached_done(self, task: asyncio.Task[Any]) -> None:
        self._detached.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("detached task %s failed", task.get_name(), exc_info=task.exception())

    def new_request_id(self) -> str:
        return f"cv-{time.time_ns():x}-{next(self._ids)}"

    # -- positions and ETAs -------------------------------------------------------------------
    def _slot_free_in_s(self, now: float) -> list[float]:
        """Predicted seconds until each slot is free: in-flight remainders (never below 0), idle 0."""
        free = [0.0] * self.slots
        for slot, t in self._running.items():
            running_s = 0.0 if t.dispatched_s is None else now - t.dispatched_s
            free[slot] = max(0.0, t.job.predicted_s - running_s)
        return free

    def _etas(self, now: float) -> tuple[list[tuple[Job[Ticket], float]], float]:
        """Waiting jobs in dispatch order with the predicted seconds until each is dispatched, and
        the predicted seconds until the tail is dispatched."""
        free = self._slot_free_in_s(now)
        heapq.heapify(free)
        out = []
        for job in self.queue.ordered(now):
            start = heapq.heappop(free)
            out.append((job, start))
            heapq.heappush(free, start + job.predicted_s)
        tail = out[-1][1] if out else min(free)
        return out, tail

    def where(self, ticket: Ticket, now: float | None = None) -> tuple[int, float] | None:
        """(position in dispatch order, predicted seconds until dispatch) of a waiting ticket."""
        now = self.clock.now() if now is None else now
        for position, (job, eta) in enumerate(self._etas(now)[0]):
            if job is ticket.job:
                return position, eta
        return None

    def waiting_ticket(self, request_id: str) -> Ticket | None:
        return self._by_id.get(request_id)

    # -- introspection ---------------------------------------------------------------------
    def snapshot(self, limit: int | None = None) -> dict[str, Any]:
        """The waiting queue in dispatch order with positions and ETAs (the first ``limit`` of
        ``waiting_count``), what is in flight, and the last finished requests (newest first;
        ``waited_s`` there is the time it spent queued); no prompt text."""
        now = self.clock.now()

        def describe(ticket: Ticket) -> dict[str, Any]:
            job = ticket.job
            return {
                "request_id": ticket.request_id,
                "endpoint": ticket.endpoint,
                "model": ticket.model,
                "tenant": job.tenant,
                "priority": job.priority,
                "predicted_class": ticket.predicted_class,
                **(
                    {}
                    if ticket.prediction is None or ticket.prediction.p_long is None
                    else {"p_long": round(ticket.prediction.p_long, 6)}
                ),
                "score": round(job.score, 6),
                "predicted_tokens": round(job.predicted_tokens, 1),
                "predicted_s": round(job.predicted_s, 3),
                "waited_s": round(now - job.arrival_s, 3),
            }

        etas, tail = self._etas(now)
        shown = etas if limit is None else etas[: max(0, limit)]
        waiting = [
            {"position": i, "eta_s": round(eta, 3), **describe(job.payload)} for i, (job, eta) in enumerate(shown)
        ]
        in_flight = [
            {
                "slot": slot,
                **describe(t),
                "running_s": round(0.0 if t.dispatched_s is None else now - t.dispatched_s, 3),
            }
            for slot, t in sorted(self._running.items())
        ]
        return {
            "policy": self.policy.name,
            "policy_detail": self.policy.describe(),
            "starvation_timeout_s": self.starvation_timeout_s,
            # overdue after tau + slowdown x predicted_s (adaptive: base x (1 + CV^2) of service times)
            "starvation_slowdown": (
                self.starvation_slowdown.describe()
                if isinstance(self.starvation_slowdown, AdaptiveSlowdown)
                else self.starvation_slowdown
            ),
            "slots": self.slots,
            "max_queue": self.max_queue,
            "tail_eta_s": round(tail, 3),
            "service_time": {
                name or "default": self.service_time.coefficients(name)
                for name in {None, *(t.model for t in self._running.values())}
            },
            "waiting_count": len(etas),
            "waiting": waiting,
            "in_flight": in_flight,
            "recent": [
                {
                    **describe(t),
                    "outcome": outcome,
                    "output_tokens": output_tokens,
                    "waited_s": round((ended_s if t.dispatched_s is None else t.dispatched_s) - t.job.arrival_s, 3),
                    "service_s": None if t.dispatched_s is None else round(ended_s - t.dispatched_s, 3),
                    "ended_ago_s": round(now - ended_s, 3),
                }
                for t, ended_s, outcome, output_tokens in reversed(self._recent)
            ],
        }

    # -- workers ---------------------------------------------------------------------------
    async def _worker(self, slot: int) -> None:
        while True:
            try:
                await self._dispatch_one(slot)
            except asyncio.CancelledError:
                raise
            except Exception:  # a worker must never die: log and keep serving
                logger.exception("dispatcher slot %d: unexpected error", slot)
                await asyncio.sleep(0.01)

    async def _dispatch_one(self, slot: int) -> None:
        got = self.queue.pop(self.clock.now())
        if got is None:
            wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle.append((slot, wake))
            try:
                await wake  # meanwhile its slot may be lent and given back, any number of times
            finally:
                wake.cancel()  # a no-op once woken; a cancelled one is skipped by _wake_one
            return
        job, promoted = got
        ticket = job.payload
        self._by_id.pop(ticket.request_id, None)
        self.metrics.depth_by_class[ticket.predicted_class].dec()
        if promoted:
            self.metrics.starvation_promotions.inc()
        if ticket.granted.done():  # cancelled in between: nothing to run
            ticket.ended = True
            self.queue.done(job)
            return
        self._grant(slot, ticket, observe_wait=True)
        await self._hold(slot, ticket)

    def _grant(self, slot: int, ticket: Ticket, *, observe_wait: bool) -> None:
        ticket.slot = slot
        ticket.released = asyncio.get_running_loop().create_future()
        ticket.dispatched_s = self.clock.now()
        self._running[slot] = ticket
        self.metrics.in_flight.inc()
        if observe_wait:
            self.metrics.wait_by_class[ticket.predicted_class].observe(ticket.dispatched_s - ticket.job.arrival_s)
        ticket.queue_position = self._grants - ticket.grants_before_arrival
        self._grants += 1
        ticket.granted.set_result(slot)

    async def _hold(self, slot: int, ticket: Ticket) -> None:
        """The slot is the ticket's until its lease releases it."""
        assert ticket.released is not None
        try:
            await ticket.released
        finally:
            self._running.pop(slot, None)
            self.metrics.in_flight.dec()
            self.queue.done(ticket.job)  # its tenant stays active for fair share until here
