"""Answers: the relay of a backend's answer to a client connection, and the exchanges around it.

``Relay`` opens the upstream request and relays status, headers and body as they arrive, through
the client's ``HttpConnection`` (proxy/connection.py). It is shared: ``Passthrough`` runs it at
once; ``ScheduledExchange`` runs it once the dispatcher grants the request a slot, and gives the
slot back exactly once (``Dispatcher.end``).

A scheduled request that must wait holds no task and no coroutine: the exchange is a record
beside its ticket, its connection parked (a bare file descriptor, proxy/parking.py) when it can
be. The grant starts the one task that resumes the connection, relays and releases. The client's
disconnect reaches the exchange from its connection (``client_left``) or, parked, from the
parking lot:

- while queued: the ticket is withdrawn, never sent;
- while the backend generates: ``abort`` cancels the relay (closing the backend connection;
  llama.cpp stops generating) or ``drain`` lets it read the answer into the void to its end, so the
  slot is freed only when the backend really is free; ``auto`` aborts, and for a non-streamed
  request then holds the slot until llama.cpp's ``/slots`` shows the backend idle.

Before dispatch a waiting client receives nothing, not even a status line (the status comes from
the backend). It can see where it stands at ``GET /queue/{request_id}`` (position and ETA; the id is
its ``X-Request-Id`` header or the one the proxy assigns). At dispatch the response headers carry
``X-Clairvoyant-Queue-Position`` (requests dispatched ahead of it while it waited) and the measured wait.

Once the status line is sent it cannot change: a backend failure after that point ends a stream
with one final error event in the dialect's framing, or cuts a plain body short.

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

from clairvoyant.errors import RequestError, UpstreamTimeout, UpstreamUnavailable
from clairvoyant.logs import REQUEST_LOG, log_request
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.dialects import Dialect, error_body, stream_error_event, with_upstream_fields
from clairvoyant.prediction.usage import Usage, UsageTap
from clairvoyant.proxy.connection import HttpConnection, closing_answer, resume_connection
from clairvoyant.proxy.pool import BackendPool, merge_model_lists
from clairvoyant.proxy.upstream import Upstream, UpstreamResponse, header_value, response_headers
from clairvoyant.scheduling.dispatcher import REFUSED, WITHDRAWN, Dispatcher, ShuttingDown, Ticket

__all__ = [
    "AtOnceExchange", "MergedListing", "Passthrough", "Relay", "ScheduledExchange", "Scheduling", "UpstreamRequest",
    "error_body",
]  # fmt: skip

logger = logging.getLogger(__name__)

SLOTS_POLL_S = 1.5  # seconds between /slots polls while a left client's slot is held (see ScheduledExchange)
LISTING_TIMEOUT_S = 5.0  # per backend, for a merged model listing
VLLM_CLASS_STRIDE = 100_000  # vLLM priority = client class x this + predicted tokens (capped below it)
HOLD_MAX_S = 600.0  # the longest a left client's slot is held waiting for the backend to go idle
_JSON = (b"content-type", b"application/json")
_OWN_HEADERS = (
    b"x-request-id: %b\r\nx-clairvoyant-backend: %b\r\nx-clairvoyant-queue-wait-ms: %b\r\n"
    b"x-clairvoyant-predicted-tokens: %.0f\r\nx-clairvoyant-predicted-class: %b\r\nx-clairvoyant-predicted-s: %.3f\r\n"
)  # a scheduled answer's own headers (ScheduledExchange._own_headers)
_CONTEXT = 3  # ScheduledExchange.flags: the bits of connection.response_context
_STREAM = 4  # ScheduledExchange.flags: the client asked for a stream


@dataclass(slots=True)  # not frozen: a frozen dataclass sets each field through object.__setattr__ (one a request)
class UpstreamRequest:
    """What to send to the backend. Not changed after it is made (``dataclasses.replace`` makes another)."""

    method: str
    path: str
    query: str
    headers: bytes  # the client's end-to-end header lines (upstream.forwardable_headers)
    body: bytes
    dialect: Dialect
    close_connection: bool = False  # ask the backend to close after answering (streams: see Upstream.open)
    authorization: bytes | None = None  # the client's Authorization value, if any (see Upstream.open)


def error_headers(exc: RequestError) -> list[tuple[bytes, bytes]]:
    """An error answer's headers (its Content-Length comes with ``respond``)."""
    headers = [_JSON]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    return headers


