"""The ASGI responses: a plain relay of the backend's answer, and a scheduled one that waits first.

``Relay`` opens the upstream request and relays status, headers and body as they arrive. It is
shared: ``PassthroughResponse`` runs it directly; ``ScheduledResponse`` runs it inside
``async with dispatcher.lease(ticket)``, so the slot is held for exactly the relay's life and given
back once (the lease is the only place that releases).

Each runs in the server's task for its request. The client's disconnect is watched the whole time
(the proxy's server calls back from its protocol: ``proxy.server.watch_disconnect``; under any
other ASGI server one more task waits for ``receive`` to yield ``http.disconnect``), which may
cancel the request's task:

- while queued: the request's task is cancelled; the lease withdraws the ticket, never sent;
- while the backend generates: ``abort`` cancels the relay (closing the backend connection;
  llama.cpp stops generating) or ``drain`` lets it read the answer into the void to its end, so the
  slot is freed only when the backend really is free. The draining relay runs on in the request's
  task: the server waits for it at shutdown, and the dispatcher interrupts it after the grace period.

Before dispatch a waiting client receives nothing, not even a status line (the status comes from
the backend). It can see where it stands at ``GET /queue/{request_id}`` (position and ETA; the id is
its ``X-Request-Id`` header or the one the proxy assigns). At dispatch the response headers carry
``X-Clairvoyant-Queue-Position`` (requests dispatched ahead of it while it waited) and the measured wait.

Once the status line is sent it cannot change: a backend failure after that point ends a stream
with one final error event in the dialect's framing, or truncates a plain body.

A scheduled answer that the backend completes (2xx, relayed or drained to its end) is read by a
``UsageTap`` as it passes, without buffering, and its ``Usage`` (what the backend really produced)
goes to the online learner and the service-time model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from starlette.types import Receive, Send

from clairvoyant.errors import RequestError, UpstreamTimeout, UpstreamUnavailable
from clairvoyant.logs import REQUEST_LOG, log_request
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.dialects import Dialect, error_body, stream_error_event, with_upstream_fields
from clairvoyant.prediction.usage import Usage, UsageTap
from clairvoyant.proxy.pool import BackendPool, merge_model_lists
from clairvoyant.proxy.server import unwatch_disconnect, watch_disconnect
from clairvoyant.proxy.upstream import Upstream, UpstreamResponse, response_headers
from clairvoyant.scheduling.dispatcher import Dispatcher, ShuttingDown, Ticket

__all__ = ["MergedListing", "PassthroughResponse", "Relay", "ScheduledResponse", "UpstreamRequest", "error_body"]

logger = logging.getLogger(__name__)

SLOTS_POLL_S = 1.5  # seconds between /slots polls while a left client's slot is held (see ScheduledResponse)
LISTING_TIMEOUT_S = 5.0  # per backend, for a merged model listing
VLLM_CLASS_STRIDE = 100_000  # vLLM priority = client class x this + predicted tokens (capped below it)
HOLD_MAX_S = 600.0  # the longest a left client's slot is held waiting for the backend to go idle


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """What to send to the backend."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    dialect: Dialect
    close_connection: bool = False  # ask the backend to close after answering (streams: see Upstream.open)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@dataclass(eq=False)
