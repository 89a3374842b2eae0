"""One scheduled request, one record: ``Ticket`` and its ``RequestStatus`` (the shape of vLLM's
``Request`` and ``RequestStatus``). The dispatcher owns the record from arrival to release; its
status changes in ``Dispatcher.move`` only, which logs (debug) and counts each change:
WAITING -> DISPATCHED (granted; back to WAITING when rerouted) -> STREAMING -> one finished status
(``is_finished``), or HOLDING (its client left; the slot held until the backend is idle) first.
``to_mapping``/``from_mapping``: the record as a flat mapping of str to str, int or float (a hash
in a shared store), without prompt text.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from clairvoyant.errors import RequestError
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.predictor import Prediction
from clairvoyant.scheduling.job_queue import Job
from clairvoyant.scheduling.routing import Load

__all__ = ["ID_PREFIX", "Placement", "RequestStatus", "Ticket", "status_counts"]

# Made request ids start with this: the process's start (hex ns) makes them unique across restarts,
# the job's seq (process-wide arrival order) within one (``Ticket.request_id``).
ID_PREFIX = f"cv-{time.time_ns():x}-"


class RequestStatus(enum.IntEnum):
    """Where a scheduled request is in its life; from ``COMPLETED`` on, how it ended."""

    WAITING = 0  # in the queue, or first in line for a backend (held back, or rerouted)
    DISPATCHED = 1  # granted a slot: sent, or about to be
    STREAMING = 2  # the backend's answer is being relayed
    HOLDING = 3  # its client left; the slot is held until the backend is idle
    COMPLETED = 4  # the backend's whole answer was relayed
    REFUSED = 5  # answered by the proxy itself while it waited (shutting down)
    EXPIRED = 6  # its queue deadline came while it waited: refused, never sent
    CLIENT_LEFT_QUEUED = 7  # withdrawn before anything was sent
    SUPERSEDED = 8  # a newer request with its X-Clairvoyant-Supersede key replaced it
    CLIENT_LEFT_BEFORE_SEND = 9  # left while the backend was waited for
    CLIENT_LEFT_STREAMING = 10  # left while the answer was relayed
    CLIENT_LEFT_WATCHING = 11  # left; the slot was held until the backend was idle
    UPSTREAM_ERROR = 12  # the backend failed before its answer began
    UPSTREAM_ERROR_MID_BODY = 13
    SHUTDOWN = 14  # the shutdown's grace period ended the answer
    GENERATION_LIMIT = 15  # it ran longer than max_generation_s
    INTERNAL_ERROR = 16
    LEASE_LOST = 17  # with replicas: its slot's lease could not be renewed, so its answer was ended

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.COMPLETED

    @property
    def in_progress(self) -> bool:
        """Nothing has ended it yet: its answer (if it has one) may still end any way."""
        return self <= RequestStatus.STREAMING

    @property
    def outcome(self) -> str:
        """How the request ended, as its log line says it ("pending" while in progress; an expired
        one was refused by the proxy, as one refused while shutting down)."""
        return _OUTCOMES[self]


# ``RequestStatus.outcome`` for each status, made once: it is read for every request's log line.
_OUTCOMES: dict[RequestStatus, str] = {
    status: "pending" if status.in_progress else status.name.lower() for status in RequestStatus
} | {RequestStatus.HOLDING: "client_left_watching", RequestStatus.EXPIRED: "refused"}


def status_counts(metrics: Metrics) -> list[int]:
    """Where each status entered is counted (``metrics.requests.status``), by ``RequestStatus``
    value: ``counts[status] += 1``."""
    return metrics.requests.status.declare([status.name.lower() for status in RequestStatus])


@dataclass(slots=True, eq=False)
class Placement:
    """Where a granted request runs, and what it found and did there: made at its first grant (a
    waiting request has none, and pays no bytes for it), kept through a reroute."""

    backend: int | None  # the granted backend's index in the pool; None while rerouted
    slot: int | None  # the granted slot, on that backend; None while rerouted
    # Clock seconds of its latest grant (service starts there: a reroute's second wait is queue wait).
    dispatched_s: float
    queue_position: int  # requests dispatched ahead of it while it waited
    load: Load = Load.UNKNOWN  # what it found on its backend: its model held, another (a switch), or unknown
    # After a switch: the load it is charged, seconds (the learned one at dispatch, then the first
    # byte's measure); 0 otherwise.
    switch_load_s: float = 0.0
    live_tokens: int = 0  # tokens its answer has streamed so far (the relay counts them)
    refused_by: tuple[int, ...] = ()  # backends that refused its connection (routing avoids them)
    # Ends the answer being relayed now with this status and error (the shutdown's grace period is
    # over; with replicas, its slot's lease was lost): False if there is none. Set by the proxy.
    interrupt: Callable[[RequestStatus, RequestError], bool] | None = None


class Ticket(Job["Ticket"]):
    """One scheduled request, from arrival to release, and its own queue record: a ``Job`` whose
    payload is itself (one object a waiting request, not two). Slotted and lean: thousands may
    wait (benchmarks/bench_waiting_memory.py measures the bytes per waiting request); where it
    runs is its ``placement``, made at its grant."""

    __slots__ = (
        "given_id", "endpoint", "dialect", "prediction", "prompt_tokens", "status", "refusal", "_future",
        "grants_before_arrival", "held_back", "ended", "placement",
    )  # fmt: skip

    def __init__(
        self,
        given_id: str,  # the client's X-Request-Id; "" = one made from its seq (``request_id``)
        endpoint: str,  # the scheduled path, e.g. /v1/chat/completions
        dialect: str,
        model: str | None,
        prediction: Prediction | None,  # None only between an at-once dispatch and its prediction
        prompt_tokens: int,  # estimated prompt tokens (service-time model input)
        arrival_s: float = 0.0,  # clock seconds when it arrived
        *,
        score: float = 0.0,
        predicted_tokens: float = 0.0,
        predicted_s: float = 1.0,
        priority: int = 0,
        tenant: str = "",
        expires_s: float = math.inf,  # clock seconds from which it must not be sent (its queue deadline)
    ) -> None:
        Job.__init__(self, self, arrival_s, score, predicted_tokens, predicted_s, priority, tenant, model, expires_s)
        self.given_id = given_id
        self.endpoint = endpoint
        self.dialect = dialect
        self.prediction = prediction
        self.prompt_tokens = prompt_tokens
        self.status = RequestStatus.WAITING  # changed by ``Dispatcher.move`` only
        self.refusal: RequestError | None = None  # why it was REFUSED or EXPIRED
        self._future: asyncio.Future[int] | None = None  # ``granted``, made on first use
        self.grants_before_arrival = 0  # the dispatcher's slot grants so far when this ticket was queued
        self.held_back = False  # popped by the policy (or rerouted), waiting for a backend that serves it
        self.ended = False  # withdrawn or released: set exactly once
        self.placement: Placement | None = None  # made at its first grant

    def __repr__(self) -> str:
        return f"Ticket({self.request_id!r}, {self.status.name}, waiting={self.waiting})"

    @property
    def granted(self) -> asyncio.Future[int]:
        """The wait as a future (made on first use, for ``await``): the granted backend's index,
        the refusal (``ShuttingDown``, ``QueueDeadline``), or cancelled when withdrawn. A new one
        after a reroute."""
        future = self._future
        if future is None:
            future = self._future = asyncio.get_running_loop().create_future()
            self.settle()
        return future

    def settle(self) -> None:
        """Settle the wait's future (if one was made) by the status: nothing while WAITING."""
        future = self._future
        if future is None or future.done() or self.status == RequestStatus.WAITING:
            return
        if not self.status.is_finished:
            placement = self.placement
            future.set_result(-1 if placement is None or placement.backend is None else placement.backend)
        elif self.refusal is not None:
            future.set_exception(self.refusal)
            future.exception()  # marked retrieved: a lease that still waits raises it anyway
        else:
            future.cancel()

    @property
    def request_id(self) -> str:
        """The client's X-Request-Id, else ``cv-<this process's start, hex ns>-<its job's seq>``:
        made when read, so that a waiting request holds no string for it."""
        return self.given_id or f"{ID_PREFIX}{self.seq}"

    @property
    def predicted_class(self) -> str:
        return "pending" if self.prediction is None else self.prediction.predicted_class

    def queue_wait_s(self) -> float | None:
        placement = self.placement
        return None if placement is None else placement.dispatched_s - self.arrival_s

    # -- a flat mapping (str -> str | int | float) ---------------------------------------------
    def to_mapping(self) -> dict[str, str | int | float]:
        """The record's state as a flat mapping (what a shared store keeps); no prompt text. A
        field that is None is left out, and so is the placement's before its grant; the refusal,
        the interrupt and the future (this process's objects) are not kept."""
        out: dict[str, str | int | float] = {}
        _put(out, self, _FIELDS)
        placement = self.placement
        if placement is not None:
            _put(out, placement, _PLACEMENT_FIELDS)
            out["refused_by"] = ",".join(map(str, placement.refused_by))
        prediction = self.prediction
        if prediction is not None:
            out["prediction_score"] = prediction.score
            out["prediction_tokens"] = prediction.predicted_tokens
            out["prediction_prior_log_tokens"] = prediction.prior_log_tokens
            out["prediction_feature_row"] = prediction.feature_row.hex()
            if prediction.cap_tokens is not None:
                out["prediction_cap_tokens"] = prediction.cap_tokens
            if prediction.probabilities is not None:
                out["prediction_probabilities"] = ",".join(map(repr, prediction.probabilities))
        return out

    @classmethod
    def from_mapping(cls, data: Mapping[str, str | int | float]) -> Ticket:
        """The record ``to_mapping`` made (a store's strings are read back as the fields' types)."""
        ticket = cls("", "", "", None, None, 0)
        _get(ticket, data, _FIELDS)
        if "dispatched_s" in data:  # granted: it has a placement
            placement = ticket.placement = Placement(None, None, 0.0, 0)
            _get(placement, data, _PLACEMENT_FIELDS)
            placement.refused_by = tuple(int(i) for i in str(data.get("refused_by", "")).split(",") if i)
        if "prediction_score" in data:
            probabilities = str(data.get("prediction_probabilities", ""))
            ticket.prediction = Prediction(
                float(data["prediction_score"]), float(data["prediction_tokens"]),
                tuple(float(p) for p in probabilities.split(",")) if probabilities else None,  # type: ignore[arg-type]
                float(data["prediction_prior_log_tokens"]), bytes.fromhex(str(data["prediction_feature_row"])),
                ticket.model, int(data["prediction_cap_tokens"]) if "prediction_cap_tokens" in data else None,
            )  # fmt: skip
        return ticket