@dataclass(eq=False, slots=True)
class Relay:
    """Open the upstream request and relay its answer to the client's connection (nothing once
    the client is gone)."""

    upstream: Upstream
    request: UpstreamRequest
    metrics: Metrics
    extra_headers: Callable[[], bytes] = lambda: b""  # the proxy's own, as header lines
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
    usage: Usage | None = None  # what the backend produced, once read (see on_usage)
    outcome: str = "pending"
    client_gone: bool = False
    _content_type: str = field(default="", repr=False)
    _sent_s: float = field(default=0.0, repr=False)  # clock seconds when the request went upstream
    _interrupt_requested: str = field(default="", repr=False)  # the outcome an interrupt ends the relay with

    async def run(self, out: HttpConnection) -> None:
        try:
            response = await self._open()
        except RequestError as exc:
            self._count_upstream_error(exc)
            self.outcome = "upstream_error"
            if not self.client_gone:
                self.send_error(out, exc)
            return
        except asyncio.CancelledError:
            if not self.consume_interrupt():
                raise
            if not self.client_gone:
                self.send_error(out, ShuttingDown("the proxy is shutting down; retry"))
            return
        try:
            await self._relay_body(response, out)
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
                    r.method, r.path, query=r.query, headers=r.headers, authorization=r.authorization, body=r.body,
                    close_connection=r.close_connection,
                )  # fmt: skip
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

    async def _relay_body(self, response: UpstreamResponse, out: HttpConnection) -> None:
        self.status = status = response.status_code
        self._content_type = response.header(b"content-type")
        lines, length = response_headers(response.raw_headers)
        lines += self.extra_headers()
        tap = UsageTap(self._content_type) if self.on_usage is not None and 200 <= status < 300 else None
        # What the backend sent with its head goes out with ours, in one write; an answer already
        # whole (a JSON answer) goes out whole.
        ready = response.ready()
        if ready:
            self.on_first_byte()
            if tap is not None:
                tap.feed(ready)
        if response.complete():
            self._usage(tap)
            self.outcome = "completed" if not self.client_gone else "client_left_streaming"
            if not self.client_gone:
                out.start(status, [], ready, end=True, lines=lines, length=length)
            return
        if not self.client_gone:
            out.start(status, [], ready, lines=lines, length=length)
            if not ready:
                out.flush()  # the head now: a stream's first token may be seconds away
        first = not ready
        try:
            async for chunk in self.upstream.iter_body(response):
                if chunk and first:
                    first = False
                    self.on_first_byte()
                if tap is not None:
                    tap.feed(chunk)
                if not self.client_gone:
                    out.write(chunk)
                    if out.paused:
                        await out.drain()
        except RequestError as exc:
            self._count_upstream_error(exc)
            self._count_backend("failed_mid_answer")
            self.on_broken(self.upstream)
            self.outcome = "upstream_error_mid_body"
            self._end_with_error(out, exc)
            return
        except asyncio.CancelledError:
            if not self.consume_interrupt():
                raise
            # the grace period ran out (or the client left): end the answer in its own framing
            self._end_with_error(out, ShuttingDown("the proxy shut down before the answer was complete"))
            return
        self._usage(tap)
        if not self.client_gone:
            self.outcome = "completed"  # before the last bytes: a disconnect from now on is not a leaver
            out.finish()
        else:
            self.outcome = "client_left_streaming"  # drained to the end

    def _usage(self, tap: UsageTap | None) -> None:
        """Before the last bytes go out: the observation is in once the client has it all."""
        if tap is not None and self.on_usage is not None:
            self.usage = tap.usage(wall_s=self.now() - self._sent_s, request_model=self.model)
            self.on_usage(self.usage)

    def _end_with_error(self, out: HttpConnection, exc: RequestError) -> None:
        if self.client_gone:
            return
        event = stream_error_event(self.request.dialect, self._content_type, exc)
        if event and out.chunked:
            out.finish(event)
        else:
            out.cut()  # a plain or fixed-length body: cut short

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

    def send_error(self, out: HttpConnection, exc: RequestError) -> None:
        self.status = exc.status_code
        out.respond(exc.status_code, error_headers(exc), error_body(self.request.dialect, exc), self.extra_headers())

    def _count_backend(self, outcome: str) -> None:
        self.metrics.count_backend_request(self.upstream.name, outcome)

    def _count_upstream_error(self, exc: RequestError) -> None:
        self.metrics.upstream_errors_by_kind["timeout" if isinstance(exc, UpstreamTimeout) else "unavailable"].inc()
        logger.warning("upstream error on %s %s: %s", self.request.method, self.request.path, exc.detail)


