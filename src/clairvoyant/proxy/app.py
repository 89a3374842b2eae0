"""The proxy's ASGI app: lifespan wiring and the routing of each request.

POST /v1/chat/completions, /v1/completions, /api/chat and /api/generate are scheduled
(proxy/scheduled.py); GET /healthz, /readyz, /metrics, /queue, /queue/{request_id}, /history and
the live page /ui are the proxy's own, served by FastAPI; everything else passes through to the
backend unqueued (in a pool, to one serving the model its body names; model listings merged).
``ProxyApp.__call__`` checks each request in the order docs/design.md gives ("A request's life"),
reading the body only after the checks, and answers every refusal in the client's dialect and
with one log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from clairvoyant.clock import Clock, MonotonicClock
from clairvoyant.config import Settings
from clairvoyant.errors import (
    BadRequest,
    BodyBudgetExhausted,
    IncompleteBody,
    LimitExceeded,
    MethodNotAllowed,
    PayloadTooLarge,
    QueueFull,
    RequestError,
    RequestTimeout,
    UpstreamUnavailable,
)
from clairvoyant.logs import REQUEST_LOG, log_request
from clairvoyant.metrics import CONTENT_TYPE_LATEST, Metrics
from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, dialect_of_path
from clairvoyant.prediction.encoder import EncoderModel, Refiner, encoder_for
from clairvoyant.prediction.predictor import OnnxPredictor, Predictor
from clairvoyant.proxy.access import LOOPBACK_HOSTS, AccessControl, Denied, Identity
from clairvoyant.proxy.body import BodyBudget, check_framing, declared_length, read_body
from clairvoyant.proxy.feedback import OnlineLearning
from clairvoyant.proxy.history import History, history_now, live_view, record_periodically
from clairvoyant.proxy.limits import TenantLimits
from clairvoyant.proxy.pool import BackendPool, merge_model_lists
from clairvoyant.proxy.relay import PassThrough, Receive, Relay, Responder, Send, UpstreamRequest, relay_unscheduled
from clairvoyant.proxy.scheduled import Arrival, Scheduling, SupersedeKeys, admit_scheduled
from clairvoyant.proxy.target import Target, check_head_size, check_host, check_target, http_version
from clairvoyant.proxy.transport import Transport
from clairvoyant.proxy.upstream import Upstream, forwardable_headers
from clairvoyant.scheduling.cluster.replica import ClusterLink, ClusterOptions
from clairvoyant.scheduling.cluster.shared import StoreUnavailable
from clairvoyant.scheduling.dispatcher import Dispatcher, Ticket
from clairvoyant.scheduling.policy import PolicyParams, build_queue, make_policy
from clairvoyant.scheduling.request import status_counts
from clairvoyant.scheduling.service_time import ServiceTimeModel
from clairvoyant.scheduling.slowdown import AdaptiveSlowdown

__all__ = ["ProxyApp", "ProxyState", "create_app"]

if TYPE_CHECKING:  # imported when replicas are on (redis-py costs start-up time otherwise)
    from clairvoyant.scheduling.cluster.observations import SharedObservations

logger = logging.getLogger(__name__)

UI_DIR = Path(__file__).with_name("ui")
PASSTHROUGH_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_ALLOW = ", ".join(sorted(PASSTHROUGH_METHODS)).encode()
SCHEDULED_METHODS = frozenset({"POST", "OPTIONS"})  # on the scheduled paths: POST is scheduled, OPTIONS passes
_SCHEDULED_ALLOW = ", ".join(sorted(SCHEDULED_METHODS))
_OWN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/queue", "/history", "/ui"})
MODEL_LISTINGS = frozenset({"/api/tags", "/v1/models"})  # merged across a pool
MODEL_SNIFF_MAX_BYTES = 64 * 1024  # a pass-through body larger than this is not searched for its model
LISTING_TIMEOUT_S = 5.0  # per backend, for a merged model listing
_REJECTION_REASONS = {BadRequest: "bad_request", PayloadTooLarge: "too_large", QueueFull: "queue_full"}


@dataclass
class ProxyState:
    """Everything the requests need, built by the lifespan."""

    pool: BackendPool
    dispatcher: Dispatcher
    learning: OnlineLearning  # its recorder is a scheduled request's on_usage: metrics and the online learner
    scheduling: Scheduling  # what every scheduled request shares
    limits: TenantLimits  # tenants' use against their limits
    history: History  # the last 15 minutes, for the live page's charts
    cluster: ClusterLink | None = None  # with replicas: this replica's side of the shared queue

    def retained(self) -> dict[str, int]:
        """Entries every long-lived structure holds (the gauge ``clairvoyant_retained_entries``)."""
        learner = self.learning.learner
        return {
            **self.dispatcher.retained(),
            **self.limits.retained(),
            **self.history.retained(),
            **self.scheduling.supersede.retained(),
            **({} if learner is None else learner.retained()),
        }


def _load_encoder(settings: Settings, predictor: Predictor) -> EncoderModel | None:
    """The encoder that refines waiting requests, when it applies: it refines a regressor's log
    tokens (not a class model's, nor a test double's). A broken one fails start-up."""
    if not settings.encoder:
        return None
    encoder = encoder_for(predictor, settings.encoder_path) if isinstance(predictor, OnnxPredictor) else None
    if encoder is None:
        logger.info("encoder off: it refines a regressor's log tokens, and this predictor is not one")
    return encoder


def _start_refiner(
    settings: Settings, predictor: Predictor, encoder: EncoderModel, dispatcher: Dispatcher, metrics: Metrics
) -> Refiner:
    """The encoder's thread: each waiting request's second opinion, re-keyed in the queue."""
    assert isinstance(predictor, OnnxPredictor)
    weights = encoder.blend_weights
    outcomes = {
        name: metrics.encoder.requests[name]
        for name in ("refined", "late", "skipped", "bypassed", "dropped", "failed", "learning", "learning_dropped")
    }

    def deliver(
        waiting: tuple[Ticket, bytes], encoder_log_tokens: float, components: bytes, knn_log_tokens: float | None
    ) -> bool | None:
        ticket, row = waiting  # its lexical row, kept by the encoder's queue until now
        prediction = ticket.prediction
        if prediction is not None and ticket.waiting and not ticket.ended:
            refined = predictor.refined(prediction, encoder_log_tokens, weights, components, knn_log_tokens, row=row)
            # Re-keyed without its row: the learner re-derives row and components after completion.
            if dispatcher.repredicted(ticket, replace(refined, feature_row=b"")):
                outcomes["refined"].inc()
                return True
        outcomes["late"].inc()  # dispatched or withdrawn while it was being encoded
        return False if ticket.placement is not None else None  # a withdrawn one says nothing of the encoder's pace

    refiner = Refiner(
        encoder, deliver, max_pending=settings.encoder_max_pending,
        observe_seconds=metrics.encoder.latency.observe, count=lambda outcome: outcomes[outcome].inc(),
    )  # fmt: skip
    refiner.start(asyncio.get_running_loop())
    logger.info(
        "encoder on: blend weight %.2f single-turn, %.2f with history, kNN %.2f, %d word pieces, %d components "
        "for the learner", weights.first, weights.later, weights.knn, encoder.card.max_word_pieces, encoder.components,
    )  # fmt: skip
    return refiner


def create_app(
    settings: Settings,
    *,
    predictor: Predictor | None = None,
    clock: Clock | None = None,
    upstream_transport: Transport | None = None,  # tests' (tests/httpx_transport.py)
) -> ProxyApp:
    """Build the proxy (served by ``server.ProxyServer``); the keywords are for tests."""
    metrics = Metrics()
    running_clock = clock or MonotonicClock()
    proxy: ProxyApp

    @asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        # Each part's stop is pushed as soon as it has started: a failure at any point of start-up
        # stops exactly what had started, in reverse order, and shutdown does the same.
        async with AsyncExitStack() as stack:
            try:
                proxy.proxy = await _start(stack, proxy, predictor, running_clock, upstream_transport)
            except BaseException as exc:
                proxy.startup_error = exc
                raise
            proxy.started.set()
            yield

    api = FastAPI(title="clairvoyant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    proxy = ProxyApp(api, settings, metrics)
    _add_own_endpoints(api, proxy)
    return proxy


async def _start(
    stack: AsyncExitStack, proxy: ProxyApp, predictor: Predictor | None, clock: Clock, transport: Transport | None
) -> ProxyState:
    """Start every part, in order, pushing each one's stop on ``stack`` once it has started."""
    settings, metrics = proxy.settings, proxy.metrics
    # A model that fails to load fails start-up: there is no silent fallback predictor.
    loaded = predictor if predictor is not None else OnnxPredictor(settings.model_path)
    pool = BackendPool(settings, transport=transport)
    stack.push_async_callback(pool.aclose)
    await pool.discover()  # a pool's kinds and llama.cpp slots, before the dispatcher counts slots
    limits = await _start_limits(settings)
    stack.push_async_callback(limits.aclose)
    stack.push_async_callback(_save_limits_at_stop, limits)
    encoder = _load_encoder(settings, loaded)
    learning = OnlineLearning(settings, loaded, metrics, encoder)
    await learning.start()
    stack.push_async_callback(learning.stop)  # after the drain: the last requests are learned, then saved
    dispatcher = _dispatcher(settings, pool, clock, metrics, proxy.tenant_weights)
    # With replicas: both stop after the dispatcher's drain (the stack unwinds in reverse).
    cluster = _cluster_link(stack, settings, metrics, proxy.tenant_weights, limits)
    observations = None if cluster is None else _shared_observations(stack, settings, dispatcher, learning)
    await dispatcher.start()
    # In-flight answers get the grace period, no more.
    stack.push_async_callback(dispatcher.stop, settings.shutdown_grace_s)
    if cluster is not None and observations is not None:
        await cluster.start(dispatcher, fallback=settings.redis_fallback)
        observations.start()
    pool.start(dispatcher)
    refiner = None
    if encoder is not None:
        refiner = _start_refiner(settings, loaded, encoder, dispatcher, metrics)
        stack.callback(refiner.stop)
    if settings.online_learning:  # the learner's encoder pass for requests that never waited
        learning.recorder.refiner = refiner
    metrics.tenants.known = _known_tenants(settings)
    supersede = SupersedeKeys(settings.supersede_running)
    scheduling = Scheduling(settings, loaded, pool, metrics, dispatcher, learning.recorder, refiner, limits, supersede)
    history = History()
    _run_background_tasks(settings, pool, dispatcher, limits, history)
    _log_ready(settings, pool, dispatcher)
    return ProxyState(pool, dispatcher, learning, scheduling, limits, history, cluster)


