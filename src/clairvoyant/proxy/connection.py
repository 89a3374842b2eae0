"""A client connection: the proxy's own HTTP/1.1 server, one asyncio Protocol per connection.

uvicorn keeps the process's life (binding, the lifespan, signals, the graceful shutdown: its
``http=`` option takes this class, ``server.build_server``); everything between the socket and the
proxy is here, as callbacks on the event loop (docs/design.md, "The client connection"):

- **Requests** are read with httptools' parser (llhttp) and handed over whole (head and body) to
  the ``Site`` (``app.ProxyApp``): a scheduled or pass-through request to ``Site.serve``, which
  answers through this connection's ``start``/``write``/``finish`` (no ASGI, no task while a
  request waits: measured, docs/benchmarks.md section 22); the proxy's own endpoints (health,
  metrics, queue, the live page) to the FastAPI app through a small ASGI bridge (``_AsgiCycle``),
  one task each.
- **Client limits**: the request line and headers must arrive within ``client_timeout_s`` of the
  connection opening (or of the next request's first byte on a kept-alive connection) and the body
  within ``client_timeout_s`` of the headers, else 408 in the path's dialect; a head above
  ``max_header_bytes`` is 431, a body above ``max_body_bytes`` 413; a connection beyond
  ``max_connections`` (parked ones count) gets 503; an idle kept-alive connection closes after
  ``keep_alive_timeout_s``. A refused connection is closed lingering: our side ends, what the
  client still sends is read and dropped for ``LINGER_S``, so that it reads the refusal rather than
  a reset. A client that leaves mid-upload is the Site's ``upload_lost``: counted, one log line.
  What llhttp cannot parse is 400, and the connection closes; a well-formed request line with a
  method llhttp does not know is 501 (the methods it knows and the proxy does not serve are 405).
  Client sockets get TCP keepalive and a user timeout (``tcp_keepalive``: a vanished host is found).
- **Answers**: the status line and headers are written with the first body bytes when they are at
  hand (one write for a whole JSON answer); a body without Content-Length is chunked (HTTP/1.1) or
  ends with the connection (HTTP/1.0); HEAD, 204 and 304 have none. Each answer carries the
  server's Date (uvicorn's, refreshed every second) and no Server header of ours.
- **Keep-alive and pipelining**: one request is answered at a time; a request pipelined behind it
  is read whole, reading pauses, and it is served when the answer before it is complete.
- **Disconnects**: the Site's listener for the running answer (``listener.client_left``) is called
  once when the client goes; its writes are dropped from then on.
- **Parking** (``park``): a request that must wait for a slot gives its connection up to the
  ``ParkingLot`` (proxy/parking.py), a bare file descriptor watched for the client leaving, and
  gets a new ``HttpConnection`` at dispatch (``resume_connection``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import unquote

import httptools

from clairvoyant.errors import HeadersTooLarge, PayloadTooLarge, RequestError, RequestTimeout
from clairvoyant.logs import log_request
from clairvoyant.prediction.dialects import dialect_of_path, error_body
from clairvoyant.proxy.keepalive import tcp_keepalive

__all__ = [
    "ASGI",
    "LINGER_S",
    "NATIVE",
    "ClientLimits",
    "HttpConnection",
    "Listener",
    "Parker",
    "Request",
    "Site",
    "closing_answer",
]

logger = logging.getLogger(__name__)

LINGER_S = 1.0  # seconds a refused connection is still read (and discarded) before it is closed
NATIVE, ASGI = 0, 1  # what ``Site.route`` answers for a request: served by ``Site.serve``, or as ASGI
_STATUS_LINES = {
    status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode("latin-1") for status in HTTPStatus
}
_NO_BODY_STATUSES = frozenset({204, 304})
_CONNECTION_CLOSE = b"connection: close\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_BAD_REQUEST = b"Invalid HTTP request received."
_NOT_IMPLEMENTED = b"Method not implemented."
# A request line: a method token (RFC 9110 tchar), a target without spaces, an HTTP version
_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [^ \r\n]+ HTTP/\d\.\d\r\n")
_JSON = (b"content-type", b"application/json")
_PLAIN_TEXT = (b"content-type", b"text/plain; charset=utf-8")
_KEEP_ALIVE, _HTTP11 = 1, 2  # response_context bits
_NOTHING, _READING, _IDLE = 0, 1, 2  # what a connection's expires_s is for
_DETACHED_PARSER = httptools.HttpRequestParser(object())  # a closed connection's: bound to nothing, never fed
TICK_S = 0.25  # seconds between the server's checks of its connections' deadlines


@dataclass(frozen=True, slots=True)
class ClientLimits:
    client_timeout_s: float  # seconds for the request's head, then for its body
    max_header_bytes: int
    max_body_bytes: int
    max_connections: int
    keep_alive_timeout_s: float  # seconds an idle kept-alive connection stays open
    on_rejected: Callable[[str], None] = lambda reason: None  # counts a limit hit (metrics)
    tcp_keepalive_s: float = 0.0  # seconds idle before TCP keepalive probes (``tcp_keepalive``); 0 = the system's


class Request:
    """One request, read whole. ``headers``: the client's, names in lower case, in order."""

    __slots__ = ("method", "path", "raw_path", "query", "headers", "http_version", "keep_alive", "body")

    def __init__(
        self,
        method: str,
        path: str,
        raw_path: bytes,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        http_version: str,
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.path = path  # percent-decoded
        self.raw_path = raw_path
        self.query = query  # raw, without the "?"
        self.headers = headers
        self.http_version = http_version  # "1.1" or "1.0"
        self.keep_alive = keep_alive  # the client lets the connection stay open after the answer
        self.body = b""


class Listener(Protocol):
    """Who is told that the client of the running answer left (once, from the loop)."""

    def client_left(self) -> None: ...


class Parker(Protocol):
    """Who parks a connection (``HttpConnection.park_when_read``): told its handle once parked."""

    def parked(self, fd: int) -> None: ...


class Site(Protocol):
    """What a connection serves: ``app.ProxyApp``."""

    asgi: Any  # the ASGI app for requests routed ASGI (the proxy's own endpoints)
    parking: Any  # the ParkingLot waiting connections are parked in, or None

    def route(self, method: str, path: str) -> int:
        """NATIVE or ASGI, for a request's method and path."""
        ...

    def serve(self, conn: HttpConnection, request: Request) -> None:
        """Answer a NATIVE request (now or later, through ``conn`` or the connection it resumes)."""
        ...

    def upload_lost(self, request: Request) -> None:
        """The client of a NATIVE request left (or was cut off) before its whole body arrived."""
        ...

    def too_large(self, request: Request, error: RequestError) -> None:
        """A NATIVE request's body is over ``max_body_bytes``: count and log it (the connection
        answers 413 and closes)."""
        ...


class _Shared:
    """What every connection of one server shares."""

    __slots__ = ("connection_class", "site", "limits", "server_state", "app_state", "parking", "ticker")

    def __init__(
        self,
        connection_class: type[HttpConnection],
        site: Site,
        limits: ClientLimits,
        server_state: Any,
        app_state: dict[str, Any],
    ) -> None:
        self.connection_class = connection_class  # the server's own subclass (a resumed connection is one too)
        self.site = site
        self.limits = limits
        self.server_state = server_state  # uvicorn's: connections, tasks, default_headers (Date)
        self.app_state = app_state  # the lifespan's state, copied into each ASGI scope
        self.parking: Any = None  # the ParkingLot once the proxy has one (its len counts toward max_connections)
        self.ticker: asyncio.TimerHandle | None = None

    def run_task(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run an answer's coroutine as a task the server waits for at shutdown (and cancels after
        its graceful timeout)."""
        tasks = self.server_state.tasks
        task = asyncio.get_running_loop().create_task(coro, name=name)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def start_ticker(self, loop: asyncio.AbstractEventLoop) -> None:
        """Check every connection's deadline each ``TICK_S`` (one timer for the server, none per
        request: a deadline fires up to ``TICK_S`` late)."""
        if self.ticker is None:
            self.ticker = loop.call_later(TICK_S, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now_s = loop.time()
        for conn in list(self.server_state.connections):
            try:
                conn.expire(now_s)
            except Exception:  # one connection's failure must not stop the others' deadlines
                logger.exception("a connection's deadline check failed")
        self.ticker = loop.call_later(TICK_S, self._tick, loop) if self.server_state.connections else None


class HttpConnection(asyncio.Protocol):
    """One client connection (see the module docstring). Built by uvicorn with
    ``(config=..., server_state=..., app_state=...)``; ``site`` and ``limits`` are class
    attributes of the subclass ``server.build_server`` makes."""

    site: Site
    limits: ClientLimits

    __slots__ = (
        "loop", "shared", "transport", "parser", "url", "headers", "header_bytes", "head_size", "in_head", "request",
        "body", "body_bytes", "kind", "expires_s", "expiry", "pipeline", "busy", "listener", "gone",
        "rejected", "parked", "read_paused", "write_paused", "drain_waiter", "keep_alive", "head_only",
        "http11", "chunked", "no_body", "remaining", "out_started", "head", "resumed", "upgraded", "in_message",
        "park_owner",
    )  # fmt: skip

    def __init__(
        self,
        config: Any = None,
        server_state: Any = None,
        app_state: dict[str, Any] | None = None,
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        shared: _Shared | None = None,
        resumed: int | None = None,
    ) -> None:
        """``resumed``: the ``response_context`` of a parked request whose answer this connection
        writes first (``resume_connection``)."""
        self.loop = _loop or asyncio.get_running_loop()
        if shared is None:
            shared = self._shared_for(server_state, app_state or {})
        self.shared = shared
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0  # bytes read since the head began (counted per read: bounds a head that never ends)
        self.head_size = 0  # the head's own bytes (request line and headers), counted as it is parsed
        self.in_head = True  # reading a request line and headers (not a body)
        self.request: Request | None = None  # the request being read
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.kind = NATIVE
        # What the connection waits for, and until when (loop seconds): the client's head or body
        # (client_timeout_s), or its next request (keep_alive_timeout_s). Checked by the server's
        # ticker, not a timer per request.
        self.expires_s = math.inf
        self.expiry = _NOTHING
        self.pipeline: list[
            tuple[int, Request]
        ] = []  # read whole, behind the running answer (56 bytes, not a deque's ~600)
        self.busy = False  # an answer is running (from the request's dispatch to its last byte)
        self.listener: Listener | None = None  # told if the client leaves during the running answer
        self.gone = False  # the client left (or the connection was closed): writes are dropped
        self.rejected = False  # refused by a limit: nothing more is read
        self.parked = False  # handed to the parking lot: this object is done
        self.read_paused = False
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        # The running answer's framing
        self.keep_alive = True
        self.head_only = False
        self.http11 = True
        self.chunked = False
        self.no_body = False
        self.remaining = -1  # Content-Length bytes still to write; -1: no length
        self.out_started = False  # status line written (or held in ``head``)
        self.head = b""  # the status line and headers, held until the first body bytes or flush()
        self.resumed = resumed
        self.upgraded = False  # the parser stopped at an Upgrade: the connection ends after this answer
        self.in_message = False  # the parser is inside a request (from its first byte to its end)
        self.park_owner: Parker | None = None  # asked to park once the read in progress is parsed
        if resumed is not None:
            self.busy = True
            self.keep_alive = bool(resumed & _KEEP_ALIVE)
            self.http11 = bool(resumed & _HTTP11)

    @classmethod
    def _shared_for(cls, server_state: Any, app_state: dict[str, Any]) -> _Shared:
        """The server's shared state, made by its first connection (the subclass is the server's own)."""
        shared: _Shared | None = cls.__dict__.get("_shared")
        if shared is None:
            shared = _Shared(cls, cls.site, cls.limits, server_state, app_state)
            shared.parking = cls.site.parking  # made by the lifespan, which has run by now
            cls._shared = shared  # type: ignore[attr-defined]
        return shared

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        shared = self.shared
        connections = shared.server_state.connections
        connections.add(self)
        shared.start_ticker(self.loop)
        if self.resumed is not None:
            return  # admitted already; its answer is on its way (the socket keeps its options)
        if shared.limits.tcp_keepalive_s > 0:
            tcp_keepalive(transport.get_extra_info("socket"), shared.limits.tcp_keepalive_s)
        parked = len(shared.parking) if shared.parking is not None else 0
        if len(connections) + parked > shared.limits.max_connections:
            self._reject(503, RequestError("too many open connections; retry later"), "max_connections")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.shared.server_state.connections.discard(self)
        self.expiry = _NOTHING
        # The parser holds this protocol (its callbacks): drop it, so the pair is freed by its
        # reference counts now rather than by a later collection of the cycle (a parked
        # connection's protocol is dropped right here).
        self.parser = _DETACHED_PARSER
        if self.parked:
            return  # the parking lot holds the connection: this transport only let go of it
        self.gone = True
        self._wake_drain()
        request = self.request
        if request is not None and not self.in_head and not self.rejected:
            self.request = None
            if self.kind == NATIVE:
                self.shared.site.upload_lost(request)
        listener, self.listener = self.listener, None
        if listener is not None:
            try:
                listener.client_left()
            except Exception:  # the connection is gone either way; the listener's failure is its own
                logger.exception("a disconnect listener failed")

    def eof_received(self) -> bool | None:
        return None  # a client that stops sending has left: close (as uvicorn)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    def data_received(self, data: bytes) -> None:
        if self.rejected or self.parked:
            return
        if self.expiry == _IDLE:
            self.expiry = _NOTHING
        if self.in_head:
            self.header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol switch here: the request is answered as plain HTTP, then the connection ends
            self.upgraded = True
            self.keep_alive = False
            if not self.busy and not self.transport.is_closing():
                self.gone = True
                self.transport.close()
        except httptools.HttpParserInvalidMethodError:
            # llhttp knows a fixed list of methods. A well-formed request line with another one
            # (BREW /pot HTTP/1.1) is a method not implemented here (RFC 9110: 501); anything
            # else it could not read as a method (a TLS hello, text) stays a bad request.
            if not self.rejected:
                self._bad_request(not_implemented=_REQUEST_LINE.match(data) is not None)
            return
        except httptools.HttpParserError:
            if not self.rejected:
                self._bad_request()
            return
        if self.park_owner is not None:  # the whole read is parsed: nothing of it would be lost now
            self._park()
        # Counted per read, so a read that also carries body bytes may overcount: only a head still
        # incomplete after it is refused.
        if self.in_head and self.header_bytes > self.shared.limits.max_header_bytes and not self.rejected:
            self._too_large_head()

    # --- parser callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.in_message = True
        self.url = b""
        self.headers = []
        self.head_size = 0
        self.in_head = True
        if self.expiry == _NOTHING:  # a kept-alive connection's next request: its first byte starts the clock
            self._arm()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))
        self.head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        if self.rejected:
            return
        self.in_head = False
        url = self.url
        if self.head_size + len(url) > self.shared.limits.max_header_bytes:
            self._too_large_head()
            return
        self.header_bytes = 0
        parser = self.parser
        raw_path, _, query = url.partition(b"?")
        if raw_path[:1] != b"/":  # an absolute-form target (http://host/path) or "*"
            try:
                parsed = httptools.parse_url(url)
                raw_path, query = parsed.path or b"/", parsed.query or b""
            except httptools.HttpParserInvalidURLError:
                self._bad_request()
                return
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        method = parser.get_method().decode("ascii")
        version = parser.get_http_version()
        request = Request(method, path, raw_path, query, self.headers, version, parser.should_keep_alive())
        self.request = request
        self.body = []
        self.body_bytes = 0
        self.kind = self.shared.site.route(method, path)
        self._arm()  # the body's deadline (disarmed at once if there is no body)
        limit = self.shared.limits.max_body_bytes
        expect_continue = False
        for name, value in request.headers:
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    self._reject(
                        413, PayloadTooLarge(f"request body of {int(value)} bytes exceeds the limit of {limit} bytes"),
                        "too_large",
                    )  # fmt: skip
                    return
            elif name == b"expect" and value.lower() == b"100-continue":
                expect_continue = True
        if expect_continue and version != "1.0" and not self.busy and not self.pipeline:  # RFC 9110 10.1.1
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.rejected:
            return
        self.body.append(body)
        self.body_bytes += len(body)
        limit = self.shared.limits.max_body_bytes
        if self.body_bytes > limit:
            self._reject(413, PayloadTooLarge(f"request body exceeds the limit of {limit} bytes"), "too_large")

    def on_message_complete(self) -> None:
        self.in_message = False
        self._disarm()
        self.in_head = True  # what comes next is a head: its bytes count toward max_header_bytes
        request = self.request
        if self.rejected or request is None:
            return
        self.request = None
        body = self.body
        if body:
            request.body = body[0] if len(body) == 1 else b"".join(body)
            self.body = []
        if self.busy:  # pipelined behind the running answer: read, served after it
            self.pipeline.append((self.kind, request))
            self._pause_reading()
            return
        self._dispatch(self.kind, request)

    # --- serving ---------------------------------------------------------------------------------
    def _dispatch(self, kind: int, request: Request) -> None:
        self.busy = True
        self.keep_alive = request.keep_alive and not self.upgraded
        self.http11 = request.http_version == "1.1"
        self.head_only = request.method == "HEAD"
        self.out_started = False
        if kind == NATIVE:
            try:
                self.shared.site.serve(self, request)
            except Exception:  # the Site answers its own errors; this is a bug, never a dead connection
                logger.exception("unexpected error on %s %s", request.method, request.path)
                if not self.out_started:
                    self.respond(500, [_PLAIN_TEXT], b"Internal Server Error")
                else:
                    self.cut()
        else:
            cycle = _AsgiCycle(self, request)
            self.listener = cycle
            self.shared.run_task(cycle.run(self.shared.site.asgi), name="asgi")

    # --- writing an answer -----------------------------------------------------------------------
    def start(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
        *,
        end: bool = False,
        lines: bytes = b"",
        length: int = -1,
    ) -> None:
        """The answer's status line and headers (names in lower case), and its first body bytes if
        they are at hand: written together, now when there is a body or ``end``, else at the first
        ``write`` or ``flush``. ``end``: ``body`` is the whole answer. ``lines``: more headers,
        rendered (``name: value\\r\\n`` each), with ``length`` their Content-Length (-1: none).
        Headers the connection owns (Date, Connection, Transfer-Encoding) must not be among them."""
        self.out_started = True
        self.chunked = False
        self.remaining = length
        self.no_body = self.head_only or status in _NO_BODY_STATUSES or status < 200
        parts = [_STATUS_LINES.get(status) or f"HTTP/1.1 {status} \r\n".encode()]
        for name, value in self.shared.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            if name == b"content-length":
                self.remaining = int(value) if value.isdigit() else -1
            parts += (name, b": ", value, b"\r\n")
        if lines:
            parts.append(lines)
        if not self.no_body and self.remaining < 0:
            if end:  # the whole body is here: give it a length
                self.remaining = len(body)
                parts += (b"content-length: ", str(len(body)).encode(), b"\r\n")
            elif self.http11:
                self.chunked = True
                parts.append(_CHUNKED)
            else:  # HTTP/1.0: the body ends with the connection
                self.keep_alive = False
        if not self.keep_alive:
            parts.append(_CONNECTION_CLOSE)
        parts.append(b"\r\n")
        self.head = b"".join(parts)
        if end:
            self.finish(body)
        elif body:
            self.write(body)

    def write(self, data: bytes) -> None:
        """Body bytes (chunk-framed when the answer is chunked); dropped once the client is gone."""
        if self.gone or not self.busy:
            return
        head, self.head = self.head, b""
        if self.no_body or not data:
            if head:
                self.transport.write(head)
            return
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        elif self.remaining >= 0:
            self.remaining -= len(data)
        self.transport.write(head + data if head else data)

    def flush(self) -> None:
        """Write the held status line and headers now (an answer whose body is slow to come)."""
        if self.head and not self.gone:
            head, self.head = self.head, b""
            self.transport.write(head)

    def finish(self, data: bytes = b"") -> None:
        """The answer's last bytes: the connection is kept for the next request, or closed."""
        if not self.busy:
            return
        if not self.gone:
            head, self.head = self.head, b""
            if self.no_body:
                data = b""
            elif self.chunked:
                data = (b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)) if data else b"0\r\n\r\n"
            elif self.remaining >= 0:
                self.remaining -= len(data)
                if self.remaining != 0:  # the body is not the length announced: the client cannot reuse this
                    self.keep_alive = False
            if head or data:
                self.transport.write(head + data if head else data)
        self._answered()

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, lines: bytes = b"") -> None:
        """A whole answer at once (with its Content-Length); ``lines`` as in ``start``."""
        if self.busy:
            self.start(status, headers, body, end=True, lines=lines)

    def cut(self) -> None:
        """End a broken answer: close the connection (the client sees it cut short)."""
        if not self.busy:
            return
        self.keep_alive = False
        if not self.gone:
            self.flush()
        self._answered()

    @property
    def paused(self) -> bool:
        """The client reads slower than the answer comes: ``await drain()`` before writing more."""
        return self.write_paused and not self.gone

    async def drain(self) -> None:
        """Wait until the transport takes writes again (or the client is gone)."""
        while self.write_paused and not self.gone:
            waiter = self.drain_waiter = self.loop.create_future()
            await waiter

    def _wake_drain(self) -> None:
        waiter, self.drain_waiter = self.drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _answered(self) -> None:
        self.busy = False
        self.listener = None
        self.head = b""
        self.shared.server_state.total_requests += 1
        if self.gone:
            return
        if not self.keep_alive or self.transport.is_closing():
            self.gone = True
            self.transport.close()
            return
        if self.pipeline:
            kind, request = self.pipeline.pop(0)
            self.loop.call_soon(self._serve_pipelined, kind, request)
            return
        self._resume_reading()
        if self.request is None:  # nothing of a next request read yet
            self.expiry = _IDLE
            self.expires_s = self.loop.time() + self.shared.limits.keep_alive_timeout_s

    def _serve_pipelined(self, kind: int, request: Request) -> None:
        if not self.gone and not self.busy:
            self._dispatch(kind, request)
            if self.park_owner is not None:  # no read in progress: park now, if nothing else was read
                self._park()
            if not self.busy and not self.pipeline:
                self._resume_reading()

    # --- parking ---------------------------------------------------------------------------------
    def park_when_read(self, owner: Parker) -> None:
        """Give this connection up to the parking lot while its request waits for a slot, once the
        read in progress is parsed (bytes after the request in it were taken from the socket: they
        would be lost with the transport). ``owner.parked(fd)`` gets the handle to resume it with;
        the connection stays live (and nothing is called) when something of a next request was
        read, or the lot refuses (no lot, TLS...). ``owner`` is what the lot reports leaving."""
        self.park_owner = owner

    def _park(self) -> None:
        owner, self.park_owner = self.park_owner, None
        lot = self.shared.parking
        if owner is None or lot is None or not self.busy or self.pipeline or self.in_message or self.gone:
            return
        if self.out_started or self.transport.is_closing():
            return
        self.parked = True  # before the transport lets go: its connection_lost is not a disconnect
        fd: int | None = lot.park(self.transport, owner)
        if fd is None:
            self.parked = False
            return
        self.listener = None
        self.expiry = _NOTHING
        owner.parked(fd)

    @property
    def response_context(self) -> int:
        """The running answer's framing flags (keep-alive, HTTP/1.1), as one small int: what a
        resumed connection needs to frame it (a waiting request keeps it)."""
        return (_KEEP_ALIVE if self.keep_alive else 0) | (_HTTP11 if self.http11 else 0)

    # --- limits ----------------------------------------------------------------------------------
    def _arm(self) -> None:
        self.expiry = _READING
        self.expires_s = self.loop.time() + self.shared.limits.client_timeout_s

    def _disarm(self) -> None:
        self.expiry = _NOTHING

    def expire(self, now_s: float) -> None:
        """The ticker's check: act on a deadline that has passed."""
        if now_s < self.expires_s or self.expiry == _NOTHING:
            return
        expiry, self.expiry = self.expiry, _NOTHING
        if expiry == _IDLE:
            if not self.busy and self.request is None and not self.transport.is_closing():
                self.gone = True
                self.transport.close()
        else:
            self._timed_out()

    def _timed_out(self) -> None:
        if self.transport.is_closing() or self.rejected:
            return
        what = "headers" if self.in_head else "body"
        timeout_s = self.shared.limits.client_timeout_s
        self._reject(408, RequestTimeout(f"the request {what} did not arrive within {timeout_s:g} s"), "client_timeout")

    def _too_large_head(self) -> None:
        limit = self.shared.limits.max_header_bytes
        self._reject(431, HeadersTooLarge(f"request headers exceed {limit} bytes"), "header_too_large")

    def _path(self) -> str:
        """The path of the request being read (for the error's dialect), or "/" before its line."""
        if self.request is not None:
            return self.request.path
        return self.url.split(b"?", 1)[0].decode("latin-1") or "/"

    def _reject(self, status: int, error: RequestError, reason: str) -> None:
        """Answer ``status`` (unless an answer is running: it finishes, then the connection closes),
        count and log it, and close lingering."""
        self._disarm()
        self.rejected = True
        path = self._path()
        request = self.request
        self.request = None
        if reason == "too_large" and request is not None:
            self.shared.site.too_large(request, error)  # the request's own counters and line
        else:
            self.shared.limits.on_rejected(reason)
            log_request({"path": path, "status": status, "outcome": reason})
        if request is not None and reason == "client_timeout" and self.kind == NATIVE:
            self.shared.site.upload_lost(request)  # cut off mid-body: the request's own counters
        if self.busy:  # an answer is running (a request pipelined behind it was refused): close after it
            self.keep_alive = False
            self.pipeline.clear()
            return
        body = error_body(dialect_of_path(path), error)
        self.transport.write(closing_answer(status, [_JSON], body, self.shared.server_state))
        self._linger()

    def _bad_request(self, not_implemented: bool = False) -> None:
        self._disarm()
        self.rejected = True
        self.request = None
        logger.warning("Unknown HTTP method received." if not_implemented else "Invalid HTTP request received.")
        if not self.busy:
            status, body = (501, _NOT_IMPLEMENTED) if not_implemented else (400, _BAD_REQUEST)
            self.transport.write(closing_answer(status, [_PLAIN_TEXT], body, self.shared.server_state))
            self._linger()
        else:
            self.keep_alive = False
            self.pipeline.clear()

    def _linger(self) -> None:
        """End our side now, discard what the client still sends, close fully a little later:
        closing at once with its bytes unread would reset the connection, and the client could
        lose the answer just written."""
        self.gone = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _pause_reading(self) -> None:
        if not self.read_paused and not self.transport.is_closing():
            self.read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.read_paused and not self.transport.is_closing():
            self.read_paused = False
            self.transport.resume_reading()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close an idle connection now, a busy one after its answer."""
        if not self.busy and self.request is None:
            if not self.transport.is_closing():
                self.gone = True
                self.transport.close()
        else:
            self.keep_alive = False


def closing_answer(status: int, headers: list[tuple[bytes, bytes]], body: bytes, server_state: Any) -> bytes:
    """A whole answer as bytes, with the server's Date, its Content-Length and ``connection: close``:
    a refusal written at once where no answer runs (a rejected connection, a parked one)."""
    parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
    for name, value in (*server_state.default_headers, *headers):
        parts += (name, b": ", value, b"\r\n")
    parts += (b"content-length: %d\r\n" % len(body), _CONNECTION_CLOSE, b"\r\n", body)
    return b"".join(parts)


async def resume_connection(shared: _Shared, fd: int, context: int) -> HttpConnection:
    """A parked request's connection, live again, ready for its answer (``context``: its
    ``response_context``). Raises ``OSError`` when the client is gone."""
    loop = asyncio.get_running_loop()
    connection = shared.connection_class
    _, protocol = await shared.parking.resume(fd, lambda: connection(_loop=loop, shared=shared, resumed=context))
    assert isinstance(protocol, HttpConnection)
    return protocol


class _AsgiCycle:
    """One request to the ASGI app (the proxy's own endpoints): its body at once, the answer
    through the connection (its start held until the first body message, so a small answer is
    one write)."""

    __slots__ = ("conn", "request", "given", "status", "headers", "started", "complete", "left")

    def __init__(self, conn: HttpConnection, request: Request) -> None:
        self.conn = conn
        self.request = request
        self.given = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.started = False  # http.response.start received
        self.complete = False
        self.left: asyncio.Event | None = None

    def scope(self) -> dict[str, Any]:
        conn = self.conn
        request = self.request
        transport = conn.transport
        server = transport.get_extra_info("sockname")
        client = transport.get_extra_info("peername")
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version,
            "server": tuple(server[:2]) if isinstance(server, tuple) else None,
            "client": tuple(client[:2]) if isinstance(client, tuple) else None,
            "scheme": "http",
            # HEAD is GET without a body (RFC 9110 9.3.2): the app answers GET, the connection drops the body
            "method": "GET" if request.method == "HEAD" else request.method,
            "root_path": "",
            "path": request.path,
            "raw_path": request.raw_path,
            "query_string": request.query,
            "headers": request.headers,
            "state": conn.shared.app_state.copy(),
        }

    async def run(self, app: Any) -> None:
        conn = self.conn
        try:
            await app(self.scope(), self.receive, self.send)
        except BaseException as exc:
            logger.error("Exception in ASGI application", exc_info=exc)
            if not self.started and conn.busy and not conn.out_started:
                conn.respond(500, [_PLAIN_TEXT], b"Internal Server Error")
            else:
                conn.cut()
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            if not self.complete:
                if not self.started:
                    logger.error("ASGI callable returned without starting response.")
                    conn.respond(500, [_PLAIN_TEXT], b"Internal Server Error")
                else:
                    logger.error("ASGI callable returned without completing response.")
                    conn.cut()

    def client_left(self) -> None:
        if self.left is not None:
            self.left.set()

    async def receive(self) -> dict[str, Any]:
        if not self.given:
            self.given = True
            return {"type": "http.request", "body": self.request.body, "more_body": False}
        if not self.conn.gone and not self.complete:
            self.left = asyncio.Event()
            await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.conn
        if conn.paused:
            await conn.drain()
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{kind}'.")
            self.started = True
            self.status = message["status"]
            self.headers = [(name.lower(), value) for name, value in message.get("headers", ())]
            return
        if self.complete:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response already completed.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if not conn.out_started:
            conn.start(self.status, self.headers, body, end=not more)
        elif more:
            conn.write(body)
        else:
            conn.finish(body)
        if not more:
            self.complete = True
            if self.left is not None:
                self.left.set()