class _Running:
    """An answer relayed in its own task, which a client's leaving may cancel (``_cancel_for_leaving``)."""

    __slots__ = ("task", "left_cancel")

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.left_cancel = False  # the disconnect cancelled the task (consumed, not propagated)

    def _cancel_for_leaving(self) -> None:
        if self.task is not None:
            self.left_cancel = True
            self.task.cancel()

    def _consume_leaving(self) -> bool:
        """In the task, on CancelledError: whether it was our own cancellation (then consumed)."""
        task = self.task
        return self.left_cancel and task is not None and task.uncancel() == 0


class Passthrough(_Running):
    """Unscheduled: relay at once; a client that leaves cancels the relay (no slot to drain for)."""

    __slots__ = ("relay", "out")

    def __init__(self, relay: Relay, out: HttpConnection) -> None:
        super().__init__()
        self.relay = relay
        self.out = out

    def start(self) -> None:
        self.out.listener = self
        self.task = self.out.shared.run_task(self.run(), name="passthrough")

    async def run(self) -> None:
        started = time.monotonic()
        try:
            await self._serve()
        except asyncio.CancelledError:
            if not self._consume_leaving():
                raise
        finally:
            relay = self.relay
            status = str(relay.status) if relay.status is not None else "client_closed"
            relay.metrics.count_request("passthrough", relay.request.dialect.value, status)
            if REQUEST_LOG.isEnabledFor(logging.INFO):
                request = relay.request
                log_request({
                    "request_id": (header_value(request.headers, b"x-request-id") or b"-").decode("latin-1"),
                    "method": request.method,
                    "path": request.path, "status": relay.status or "client_closed", "outcome": "passthrough_" + relay.outcome,
                    "service_ms": f"{(time.monotonic() - started) * 1000:.1f}",
                })  # fmt: skip

    async def _serve(self) -> None:
        await self.relay.run(self.out)

    def client_left(self) -> None:
        self.relay.client_gone = True
        if self.relay.outcome != "pending":
            return  # already answered in full
        self.relay.metrics.disconnects_by_stage["streaming"].inc()
        self._cancel_for_leaving()


class MergedListing(Passthrough):
    """``GET /api/tags`` or ``/v1/models`` in front of a pool: every backend's list, merged (the
    first backend's entry wins a model listed twice). Backends that do not answer are left out;
    none answering is a 502."""

    __slots__ = ("pool",)

    def __init__(self, pool: BackendPool, request: UpstreamRequest, metrics: Metrics, out: HttpConnection) -> None:
        super().__init__(Relay(pool.first, request, metrics), out)
        self.pool = pool

    async def _serve(self) -> None:
        relay = self.relay
        path = relay.request.path + (f"?{relay.request.query}" if relay.request.query else "")
        bodies = await asyncio.gather(*(m.upstream.get_json(path, LISTING_TIMEOUT_S) for m in self.pool.members))
        answered = [body for body in bodies if body is not None]
        if not answered:
            relay.outcome = "upstream_error"
            relay.send_error(self.out, UpstreamUnavailable("no backend answered the model listing"))
            return
        body = merge_model_lists(relay.request.path, answered)
        relay.status = 200
        relay.outcome = "completed"
        self.out.respond(200, [_JSON], body)