def replica_name(settings: Settings) -> str:
    """This replica's name in the cluster: ``replica_id``, else host name and port."""
    return settings.replica_id or f"{socket.gethostname()}:{settings.port}"


async def _start_limits(settings: Settings) -> TenantLimits:
    """The tenants' limits: counted in this process (with its state file), or in Redis with replicas."""
    redis_url = None if settings.redis_url is None else settings.redis_url.get_secret_value()
    limits = TenantLimits(
        settings.tenant_limits,
        state_path=None if redis_url else _limits_path(settings),
        redis_url=redis_url,
        cluster=settings.cluster_name,
        replica=replica_name(settings),
    )
    try:
        await limits.start()
    except Exception as exc:
        if redis_url is None:
            raise
        if not settings.redis_fallback:
            raise StoreUnavailable(f"the tenants' limits: {type(exc).__name__}: {exc}") from exc
        limits.degraded = True  # counted on this replica until Redis answers
    return limits


def _on_heartbeat(limits: TenantLimits) -> Callable[[tuple[str, ...]], Awaitable[None]]:
    """After each renewal: a replica the store dropped (it stopped beating) loses its tenants'
    counts, and this replica's own counts are written again (a write Redis missed, or lost)."""
    seen: set[str] = set()

    async def beat(replicas: tuple[str, ...]) -> None:
        for gone in seen - set(replicas):
            dropped = await limits.drop_replica(gone)
            if dropped:
                logger.warning("replica %s is gone: its tenants' %d request(s) no longer count", gone, dropped)
        seen.clear()
        seen.update(replicas)
        await limits.resync()

    return beat


