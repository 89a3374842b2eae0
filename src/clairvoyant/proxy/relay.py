"""The relay of one backend answer to one client, over ASGI, for scheduled and pass-through
requests alike: ``Relay.run`` opens the upstream request (waiting out a backend that cannot take
it yet: ``Relay._open``) and relays status, headers and body as they arrive, through a
``Responder`` (the ASGI ``send``). Once the status is sent it cannot change: a backend failure
after that ends a stream with one error event in the dialect's framing (SSE or NDJSON), or cuts a
plain body short. A 2xx answer is read by a ``UsageTap`` as it passes, without buffering: what the
backend really produced goes to ``RelayHooks.usage``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from clairvoyant.errors import RequestError, UpstreamNotReady, UpstreamTimeout, UpstreamUnavailable
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.dialects import Dialect, error_body, stream_error_event
from clairvoyant.prediction.usage import Usage, UsageTap
from clairvoyant.proxy.transport import Headers, UpstreamResponse, header
from clairvoyant.proxy.upstream import Upstream, response_headers
from clairvoyant.scheduling.request import RequestStatus

if TYPE_CHECKING:
    from clairvoyant.proxy.pool import BackendPool

__all__ = [
    "PassThrough", "Receive", "Record", "Relay", "RelayHooks", "Responder", "Send", "UpstreamRequest", "disconnected",
    "relay_unscheduled",
]  # fmt: skip

logger = logging.getLogger(__name__)

# Seconds before a request the backend answered 503 is sent again, doubling up to the maximum
# (within backend_wait_s): 0.25, 0.5, 1, 2, 2, ...
RESEND_AFTER_503_S = 0.25
RESEND_AFTER_503_MAX_S = 2.0

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


@dataclass(slots=True)
class UpstreamRequest:
    """What to send to the backend."""

    method: str
    target: str  # the raw path and query, as the client sent them (proxy/target.py checked them)
    headers: Headers  # the client's end-to-end headers (upstream.forwardable_headers)
    body: bytes
    dialect: Dialect
    close_connection: bool = False  # ask the backend to close after answering (llama.cpp streams)
    authorization: str | None = None  # the client's Authorization value, if any (see Upstream.open)
    model: str | None = None  # the model the request named (its usage falls back to it)
    wait_s: float = 0.0  # seconds a not-yet-sent request waits for a backend that is down
    retry_unavailable: bool = False  # also wait and resend when the backend answers 503 (scheduled requests)


class Record(Protocol):
    """The request a relay answers, as the relay reads it: its status (``RequestStatus``)."""

    status: RequestStatus


class RelayHooks(Protocol):
    """What a relay tells the request it answers, and asks of it (the defaults: a request that
    needs none of it)."""

    reads_usage: bool = False  # a 2xx answer's usage is read as it passes (``usage`` gets it)
    pool: BackendPool | None = None  # the backends it may be sent to, told what each answer shows of them

    def move(self, status: RequestStatus) -> bool:
        """The request's status changes (the one way a relay changes it); False if it had ended."""
        ...

    def own_headers(self) -> list[tuple[bytes, bytes]]:
        """The proxy's own headers for the answer."""
        return []

    def first_byte(self, at_s: float) -> None:
        """The answer's first bytes went on to the client (``at_s``: their arrival, on the relay's clock)."""
        return None

    def progress(self, tokens: int) -> None:
        """A stream's content events so far, after each chunk."""
        return None

    def usage(self, usage: Usage) -> None:
        """What the backend produced, once a 2xx answer has fully arrived."""
        return None

    def backend_state(self, upstream: Upstream, healthy: bool) -> None:
        """A backend sent a status (``healthy``), or failed after the request was sent: the pool is told."""
        pool = self.pool
        if pool is not None:
            (pool.answered if healthy else pool.broken)(upstream)

    async def failover(self, relay: Relay) -> bool:
        """``relay.upstream`` cannot take the request (its connection refused or not accepted, or
        suspect and failing its health check; nothing was sent): point the relay at another backend
        and return True, or False to wait for this one (up to the request's ``wait_s``)."""
        return False