@dataclass(frozen=True, slots=True, eq=False)
class Scheduling:
    """What every scheduled exchange shares (built once, in the lifespan)."""

    pool: BackendPool
    metrics: Metrics
    dispatcher: Dispatcher
    disconnect_mode: Literal["auto", "drain", "abort"]
    backend_wait_s: float
    on_usage: Callable[[Ticket, Usage, bytes], None] | None  # a completed answer's usage and its body (the learner)
    vllm_priority: bool  # send a vLLM backend the computed priority (see ScheduledExchange._bind)


class ScheduledExchange(_Running):
    """A scheduled request from its arrival to its slot's release.

    Waiting, it is this record and its ticket; its client is its live connection or, parked, a
    file descriptor (``client``). The grant (``wait_ended``) starts the task that resumes a
    parked connection, relays the backend's answer and gives the slot back (``Dispatcher.end``):
    exactly once, whatever happens. A relay that drains after its client left keeps running in
    that task (the server waits for it at shutdown; the dispatcher interrupts it after the grace
    period)."""

    # Lean on purpose: a waiting request is this record, its ticket and its body (no request
    # object until the grant: ``upstream_request``).
    __slots__ = (
        "shared", "ticket", "client", "server", "flags", "headers", "per_request_headers", "body", "query",
        "authorization", "relay", "stage",
    )  # fmt: skip

    def __init__(
        self,
        shared: Scheduling,
        ticket: Ticket,
        out: HttpConnection,
        *,
        headers: bytes,  # the end-to-end header lines to forward (the request id's is added at the grant)
        per_request_headers: bytes = b"",  # more of them, new with every request (tracing): apart from ``headers``
        body: bytes,  # the body to forward
        query: str = "",
        authorization: bytes | None = None,  # the client's (see Upstream.open)
        stream: bool,  # the client asked for a stream (decides ``auto``, asks the backend to close)
    ) -> None:
        super().__init__()
        self.shared = shared
        self.ticket = ticket
        self.client: HttpConnection | int = out  # the connection, or its parked file descriptor
        self.server = out.shared  # what resumes a parked connection (the connection itself is dropped)
        # The answer's framing on a resumed connection (connection.response_context), and the stream bit
        self.flags = out.response_context | (_STREAM if stream else 0)
        self.headers = headers  # often one object shared by the client's requests (proxy/app.py)
        self.per_request_headers = per_request_headers
        self.body = body
        self.query = query
        self.authorization = authorization
        self.relay: Relay | None = None  # made at the grant
        self.stage = "queued"  # queued -> relaying -> done

    predict_later: Callable[[], None] | None = None  # only an exchange granted at arrival has one (AtOnceExchange)

    @property
    def mode(self) -> str:
        """What the client's leaving does (docs/design.md, "Disconnects"): abort closes the backend
        connection and frees the slot; drain reads the answer to its end; auto aborts, and for a
        non-streamed request then holds the slot until llama.cpp's /slots shows the backend idle
        (llama.cpp notices a closed non-streamed request only when nothing else keeps its HTTP
        thread busy; a stream it stops within ~0.2 s)."""
        mode = self.shared.disconnect_mode
        return "abort" if mode == "auto" and self.flags & _STREAM else mode

    def upstream_request(self) -> UpstreamRequest:
        """What goes to the backend: the client's request, with its request id."""
        ticket = self.ticket
        headers = self.headers + self.per_request_headers + b"x-request-id: %b\r\n" % ticket.request_id.encode()
        return UpstreamRequest(
            "POST", ticket.endpoint, self.query, headers, self.body, Dialect(ticket.dialect),
            bool(self.flags & _STREAM), self.authorization,
        )  # fmt: skip

    # --- arrival ---------------------------------------------------------------------------------
    def wait(self, parking: Any) -> None:
        """Queued: start when granted. The connection is parked while it waits, when it can be."""
        out = self.client
        assert isinstance(out, HttpConnection)
        out.listener = self
        self.ticket.waiter = self
        if parking is not None:
            out.park_when_read(self)

    def interrupt(self) -> bool:
        """``Waiter.interrupt``: the shutdown's grace period is over; end the answer being relayed."""
        relay, task = self.relay, self.task
        if self.stage not in ("relaying", "rerouted") or relay is None or task is None:
            return False
        relay.interrupt(task, "shutdown")
        return True

    def parked(self, fd: int) -> None:
        """Its connection is parked (``HttpConnection.park_when_read``): resumed through ``fd``."""
        self.client = fd

    def wait_ended(self, ticket: Ticket) -> None:
        """The dispatcher ended the ticket's wait (``Waiter``): start the relay, or answer the refusal."""
        client = self.client
        if isinstance(client, HttpConnection):
            client.park_owner = None  # its wait is over: never parked from now on
        if self.stage != "queued" or ticket.wait == WITHDRAWN:
            return  # withdrawn (its client left), or a reroute's second grant (awaited in the task)
        if ticket.wait == REFUSED:  # shutting down
            self.stage = "done"
            self._refuse(ticket.refusal or ShuttingDown("the proxy is shutting down; retry"))
            return
        self.task = self.server.run_task(self.run(), name="scheduled")

    def _refuse(self, error: RequestError) -> None:
        self.relay = self._make_relay()
        self.relay.outcome = "refused"
        self.relay.status = error.status_code
        client = self.client
        if isinstance(client, int):
            server = self.server
            body = error_body(Dialect(self.ticket.dialect), error)
            server.parking.refuse(
                client, closing_answer(error.status_code, error_headers(error), body, server.server_state)
            )
        else:
            client.listener = None
            self.relay.send_error(client, error)
        self._log()

    # --- the slot's life -------------------------------------------------------------------------
    async def run(self) -> None:
        """Resume the client's connection, relay, give the slot back (once, whatever happens)."""
        ticket = self.ticket
        dispatcher = self.shared.dispatcher
        relay = self.relay = self.relay or self._make_relay()
        completed = False
        try:
            if self.stage != "queued":
                return  # left between the grant and this task's first step: the slot is given back already
            client = self.client
            out = client if isinstance(client, HttpConnection) else await self._resume(client)
            if out is None or out.gone:  # left before anything was sent: its slot is given back
                self._left_queued()
                return
            self._bind(ticket.backend if ticket.backend is not None else 0)
            self.stage = "relaying"
            if self.predict_later is not None:
                # After this task's step, in which the backend client writes the request on a
                # pooled connection (backend_connection.py writes in send, no task of its own)
                asyncio.get_running_loop().call_soon(self._predicted)
            await relay.run(out)
            if relay.outcome == "client_left_watching":
                try:
                    await self._hold_until_backend_idle()
                except asyncio.CancelledError:
                    if not relay.consume_interrupt():  # the shutdown's interrupt ends the hold quietly
                        raise
            finished = relay.outcome in ("completed", "client_left_streaming")
            if finished:
                self._observe_end()
            # Only whole successful answers teach the service-time model.
            completed = finished and relay.status is not None and relay.status < 400
        except asyncio.CancelledError:
            if not self._consume_leaving():
                raise
        except Exception:  # a bug: logged, the client answered or cut, the slot given back below
            logger.exception("request_id=%s: unexpected error", ticket.request_id)
            relay.outcome = "internal_error"
            client = self.client
            if isinstance(client, HttpConnection) and client.busy:
                if client.out_started:
                    client.cut()
                else:
                    relay.send_error(client, RequestError("internal error in the proxy"))
        finally:
            if self.stage != "done":
                self.stage = "done"
                dispatcher.end(ticket, completed=completed, usage=relay.usage)
                self._log()

    async def _resume(self, fd: int) -> HttpConnection | None:
        """The parked connection, live again (None: its client is gone)."""
        try:
            out = await resume_connection(self.server, fd, self.flags & _CONTEXT)
        except OSError:
            return None
        self.client = out
        out.listener = self
        return out

    def client_left(self) -> None:
        """The client is gone (its connection told, or the parking lot did)."""
        relay = self.relay
        if self.stage == "queued":
            self._left_queued()
            if self.task is not None:
                self._cancel_for_leaving()
            return
        if self.stage == "rerouted" and relay is not None:  # waiting again, first in line: withdrawn
            relay.client_gone = True
            relay.outcome = "client_left_queued"
            self._cancel_for_leaving()
            return
        if self.stage != "relaying" or relay is None:
            return
        relay.client_gone = True
        if relay.outcome != "pending":
            return  # already answered in full
        relay.outcome = "client_left_streaming"
        self.shared.metrics.disconnects_by_stage["streaming"].inc()
        if self.mode == "auto":
            assert self.task is not None
            relay.interrupt(self.task, "client_left_watching")  # closes it; the slot waits for /slots
        elif self.mode == "abort":
            self._cancel_for_leaving()  # closes the backend connection, then the slot is given back
        # drain: the relay reads the backend's answer to its end, so the slot is freed when the backend is

    def _left_queued(self) -> None:
        """Left before anything was sent: withdrawn (or its fresh slot given back), logged once."""
        if self.stage == "done":
            return
        self.stage = "done"
        relay = self.relay = self.relay or self._make_relay()
        relay.client_gone = True
        relay.outcome = "client_left_queued"
        self.shared.dispatcher.end(self.ticket)  # withdrawn if waiting (counted there), else released
        self._log()

    def _make_relay(self) -> Relay:
        shared = self.shared
        pool = shared.pool
        return Relay(
            pool.first, self.upstream_request(), shared.metrics, self._own_headers, self._first_byte,
            on_usage=self._record_usage, now=shared.dispatcher.clock.now, model=self.ticket.model,
            backend_wait_s=shared.backend_wait_s, retry_unavailable=True, failover=self._failover,
            on_answered=pool.answered, on_broken=pool.broken,
        )  # fmt: skip

    def _bind(self, backend: int) -> None:
        """Send to the granted backend. A vLLM one (with ``vllm_priority``) gets the request's
        computed priority in its body: the client's class, then the predicted tokens (lower =
        sooner, as vLLM's priority scheduling reads it)."""
        relay = self.relay
        assert relay is not None
        shared = self.shared
        relay.upstream = shared.pool.members[backend].upstream
        request = relay.request
        if shared.vllm_priority and shared.pool.kind_of(backend) == "vllm":
            ticket = self._predicted()
            priority = ticket.priority * VLLM_CLASS_STRIDE + min(
                VLLM_CLASS_STRIDE - 1, max(0, round(ticket.predicted_tokens))
            )
            request = replace(request, body=with_upstream_fields(request.body, {"priority": priority}))
        relay.request = request

    async def _failover(self, refused: Upstream) -> Upstream | None:
        """The granted backend refused the connection: wait first in line for another healthy
        backend (the client sees nothing of it), or None when there is none (the relay waits for
        this one)."""
        shared = self.shared
        shared.pool.refused(refused)
        if not shared.dispatcher.reroute(self.ticket):
            return None
        self.stage = "rerouted"  # a client that leaves now cancels the task: the slot's exit withdraws it
        try:
            await shared.dispatcher.regranted(self.ticket)
        finally:
            if self.stage == "rerouted":
                self.stage = "relaying"
        assert self.ticket.backend is not None
        self._bind(self.ticket.backend)
        assert self.relay is not None
        return self.relay.upstream

    def _predicted(self) -> Ticket:
        """The ticket, its prediction made (``AtOnceExchange`` makes a deferred one now)."""
        return self.ticket

    async def _hold_until_backend_idle(self) -> None:
        """Keep the slot until the backend's /slots shows no more busy slots than our other
        requests in flight, polled every SLOTS_POLL_S (a poll more often than llama.cpp's 1 s
        disconnect check would keep it from noticing), for at most HOLD_MAX_S. A backend without
        /slots (Ollama, vLLM: they stop on disconnect) releases at once."""
        relay = self.relay
        assert relay is not None
        deadline_s = time.monotonic() + HOLD_MAX_S
        while time.monotonic() < deadline_s:
            await asyncio.sleep(SLOTS_POLL_S)
            busy = await relay.upstream.busy_slots()
            assert self.ticket.backend is not None
            if busy is None or busy <= self.shared.dispatcher.in_flight_on(self.ticket.backend) - 1:
                return

    def _record_usage(self, usage: Usage) -> None:
        on_usage = self.shared.on_usage
        if on_usage is not None:
            try:
                on_usage(self.ticket, usage, self.body)
            except Exception:  # the answer is already relayed: a failing observer must not break it
                logger.exception("request_id=%s: recording usage failed", self.ticket.request_id)

    def _own_headers(self) -> bytes:
        ticket = self._predicted()
        prediction = ticket.prediction
        assert prediction is not None and self.relay is not None
        wait = ticket.queue_wait_s()
        lines = _OWN_HEADERS % (
            ticket.request_id.encode(), self.relay.upstream.name.encode("latin-1"),
            b"" if wait is None else b"%.1f" % (wait * 1000), prediction.predicted_tokens,
            prediction.predicted_class.encode(), ticket.predicted_s,
        )  # fmt: skip
        if prediction.probabilities is not None:  # class models only
            lines += b"x-clairvoyant-p-long: %.4f\r\n" % prediction.probabilities[2]
        if ticket.queue_position is not None:
            lines += b"x-clairvoyant-queue-position: %d\r\n" % ticket.queue_position
        return lines

    def _first_byte(self) -> None:
        self.shared.metrics.ttft_by_class[self.ticket.predicted_class].observe(
            self.shared.dispatcher.clock.now() - self.ticket.arrival_s
        )

    def _observe_end(self) -> None:
        self.shared.metrics.end_to_end_by_class[self.ticket.predicted_class].observe(
            self.shared.dispatcher.clock.now() - self.ticket.arrival_s
        )

    def _log(self) -> None:
        ticket = self._predicted()
        relay = self.relay
        assert relay is not None
        status = str(relay.status) if relay.status is not None else "client_closed"
        metrics = self.shared.metrics
        metrics.count_request(ticket.endpoint, relay.request.dialect.value, status)
        if not REQUEST_LOG.isEnabledFor(logging.INFO):
            return
        wait = ticket.queue_wait_s()
        clock = self.shared.dispatcher.clock
        service = None if ticket.dispatched_s is None else clock.now() - ticket.dispatched_s
        usage = relay.usage
        log_request({
            "request_id": ticket.request_id, "endpoint": ticket.endpoint, "tenant": ticket.tenant or "-",
            "backend": "-" if ticket.backend is None else relay.upstream.name,
            "priority": ticket.priority, "predicted_class": ticket.predicted_class,
            "predicted_tokens": "-" if ticket.prediction is None else f"{ticket.prediction.predicted_tokens:.0f}",
            "predicted_s": f"{ticket.predicted_s:.3f}",
            "queue_wait_ms": "-" if wait is None else f"{wait * 1000:.1f}",
            "service_ms": "-" if service is None else f"{service * 1000:.1f}",
            "status": relay.status if relay.status is not None else "-", "outcome": relay.outcome,
            "output_tokens": "-" if usage is None or usage.output_tokens is None else usage.output_tokens,
            "usage_source": "-" if usage is None else usage.source,
        })  # fmt: skip


class AtOnceExchange(ScheduledExchange):
    """A scheduled request granted a slot at arrival (a free slot, nobody waiting): it relays at
    once and is predicted while the backend works (``predict_later``, run once after the request
    is written, or when the prediction is first needed)."""

    __slots__ = ("predict_later",)

    predict_later: Callable[[], None] | None  # set by ``start``; None once run

    def _predicted(self) -> Ticket:
        """The ticket, its prediction made (now, if it has not run yet)."""
        predict = self.predict_later
        if predict is not None:
            self.predict_later = None
            predict()
        return self.ticket

    def start(self, predict_later: Callable[[], None]) -> None:
        """Granted at arrival (a free slot, nobody waiting): relay at once; ``predict_later`` makes
        its prediction while the backend works."""
        self.predict_later = predict_later
        out = self.client
        assert isinstance(out, HttpConnection)
        out.listener = self
        self.ticket.waiter = self  # (granted already: only interrupted, or told of a reroute's grant)
        self.task = out.shared.run_task(self.run(), name="scheduled")
