"""The proxy's ASGI app: lifespan wiring and thin routes.

Scheduled endpoints (scored, queued, dispatched serially): POST /v1/chat/completions,
/v1/completions, /api/chat, /api/generate. The proxy's own endpoints: GET /healthz, /readyz,
/metrics, /queue, /queue/{request_id}, and the live page /ui. Every other path and method passes through to the
backend, streamed, unqueued. With a pool of backends (proxy/pool.py), a scheduled request's backend is chosen
at dispatch; a pass-through one goes to a backend serving the model its body names, and the model
listings are merged. In front of everything, ``AccessControl`` (proxy/access.py): API keys and the
pass-through allowlist.

The scheduled and pass-through requests are served as raw ASGI by ``ProxyApp`` (no request
object, no routing table, no exception middleware: measured, docs/benchmarks.md section 6);
FastAPI keeps the lifespan and the proxy's own endpoints, where its conveniences cost nothing
that matters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as ApiRequest
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from clairvoyant.clock import Clock, MonotonicClock
from clairvoyant.config import Settings
from clairvoyant.errors import BadRequest, PayloadTooLarge, QueueFull, RequestError
from clairvoyant.logs import log_request
from clairvoyant.metrics import CONTENT_TYPE_LATEST, Metrics
from clairvoyant.prediction.dialects import (
    SCHEDULED_ENDPOINTS,
    dialect_of_path,
    error_body,
    parse_request,
    with_upstream_fields,
)
from clairvoyant.prediction.encoder import EncoderModel, Refiner, encoder_for
from clairvoyant.prediction.predictor import OnnxPredictor, Predictor
from clairvoyant.proxy.access import AccessControl, Denied, Identity
from clairvoyant.proxy.connection import ASGI, NATIVE, HttpConnection, Request
from clairvoyant.proxy.feedback import OnlineLearning
from clairvoyant.proxy.parking import ParkingLot
from clairvoyant.proxy.pool import BackendPool
from clairvoyant.proxy.responses import (
    AtOnceExchange,
    MergedListing,
    Passthrough,
    Relay,
    ScheduledExchange,
    Scheduling,
    UpstreamRequest,
    error_headers,
)
from clairvoyant.proxy.upstream import Upstream, forwardable_headers
from clairvoyant.scheduling.boost import bucket_for
from clairvoyant.scheduling.dispatcher import Dispatcher, Ticket
from clairvoyant.scheduling.policy import PolicyParams, build_queue, make_policy
from clairvoyant.scheduling.service_time import ServiceTimeModel
from clairvoyant.scheduling.slowdown import AdaptiveSlowdown

__all__ = ["ProxyApp", "create_app"]

logger = logging.getLogger(__name__)

UI_DIR = Path(__file__).with_name("ui")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_REJECTION_REASONS = {BadRequest: "bad_request", PayloadTooLarge: "too_large", QueueFull: "queue_full"}
PASSTHROUGH_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_OWN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/queue"})
_JSON_HEADERS = [(b"content-type", b"application/json")]
_ALLOW = ", ".join(sorted(PASSTHROUGH_METHODS)).encode()
MODEL_LISTINGS = frozenset({"/api/tags", "/v1/models"})  # merged across a pool
MODEL_SNIFF_MAX_BYTES = 64 * 1024  # a pass-through body larger than this is not searched for its model
# Header blocks and Authorization values a waiting request forwards, shared by the requests that
# carry the same one (a client sends the same headers and key with every request: ~200 bytes a
# waiting request from the OpenAI SDK). Bounded: cleared when full, so a client varying its headers
# costs nothing lasting; a key stays no longer than that (the process holds it anyway meanwhile).
_HEADER_BLOCKS: dict[bytes, bytes] = {}
_HEADER_BLOCKS_MAX = 1024
# Headers whose value is new with every request (distributed tracing, idempotency keys): a waiting
# request keeps their lines apart, so that the rest of its block is still the one shared with the
# client's other requests. One traceparent each made every block unique: 1,422 bytes a waiting
# request from the OpenAI SDK instead of ~1,000 (docs/benchmarks.md section 24).
_PER_REQUEST_HEADER = re.compile(
    rb"(?:^|\n)(?:traceparent|tracestate|baggage|sentry-trace|b3|x-b3-[a-z]+|x-amzn-trace-id|x-cloud-trace-context"
    rb"|uber-trace-id|x-datadog-[a-z-]+|idempotency-key|x-correlation-id):"
)


@dataclass
class ProxyState:
    """Everything the routes need; built by the lifespan, closed in reverse order."""

    settings: Settings
    predictor: Predictor
    pool: BackendPool
    dispatcher: Dispatcher
    metrics: Metrics
    learning: OnlineLearning  # its recorder is the relay's on_usage: metrics and the online learner
    scheduling: Scheduling  # what every scheduled exchange shares
    parking: ParkingLot[ScheduledExchange] | None  # where waiting requests' connections wait (None: kept live)
    refiner: Refiner | None = None  # the encoder's second opinion for waiting requests (None: off)

    # The request headers that are the proxy's own (request id, tenant, priority): read, not forwarded.
    own_headers: tuple[bytes, bytes, bytes] = field(init=False)

    def __post_init__(self) -> None:
        settings = self.settings
        self.own_headers = (
            b"x-request-id",
            settings.tenant_header.lower().encode(),
            settings.priority_header.lower().encode(),
        )


def _load_encoder(settings: Settings, predictor: Predictor) -> EncoderModel | None:
    """The encoder that refines waiting requests (``prediction/encoder.py``), when it applies: it
    refines a regressor's log tokens, so a class model (``--preset paper``) or a test double runs
    without it. A broken encoder fails start-up, like a broken predictor."""
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
        name: metrics.encoder_requests.labels(name)
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
        return False if ticket.dispatched_s is not None else None  # a withdrawn one says nothing of the encoder's pace

    refiner = Refiner(
        encoder, deliver, max_pending=settings.encoder_max_pending,
        observe_seconds=metrics.encoder_latency.observe, count=lambda outcome: outcomes[outcome].inc(),
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
    upstream_transport: Any = None,  # an httpx transport (tests; see proxy/upstream.py)
) -> ProxyApp:
    """Build the proxy (served by ``server.build_server``). ``predictor``, ``clock`` and ``upstream_transport`` are for tests."""
    metrics = Metrics()
    clock = clock or MonotonicClock()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A model that fails to load fails start-up: there is no silent fallback predictor.
        loaded = predictor if predictor is not None else OnnxPredictor(settings.model_path)
        pool = BackendPool(settings, transport=upstream_transport)
        await pool.discover()  # a pool's kinds and llama.cpp slots, before the dispatcher counts slots
        policy = make_policy(
            settings.policy,
            PolicyParams(settings.boost_gamma_per_s, settings.boost_auto_gamma, settings.boost_max_s),
        )
        encoder = _load_encoder(settings, loaded)
        learning = OnlineLearning(settings, loaded, metrics, encoder)
        await learning.start()
        slowdown: float | AdaptiveSlowdown = settings.starvation_slowdown
        if settings.starvation_slowdown_adaptive:
            slowdown = AdaptiveSlowdown(settings.starvation_slowdown)
        queue = build_queue(
            policy,
            starvation_timeout_s=settings.starvation_timeout_s,
            starvation_slowdown=slowdown,
            fair_share=settings.fair_share,
            tenant_weights={key.tenant: key.weight for key in settings.api_keys},
        )
        service_time = ServiceTimeModel(path=settings.service_time_path)
        service_time.load()
        dispatcher = Dispatcher(
            queue, policy, backends=pool.scheduling_backends(), clock=clock, metrics=metrics, max_queue=settings.max_queue,
            service_time=service_time, min_retry_after_s=settings.retry_after_s,
            starvation_timeout_s=settings.starvation_timeout_s, starvation_slowdown=slowdown,
        )  # fmt: skip
        await dispatcher.start()
        pool.start(dispatcher)
        refiner = None if encoder is None else _start_refiner(settings, loaded, encoder, dispatcher, metrics)
        if settings.online_learning:  # the learner's encoder pass for requests that never waited
            learning.recorder.refiner = refiner
        scheduling = Scheduling(
            pool, metrics, dispatcher, settings.disconnect_mode, settings.backend_wait_s,
            learning.recorder, settings.vllm_priority,
        )  # fmt: skip
        parking = ParkingLot(asyncio.get_running_loop(), _parked_client_left) if settings.park_waiting else None
        if parking is not None and not parking.enabled:
            parking = None
        app.state.proxy = ProxyState(
            settings, loaded, pool, dispatcher, metrics, learning, scheduling, parking, refiner
        )
        logger.info(
            "clairvoyant ready: backends=%s policy=%s tau=%ss+%sxS slots=%d max_queue=%d disconnect_mode=%s",
            ", ".join(f"{m.name}={m.upstream.display_url} ({m.kind}, {m.slots} slots)" for m in pool.members),
            settings.policy,
            settings.starvation_timeout_s,
            settings.starvation_slowdown,
            dispatcher.slots,
            settings.max_queue,
            settings.disconnect_mode,
        )
        for member in pool.members:
            dispatcher.run_detached(_check_upstream_at_start(member.upstream), name=f"upstream-check-{member.name}")
        try:
            yield
        finally:
            if parking is not None:
                parking.close()
            if refiner is not None:
                refiner.stop()
            await dispatcher.stop(settings.shutdown_grace_s)  # in-flight answers get the grace period, no more
            await learning.stop()  # after the drain: the last requests are learned, then saved
            await pool.aclose()

    app = FastAPI(title="clairvoyant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics

    @app.exception_handler(Exception)
    async def unexpected_error(request: ApiRequest, exc: Exception) -> Response:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        log_request({"method": request.method, "path": request.url.path, "status": 500, "outcome": "internal_error"})
        return _error_response(request.url.path, RequestError("internal error in the proxy"), metrics)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: ApiRequest) -> Response:
        """Ready while the model is loaded, the dispatcher runs and at least one backend is ready;
        ``backends`` says which."""
        state: ProxyState = request.app.state.proxy
        checks: dict[str, Any] = {"model_loaded": state.predictor is not None, "dispatcher": state.dispatcher.healthy}
        problems = await asyncio.gather(*(m.upstream.probe() for m in state.pool.members))
        checks["backends"] = {m.name: problem is None for m, problem in zip(state.pool.members, problems, strict=True)}
        checks["upstream"] = any(problem is None for problem in problems)
        for member, problem in zip(state.pool.members, problems, strict=True):
            if problem is not None:
                logger.info("readiness: backend %s: %s", member.name, problem)
        if not checks["upstream"]:
            checks["upstream_error"] = "no backend is ready"  # the details (addresses) stay in the log
        ready = checks["model_loaded"] and checks["dispatcher"] and checks["upstream"]
        return JSONResponse({"status": "ready" if ready else "not_ready", **checks}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint(request: ApiRequest) -> Response:
        state: ProxyState = request.app.state.proxy
        await state.learning.refresh_quality()
        metrics.parked_connections.set(len(state.parking) if state.parking is not None else 0)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/queue")
    async def queue_endpoint(request: ApiRequest, limit: int | None = None) -> Response:
        """``limit``: list only the first waiting requests (the live page asks for 100; the
        counts and the tail's ETA still cover the whole queue)."""
        dispatcher: Dispatcher = request.app.state.proxy.dispatcher
        # JSONResponse directly: FastAPI's encoder walks every value, slow for thousands waiting.
        return JSONResponse(dispatcher.snapshot(limit))

    @app.get("/queue/{request_id}")
    async def queue_position(request: ApiRequest, request_id: str) -> Response:
        """Where one waiting request stands: position in dispatch order and ETA in seconds."""
        dispatcher: Dispatcher = request.app.state.proxy.dispatcher
        ticket = dispatcher.waiting_ticket(request_id)
        where = None if ticket is None else dispatcher.where(ticket)
        if ticket is None or where is None:
            return JSONResponse({"request_id": request_id, "waiting": False}, status_code=404)
        position, eta_s = where
        return JSONResponse({"request_id": request_id, "waiting": True, "position": position, "eta_s": round(eta_s, 3)})

    @app.get("/ui")
    async def ui_root() -> Response:
        return RedirectResponse("/ui/")

    # The live queue page: static files in the package, no build step, no CDN.
    app.mount("/ui/", StaticFiles(directory=UI_DIR, html=True), name="ui")
    return ProxyApp(app, AccessControl(app, settings), metrics)


def _parked_client_left(exchange: ScheduledExchange) -> None:
    """The parking lot saw a waiting request's client leave."""
    exchange.client_left()


class ProxyApp:
    """What the proxy's connections serve (``connection.Site``). A POST to a scheduled endpoint is
    scheduled; any other path with a pass-through method is relayed to the backend; both are
    served here, with no ASGI in between (``serve``). The proxy's own GET endpoints and the
    lifespan are FastAPI's, behind access control (``asgi``)."""

    def __init__(self, api: FastAPI, access: AccessControl, metrics: Metrics) -> None:
        self.api = api
        self.access = access
        self.asgi = access  # the ASGI app: access control in front of FastAPI (own endpoints, lifespan)
        self.state = api.state  # ``proxy`` (a ProxyState) once the lifespan has run; ``metrics``
        self.metrics = metrics

    @property
    def parking(self) -> ParkingLot[ScheduledExchange] | None:
        proxy: ProxyState | None = getattr(self.state, "proxy", None)
        return None if proxy is None else proxy.parking

    def route(self, method: str, path: str) -> int:
        if method in PASSTHROUGH_METHODS and _is_own_endpoint(method, path):
            return ASGI
        return NATIVE

    def serve(self, conn: HttpConnection, request: Request) -> None:
        method = request.method
        path = request.path
        try:
            identity, headers = self.access.admit(method, path, request.headers)
        except Denied as denied:
            _log_rejection(request, None, denied.error.status_code, denied.outcome)
            self._send_error(conn, path, denied.error)
            return
        try:
            if method == "POST" and path in SCHEDULED_ENDPOINTS:
                _scheduled(self.state.proxy, identity, headers, conn, request)
            elif method in PASSTHROUGH_METHODS:
                _passthrough(self.state.proxy, headers, conn, request)
            else:
                body = b'{"detail":"Method Not Allowed"}'
                conn.respond(405, [*_JSON_HEADERS, (b"allow", _ALLOW)], body)
        except RequestError as exc:
            reason = next((r for cls, r in _REJECTION_REASONS.items() if isinstance(exc, cls)), None)
            if reason is not None:
                self.metrics.rejections_by_reason[reason].inc()
            _log_rejection(request, identity, exc.status_code, exc.code or "error")
            self._send_error(conn, path, exc)

    def upload_lost(self, request: Request) -> None:
        """Nobody to answer: counted and logged once, no traceback."""
        path = request.path
        self.metrics.disconnects_by_stage["upload"].inc()
        self.metrics.count_request(_endpoint_label(path), dialect_of_path(path).value, "client_closed")
        _log_rejection(request, self._identity(request), "client_closed", "client_left_uploading")

    def too_large(self, request: Request, error: RequestError) -> None:
        self.metrics.rejections_by_reason["too_large"].inc()
        _log_rejection(request, self._identity(request), error.status_code, error.code or "error")
        path = request.path
        self.metrics.count_request(_endpoint_label(path), dialect_of_path(path).value, str(error.status_code))

    def _identity(self, request: Request) -> Identity | None:
        """Whose request it is, for its log line (None: keys off, or none valid)."""
        try:
            return self.access.admit(request.method, request.path, request.headers)[0]
        except Denied:
            return None

    def _send_error(self, conn: HttpConnection, path: str, exc: RequestError) -> None:
        dialect = dialect_of_path(path)
        self.metrics.count_request(_endpoint_label(path), dialect.value, str(exc.status_code))
        conn.respond(exc.status_code, error_headers(exc), error_body(dialect, exc))


def _is_own_endpoint(method: str, path: str) -> bool:
    """The proxy's own GET (and HEAD) endpoints: /healthz /readyz /metrics /queue /queue/{id} /ui."""
    if method != "GET" and method != "HEAD":
        return False
    if path in _OWN_PATHS or path == "/ui" or path.startswith("/ui/"):
        return True
    return path.startswith("/queue/") and len(path) > 7 and "/" not in path[7:]


async def _check_upstream_at_start(upstream: Upstream) -> None:
    """Start anyway, but say so when the backend cannot be reached (requests will wait for it)."""
    try:
        problem = await upstream.probe(timeout_s=5.0)
    except Exception as exc:  # a background check must never fail loudly
        problem = repr(exc)
    if problem is not None:
        logger.warning(
            "the backend at %s is not ready yet (%s); requests will wait for it", upstream.display_url, problem
        )


def _log_rejection(request: Request, identity: Identity | None, status: int | str, outcome: str) -> None:
    """The request line of an answer the proxy gave itself (it never reached the queue or the backend)."""
    request_id = next((v.decode("latin-1") for k, v in request.headers if k == b"x-request-id"), "-")
    log_request({
        "request_id": request_id, "method": request.method, "path": request.path,
        "tenant": identity.tenant if identity is not None else "-", "status": status, "outcome": outcome,
    })  # fmt: skip


def _endpoint_label(path: str) -> str:
    return path if path in SCHEDULED_ENDPOINTS else "passthrough"


def _error_response(path: str, exc: RequestError, metrics: Metrics) -> Response:
    dialect = dialect_of_path(path)
    metrics.count_request(_endpoint_label(path), dialect.value, str(exc.status_code))
    return Response(
        error_body(dialect, exc), status_code=exc.status_code, headers=exc.headers, media_type="application/json"
    )


class _Head:
    """The request headers the proxy reads, found in one pass; ``forward`` is every end-to-end
    header (``upstream.forwardable_headers``) as header lines, less the proxy's own (the tenant
    header may carry an identity) and the Authorization (``authorization``)."""

    __slots__ = ("request_id", "tenant", "priority", "forward", "authorization")

    def __init__(self, headers: list[tuple[bytes, bytes]], own: tuple[bytes, bytes, bytes] | None) -> None:
        """``own``: the proxy's own header names (request id, tenant, priority), or None to keep them."""
        self.forward, self.authorization, dropped = forwardable_headers(headers, own or ())
        self.request_id = self.tenant = ""
        self.priority: str | None = None
        if dropped and own is not None:
            self.request_id = dropped.get(b"x-request-id", b"").decode("latin-1")
            self.tenant = dropped.get(own[1], b"").decode("latin-1")
            priority = dropped.get(own[2])
            self.priority = None if priority is None else priority.decode("latin-1")


def _shared_header_block(block: bytes) -> bytes:
    """``block`` (header lines or an Authorization value), or an equal one already held (see
    ``_HEADER_BLOCKS``)."""
    shared = _HEADER_BLOCKS.get(block)
    if shared is None:
        if len(_HEADER_BLOCKS) >= _HEADER_BLOCKS_MAX:
            _HEADER_BLOCKS.clear()
        shared = _HEADER_BLOCKS[block] = block
    return shared


def _split_per_request(block: bytes) -> tuple[bytes, bytes]:
    """``block``'s header lines as (the shared rest, the lines of headers new with every request:
    ``_PER_REQUEST_HEADER``), each in its original order; (``block``, b"") when it has none."""
    if _PER_REQUEST_HEADER.search(block) is None:
        return block, b""
    shared: list[bytes] = []
    own: list[bytes] = []
    for line in block.split(b"\r\n")[:-1]:  # every line ends with CRLF
        (own if _PER_REQUEST_HEADER.match(line) else shared).append(line + b"\r\n")
    return b"".join(shared), b"".join(own)


def _clamped_priority(header: str | None, given: int | None, settings: Settings, identity: Identity | None) -> int:
    """The body's priority, else the header's, else 0; clamped to [min_priority, max_priority]
    (the API key's range when the request came with one)."""
    if given is None and header is not None:
        try:
            given = int(header.strip())
        except ValueError:
            raise BadRequest(f"header {settings.priority_header} must be an integer") from None
    value = 0 if given is None else given
    if identity is None:
        return max(settings.min_priority, min(settings.max_priority, value))
    return max(identity.min_priority, min(identity.max_priority, value))


def _scheduled(
    state: ProxyState,
    identity: Identity | None,
    headers: list[tuple[bytes, bytes]],
    conn: HttpConnection,
    request: Request,
) -> None:
    """Parse, predict and queue (or dispatch at once) a scheduled request admitted with
    ``identity`` and ``headers`` (``AccessControl.admit``); its exchange answers it when it is
    granted a slot. Raises ``RequestError`` for what is refused at once."""
    settings = state.settings
    dispatcher = state.dispatcher
    arrival_s = dispatcher.clock.now()
    endpoint = SCHEDULED_ENDPOINTS[request.path]
    head = _Head(headers, state.own_headers)
    given_id = head.request_id if _REQUEST_ID_RE.match(head.request_id) else ""  # "": made from its seq
    parsed = parse_request(endpoint, request.body, keep_priority=settings.forward_priority)

    forward_body = parsed.forward_body
    bench_fields = parsed.proxy_options.get("upstream")
    if settings.bench_upstream_fields and isinstance(bench_fields, dict):
        forward_body = with_upstream_fields(forward_body, bench_fields)  # the prediction never sees these
    prompt_tokens = parsed.prompt.context_chars // 4  # ~4 characters a token until usage says better
    ticket = Ticket(
        given_id, endpoint.path, endpoint.dialect.value, parsed.model, None, prompt_tokens, arrival_s,
        cap_tokens=parsed.cap_tokens,
        priority=_clamped_priority(head.priority, parsed.priority, settings, identity),
        tenant=identity.tenant if identity is not None else head.tenant[:128],
    )  # fmt: skip
    if settings.log_prompts:
        logger.debug("request_id=%s prompt=%r", ticket.request_id, parsed.prompt.instruction[:2000])

    def predict() -> None:
        """The prediction, into the ticket (its queue key, predicted tokens and seconds)."""
        started = time.perf_counter()
        prediction = state.predictor.predict(parsed.prompt, model=parsed.model, cap_tokens=parsed.cap_tokens)
        state.metrics.predictor_latency.observe(time.perf_counter() - started)
        score = prediction.score
        predicted_tokens = prediction.predicted_tokens
        oracle = parsed.proxy_options.get("output_tokens")
        if settings.allow_oracle and isinstance(oracle, (int, float)) and not isinstance(oracle, bool):
            score = predicted_tokens = float(oracle)  # benchmark-only: the true length, the ideal ordering
            if parsed.cap_tokens is not None:  # the predictor applied the cap itself; the oracle must too
                predicted_tokens = min(predicted_tokens, float(parsed.cap_tokens))
        ticket.prediction = prediction
        ticket.score = score
        ticket.predicted_tokens = predicted_tokens
        ticket.predicted_s = predicted_s = dispatcher.predicted_s(parsed.model, prompt_tokens, predicted_tokens)
        ticket.bucket = bucket_for(predicted_s)

    # A free slot and nobody waiting: there is no order to decide, so the request goes now and is
    # predicted while the backend works (the prediction still feeds the learner and the metrics).
    if dispatcher.dispatch_at_once(ticket):

        def predict_later() -> None:
            charged_s = ticket.predicted_s  # the default its tenant was charged at dispatch
            predict()
            dispatcher.predicted_at_once(ticket, charged_s)

        AtOnceExchange(
            state.scheduling, ticket, conn, headers=head.forward, body=forward_body, query=request.query.decode("latin-1"),
            authorization=head.authorization, stream=parsed.stream,
        ).start(predict_later)  # fmt: skip
        return
    predict()
    # It waits without its feature row (0.2 KB of 1 KB): the learner re-derives the row from the
    # body after completion (feedback.UsageRecorder), and the encoder's queue keeps it until then.
    prediction = ticket.prediction
    assert prediction is not None
    row = prediction.feature_row
    ticket.prediction = replace(prediction, feature_row=b"")
    dispatcher.submit(ticket)
    refiner = state.refiner
    if (
        refiner is not None
        and ticket.waiting
        and not (settings.allow_oracle and "output_tokens" in parsed.proxy_options)
    ):
        refiner.want(  # plain reads, from its thread
            (ticket, row), parsed.prompt.instruction, lambda: ticket.waiting, lambda: ticket.dispatched_s is not None
        )
    shared_headers, per_request_headers = _split_per_request(head.forward)
    ScheduledExchange(
        state.scheduling, ticket, conn, headers=_shared_header_block(shared_headers),
        per_request_headers=per_request_headers, body=forward_body, query=request.query.decode("latin-1"),
        stream=parsed.stream,
        authorization=None if head.authorization is None else _shared_header_block(head.authorization),
    ).wait(state.parking)  # fmt: skip


def _passthrough(state: ProxyState, headers: list[tuple[bytes, bytes]], conn: HttpConnection, request: Request) -> None:
    """Relay a pass-through request admitted with ``headers`` (``AccessControl.admit``)."""
    head = _Head(headers, None)
    body = request.body
    path = request.path
    pool = state.pool
    upstream_request = UpstreamRequest(
        request.method, path, request.query.decode("latin-1"), head.forward, body, dialect_of_path(path),
        authorization=head.authorization,
    )  # fmt: skip
    if len(pool) == 1:
        relay = Relay(pool.first, upstream_request, state.metrics, backend_wait_s=state.settings.backend_wait_s)
        Passthrough(relay, conn).start()
        return
    if request.method == "GET" and path in MODEL_LISTINGS:
        MergedListing(pool, upstream_request, state.metrics, conn).start()
        return
    # A pool: to a backend serving the model the body names (Ollama's show, embeddings), or to the
    # first healthy backend; a refused connection tries the next.
    order = pool.passthrough_order(_model_named(body))
    tried: list[Upstream] = []

    async def failover(refused: Upstream) -> Upstream | None:
        pool.refused(refused)
        tried.append(refused)
        return next((u for u in order if u not in tried), None)

    relay = Relay(
        order[0], upstream_request, state.metrics, backend_wait_s=state.settings.backend_wait_s,
        failover=failover, on_answered=pool.answered, on_broken=pool.broken,
    )  # fmt: skip
    Passthrough(relay, conn).start()


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