def _shared_observations(
    stack: AsyncExitStack, settings: Settings, dispatcher: Dispatcher, learning: OnlineLearning
) -> SharedObservations:
    """With replicas: every replica learns from every replica's answers (numbers only) through a
    Redis stream, so that their predictions, compared in one queue, stay comparable. Not started yet."""
    from clairvoyant.scheduling.cluster.observations import SharedObservations  # redis-py: replicas only

    assert settings.redis_url is not None
    shared = SharedObservations(
        settings.redis_url.get_secret_value(), cluster=settings.cluster_name, replica=replica_name(settings),
        service_time=dispatcher.service_time, backends=dispatcher.backends,
        catch_up=not any(fit["observations"] for fit in dispatcher.service_time.fits().values()),
    )  # fmt: skip
    dispatcher.cluster.on_observed = shared.publish_service
    learner = learning.learner
    if learner is not None:
        shared.share_learner(learner.identity, learning.recorder.observe_shared)
        learning.recorder.on_observed = shared.publish_learner
    stack.push_async_callback(shared.stop)
    return shared


def _cluster_link(
    stack: AsyncExitStack, settings: Settings, metrics: Metrics, tenant_weights: dict[str, float], limits: TenantLimits
) -> ClusterLink | None:
    """With ``redis_url``: this replica's side of the shared queue (not started yet). Its goodbye
    is pushed before the dispatcher's stop: it runs after the last slot's release."""
    if settings.redis_url is None:
        return None
    from clairvoyant.scheduling.cluster.store import RedisSlotStore  # redis-py: loaded with replicas only

    replica = replica_name(settings)
    metrics.replica = replica
    if settings.policy not in ("sjf", "fcfs"):
        logger.warning(
            "with replicas the shared queue orders by the predictor's key (sjf); the policy %s is not applied",
            settings.policy,
        )
    store = RedisSlotStore(
        settings.redis_url.get_secret_value(),
        settings.cluster_name,
        replica,
        lease_s=settings.lease_s,
        switch_bound_s=0.0 if settings.policy == "fcfs" else settings.model_switch_bound_s,
    )
    options = ClusterOptions(settings.cluster_name, settings.lease_s, settings.fair_share, settings.supersede_running)
    link = ClusterLink(store, options, tenant_weights, on_heartbeat=_on_heartbeat(limits))
    stack.push_async_callback(link.leave)
    logger.info("replica %s of cluster %s (lease %.1f s)", replica, settings.cluster_name, settings.lease_s)
    return link