class PassThrough(RelayHooks):
    """An unscheduled request's record and hooks: a status, and in a pool the next backend to try."""

    __slots__ = ("status", "pool", "_counts", "_order", "_tried")

    def __init__(self, counts: list[int], pool: BackendPool | None = None, order: Sequence[Upstream] = ()) -> None:
        """``counts``: where each status entered is counted (``scheduling.request.status_counts``)."""
        self.status = RequestStatus.DISPATCHED
        counts[RequestStatus.DISPATCHED] += 1
        self.pool = pool
        self._counts = counts
        self._order = order  # in a pool: the backends to try, in order
        self._tried: list[Upstream] = []

    def move(self, status: RequestStatus) -> bool:
        old = self.status
        if old == status or old.is_finished:
            return False
        self.status = status
        self._counts[status] += 1
        return True

    async def failover(self, relay: Relay) -> bool:
        if self.pool is None:
            return False
        self.pool.refused(relay.upstream)
        self._tried.append(relay.upstream)
        other = next((u for u in self._order if u not in self._tried), None)
        if other is None:
            return False
        relay.upstream = other
        return True


class Responder:
    """The client's side of one answer: ASGI ``send``, and what has been sent."""

    __slots__ = ("send", "started", "client_gone")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False  # the status line is out: it cannot change
        self.client_gone = False  # from now on nothing is sent

    async def tracked(self, message: MutableMapping[str, Any]) -> None:
        """``send`` for an app that answers by itself (FastAPI): what it starts counts as started."""
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        if not self.client_gone:
            await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, chunk: bytes, *, more: bool = True) -> None:
        if not self.client_gone:
            await self.send({"type": "http.response.body", "body": chunk, "more_body": more})

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await self.start(status, headers)
        await self.body(body, more=False)

    async def error(self, dialect: Dialect, exc: RequestError, extra: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
        """Answer ``exc`` in the client's dialect (nothing when the answer has begun: see ``Relay``)."""
        if self.started:
            return
        payload = error_body(dialect, exc)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
        headers += extra
        await self.respond(exc.status_code, headers, payload)


@dataclass(eq=False, slots=True)
class Relay:
    """Open the upstream request and relay its answer (nothing once the client is gone)."""

    upstream: Upstream
    request: UpstreamRequest
    metrics: Metrics
    record: Record  # the request answered: its status is read here, changed through ``hooks.move``
    hooks: RelayHooks
    now: Callable[[], float] = time.monotonic  # seconds; the dispatcher's clock for scheduled requests
    status: int | None = None  # the status sent to the client, once sent
    usage: Usage | None = None  # what the backend produced, once read (see RelayHooks.usage)
    sent_s: float = field(default=0.0, repr=False)  # clock seconds when the request went upstream
    first_byte_s: float | None = field(default=None, repr=False)  # clock seconds of the answer's first byte
    content_type: str = field(default="", repr=False)  # the answer's, once its head arrived
    # Set by ``interrupt``: the status it ends the request with, and the error the client gets.
    _interrupt: tuple[RequestStatus, RequestError | None] | None = field(default=None, repr=False)

    def interrupt(self, task: asyncio.Task[Any], status: RequestStatus, error: RequestError | None = None) -> None:
        """End this request now (``task`` runs it) with ``status``, closing the backend connection
        if open; the client gets ``error`` (None: it left). A waiting request takes ``status`` at
        once (the lease's exit withdraws it); one being answered, when its task is interrupted (an
        answer whole by then keeps its ending). The first call wins."""
        if self._interrupt is not None or self.record.status.is_finished:
            return
        self._interrupt = (status, error)
        if self.record.status is RequestStatus.WAITING:
            self.hooks.move(status)
        task.cancel()

    def interrupted(self) -> bool:
        """In the task's ``except CancelledError``: cancelled by ``interrupt``, and by nothing else."""
        task = asyncio.current_task()
        return self._interrupt is not None and task is not None and task.uncancel() == 0

    async def end_interrupted(self, out: Responder) -> None:
        """Give what ``interrupt`` ended its status, and its error (nothing when the answer was whole
        already: its stream's end event went out)."""
        assert self._interrupt is not None
        (status, error), self._interrupt = self._interrupt, None
        if not self.record.status.is_finished:
            self.hooks.move(status)
        elif self.record.status is not status:
            return
        if error is not None:
            if out.started:
                await self.end_with_error(out, error)
            else:
                await self.send_error(out, error)

    async def run(self, out: Responder) -> None:
        """Relay the answer to ``out``; never raises a ``RequestError`` (the client gets it)."""
        try:
            await self._run(out)
        except asyncio.CancelledError:
            if not self.interrupted():
                raise
            await self.end_interrupted(out)

    async def _run(self, out: Responder) -> None:
        try:
            response = await self._open(out)
        except RequestError as exc:
            self._count_upstream_error(exc)
            self.hooks.move(RequestStatus.UPSTREAM_ERROR)
            await self.send_error(out, exc)
            return
        if response is None:  # the client left while the backend was waited for: never sent
            self.hooks.move(RequestStatus.CLIENT_LEFT_BEFORE_SEND)
            return
        try:
            await self._relay_body(response, out)
        finally:
            await response.aclose()

    async def _open(self, out: Responder) -> UpstreamResponse | None:
        """Open the upstream request (None: the client left before it was sent). While the backend
        is down (connection refused or not accepted in time), suspect (a first-byte deadline passed)
        or, for a scheduled request, answers 503 (a model loading), nothing has been generated: wait
        for its health check, up to ``wait_s`` from the outage's start, and send again (in a pool,
        ``failover`` may pick another backend). A suspect one still failing it then is never sent
        the request: 503 with Retry-After."""
        unavailable_since_s: float | None = None  # our own first 503 (a loading model)
        wait_s = self.request.wait_s
        resend_in_s = RESEND_AFTER_503_S
        while True:
            if out.client_gone:
                return None
            if self.upstream.suspect:
                deadline_s = self.upstream.outage_deadline_s(wait_s)
                ready = await self.upstream.wait_until_ready(deadline_s, lambda: out.client_gone)
                if out.client_gone:
                    return None
                if not ready:
                    if await self._failed_over("did not pass its health check after a first-byte timeout"):
                        continue
                    raise UpstreamNotReady(
                        "the backend is not answering; try again later",
                        retry_after_s=max(1, math.ceil(wait_s)),
                        detail=f"backend {self.upstream.name} did not pass its health check after a first-byte "
                        f"timeout, within backend_wait_s ({wait_s:g} s); not sent",
                    )
            r = self.request  # a failover may rewrite it for its new backend
            self.sent_s = self.now()
            try:
                response = await self.upstream.open(
                    r.method, r.target, headers=r.headers, authorization=r.authorization, body=r.body,
                    close_connection=r.close_connection,
                )  # fmt: skip
            except RequestError as exc:
                if not (isinstance(exc, (UpstreamUnavailable, UpstreamTimeout)) and exc.never_sent):
                    self._count_backend("failed")
                    self.hooks.backend_state(self.upstream, False)
                    raise
                self._count_backend("refused")
                if await self._failed_over("refused the connection"):
                    continue
                deadline_s = self.upstream.outage_deadline_s(wait_s)
                if time.monotonic() >= deadline_s:
                    raise
                if not await self.upstream.wait_until_ready(deadline_s, lambda: out.client_gone):
                    if out.client_gone:
                        return None
                    raise
                continue
            self._count_backend("answered")
            self.hooks.backend_state(self.upstream, True)
            if response.status_code != 503 or not r.retry_unavailable:
                return response
            unavailable_since_s = unavailable_since_s or time.monotonic()
            deadline_s = unavailable_since_s + wait_s
            if time.monotonic() >= deadline_s:
                return response  # relayed as it is: the backend's own 503 and reason
            await response.aclose()
            logger.info(
                "the backend answered 503 before starting; waiting up to %.0f s for it", deadline_s - time.monotonic()
            )
            # A backend whose health check passes can still refuse this very request (its own queue
            # full): the health check alone would let it be sent again at once, hundreds of times.
            await asyncio.sleep(min(resend_in_s, max(0.0, deadline_s - time.monotonic())))
            resend_in_s = min(RESEND_AFTER_503_MAX_S, 2 * resend_in_s)
            await self.upstream.wait_until_ready(deadline_s, lambda: out.client_gone)

    async def _failed_over(self, why: str) -> bool:
        """In a pool: send to another backend instead of this one, which ``why`` (nothing was sent).
        False when there is none: the caller waits for this one."""
        refused = self.upstream
        if not await self.hooks.failover(self):
            return False
        logger.info("backend %s %s; sending to %s", refused.name, why, self.upstream.name)
        return True

    async def _relay_body(self, response: UpstreamResponse, out: Responder) -> None:
        self.status = status = response.status_code
        self.content_type = header(response, b"content-type")
        length = header(response, b"content-length")
        known_bytes = int(length) if length.isdigit() else -1  # -1: streamed, or read to the close
        hooks = self.hooks
        tap = UsageTap(self.content_type) if hooks.reads_usage and 200 <= status < 300 else None
        # The head at once: a stream's first token may be seconds away.
        await out.start(status, response_headers(response.raw_headers) + hooks.own_headers())
        relayed_bytes = 0
        arrived_s = 0.0  # the first byte's arrival
        try:
            while chunk := await self.upstream.read_chunk(response):
                first = self.first_byte_s is None
                if first:
                    self.first_byte_s = arrived_s = self.now()
                    hooks.move(RequestStatus.STREAMING)
                relayed_bytes += len(chunk)
                last = relayed_bytes == known_bytes  # a body of known length ends with its last bytes
                if tap is not None:
                    tap.feed(chunk)  # a few microseconds: before the bytes go out, for the stream's end below
                    if tap.ended and not last:
                        # The stream's end event: the answer is whole, its counts in. Recorded before
                        # the event goes out, so that a client closing as soon as it has it (the
                        # OpenAI SDK does) cannot lose it; the body's end is relayed when it comes.
                        self._completed(tap, out)
                if not last:
                    # The client's bytes first; the bookkeeping below comes after (a stream's first
                    # token is not held back by it). The last ones wait for the usage.
                    await out.body(chunk)
                if first:
                    hooks.first_byte(arrived_s)
                if tap is not None and tap.is_stream:
                    hooks.progress(tap.stream_events)
                if last:
                    self._completed(tap, out)
                    await out.body(chunk, more=False)
                    return
        except RequestError as exc:
            if tap is not None and tap.ended:  # after the stream's end event: the answer is whole
                logger.debug("the backend's body broke off after its stream's end: %s", exc.detail)
                await out.body(b"", more=False)
                return
            self._count_upstream_error(exc)
            self._count_backend("failed_mid_answer")
            hooks.backend_state(self.upstream, False)
            hooks.move(RequestStatus.UPSTREAM_ERROR_MID_BODY)
            await self.end_with_error(out, exc)
            return
        self._completed(tap, out)
        await out.body(b"", more=False)

    def _completed(self, tap: UsageTap | None, out: Responder) -> None:
        """The whole answer has arrived (once: a stream's end event, or the body's end); its last
        bytes are about to go out (the learner's observation is in before the client has it all).
        From here on a client that leaves does not end the relay (its status is no longer in progress)."""
        if not self.record.status.in_progress:
            return
        if tap is not None:
            self.usage = tap.usage(wall_s=self.now() - self.sent_s, request_model=self.request.model)
            self.hooks.usage(self.usage)
        self.hooks.move(RequestStatus.COMPLETED if not out.client_gone else RequestStatus.CLIENT_LEFT_STREAMING)

    async def end_with_error(self, out: Responder, exc: RequestError) -> None:
        """End an answer that has begun: one final error event in a stream's framing, or, for a
        plain body, no end at all (the server closes the connection: the client sees it cut short)."""
        event = stream_error_event(self.request.dialect, self.content_type, exc)
        if event:
            await out.body(event, more=False)

    async def send_error(self, out: Responder, exc: RequestError) -> None:
        if out.started:
            return
        self.status = exc.status_code
        await out.error(self.request.dialect, exc, self.hooks.own_headers())

    def _count_backend(self, outcome: str) -> None:
        self.metrics.backends.requests[self.upstream.name, outcome].inc()

    def _count_upstream_error(self, exc: RequestError) -> None:
        self.metrics.backends.errors["timeout" if isinstance(exc, UpstreamTimeout) else "unavailable"].inc()
        path = self.request.target.partition("?")[0]  # its query may carry a client's token
        logger.warning("upstream error on %s %s: %s", self.request.method, path, exc.detail)


async def disconnected(receive: Receive) -> None:
    """Return when the server reports that the client has gone (its body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def relay_unscheduled(relay: Relay, out: Responder, receive: Receive, metrics: Metrics) -> None:
    """Relay a pass-through answer at once; a client that leaves ends it (no slot to drain for)."""
    task = asyncio.current_task()
    assert task is not None

    async def watch() -> None:
        await disconnected(receive)
        out.client_gone = True
        if relay.record.status.in_progress:
            metrics.requests.disconnects["streaming"].inc()
            relay.interrupt(task, RequestStatus.CLIENT_LEFT_STREAMING)

    watching = asyncio.create_task(watch())
    try:
        await relay.run(out)
    finally:
        watching.cancel()
