"""The dispatcher: one asyncio worker per backend slot, pulling from the scheduling queue.

A request's life: ``submit`` (queued) -> a worker grants it a slot (``wait_turn`` returns) -> the
response relays the backend's answer -> ``release`` frees the slot. Never more than ``slots``
tickets hold a slot. A ticket whose client leaves while queued is ``withdraw``n and never sent.

Invariants:
- every granted ticket is released exactly once (``release`` is idempotent; the response releases
  in ``finally``, or hands the release to a detached task that drains or aborts the backend first);
- a worker never dies of an unexpected error (it logs and goes on), so the queue cannot stall
  silently; detached tasks are strongly referenced and their failures logged.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from clairvoyant.clock import Clock
from clairvoyant.errors import RequestError
from clairvoyant.job_queue import JobQueue, QueuedJob
from clairvoyant.metrics import Metrics
from clairvoyant.predictor import Prediction

__all__ = ["Dispatcher", "ShuttingDown", "Ticket"]

logger = logging.getLogger(__name__)


class ShuttingDown(RequestError):
    status_code = 503
    error_type = "server_error"
    code = "shutting_down"


@dataclass(eq=False)
class Ticket:
    """One scheduled request, from arrival to release."""

    request_id: str
    endpoint: str  # the scheduled path, e.g. /v1/chat/completions
    dialect: str
    model: str | None
    prediction: Prediction
    score: float  # the queue key: the prediction's score, or the true length under the benchmark oracle
    arrival_s: float  # clock seconds at arrival
    granted: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    released: asyncio.Event = field(default_factory=asyncio.Event)
    job: QueuedJob[Ticket] | None = None
    slot: int | None = None
    dispatched_s: float | None = None  # clock seconds when a slot was granted

    @property
    def predicted_class(self) -> str:
        return self.prediction.predicted_class

    def queue_wait_s(self) -> float | None:
        return None if self.dispatched_s is None else self.dispatched_s - self.arrival_s


class Dispatcher:
    def __init__(self, queue: JobQueue[Ticket], *, slots: int, clock: Clock, metrics: Metrics) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.queue = queue
        self.slots = slots
        self.clock = clock
        self.metrics = metrics
        self._wakeup = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._detached: set[asyncio.Task[Any]] = set()
        self._running: dict[int, Ticket] = {}
        self._closing = False
        self._ids = itertools.count()
        metrics.starvation_timeout.set(queue.starvation_timeout_s)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._workers = [asyncio.create_task(self._worker(slot), name=f"dispatcher-slot-{slot}") for slot in range(self.slots)]

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Refuse new work, let in-flight requests finish for up to ``timeout_s``, then cancel."""
        self._closing = True
        while (job := self.queue.pop(math.inf)) is not None:
            self.metrics.depth_by_class[job.payload.predicted_class].dec()
            if not job.payload.granted.done():
                job.payload.granted.set_exception(ShuttingDown("the proxy is shutting down; retry"))
        deadline = time.monotonic() + timeout_s
        while (self._running or self._detached) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in [*self._workers, *self._detached]:
            task.cancel()
        await asyncio.gather(*self._workers, *self._detached, return_exceptions=True)
        self._workers.clear()

    @property
    def healthy(self) -> bool:
        return bool(self._workers) and not any(t.done() for t in self._workers)

    # -- requests --------------------------------------------------------------------------
    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket. Raises ``QueueFull`` at capacity, ``ShuttingDown`` after ``stop``."""
        if self._closing:
            raise ShuttingDown("the proxy is shutting down; retry")
        ticket.job = self.queue.push(ticket, ticket.score, ticket.arrival_s)
        self.metrics.depth_by_class[ticket.predicted_class].inc()
        self._wakeup.set()

    async def wait_turn(self, ticket: Ticket) -> int:
        """Wait until the ticket holds a slot; returns the slot number. Cancel-safe: if cancelled
        while still queued the ticket is withdrawn."""
        try:
            return await asyncio.shield(ticket.granted)
        except asyncio.CancelledError:
            self.abandon(ticket)
            raise

    def withdraw(self, ticket: Ticket) -> bool:
        """Remove a ticket whose client left while queued. True if it was still waiting."""
        if ticket.job is not None and self.queue.remove(ticket.job):
            self.metrics.depth_by_class[ticket.predicted_class].dec()
            if not ticket.granted.done():
                ticket.granted.cancel()
            return True
        return False

    def abandon(self, ticket: Ticket) -> None:
        """The client left before using its slot: withdraw it if queued, release it if granted."""
        if not self.withdraw(ticket):
            granted = ticket.granted
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self.release(ticket)

    def release(self, ticket: Ticket) -> None:
        """Free the ticket's slot. Idempotent."""
        ticket.released.set()

    def run_detached(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run ``coro`` after its request's handler has returned (draining or aborting the backend)."""
        task = asyncio.create_task(coro, name=name)
        self._detached.add(task)
        task.add_done_callback(self._detached_done)

    def _detached_done(self, task: asyncio.Task[Any]) -> None:
        self._detached.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("detached task %s failed", task.get_name(), exc_info=task.exception())

    def new_request_id(self) -> str:
        return f"cv-{time.time_ns():x}-{next(self._ids)}"

    # -- introspection ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The waiting queue (dispatch order, starvation aside) and what is in flight; no prompt text."""
        now = self.clock.now()

        def describe(ticket: Ticket) -> dict[str, Any]:
            return {
                "request_id": ticket.request_id,
                "endpoint": ticket.endpoint,
                "model": ticket.model,
                "predicted_class": ticket.predicted_class,
                "predicted_tokens": round(ticket.prediction.predicted_tokens, 1),
                **({} if ticket.prediction.p_long is None else {"p_long": round(ticket.prediction.p_long, 6)}),
                "score": round(ticket.score, 6),
                "waited_s": round(now - ticket.arrival_s, 3),
            }

        waiting = [{"position": i, **describe(job.payload)} for i, job in enumerate(self.queue)]
        in_flight = [
            {"slot": slot, **describe(t), "running_s": round(now - (t.dispatched_s or now), 3)}
            for slot, t in sorted(self._running.items())
        ]
        return {
            "policy": self.queue.policy.name,
            "starvation_timeout_s": self.queue.starvation_timeout_s,
            "slots": self.slots,
            "waiting": waiting,
            "in_flight": in_flight,
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
        promotions = self.queue.promotions
        job = self.queue.pop(self.clock.now())
        if job is None:
            self._wakeup.clear()
            await self._wakeup.wait()
            return
        ticket = job.payload
        self.metrics.depth_by_class[ticket.predicted_class].dec()
        if self.queue.promotions != promotions:
            self.metrics.starvation_promotions.inc()
        if ticket.granted.done():  # withdrawn or failed in between: nothing to run
            return
        ticket.slot = slot
        ticket.dispatched_s = self.clock.now()
        self._running[slot] = ticket
        self.metrics.in_flight.inc()
        self.metrics.wait_by_class[ticket.predicted_class].observe(ticket.dispatched_s - ticket.arrival_s)
        ticket.granted.set_result(slot)
        try:
            await ticket.released.wait()
        finally:
            self._running.pop(slot, None)
            self.metrics.in_flight.dec()
