"""One typed view of the queue (``QueueView``): the records' public fields and the backends' state,
served by ``/queue`` as JSON, sampled by ``/history``, read by the live page and ``clairvoyant
status``. No prompt text.

Every field has a default (None where a reader must tell "absent"), so that a reader validates an
older proxy's sparser body, and a newer one's extra fields are kept (``extra="allow"``) but in a
request's row. A field only some requests have (``p_long``, ``expires_in_s``, ``switch_due_in_s``)
is left out of the JSON where it has none. A request's row is a slotted dataclass, not a model:
pydantic takes a dataclass instance as it is, where it would validate 10,000 rows field by field
(``model_construct`` loops in Python too); benchmarks/bench_queue_view.py measures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from clairvoyant.scheduling.service_time import FREE_LOAD_S
from clairvoyant.scheduling.slowdown import AdaptiveSlowdown

if TYPE_CHECKING:  # typing only: the dispatcher is what is viewed
    from clairvoyant.scheduling.dispatcher import Dispatcher
    from clairvoyant.scheduling.request import Ticket

__all__ = [
    "BackendView", "ClusterLeaseView", "ClusterPartView", "ClusterWaitingView", "FinishedView", "QueueView",
    "ReplicaHealthView", "RequestView", "RunningView", "WaitingView", "queue_view",
]  # fmt: skip

Optional = Annotated[float | None, Field(exclude_if=lambda value: value is None)]  # left out of the JSON when None


class _View(BaseModel):
    model_config = ConfigDict(extra="allow")


@dataclass(slots=True, kw_only=True)
class RequestView:
    """A request's public fields (``waited_s``: seconds since it arrived; for a finished one, the
    seconds it spent queued)."""

    request_id: str | None = None
    endpoint: str | None = None
    model: str | None = None
    tenant: str | None = None
    priority: int | None = None
    predicted_class: str | None = None
    p_long: Optional = None
    score: float | None = None
    predicted_tokens: float | None = None
    predicted_s: float | None = None
    waited_s: float | None = None
    expires_in_s: Optional = None


@dataclass(slots=True, kw_only=True)
class WaitingView(RequestView):
    position: int | None = None  # in dispatch order
    eta_s: float | None = None  # predicted seconds until it is dispatched
    switch_due_in_s: Optional = None  # seconds until a switch to its model is due (model affinity)


@dataclass(slots=True, kw_only=True)
class RunningView(RequestView):
    backend: str | None = None
    slot: int | None = None
    running_s: float | None = None


@dataclass(slots=True, kw_only=True)
class FinishedView(RequestView):
    backend: str | None = None
    outcome: str = ""  # completed, ended, left_queued or expired
    output_tokens: int | None = None
    service_s: float | None = None
    ended_ago_s: float | None = None


class LoadView(_View):
    load_s: float = 0.0  # learned seconds to load the model
    observations: int = 0


class BackendView(_View):
    """A backend's state (and its ``info``: url, kind, as extra fields)."""

    name: str = ""
    slots: int = 0
    in_flight: int = 0
    healthy: bool | None = None
    models: list[str] = []
    loaded_models: list[str] = []
    holds: str | None = None  # the model it served last
    switched_ago_s: float | None = None
    load_s: dict[str, LoadView] = {}  # per model
    remaining_s: float | None = None  # predicted seconds of work left on it
    slowness: float | None = None  # measured / predicted service seconds: scales every prediction on it alike


class ModelSwitchView(_View):
    """A backend serves the model it holds while no request for another has been put off ``bound_s``."""

    bound_s: float = 0.0
    free_load_s: float = FREE_LOAD_S  # a load this short is no reason to put a switch off
    load_prior_s: float = 0.0  # a load not yet measured
    waiting_by_model: dict[str, int] = {}