def _dispatcher(
    settings: Settings, pool: BackendPool, clock: Clock, metrics: Metrics, tenant_weights: dict[str, float]
) -> Dispatcher:
    """The queue the policy orders, and the dispatcher that grants its requests the pool's slots."""
    policy = make_policy(
        settings.policy, PolicyParams(settings.boost_gamma_per_s, settings.boost_auto_gamma, settings.boost_max_s)
    )
    slowdown: float | AdaptiveSlowdown = settings.starvation_slowdown
    if settings.starvation_slowdown_adaptive:
        slowdown = AdaptiveSlowdown(settings.starvation_slowdown)
    queue = build_queue(
        policy,
        starvation_timeout_s=settings.starvation_timeout_s,
        starvation_slowdown=slowdown,
        fair_share=settings.fair_share,
        tenant_weights=tenant_weights,  # the app's own dict: a reload of the keys updates it in place
        model_switch_bound_s=settings.model_switch_bound_s,
    )
    service_time = ServiceTimeModel(path=settings.service_time_path)
    service_time.load()
    return Dispatcher(
        queue, policy, backends=pool.scheduling_backends(), clock=clock, metrics=metrics, max_queue=settings.max_queue,
        service_time=service_time, min_retry_after_s=settings.retry_after_s,
        starvation_timeout_s=settings.starvation_timeout_s, starvation_slowdown=slowdown,
    )  # fmt: skip


def _run_background_tasks(
    settings: Settings, pool: BackendPool, dispatcher: Dispatcher, limits: TenantLimits, history: History
) -> None:
    """The dispatcher's detached tasks (cancelled when it stops)."""
    for member in pool.members:
        dispatcher.run_detached(
            _check_upstream_at_start(member.upstream, settings.backend_wait_s),
            name=f"upstream-check-{member.name}",
            cancel_at_stop=True,
        )
    if limits.state_path is not None:
        dispatcher.run_detached(
            _save_limits_periodically(limits, settings.learner_save_interval_s), "limits-save", cancel_at_stop=True
        )
    dispatcher.run_detached(record_periodically(history, dispatcher, limits), "history", cancel_at_stop=True)


