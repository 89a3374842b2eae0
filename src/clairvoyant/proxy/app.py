"""The FastAPI app: lifespan wiring and thin routes.

Scheduled endpoints (scored, queued, dispatched serially): POST /v1/chat/completions,
/v1/completions, /api/chat, /api/generate. The proxy's own endpoints: GET /healthz, /readyz,
/metrics, /queue, /queue/{request_id}. Every other path and method passes through to the backend, streamed, unqueued.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from clairvoyant.clock import Clock, MonotonicClock
from clairvoyant.config import Settings
from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, dialect_of_path, error_body, parse_request, with_upstream_fields
from clairvoyant.scheduling.dispatcher import Dispatcher, Ticket
from clairvoyant.errors import BadRequest, ClientGone, PayloadTooLarge, QueueFull, RequestError
from clairvoyant.proxy.feedback import OnlineLearning
from clairvoyant.scheduling.job_queue import Job
from clairvoyant.metrics import CONTENT_TYPE_LATEST, Metrics
from clairvoyant.scheduling.policy import PolicyParams, build_queue, make_policy
from clairvoyant.prediction.predictor import OnnxPredictor, Prediction, Predictor
from clairvoyant.proxy.responses import PassthroughResponse, Relay, ScheduledResponse, UpstreamRequest
from clairvoyant.scheduling.boost import bucket_for
from clairvoyant.scheduling.service_time import ServiceTimeModel
from clairvoyant.scheduling.slowdown import AdaptiveSlowdown
from clairvoyant.proxy.upstream import Upstream

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_REJECTION_REASONS = {BadRequest: "bad_request", PayloadTooLarge: "too_large", QueueFull: "queue_full"}
PASSTHROUGH_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@dataclass
class ProxyState:
    """Everything the routes need; built by the lifespan, closed in reverse order."""

    settings: Settings
    predictor: Predictor
    upstream: Upstream
    dispatcher: Dispatcher
    metrics: Metrics
    learning: OnlineLearning  # its recorder is the relay's on_usage: metrics and the online learner


def create_app(
    settings: Settings,
    *,
    predictor: Predictor | None = None,
    clock: Clock | None = None,
    upstream_transport: Any = None,  # an httpx transport (tests; see proxy/upstream.py)
) -> FastAPI:
    """Build the proxy app. ``predictor``, ``clock`` and ``upstream_transport`` are for tests."""
    metrics = Metrics()
    clock = clock or MonotonicClock()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A model that fails to load fails start-up: there is no silent fallback predictor.
        loaded = predictor if predictor is not None else OnnxPredictor(settings.model_path)
        upstream = Upstream(
            settings.upstream_url,
            connect_timeout_s=settings.connect_timeout_s,
            read_timeout_s=settings.read_timeout_s,
            first_byte_timeout_s=settings.first_byte_timeout_s,
            transport=upstream_transport,
        )
        policy = make_policy(
            settings.policy,
            PolicyParams(settings.boost_gamma_per_s, settings.boost_auto_gamma, settings.boost_max_s),
        )
        learning = OnlineLearning(settings, loaded, metrics)
        await learning.start()
        slowdown: float | AdaptiveSlowdown = settings.starvation_slowdown
        if settings.starvation_slowdown_adaptive:
            slowdown = AdaptiveSlowdown(settings.starvation_slowdown)
        queue = build_queue(
            policy,
            starvation_timeout_s=settings.starvation_timeout_s,
            starvation_slowdown=slowdown,
            fair_share=settings.fair_share,
        )
        service_time = ServiceTimeModel(path=settings.service_time_path)
        service_time.load()
        dispatcher = Dispatcher(
            queue, policy, slots=settings.slots, clock=clock, metrics=metrics, max_queue=settings.max_queue,
            service_time=service_time, min_retry_after_s=settings.retry_after_s,
            starvation_timeout_s=settings.starvation_timeout_s, starvation_slowdown=slowdown,
        )  # fmt: skip
        await dispatcher.start()
        app.state.proxy = ProxyState(settings, loaded, upstream, dispatcher, metrics, learning)
        logger.info(
            "clairvoyant ready: upstream=%s policy=%s tau=%ss+%sxS slots=%d max_queue=%d disconnect_mode=%s",
            upstream.display_url, settings.policy, settings.starvation_timeout_s, settings.starvation_slowdown, settings.slots,
            settings.max_queue, settings.disconnect_mode,
        )
        dispatcher.run_detached(_check_upstream_at_start(upstream), name="upstream-check")
        try:
            yield
        finally:
            await dispatcher.stop()
            await learning.stop()  # after the drain: the last requests are learned, then saved
            await upstream.aclose()

    app = FastAPI(
        title="clairvoyant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.metrics = metrics

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> Response:
        if isinstance(exc, ClientGone):  # nobody to answer: counted and logged once, no traceback
            metrics.disconnects_by_stage["upload"].inc()
            metrics.count_request(_endpoint_label(request.url.path), dialect_of_path(request.url.path).value, "client_closed")
            logger.info("client left during its upload: %s %s", request.method, request.url.path)
            return Response(status_code=exc.status_code)
        reason = next((r for cls, r in _REJECTION_REASONS.items() if isinstance(exc, cls)), None)
        if reason is not None:
            metrics.rejections_by_reason[reason].inc()
        return _error_response(request, exc, metrics)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error_response(request, RequestError("internal error in the proxy"), metrics)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        state: ProxyState = request.app.state.proxy
        checks: dict[str, Any] = {"model_loaded": state.predictor is not None, "dispatcher": state.dispatcher.healthy}
        problem = await state.upstream.probe()
        checks["upstream"] = problem is None
        if problem is not None:
            checks["upstream_error"] = "the backend is not ready"  # the detail (its address) stays in the log
            logger.info("readiness: %s", problem)
        ready = checks["model_loaded"] and checks["dispatcher"] and checks["upstream"]
        return JSONResponse({"status": "ready" if ready else "not_ready", **checks}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        await request.app.state.proxy.learning.refresh_quality()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/queue")
    async def queue_endpoint(request: Request) -> dict[str, Any]:
        return request.app.state.proxy.dispatcher.snapshot()

    @app.get("/queue/{request_id}")
    async def queue_position(request: Request, request_id: str) -> Response:
        """Where one waiting request stands: position in dispatch order and ETA in seconds."""
        dispatcher: Dispatcher = request.app.state.proxy.dispatcher
        ticket = dispatcher.waiting_ticket(request_id)
        where = None if ticket is None else dispatcher.where(ticket)
        if ticket is None or where is None:
            return JSONResponse({"request_id": request_id, "waiting": False}, status_code=404)
        position, eta_s = where
        return JSONResponse({"request_id": request_id, "waiting": True, "position": position, "eta_s": round(eta_s, 3)})

    for path in SCHEDULED_ENDPOINTS:
        app.add_api_route(path, _scheduled, methods=["POST"], include_in_schema=False)
    app.add_api_route("/{path:path}", _passthrough, methods=PASSTHROUGH_METHODS, include_in_schema=False)
    return app


async def _check_upstream_at_start(upstream: Upstream) -> None:
    """Start anyway, but say so when the backend cannot be reached (requests will wait for it)."""
    try:
        problem = await upstream.probe(timeout_s=5.0)
    except Exception as exc:  # a background check must never fail loudly
        problem = repr(exc)
    if problem is not None:
        logger.warning("the backend at %s is not ready yet (%s); requests will wait for it", upstream.display_url, problem)


def _endpoint_label(path: str) -> str:
    return path if path in SCHEDULED_ENDPOINTS else "passthrough"


def _error_response(request: Request, exc: RequestError, metrics: Metrics) -> Response:
    path = request.url.path
    dialect = dialect_of_path(path)
    metrics.count_request(_endpoint_label(path), dialect.value, str(exc.status_code))
    return Response(
        error_body(dialect, exc), status_code=exc.status_code, headers=exc.headers, media_type="application/json"
    )


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body, or ``PayloadTooLarge``; ``ClientGone`` when the client closes mid-upload.
    (A client that stalls is cut off by the server's body timeout, which ends here as ``ClientGone``.)"""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    except ClientDisconnect:
        raise ClientGone("the client closed the connection before sending its whole request") from None
    return bytes(body)