Reader = Callable[[str | int | float], object]


def _put(out: dict[str, str | int | float], record: object, fields: dict[str, Reader]) -> None:
    for name in fields:
        value = getattr(record, name)
        if value is not None:
            out[name] = int(value) if isinstance(value, (bool, enum.IntEnum)) else value


def _get(record: object, data: Mapping[str, str | int | float], fields: dict[str, Reader]) -> None:
    for name, kind in fields.items():
        if name in data:
            setattr(record, name, kind(data[name]))


def _bool(value: str | int | float) -> bool:
    return bool(int(value))


# The record's plain fields and how each is read back from a store (which may give strings).
_FIELDS: dict[str, Reader] = {
    "given_id": str, "endpoint": str, "dialect": str, "model": str, "tenant": str, "seq": int, "status": lambda v:
    RequestStatus(int(v)), "arrival_s": float, "expires_s": float, "deadline_s": float, "score": float,
    "predicted_tokens": float, "predicted_s": float, "priority": int,
    "prompt_tokens": int, "waiting": _bool, "held_back": _bool, "ended": _bool, "grants_before_arrival": int,
}  # fmt: skip
_PLACEMENT_FIELDS: dict[str, Reader] = {
    "backend": int, "slot": int, "dispatched_s": float, "queue_position": int, "live_tokens": int,
    "load": lambda v: Load(int(v)), "switch_load_s": float,
}  # fmt: skip