def _log_ready(settings: Settings, pool: BackendPool, dispatcher: Dispatcher) -> None:
    logger.info(
        "clairvoyant ready: backends=%s policy=%s tau=%ss+%sxS slots=%d max_queue=%d disconnect_mode=%s",
        ", ".join(f"{m.name}={m.upstream.display_url} ({m.kind}, {m.slots} slots)" for m in pool.members),
        settings.policy, settings.starvation_timeout_s, settings.starvation_slowdown, dispatcher.slots,
        settings.max_queue, settings.disconnect_mode,
    )  # fmt: skip
    if settings.api_keys:
        logger.info("authentication on: %d API key(s)", len(settings.api_keys))
        return
    logger.info("authentication off: no api_keys")
    if settings.host not in LOOPBACK_HOSTS:
        logger.warning(
            "listening on %s with no API keys: anyone who can reach this port can use the backend "
            "(add [[api_keys]]: `clairvoyant keys add`)", settings.host,
        )  # fmt: skip


def _add_own_endpoints(api: FastAPI, proxy: ProxyApp) -> None:
    """The proxy's own GET endpoints."""
    metrics = proxy.metrics

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz")
    async def readyz() -> Response:
        """Ready while the dispatcher runs and at least one backend is ready; ``backends`` says which."""
        state = proxy.state
        checks: dict[str, Any] = {"dispatcher": state.dispatcher.healthy}
        problems = await asyncio.gather(*(m.upstream.probe() for m in state.pool.members))
        checks["backends"] = {m.name: problem is None for m, problem in zip(state.pool.members, problems, strict=True)}
        checks["upstream"] = any(problem is None for problem in problems)
        for member, problem in zip(state.pool.members, problems, strict=True):
            if problem is not None:
                logger.info("readiness: backend %s: %s", member.name, problem)
        if not checks["upstream"]:
            checks["upstream_error"] = "no backend is ready"  # the details (addresses) stay in the log
        ready = checks["dispatcher"] and checks["upstream"]
        status = "ready" if ready else "not_ready"
        if state.cluster is not None:  # with replicas: degraded = scheduling locally, Redis unreachable
            checks["cluster"] = state.cluster.mode.value
            if ready and (state.cluster.degraded or state.limits.degraded):
                status = "degraded"
        return JSONResponse({"status": status, **checks}, status_code=200 if ready else 503)

    @api.get("/metrics")
    async def metrics_endpoint() -> Response:
        state = proxy.state
        await state.learning.refresh_quality()
        metrics.process.publish(len(asyncio.all_tasks()), state.retained())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @api.get("/queue")
    async def queue_endpoint(limit: int | None = None) -> Response:
        """``limit``: list only the first waiting requests (the counts and ETAs cover them all)."""
        state = proxy.state
        view = await live_view(state.dispatcher, state.limits, limit)
        if state.cluster is not None:
            view.cluster = await state.cluster.view(limit)
        return Response(view.model_dump_json(), media_type="application/json")

    @api.get("/history")
    async def history_endpoint() -> Response:
        """The last 15 minutes, for the live page's charts (proxy/history.py)."""
        state = proxy.state
        return JSONResponse(await history_now(state.history, state.dispatcher, state.limits))

    @api.get("/queue/{request_id}")
    async def queue_position(request_id: str) -> Response:
        """Where one waiting request stands: its position in dispatch order and ETA."""
        dispatcher = proxy.state.dispatcher
        ticket = dispatcher.waiting_ticket(request_id)
        where = None if ticket is None else dispatcher.where(ticket)
        if ticket is None or where is None:
            return JSONResponse({"request_id": request_id, "waiting": False}, status_code=404)
        position, eta_s = where
        return JSONResponse({"request_id": request_id, "waiting": True, "position": position, "eta_s": round(eta_s, 3)})

    @api.get("/ui")
    async def ui_root() -> Response:
        return RedirectResponse("/ui/")

    # The live queue page: static files in the package, no build step, no CDN. The page loads
    # without a key; the data it polls (/queue, /metrics, /history) needs one when status_requires_key.
    api.mount("/ui/", StaticFiles(directory=UI_DIR, html=True), name="ui")


