"""The FastAPI app: lifespan wiring and thin routes.

Scheduled endpoints (scored, queued, dispatched serially): POST /v1/chat/completions,
/v1/completions, /api/chat, /api/generate. The proxy's own endpoints: GET /healthz, /readyz,
/metrics, /queue. Every other path and method passes through to the backend, streamed, unqueued.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from clairvoyant.clock import Clock, MonotonicClock
from clairvoyant.config import Settings
from clairvoyant.dialects import SCHEDULED_ENDPOINTS, dialect_of_path, parse_request
from clairvoyant.dispatcher import Dispatcher, Ticket
from clairvoyant.errors import BadRequest, PayloadTooLarge, QueueFull, RequestError
from clairvoyant.feedback import OnlineLearning
from clairvoyant.job_queue import JobQueue
from clairvoyant.metrics import CONTENT_TYPE_LATEST, Metrics
from clairvoyant.policy import make_policy
from clairvoyant.predictor import OnnxPredictor, Prediction, Predictor
from clairvoyant.proxy_response import ProxyResponse, error_body
from clairvoyant.upstream import Upstream

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
    upstream_transport: httpx.AsyncBaseTransport | None = None,
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
            transport=upstream_transport,
        )
        queue: JobQueue[Ticket] = JobQueue(
            make_policy(settings.policy),
            starvation_timeout_s=settings.starvation_timeout_s,
            max_size=settings.max_queue,
            retry_after_s=settings.retry_after_s,
        )
        learning = OnlineLearning(settings, loaded, metrics)
        await learning.start()
        dispatcher = Dispatcher(queue, slots=settings.slots, clock=clock, metrics=metrics)
        await dispatcher.start()
        app.state.proxy = ProxyState(settings, loaded, upstream, dispatcher, metrics, learning)
        logger.info(
            "clairvoyant ready: upstream=%s policy=%s tau=%ss slots=%d max_queue=%d disconnect_mode=%s",
            settings.upstream_url, settings.policy, settings.starvation_timeout_s, settings.slots,
            settings.max_queue, settings.disconnect_mode,
        )
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
        try:
            await state.upstream.get("/", timeout_s=2.0)
            checks["upstream"] = True
        except RequestError as exc:
            checks["upstream"] = False
            checks["upstream_error"] = exc.message
        ready = checks["model_loaded"] and checks["dispatcher"] and checks["upstream"]
        return JSONResponse({"status": "ready" if ready else "not_ready", **checks}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        await request.app.state.proxy.learning.refresh_quality()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/queue")
    async def queue_endpoint(request: Request) -> dict[str, Any]:
        return request.app.state.proxy.dispatcher.snapshot()

    for path in SCHEDULED_ENDPOINTS:
        app.add_api_route(path, _scheduled, methods=["POST"], include_in_schema=False)
    app.add_api_route("/{path:path}", _passthrough, methods=PASSTHROUGH_METHODS, include_in_schema=False)
    return app


def _error_response(request: Request, exc: RequestError, metrics: Metrics) -> Response:
    path = request.url.path
    dialect = dialect_of_path(path)
    endpoint = path if path in SCHEDULED_ENDPOINTS else "passthrough"
    metrics.count_request(endpoint, dialect.value, str(exc.status_code))
    return Response(
        error_body(dialect, exc), status_code=exc.status_code, headers=exc.headers, media_type="application/json"
    )


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def _request_id(request: Request, dispatcher: Dispatcher) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID_RE.match(given) else dispatcher.new_request_id()


def _forward_headers(request: Request, request_id: str) -> list[tuple[str, str]]:
    headers = [(k, v) for k, v in request.headers.items() if k != "x-request-id"]
    headers.append(("x-request-id", request_id))
    return headers


async def _scheduled(request: Request) -> ProxyResponse:
    state: ProxyState = request.app.state.proxy
    arrival_s = state.dispatcher.clock.now()
    endpoint = SCHEDULED_ENDPOINTS[request.url.path]
    request_id = _request_id(request, state.dispatcher)
    parsed = parse_request(endpoint, await _read_body(request, state.settings.max_body_bytes))

    started = time.perf_counter()
    prediction: Prediction = state.predictor.predict(parsed.prompt, model=parsed.model, cap_tokens=parsed.cap_tokens)
    state.metrics.predictor_latency.observe(time.perf_counter() - started)
    score = prediction.score
    oracle = parsed.proxy_options.get("output_tokens")
    if state.settings.allow_oracle and isinstance(oracle, (int, float)) and not isinstance(oracle, bool):
        score = float(oracle)  # benchmark-only: the true length, to measure the ideal ordering
    if state.settings.log_prompts:
        logger.debug("request_id=%s prompt=%r", request_id, parsed.prompt.instruction[:2000])

    ticket = Ticket(
        request_id=request_id,
        endpoint=endpoint.path,
        dialect=endpoint.dialect.value,
        model=parsed.model,
        prediction=prediction,
        score=score,
        arrival_s=arrival_s,
    )
    state.dispatcher.submit(ticket)
    return ProxyResponse(
        upstream=state.upstream,
        method="POST",
        path=endpoint.path,
        query=request.url.query,
        headers=_forward_headers(request, request_id),
        body=parsed.forward_body,
        dialect=endpoint.dialect,
        metrics=state.metrics,
        dispatcher=state.dispatcher,
        ticket=ticket,
        disconnect_mode=state.settings.disconnect_mode,
        on_usage=state.learning.recorder,
    )


async def _passthrough(request: Request) -> ProxyResponse:
    state: ProxyState = request.app.state.proxy
    body = await _read_body(request, state.settings.max_body_bytes)
    return ProxyResponse(
        upstream=state.upstream,
        method=request.method,
        path=request.url.path,
        query=request.url.query,
        headers=list(request.headers.items()),
        body=body,
        dialect=dialect_of_path(request.url.path),
        metrics=state.metrics,
        dispatcher=state.dispatcher,  # owns the task that finishes a relay whose client left
    )