class ClusterWaitingView(_View):
    """A request waiting in the whole cluster's queue: metadata only, and the replica that holds it."""

    request_id: str = ""
    replica: str = ""
    tenant: str = ""
    priority: int = 0
    model: str = ""
    predicted_s: float = 0.0
    waited_s: float = 0.0
    overdue: bool = False  # past its starvation bound: it goes before later arrivals


class ClusterLeaseView(_View):
    """A slot held through the shared store, by whichever replica."""

    backend: str = ""
    slot: int = 0
    request_id: str = ""
    replica: str = ""
    expires_in_s: float = 0.0  # seconds until it comes back unless renewed


class ReplicaHealthView(_View):
    replica: str = ""
    beat_age_s: float = 0.0  # seconds since its last heartbeat
    live: bool = True  # it beat within the lease: its requests stay in the queue


class ClusterPartView(_View):
    """With replicas (``redis_url``): the whole cluster as the shared store holds it."""

    name: str = ""
    replica: str = ""  # the replica that answered
    mode: str = "shared"  # shared, or local: Redis unreachable, scheduling on a share of the slots
    lease_s: float = 0.0
    quiet_s: float = 0.0  # seconds left of the pause after Redis lost its state (no new grants)
    replicas: list[ReplicaHealthView] = []
    waiting_count: int = 0
    waiting: list[ClusterWaitingView] = []  # in dispatch order (the first ``limit`` when asked)
    leases: list[ClusterLeaseView] = []
    error: str | None = None  # why the store could not be read (the rest is then empty)


class QueueView(_View):
    policy: str = ""
    policy_detail: dict[str, Any] = {}
    starvation_timeout_s: float | None = None  # None when the guard is off (JSON has no infinity)
    # overdue after tau + slowdown x predicted_s (adaptive: base x (1 + CV^2) of service times)
    starvation_slowdown: float | dict[str, float] | None = None
    model_switch: ModelSwitchView = ModelSwitchView()
    slots: int = 0
    max_queue: int = 0
    tail_eta_s: float | None = None
    service_time: dict[str, dict[str, float]] = {}  # per model ("default" for none): its fit
    backends: list[BackendView] = []
    waiting_count: int = 0  # all of them; ``waiting`` may list only the first
    waiting: list[WaitingView] = []
    in_flight: list[RunningView] = []
    recent: list[FinishedView] = []  # newest first
    tenants: dict[str, dict[str, Any]] = {}  # limits and use (proxy/limits.py), added by the proxy
    # with replicas: the whole cluster, added by the proxy (left out of the JSON without them)
    cluster: Annotated[ClusterPartView | None, Field(exclude_if=lambda value: value is None)] = None


def _request(ticket: Ticket, now: float) -> dict[str, Any]:
    prediction = ticket.prediction
    probabilities = None if prediction is None else prediction.probabilities
    return {
        "request_id": ticket.request_id, "endpoint": ticket.endpoint, "model": ticket.model, "tenant": ticket.tenant,
        "priority": ticket.priority, "predicted_class": ticket.predicted_class,
        "p_long": None if probabilities is None else round(probabilities[2], 6),
        "score": round(ticket.score, 6), "predicted_tokens": round(ticket.predicted_tokens, 1),
        "predicted_s": round(ticket.predicted_s, 3), "waited_s": round(now - ticket.arrival_s, 3),
        "expires_in_s": None if math.isinf(ticket.expires_s) else round(ticket.expires_s - now, 3),
    }  # fmt: skip


def _switch_due_in_s(dispatcher: Dispatcher, ticket: Ticket, now: float) -> float | None:
    """Seconds until a switch to its model is due (put off ``bound_s``), when no backend that
    serves it holds it (then, with two models, its model is loaded next)."""
    bound_s = dispatcher.queue.bound_s
    if not bound_s:
        return None
    serving = [b for b in dispatcher.backends if b.serves(ticket.model)]
    if not serving or any(b.held.holds(ticket.model) for b in serving):
        return None
    return round(min(max(ticket.arrival_s, b.held.switched_s) for b in serving) + bound_s - now, 3)