class ProxyApp:
    """The ASGI app the server runs (module docstring)."""

    def __init__(self, api: FastAPI, settings: Settings, metrics: Metrics) -> None:
        self.api = api  # the lifespan and the proxy's own endpoints
        self.settings = settings
        self.metrics = metrics
        self.status_counts = status_counts(metrics)  # pass-through requests' statuses
        self.access = AccessControl(settings)
        self.body_budget = BodyBudget(settings.body_budget_bytes)
        self.proxy: ProxyState | None = None  # set by the lifespan once started
        self.started = asyncio.Event()
        self.startup_error: BaseException | None = None  # what stopped the lifespan's start-up
        self.tenant_weights = settings.tenant_weights  # the fair-share queue reads this very dict

    def reload_keys(self, new: Settings) -> None:
        """SIGHUP: the keys and tenants of ``new`` replace the current ones; the queue, the requests
        in flight and every tenant's counts stay. Other settings need a restart."""
        self.settings = self.settings.model_copy(update={"api_keys": new.api_keys, "tenants": new.tenants})
        self.access = AccessControl(self.settings)
        self.tenant_weights.clear()
        self.tenant_weights.update(self.settings.tenant_weights)
        state = self.proxy
        if state is not None:
            state.limits.reload(self.settings.tenant_limits)
            self.metrics.tenants.known = _known_tenants(self.settings)
        logger.info("reloaded %d API key(s) and %d tenant(s)", len(new.api_keys), len(new.tenants))

    @property
    def state(self) -> ProxyState:
        assert self.proxy is not None, "the app has not started"
        return self.proxy

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)  # the lifespan (websockets are not served)
            return
        out = Responder(send)
        method: str = scope["method"]
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        try:
            check_head_size(raw_path, scope["query_string"], scope["headers"], self.settings.max_header_bytes)
            version = http_version(scope["http_version"])
            check_host(version, scope["headers"])
            check_framing(version, scope["headers"])
            if raw_path == b"*":
                if method != "OPTIONS":
                    raise BadRequest("the request target '*' is only for OPTIONS")
                await out.respond(204, [(b"allow", _ALLOW)], b"")  # the proxy describes itself (RFC 9110 9.3.7)
                return
            target = check_target(method, raw_path, scope["query_string"])
            path = target.path
            if method in ("GET", "HEAD") and _is_own_endpoint(path):
                self.access.admit(method, path, scope["headers"])
                await self.api(scope, receive, out.tracked)
                return
            identity, headers = self.access.admit(method, path, scope["headers"])
            if path in SCHEDULED_ENDPOINTS and method not in SCHEDULED_METHODS:
                # Every backend answers a completion path only to POST; a GET (or PUT, ...) passed
                # through would get the backend's 404. OPTIONS still passes: the backend answers
                # a browser's CORS preflight.
                raise MethodNotAllowed(f"{path} takes POST, not {method}", allow=_SCHEDULED_ALLOW)
            if method == "POST" and path in SCHEDULED_ENDPOINTS:
                await self._scheduled(target, identity, headers, receive, out)
            elif method in PASSTHROUGH_METHODS:
                await self._passthrough(method, target, headers, receive, out)
            else:
                raise MethodNotAllowed(f"{method} is not served here", allow=_ALLOW.decode())
        except Denied as denied:
            self._reject(method, scope, denied.error, denied.outcome)
            await out.error(dialect_of_path(scope["path"]), denied.error)
        except IncompleteBody as incomplete:  # most often the client left mid-upload: counted as such
            self.metrics.requests.disconnects["upload"].inc()
            self._reject(method, scope, incomplete, "client_left_uploading")
            await out.error(dialect_of_path(scope["path"]), incomplete)
        except RequestError as error:
            outcome = "client_timeout" if isinstance(error, RequestTimeout) else error.code or "error"
            self._reject(method, scope, error, outcome)
            await out.error(dialect_of_path(scope["path"]), error)
        except Exception:  # a bug: logged, answered if nothing was sent yet; the proxy goes on
            logger.exception("unexpected error on %s %s", method, scope["path"])
            internal = RequestError("internal error in the proxy")
            self._reject(method, scope, internal, "internal_error")
            await out.error(dialect_of_path(scope["path"]), internal)

    async def _read(self, declared_bytes: int | None, receive: Receive) -> tuple[bytes, int]:
        settings = self.settings
        return await read_body(
            receive, declared_bytes=declared_bytes, max_bytes=settings.max_body_bytes,
            timeout_s=settings.client_timeout_s, budget=self.body_budget,
        )  # fmt: skip

    async def _scheduled(
        self,
        target: Target,
        identity: Identity | None,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
        out: Responder,
    ) -> None:
        """The tenant's limits and the queue's room first: a refused upload is never invited (the
        server's 100 Continue goes out with the first read)."""
        state = self.state
        settings = self.settings
        metrics = self.metrics
        declared_bytes = declared_length(headers, settings.max_body_bytes)  # 413 before anything else is said
        tenant = identity.tenant if identity else _header(headers, settings.tenant_header.lower().encode()) or ""
        dispatcher = state.dispatcher
        try:
            await state.limits.admit(tenant, lambda: dispatcher.tenant_free_in_s(tenant))
        except LimitExceeded as refused:
            metrics.tenants.refusals[metrics.tenants.label(tenant), refused.limit].inc()
            raise
        metrics.tenants.requests[metrics.tenants.label(tenant)].inc()
        held_bytes = 0
        try:
            dispatcher.check_room()
            body, held_bytes = await self._read(declared_bytes, receive)
            forward, authorization, own = forwardable_headers(headers, state.scheduling.own_headers)
            arrival = Arrival(
                SCHEDULED_ENDPOINTS[target.path], target.raw_path + _query(target), forward, authorization, own, body,
                identity, tenant,
            )  # fmt: skip
            request = admit_scheduled(state.scheduling, arrival, out)
            await request.serve(receive)
        finally:
            await state.limits.release(tenant)
            self.body_budget.give_back(held_bytes)

    async def _passthrough(
        self, method: str, target: Target, headers: list[tuple[bytes, bytes]], receive: Receive, out: Responder
    ) -> None:
        """Relay a request unscheduled: to the backend, or in a pool to one serving its model."""
        pool = self.state.pool
        body, held_bytes = await self._read(declared_length(headers, self.settings.max_body_bytes), receive)
        relay: Relay | None = None
        try:
            forward, authorization, _ = forwardable_headers(headers)
            path = target.path
            request = UpstreamRequest(
                method, target.raw_path + _query(target), forward, body, dialect_of_path(path),
                authorization=authorization, wait_s=self.settings.backend_wait_s,
            )  # fmt: skip
            if len(pool) > 1 and method == "GET" and path in MODEL_LISTINGS:
                await self._merged_listing(pool, request, out)
                return
            if len(pool) == 1:
                passing, upstream = PassThrough(self.status_counts), pool.first
            else:
                # To a backend serving the model the body names (Ollama's show, embeddings), or to
                # the first healthy backend; a refused connection tries the next.
                order = pool.passthrough_order(_model_named(body))
                passing, upstream = PassThrough(self.status_counts, pool, order), order[0]
            relay = Relay(upstream, request, self.metrics, passing, passing)
            await relay_unscheduled(relay, out, receive, self.metrics)
        finally:
            self.body_budget.give_back(held_bytes)
            status = "client_closed" if relay is None or relay.status is None else str(relay.status)
            self.metrics.requests.answered["passthrough", dialect_of_path(target.path).value, status].inc()
            if relay is not None and REQUEST_LOG.isEnabledFor(logging.INFO):
                log_request({
                    "request_id": _header(headers, b"x-request-id") or "-", "method": method, "path": target.path,
                    "status": relay.status or "client_closed", "outcome": "passthrough_" + relay.record.status.outcome,
                })  # fmt: skip

    async def _merged_listing(self, pool: BackendPool, request: UpstreamRequest, out: Responder) -> None:
        """``GET /api/tags`` or ``/v1/models`` in front of a pool: the lists of the backends that
        answer, merged (the first backend's entry wins a duplicate); none answering is a 502."""
        bodies = await asyncio.gather(*(m.upstream.get_json(request.target, LISTING_TIMEOUT_S) for m in pool.members))
        answered = [body for body in bodies if body is not None]
        if not answered:
            raise UpstreamUnavailable("no backend answered the model listing")
        body = merge_model_lists(request.target.partition("?")[0], answered)
        await out.respond(200, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))], body)

    def _reject(self, method: str, scope: dict[str, Any], error: RequestError, outcome: str) -> None:
        """Count and log an answer the proxy gave itself (it never reached the queue or the backend)."""
        path: str = scope["path"]
        reason = next((r for cls, r in _REJECTION_REASONS.items() if isinstance(error, cls)), None)
        if reason is not None:
            self.metrics.requests.rejections[reason].inc()
        if isinstance(error, RequestTimeout):
            self.metrics.requests.client_rejections["client_timeout"].inc()
        elif isinstance(error, BodyBudgetExhausted):
            self.metrics.requests.client_rejections["body_budget"].inc()
        endpoint = path if path in SCHEDULED_ENDPOINTS else "passthrough"
        status = error.status_code
        self.metrics.requests.answered[endpoint, dialect_of_path(path).value, str(status)].inc()
        log_request({
            "request_id": _header(scope["headers"], b"x-request-id") or "-", "method": method, "path": path[:256],
            "status": status, "outcome": outcome,
        })  # fmt: skip