def _request_id(request: Request, dispatcher: Dispatcher) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID_RE.match(given) else dispatcher.new_request_id()


def _forward_headers(request: Request, request_id: str, settings: Settings) -> list[tuple[str, str]]:
    # The proxy's own headers stay here (the tenant header may carry an identity); the request id goes on.
    own = {"x-request-id", settings.tenant_header.lower(), settings.priority_header.lower()}
    headers = [(k, v) for k, v in request.headers.items() if k not in own]
    headers.append(("x-request-id", request_id))
    return headers


def _clamped_priority(request: Request, given: int | None, settings: Settings) -> int:
    """The body's priority, else the header's, else 0; clamped to [min_priority, max_priority]."""
    if given is None:
        header = request.headers.get(settings.priority_header)
        if header is not None:
            try:
                given = int(header.strip())
            except ValueError:
                raise BadRequest(f"header {settings.priority_header} must be an integer") from None
    value = 0 if given is None else given
    return max(settings.min_priority, min(settings.max_priority, value))


async def _scheduled(request: Request) -> ScheduledResponse:
    state: ProxyState = request.app.state.proxy
    settings = state.settings
    dispatcher = state.dispatcher
    arrival_s = dispatcher.clock.now()
    endpoint = SCHEDULED_ENDPOINTS[request.url.path]
    request_id = _request_id(request, dispatcher)
    parsed = parse_request(
        endpoint, await _read_body(request, settings.max_body_bytes), keep_priority=settings.forward_priority
    )

    started = time.perf_counter()
    prediction: Prediction = state.predictor.predict(parsed.prompt, model=parsed.model, cap_tokens=parsed.cap_tokens)
    state.metrics.predictor_latency.observe(time.perf_counter() - started)
    score = prediction.score
    predicted_tokens = prediction.predicted_tokens
    oracle = parsed.proxy_options.get("output_tokens")
    if settings.allow_oracle and isinstance(oracle, (int, float)) and not isinstance(oracle, bool):
        score = predicted_tokens = float(oracle)  # benchmark-only: the true length, the ideal ordering
        if parsed.cap_tokens is not None:  # the predictor applied the cap itself; the oracle must too
            predicted_tokens = min(predicted_tokens, float(parsed.cap_tokens))
    forward_body = parsed.forward_body
    bench_fields = parsed.proxy_options.get("upstream")
    if settings.bench_upstream_fields and isinstance(bench_fields, dict):
        forward_body = with_upstream_fields(forward_body, bench_fields)  # after prediction: never a cap
    if settings.log_prompts:
        logger.debug("request_id=%s prompt=%r", request_id, parsed.prompt.instruction[:2000])

    prompt_tokens = parsed.prompt.context_chars // 4  # ~4 characters a token until usage says better
    predicted_s = dispatcher.predicted_s(parsed.model, prompt_tokens, predicted_tokens)
    ticket = Ticket(
        request_id=request_id,
        endpoint=endpoint.path,
        dialect=endpoint.dialect.value,
        model=parsed.model,
        prediction=prediction,
        prompt_tokens=prompt_tokens,
    )
    job = Job(
        ticket,
        arrival_s,
        score=score,
        predicted_tokens=predicted_tokens,
        predicted_s=predicted_s,
        bucket=bucket_for(predicted_s),
        cap_tokens=parsed.cap_tokens,
        priority=_clamped_priority(request, parsed.priority, settings),
        tenant=request.headers.get(settings.tenant_header, "")[:128],
    )
    dispatcher.submit(ticket, job)
    upstream_request = UpstreamRequest(
        "POST", endpoint.path, request.url.query, _forward_headers(request, request_id, settings), forward_body,
        endpoint.dialect, close_connection=parsed.stream,
    )  # fmt: skip
    return ScheduledResponse(
        upstream=state.upstream,
        request=upstream_request,
        metrics=state.metrics,
        dispatcher=dispatcher,
        ticket=ticket,
        disconnect_mode=settings.disconnect_mode,
        stream=parsed.stream,
        backend_wait_s=settings.backend_wait_s,
        on_usage=state.learning.recorder,
    )


async def _passthrough(request: Request) -> PassthroughResponse:
    state: ProxyState = request.app.state.proxy
    body = await _read_body(request, state.settings.max_body_bytes)
    upstream_request = UpstreamRequest(
        request.method, request.url.path, request.url.query, list(request.headers.items()), body,
        dialect_of_path(request.url.path),
    )  # fmt: skip
    return PassthroughResponse(
        Relay(state.upstream, upstream_request, state.metrics, backend_wait_s=state.settings.backend_wait_s)
    )