def _backends(dispatcher: Dispatcher, now: float) -> list[dict[str, Any]]:
    loads = dispatcher.service_time.loads()
    return [
        {
            "name": b.name,
            **b.info,
            "slots": b.slots,
            "in_flight": len(b.running),
            "healthy": b.healthy,
            "models": list(b.models),
            "loaded_models": list(b.held.loaded),
            "holds": b.held.last_model,
            "switched_ago_s": None if math.isinf(b.held.switched_s) else round(now - b.held.switched_s, 3),
            "load_s": {
                m: {"load_s": round(x["load_s"], 3), "observations": int(x["observations"])}
                for m, x in loads.get(b.name, {}).items()
            },
            "remaining_s": round(dispatcher.remaining_s(b), 3),
            "slowness": round(b.slowness, 3),
        }  # fmt: skip
        for b in dispatcher.backends
    ]


def _finished(
    dispatcher: Dispatcher, ticket: Ticket, ended_s: float, outcome: str, output_tokens: int | None, now: float
) -> FinishedView:
    placement = ticket.placement
    row = _request(ticket, now)
    row["waited_s"] = round((ended_s if placement is None else placement.dispatched_s) - ticket.arrival_s, 3)
    return FinishedView(
        **row,
        backend=None if placement is None or placement.backend is None else dispatcher.backends[placement.backend].name,
        outcome=outcome, output_tokens=output_tokens,
        service_s=None if placement is None else round(ended_s - placement.dispatched_s, 3),
        ended_ago_s=round(now - ended_s, 3),
    )  # fmt: skip


def queue_view(dispatcher: Dispatcher, limit: int | None = None) -> QueueView:
    """The waiting queue in dispatch order with positions and ETAs (the first ``limit`` of
    ``waiting_count``), what is in flight on each backend, the backends, and the last finished
    requests."""
    now = dispatcher.clock.now()
    etas, tail = dispatcher.etas(now)
    shown = etas if limit is None else etas[: max(0, limit)]
    slowdown = dispatcher.limits.starvation_slowdown
    service_time = dispatcher.service_time
    return QueueView.model_validate({
        "policy": dispatcher.policy.name,
        "policy_detail": dispatcher.policy.describe(),
        "starvation_timeout_s": None if math.isinf(timeout_s := dispatcher.limits.starvation_timeout_s) else timeout_s,
        "starvation_slowdown": slowdown.describe() if isinstance(slowdown, AdaptiveSlowdown) else slowdown,
        "model_switch": {
            "bound_s": dispatcher.queue.bound_s,
            "load_prior_s": service_time.defaults.load_s,
            "waiting_by_model": {m or "default": n for m, n in dispatcher.queue.waiting_by_model().items()},
        },
        "slots": dispatcher.slots,
        "max_queue": dispatcher.limits.max_queue,
        "tail_eta_s": round(tail, 3),
        # Every model's fit that orders requests (predicted seconds; times each backend's slowness
        # for its ETAs), including a model still at the defaults while it waits.
        "service_time": {
            **service_time.fits(),
            **{
                model: service_time.coefficients(model)
                for model in {t.model for t in dispatcher.running()} | {job.payload.model for job, _ in etas}
                if model
            },
        },
        "backends": _backends(dispatcher, now),
        "waiting_count": len(etas),
        "waiting": [
            WaitingView(
                **_request(job.payload, now), position=i, eta_s=round(eta, 3),
                switch_due_in_s=_switch_due_in_s(dispatcher, job.payload, now),
            )
            for i, (job, eta) in enumerate(shown)
        ],
        "in_flight": [
            RunningView(**_request(t, now), backend=b.name, slot=slot, running_s=round(now - t.placement.dispatched_s, 3))
            for b in dispatcher.backends
            for slot, t in sorted(b.running.items())
            if t.placement is not None  # (granted: it runs)
        ],
        "recent": [_finished(dispatcher, *entry, now) for entry in reversed(dispatcher.stats.recent)],
    })  # fmt: skip