class Relay:
    """Open the upstream request and relay its answer to ``send`` (nothing once the client is gone)."""

    upstream: Upstream
    request: UpstreamRequest
    metrics: Metrics
    extra_headers: Callable[[], list[tuple[str, str]]] = lambda: []
    on_first_byte: Callable[[], None] = lambda: None
    # Called once with what the backend produced, when a 2xx answer has fully arrived (None: not read).
    on_usage: Callable[[Usage], None] | None = None
    now: Callable[[], float] = time.monotonic  # seconds; the dispatcher's clock for scheduled requests
    model: str | None = None  # the model the request named (usage falls back to it)
    backend_wait_s: float = 0.0  # seconds a not-yet-sent request waits for a backend that is down
    retry_unavailable: bool = False  # also wait and resend when the backend answers 503 (scheduled requests)
    # The backend refused the connection (nothing was sent): another backend to send it to, or
    # None to wait for this one (up to backend_wait_s).
    failover: Callable[[Upstream], Awaitable[Upstream | None]] | None = None
    on_answered: Callable[[Upstream], None] = lambda upstream: None  # a backend sent a status
    on_broken: Callable[[Upstream], None] = lambda upstream: None  # a backend failed after the request was sent
    status: int | None = None  # sent status, once sent
    outcome: str = "pending"
    client_gone: bool = False
    _content_type: str = field(default="", repr=False)
    _sent_s: float = field(default=0.0, repr=False)  # clock seconds when the request went upstream
    _interrupt_requested: str = field(default="", repr=False)  # the outcome an interrupt ends the relay with

    async def run(self, send: Send) -> None:
        try:
            response = await self._open()
        except RequestError as exc:
            self._count_upstream_error(exc)
            self.outcome = "upstream_error"
            if not self.client_gone:
                await self.send_error(send, exc)
            return
        except asyncio.CancelledError:
            if not self.consume_interrupt():
                raise
            if not self.client_gone:
                await self.send_error(send, ShuttingDown("the proxy is shutting down; retry"))
            return
        try:
            await self._relay_body(response, send)
        finally:
            await response.aclose()

    async def _open(self) -> UpstreamResponse:
        """Open the upstream request. While the backend is down (connection refused) or, for a
        scheduled request, answers 503 (a model loading, its queue full), nothing has been
        generated: wait for its health check, up to ``backend_wait_s`` from the first failure, and
        send again."""
        unavailable_since_s: float | None = None  # our own first 503 (a loading model)
        while True:
            r = self.request  # a failover may rewrite it for its new backend
            if self.client_gone:  # left while we waited for the backend: it never had the request
                self.outcome = "client_left_before_send"
                raise asyncio.CancelledError
            self._sent_s = self.now()
            try:
                response = await self.upstream.open(
                    r.method, r.path, query=r.query, headers=r.headers, body=r.body, close_connection=r.close_connection
                )
            except UpstreamUnavailable as exc:
                if not exc.never_sent:
                    self._count_backend("failed")
                    self.on_broken(self.upstream)
                    raise
                self._count_backend("refused")
                if self.failover is not None:
                    other = await self.failover(self.upstream)
                    if other is not None:
                        logger.info("backend %s refused the connection; sending to %s", self.upstream.name, other.name)
                        self.upstream = other
                        continue
                deadline_s = self.upstream.outage_deadline_s(self.backend_wait_s)
                if time.monotonic() >= deadline_s or not await self.upstream.wait_until_ready(
                    deadline_s, lambda: self.client_gone
                ):
                    if self.client_gone:
                        continue
                    raise
                continue
            except RequestError:
                self._count_backend("failed")
                self.on_broken(self.upstream)
                raise
            self._count_backend("answered")
            self.on_answered(self.upstream)
            if response.status_code != 503 or not self.retry_unavailable:
                return response
            unavailable_since_s = unavailable_since_s or time.monotonic()
            deadline_s = unavailable_since_s + self.backend_wait_s
            if time.monotonic() >= deadline_s:
                return response  # relayed as it is: the backend's own 503 and reason
            await response.aclose()
            logger.info(
                "the backend answered 503 before starting; waiting up to %.0f s for it", deadline_s - time.monotonic()
            )
            await self.upstream.wait_until_ready(deadline_s, lambda: self.client_gone)

    async def _relay_body(self, response: UpstreamResponse, send: Send) -> None:
        self.status = response.status_code
        self._content_type = response.header(b"content-type")
        headers = response_headers(response.raw_headers)
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.extra_headers()]
        read_usage = self.on_usage is not None and 200 <= response.status_code < 300
        tap = UsageTap(self._content_type) if read_usage else None
        if not self.client_gone:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": headers,
                }
            )
        first = True
        try:
            async for chunk in self.upstream.iter_body(response):
                if chunk and first:
                    first = False
                    self.on_first_byte()
                if tap is not None:
                    tap.feed(chunk)
                if not self.client_gone:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except RequestError as exc:
            self._count_upstream_error(exc)
            self._count_backend("failed_mid_answer")
            self.on_broken(self.upstream)
            self.outcome = "upstream_error_mid_body"
            await self._end_with_error(send, exc)
            return
        except asyncio.CancelledError:
            if not self.consume_interrupt():
                raise
            # the grace period ran out (or the client left): end the answer in its own framing
            await self._end_with_error(send, ShuttingDown("the proxy shut down before the answer was complete"))
            return
        if tap is not None and self.on_usage is not None:
            # Before the last send: the observation is in once the client has it all.
            self.on_usage(tap.usage(wall_s=self.now() - self._sent_s, request_model=self.model))
        if not self.client_gone:
            self.outcome = "completed"  # before the last send: a disconnect from now on is not a leaver
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            self.outcome = "client_left_streaming"  # drained to the end

    async def _end_with_error(self, send: Send, exc: RequestError) -> None:
        if not self.client_gone:
            event = stream_error_event(self.request.dialect, self._content_type, exc)
            await send({"type": "http.response.body", "body": event, "more_body": False})

    def interrupt(self, task: asyncio.Task[Any], outcome: str) -> None:
        """End this relay now (``task`` runs it): the answer so far ends with an error event, and
        ``run`` returns with ``outcome``."""
        self._interrupt_requested = outcome
        task.cancel()

    def consume_interrupt(self) -> bool:
        """Whether a cancellation is our own ``interrupt`` (then it is consumed, not propagated)."""
        if not self._interrupt_requested:
            return False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        self.outcome = self._interrupt_requested
        return True

    async def send_error(self, send: Send, exc: RequestError) -> None:
        body = error_body(self.request.dialect, exc)
        self.status = exc.status_code
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (*exc.headers.items(), *self.extra_headers())]
        await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _count_backend(self, outcome: str) -> None:
        self.metrics.count_backend_request(self.upstream.name, outcome)

    def _count_upstream_error(self, exc: RequestError) -> None:
        self.metrics.upstream_errors_by_kind["timeout" if isinstance(exc, UpstreamTimeout) else "unavailable"].inc()
        logger.warning("upstream error on %s %s: %s", self.request.method, self.request.path, exc.detail)