def _is_own_endpoint(path: str) -> bool:
    """The proxy's own GET (and HEAD) endpoints: /healthz /readyz /metrics /queue /queue/{id} /history /ui."""
    if path in _OWN_PATHS or path.startswith("/ui/"):
        return True
    return path.startswith("/queue/") and len(path) > 7 and "/" not in path[7:]


def _known_tenants(settings: Settings) -> frozenset[str]:
    """The tenants the configuration names: their own label in the metrics."""
    return frozenset({*settings.tenant_weights, *settings.tenant_limits})


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """A header's first value, at most 128 characters (for a log line or a tenant's name)."""
    return next((v.decode("latin-1")[:128] for k, v in headers if k == name), None)


def _query(target: Target) -> str:
    return f"?{target.query}" if target.query else ""


def _limits_path(settings: Settings) -> Path | None:
    """Where the tenants' counts are kept: beside the learner's state, when it is kept."""
    path = settings.learner_state_path
    return None if path is None else path.with_name(path.stem + ".limits.json")


def _save_limits(limits: TenantLimits, state: dict[str, Any]) -> None:
    try:
        limits.save(state)
    except OSError as exc:
        logger.warning("cannot save the tenants' counts to %s: %s", limits.state_path, exc)


async def _save_limits_periodically(limits: TenantLimits, interval_s: float) -> None:
    """The counts, every ``interval_s``: taken on the loop, written from a thread (fsync)."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(_save_limits, limits, await limits.state())


async def _save_limits_at_stop(limits: TenantLimits) -> None:
    if limits.state_path is not None:
        _save_limits(limits, await limits.state())


async def _check_upstream_at_start(upstream: Upstream, wait_s: float) -> None:
    """Start anyway, but say at once when the backend cannot be reached, and why if it can tell: a
    misconfigured scheme is an error; anything else is waited for (``backend_wait_s`` a request)."""
    problem = await upstream.probe(timeout_s=5.0)
    if problem is None:
        return
    hint = await upstream.diagnose()
    if hint is not None:
        logger.error("the backend at %s does not answer its health check: %s (%s)", upstream.display_url, hint, problem)
        return
    logger.warning(
        "the backend at %s is not ready (%s); each request waits up to %g s (backend_wait_s) for it",
        upstream.display_url, problem, wait_s,
    )  # fmt: skip


def _model_named(body: bytes) -> str | None:
    """The model a pass-through body names (``model``, or Ollama's older ``name``), if it is a JSON object."""
    if not body.startswith(b"{") or len(body) > MODEL_SNIFF_MAX_BYTES:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    model = parsed.get("model") or parsed.get("name") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None