class _Exchange:
    """One request's relay, run in the request's own task, told of the client's disconnect by the
    server (or, under another ASGI server, by a watcher task on ``receive``), which may cancel the
    request's task; see ``_client_left``."""

    relay: Relay
    _left_cancel: bool = False  # the disconnect cancelled the request's task (consumed, not propagated)
    _task: asyncio.Task[Any] | None = None  # the request's task (set by _run)

    async def _run(self, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        on_disconnect = self._disconnected
        watcher = None
        if not watch_disconnect(receive, on_disconnect):  # not the proxy's own server: watch receive
            watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        try:
            await self._serve(send, task)
        except asyncio.CancelledError:
            if self._left_cancel and task.uncancel() == 0:
                return  # our own cancellation: the client is gone
            raise
        finally:
            if watcher is None:
                unwatch_disconnect(receive, on_disconnect)
            else:
                watcher.cancel()

    async def _watch(self, receive: Receive) -> None:
        await _wait_disconnect(receive)
        self._disconnected()

    def _disconnected(self) -> None:
        self.relay.client_gone = True
        if self._client_left():
            self._left_cancel = True
            assert self._task is not None
            self._task.cancel()

    async def _serve(self, send: Send, task: asyncio.Task[Any]) -> None:
        raise NotImplementedError

    def _client_left(self) -> bool:
        """The client is gone: True to cancel the request's task."""
        raise NotImplementedError


class PassthroughResponse(_Exchange):
    """Unscheduled: relay at once; a client that leaves cancels the relay (no slot to drain for)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    async def __call__(self, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        try:
            await self._run(receive, send)
        finally:
            status = str(self.relay.status) if self.relay.status is not None else "client_closed"
            self.relay.metrics.count_request("passthrough", self.relay.request.dialect.value, status)
            if REQUEST_LOG.isEnabledFor(logging.INFO):
                request = self.relay.request
                log_request({
                    "request_id": next((v for k, v in request.headers if k == "x-request-id"), "-"), "method": request.method,
                    "path": request.path, "status": self.relay.status or "client_closed",
                    "outcome": "passthrough_" + self.relay.outcome,
                    "service_ms": f"{(time.monotonic() - started) * 1000:.1f}",
                })  # fmt: skip

    async def _serve(self, send: Send, task: asyncio.Task[Any]) -> None:
        await self.relay.run(send)

    def _client_left(self) -> bool:
        if self.relay.outcome != "pending":
            return False  # already answered in full
        self.relay.metrics.disconnects_by_stage["streaming"].inc()
        return True


class MergedListing(PassthroughResponse):
    """``GET /api/tags`` or ``/v1/models`` in front of a pool: every backend's list, merged (the
    first backend's entry wins a model listed twice). Backends that do not answer are left out;
    none answering is a 502."""

    def __init__(self, pool: BackendPool, request: UpstreamRequest, metrics: Metrics) -> None:
        super().__init__(Relay(pool.first, request, metrics))
        self.pool = pool

    async def _serve(self, send: Send, task: asyncio.Task[Any]) -> None:
        relay = self.relay
        path = relay.request.path + (f"?{relay.request.query}" if relay.request.query else "")
        bodies = await asyncio.gather(*(m.upstream.get_json(path, LISTING_TIMEOUT_S) for m in self.pool.members))
        answered = [body for body in bodies if body is not None]
        if not answered:
            relay.outcome = "upstream_error"
            await relay.send_error(send, UpstreamUnavailable("no backend answered the model listing"))
            return
        body = merge_model_lists(relay.request.path, answered)
        relay.status = 200
        relay.outcome = "completed"
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class ScheduledResponse(_Exchange):
    """Scheduled: ``async with dispatcher.lease(ticket)`` around the relay, in the request's own
    task, whose life is the slot's life. A relay that drains after its client left keeps running
    in that task (the server waits for it at shutdown; the dispatcher interrupts it after the
    grace period)."""

    def __init__(
        self,
        *,
        pool: BackendPool,
        request: UpstreamRequest,
        metrics: Metrics,
        dispatcher: Dispatcher,
        ticket: Ticket,
        disconnect_mode: Literal["auto", "drain", "abort"] = "auto",
        stream: bool = True,  # the client asked for a stream (decides ``auto``)
        backend_wait_s: float = 0.0,
        on_usage: Callable[[Ticket, Usage], None] | None = None,  # a completed answer's usage (the learner)
        predict_later: Callable[[], None] | None = None,  # dispatched at once: predict while the backend works
        vllm_priority: bool = False,  # send a vLLM backend the computed priority (see _bind)
    ) -> None:
        self.pool = pool
        self.request = request
        self.vllm_priority = vllm_priority
        self.predict_later = predict_later
        self.dispatcher = dispatcher
        self.ticket = ticket
        self.metrics = metrics
        # What a client's leaving does (docs/design.md, "Disconnects"): abort closes the backend
        # connection and frees the slot; drain reads the answer to its end; auto aborts, and for a
        # non-streamed request then holds the slot until llama.cpp's /slots shows the backend idle
        # (llama.cpp notices a closed non-streamed request only when nothing else keeps its HTTP
        # thread busy; a stream it stops within ~0.2 s).
        self.mode = "abort" if disconnect_mode == "auto" and stream else disconnect_mode
        self.on_usage = on_usage
        self.usage: Usage | None = None
        self.relay = Relay(
            pool.first, request, metrics, self._own_headers, self._first_byte,
            on_usage=self._record_usage, now=dispatcher.clock.now, model=ticket.model,
            backend_wait_s=backend_wait_s, retry_unavailable=True, failover=self._failover,
            on_answered=pool.answered, on_broken=pool.broken,
        )  # fmt: skip
        self.stage = "queued"  # queued -> relaying -> done

    # the exchange itself: no coroutine layer of its own (each costs a frame per waiting request)
    __call__ = _Exchange._run

    async def _serve(self, send: Send, task: asyncio.Task[Any]) -> None:
        """The slot's whole life: wait, relay, release (in the lease)."""
        try:
            async with self.dispatcher.lease(self.ticket) as lease:
                self._bind(lease.backend)
                self.stage = "relaying"
                self.ticket.interrupt = lambda: self.relay.interrupt(task, "shutdown")
                if self.predict_later is not None:
                    # After this task's step, in which the backend client writes the request on a
                    # pooled connection (backend_connection.py writes in send, no task of its own)
                    asyncio.get_running_loop().call_soon(self._predicted)
                await self.relay.run(send)
                if self.relay.outcome == "client_left_watching":
                    try:
                        await self._hold_until_backend_idle()
                    except asyncio.CancelledError:
                        if not self.relay.consume_interrupt():  # the shutdown's interrupt ends the hold quietly
                            raise
                finished = self.relay.outcome in ("completed", "client_left_streaming")
                if finished:
                    self._observe_end()
                # Only whole successful answers teach the service-time model.
                lease.completed = finished and self.relay.status is not None and self.relay.status < 400
                lease.usage = self.usage
        except RequestError as exc:  # refused while waiting (shutting down)
            self.relay.outcome = "refused"
            if not self.relay.client_gone:
                await self.relay.send_error(send, exc)
        finally:
            self.stage = "done"
            self._log()

    def _client_left(self) -> bool:
        if self.stage == "queued":
            self.relay.outcome = "client_left_queued"  # the lease withdraws it (and counts it)
            return True
        if self.stage != "relaying" or self.relay.outcome != "pending":
            return False  # already answered in full
        self.relay.outcome = "client_left_streaming"
        self.metrics.disconnects_by_stage["streaming"].inc()
        if self.mode == "auto":
            assert self._task is not None
            self.relay.interrupt(self._task, "client_left_watching")  # closes it; the slot waits for /slots
            return False
        # abort: closes the backend connection, then the lease releases the slot; drain: the relay
        # reads the backend's answer to its end, so the slot is freed when the backend is.
        return self.mode == "abort"

    def _bind(self, backend: int) -> None:
        """Send to the granted backend. A vLLM one (with ``vllm_priority``) gets the request's
        computed priority in its body: the client's class, then the predicted tokens (lower =
        sooner, as vLLM's priority scheduling reads it)."""
        self.relay.upstream = self.pool.members[backend].upstream
        request = self.request
        if self.vllm_priority and self.pool.kind_of(backend) == "vllm":
            ticket = self._predicted()
            priority = ticket.job.priority * VLLM_CLASS_STRIDE + min(
                VLLM_CLASS_STRIDE - 1, max(0, round(ticket.job.predicted_tokens))
            )
            request = replace(request, body=with_upstream_fields(request.body, {"priority": priority}))
        self.relay.request = request

    async def _failover(self, refused: Upstream) -> Upstream | None:
        """The granted backend refused the connection: wait first in line for another healthy
        backend (the client sees nothing of it), or None when there is none (the relay waits for
        this one)."""
        self.pool.refused(refused)
        if not self.dispatcher.reroute(self.ticket):
            return None
        self.stage = "queued"  # a client that leaves now is withdrawn, never sent
        await self.dispatcher.regranted(self.ticket)
        self.stage = "relaying"
        assert self.ticket.backend is not None
        self._bind(self.ticket.backend)
        return self.relay.upstream

    def _predicted(self) -> Ticket:
        """The ticket, its prediction made (now, if it was deferred and has not run yet)."""
        if self.predict_later is not None:
            predict, self.predict_later = self.predict_later, None
            predict()
        return self.ticket

    async def _hold_until_backend_idle(self) -> None:
        """Keep the slot until the backend's /slots shows no more busy slots than our other
        requests in flight, polled every SLOTS_POLL_S (a poll more often than llama.cpp's 1 s
        disconnect check would keep it from noticing), for at most HOLD_MAX_S. A backend without
        /slots (Ollama, vLLM: they stop on disconnect) releases at once."""
        deadline_s = time.monotonic() + HOLD_MAX_S
        while time.monotonic() < deadline_s:
            await asyncio.sleep(SLOTS_POLL_S)
            busy = await self.relay.upstream.busy_slots()
            assert self.ticket.backend is not None
            if busy is None or busy <= self.dispatcher.in_flight_on(self.ticket.backend) - 1:
                return

    def _record_usage(self, usage: Usage) -> None:
        self.usage = usage
        if self.on_usage is not None:
            try:
                self.on_usage(self.ticket, usage)
            except Exception:  # the answer is already relayed: a failing observer must not break it
                logger.exception("request_id=%s: recording usage failed", self.ticket.request_id)

    def _own_headers(self) -> list[tuple[str, str]]:
        ticket = self._predicted()
        wait = ticket.queue_wait_s()
        prediction = ticket.prediction
        assert prediction is not None
        headers = [
            ("x-request-id", ticket.request_id),
            ("x-clairvoyant-backend", self.relay.upstream.name),
            ("x-clairvoyant-queue-wait-ms", "" if wait is None else f"{wait * 1000:.1f}"),
            ("x-clairvoyant-predicted-tokens", f"{prediction.predicted_tokens:.0f}"),
            ("x-clairvoyant-predicted-class", ticket.predicted_class),
            ("x-clairvoyant-predicted-s", f"{ticket.job.predicted_s:.3f}"),
        ]
        if prediction.p_long is not None:  # class models only
            headers.append(("x-clairvoyant-p-long", f"{prediction.p_long:.4f}"))
        if ticket.queue_position is not None:
            headers.append(("x-clairvoyant-queue-position", str(ticket.queue_position)))
        return headers

    def _first_byte(self) -> None:
        self.metrics.ttft_by_class[self.ticket.predicted_class].observe(
            self.dispatcher.clock.now() - self.ticket.arrival_s
        )

    def _observe_end(self) -> None:
        self.metrics.end_to_end_by_class[self.ticket.predicted_class].observe(
            self.dispatcher.clock.now() - self.ticket.arrival_s
        )

    def _log(self) -> None:
        ticket = self._predicted()
        relay = self.relay
        status = str(relay.status) if relay.status is not None else "client_closed"
        self.metrics.count_request(ticket.endpoint, relay.request.dialect.value, status)
        if not REQUEST_LOG.isEnabledFor(logging.INFO):
            return
        wait = ticket.queue_wait_s()
        service = None if ticket.dispatched_s is None else self.dispatcher.clock.now() - ticket.dispatched_s
        usage = self.usage
        log_request({
            "request_id": ticket.request_id, "endpoint": ticket.endpoint, "tenant": ticket.job.tenant or "-",
            "backend": "-" if ticket.backend is None else self.relay.upstream.name,
            "priority": ticket.job.priority, "predicted_class": ticket.predicted_class,
            "predicted_tokens": "-" if ticket.prediction is None else f"{ticket.prediction.predicted_tokens:.0f}",
            "predicted_s": f"{ticket.job.predicted_s:.3f}",
            "queue_wait_ms": "-" if wait is None else f"{wait * 1000:.1f}",
            "service_ms": "-" if service is None else f"{service * 1000:.1f}",
            "status": relay.status if relay.status is not None else "-", "outcome": relay.outcome,
            "output_tokens": "-" if usage is None or usage.output_tokens is None else usage.output_tokens,
            "usage_source": "-" if usage is None else usage.source,
        })  # fmt: skip
