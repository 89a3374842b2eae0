"""The HTTP server: uvicorn, with the client limits a proxy facing a network needs, and a shutdown
that answers everyone.

uvicorn bounds neither how long a client may take to send its request nor how big its headers
may be, so its httptools protocol is extended here (per connection, all on the event loop):

- the request line and headers must arrive within ``client_timeout_s`` of the connection opening
  (or of the request's first byte, on a kept-alive connection), and the body within
  ``client_timeout_s`` of the headers: else 408 in the path's dialect and the connection closes.
  The application sees a client disconnect (``ClientGone``), never a 500;
- request line + headers above ``max_header_bytes``: 431, closed;
- more than ``max_connections`` open: the new one gets 503 and is closed at once;
- an idle keep-alive connection closes after ``keep_alive_timeout_s`` (uvicorn's own timer).

A request's handler learns of its client's disconnect from the protocol itself
(``watch_disconnect``: a callback from ``connection_lost``), not from a task parked on ``receive()``
per request (measured: docs/benchmarks.md section 6h). Per connection, the protocol's empty
``asyncio.Event`` waiter queues (two deques of ~760 bytes each, one per connection and one per
request) become lists: a waiting request is that much smaller.

On SIGTERM (``ProxyServer.shutdown``): the dispatcher refuses every waiting request at once (503
``shutting_down``, Retry-After), then uvicorn stops accepting and waits for the open answers,
which the dispatcher ends with an error event after ``shutdown_grace_s``. uvicorn's own graceful
timeout, one second later, is the backstop for pass-through requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from clairvoyant.config import Settings
from clairvoyant.errors import HeadersTooLarge, RequestError, RequestTimeout
from clairvoyant.logs import log_request
from clairvoyant.prediction.dialects import dialect_of_path, error_body

__all__ = ["ClientLimits", "ProxyServer", "build_server", "unwatch_disconnect", "watch_disconnect"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClientLimits:
    client_timeout_s: float
    max_header_bytes: int
    max_connections: int
    on_rejected: Callable[[str], None] = lambda reason: None  # counts a limit hit (metrics)


LINGER_S = 1.0  # seconds a rejected connection is still read (and discarded) before it is closed


def _raw_response(status: int, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _ConnectionState:
    __slots__ = ("header_bytes", "in_headers", "deadline", "rejected", "on_disconnect")

    def __init__(self) -> None:
        self.header_bytes = 0
        self.in_headers = True
        self.deadline: asyncio.TimerHandle | None = None
        self.rejected = False
        self.on_disconnect: Callable[[], None] | None = None  # the running request's (watch_disconnect)


class _Pipeline(list):  # type: ignore[type-arg]
    """What uvicorn uses of its pipeline deque (appendleft, pop, truth): 56 bytes empty, not ~760."""

    __slots__ = ()

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


def _slim_event(event: asyncio.Event) -> None:
    """An Event's waiters in a list instead of a deque (asyncio only appends, removes and iterates
    them): 56 bytes empty instead of ~760, for the same behaviour."""
    if type(event._waiters) is deque and not event._waiters:
        event._waiters = []  # type: ignore[assignment]  # a list: asyncio appends, removes and iterates


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header/body deadlines, a header size cap and a connection cap."""

    limits: ClientLimits  # set on the subclass that ``build_server`` makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Our per-connection state in one slotted object: uvicorn's protocol has 27 attributes,
        # and a 30th turns its compact shared-key dict (296 bytes) into a plain one (1,584).
        self._c = _ConnectionState()
        # uvicorn's queue of pipelined requests: a list, not an empty ~760-byte deque
        self.pipeline = _Pipeline()  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _slim_event(self.flow._is_writable_event)
        if len(self.connections) > self.limits.max_connections:
            self._reject(503, RequestError("too many open connections; retry later"), "max_connections")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        self._notify_disconnect()

    def _notify_disconnect(self) -> None:
        """The running request's client is gone: tell its handler, once."""
        callback = self._c.on_disconnect
        if callback is not None and self.cycle is not None and self.cycle.disconnected:
            self._c.on_disconnect = None
            try:
                callback()
            except Exception:  # the connection is gone either way; the handler's failure is its own
                logger.exception("a disconnect callback failed")

    def data_received(self, data: bytes) -> None:
        if self._c.rejected:
            return
        if self._c.in_headers:
            self._c.header_bytes += len(data)
        super().data_received(data)
        # Counted per read, so a read that also carries body bytes may overcount: only headers
        # still incomplete after it are refused.
        if self._c.in_headers and self._c.header_bytes > self.limits.max_header_bytes and not self._c.rejected:
            message = f"request headers exceed {self.limits.max_header_bytes} bytes"
            self._reject(431, HeadersTooLarge(message), "header_too_large")

    # Parser callbacks (called from data_received) -------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._c.in_headers = True
        if self._c.deadline is None:  # a kept-alive connection's next request: its first byte starts the clock
            self._arm()

    def on_headers_complete(self) -> None:
        self._c.in_headers = False
        self._c.header_bytes = 0
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self._reject(
                431, HeadersTooLarge(f"request headers exceed {self.limits.max_header_bytes} bytes"), "header_too_large"
            )
            return
        self._disarm()
        self._arm()  # the body's deadline (disarmed at once if there is no body)
        super().on_headers_complete()
        if self.cycle is not None:
            _slim_event(self.cycle.message_event)

    def on_body(self, body: bytes) -> None:
        if not self._c.rejected:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        if not self._c.rejected:
            super().on_message_complete()

    # Deadlines ------------------------------------------------------------------------------
    def _arm(self) -> None:
        self._c.deadline = self.loop.call_later(self.limits.client_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._c.deadline is not None:
            self._c.deadline.cancel()
            self._c.deadline = None

    def _timed_out(self) -> None:
        self._c.deadline = None
        if self.transport.is_closing():
            return
        what = "headers" if self._c.in_headers else "body"
        self._reject(
            408,
            RequestTimeout(f"the request {what} did not arrive within {self.limits.client_timeout_s:g} s"),
            "client_timeout",
        )

    def _path(self) -> str:
        """The request's path so far (for the error's dialect), or "/" before the request line."""
        url = getattr(self, "url", b"") if self.scope is not None else b""
        return url.split(b"?", 1)[0].decode("latin-1") or "/"

    def _reject(self, status: int, error: RequestError, reason: str) -> None:
        """Answer ``status`` unless this request's response already started, tell the application
        its client is gone, and close.

        While headers arrive, ``self.cycle`` is still the PREVIOUS request's (uvicorn makes a
        request's cycle when its headers are complete): that answer is done (keep-alive: answer
        now) or still running (pipelining: let it finish, then close; do not write into it)."""
        self._disarm()
        self._c.rejected = True
        self.limits.on_rejected(reason)
        log_request({"path": self._path(), "status": status, "outcome": reason})
        cycle = self.cycle
        if self._c.in_headers:
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False  # uvicorn closes the connection once that answer is complete
                return
        elif cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # this request's app: receive() yields http.disconnect, sends are dropped
            cycle.message_event.set()
            self._notify_disconnect()
        started = not self._c.in_headers and cycle is not None and cycle.response_started
        if not started:
            self.transport.write(_raw_response(status, error_body(dialect_of_path(self._path()), error)))
        # A lingering close: end our side now, discard what the client still sends, close fully a
        # little later. Closing at once with its bytes unread would reset the connection, and the
        # client could lose the answer above.
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


def watch_disconnect(receive: Any, callback: Callable[[], None]) -> bool:
    """Have ``callback`` called once, from the event loop, when the client of the request whose
    ASGI ``receive`` this is disconnects (or is cut off by a limit). True when the proxy's own
    server runs the request; False under any other server (then the caller watches ``receive``
    for ``http.disconnect`` itself). A client already gone is reported on the next loop turn.
    ``unwatch_disconnect`` with the same arguments cancels it."""
    cycle = getattr(receive, "__self__", None)
    protocol = getattr(getattr(cycle, "on_response", None), "__self__", None)
    if not isinstance(protocol, LimitedHttpToolsProtocol) or protocol.cycle is not cycle:
        return False
    if cycle.disconnected:
        protocol.loop.call_soon(callback)
    else:
        protocol._c.on_disconnect = callback
    return True


def unwatch_disconnect(receive: Any, callback: Callable[[], None]) -> None:
    """Cancel ``watch_disconnect(receive, callback)`` if it has not fired."""
    protocol = getattr(getattr(getattr(receive, "__self__", None), "on_response", None), "__self__", None)
    if isinstance(protocol, LimitedHttpToolsProtocol) and protocol._c.on_disconnect is callback:
        protocol._c.on_disconnect = None


class ProxyServer(uvicorn.Server):
    """uvicorn's server, with the dispatcher's refusal of the queue at the start of shutdown
    (uvicorn would otherwise wait for every open connection, queued ones included, before the
    application hears of it)."""

    def __init__(self, config: uvicorn.Config, grace_s: float) -> None:
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets: Any = None) -> None:
        proxy = getattr(self.config.app.state, "proxy", None) if hasattr(self.config.app, "state") else None
        if proxy is not None:
            proxy.dispatcher.begin_shutdown(self.grace_s)
        await super().shutdown(sockets)


def build_server(
    app: Any, settings: Settings, *, host: str | None = None, port: int | None = None, log_level: str | None = None
) -> ProxyServer:
    """The proxy's uvicorn server for ``app`` (from ``create_app``) with ``settings``' limits."""
    metrics = getattr(getattr(app, "state", None), "metrics", None)

    def on_rejected(reason: str) -> None:
        if metrics is not None:
            metrics.client_rejections.labels(reason).inc()

    limits = ClientLimits(settings.client_timeout_s, settings.max_header_bytes, settings.max_connections, on_rejected)
    protocol = type("ProxyHttpProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
    config = uvicorn.Config(
        app,
        host=settings.host if host is None else host,
        port=settings.port if port is None else port,
        http=protocol,
        log_level=settings.log_level if log_level is None else log_level,
        access_log=False,  # the proxy logs one line per request itself (clairvoyant.logs)
        log_config=None,  # uvicorn's loggers propagate to ours: one format
        lifespan="on",
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]  # used as call_later seconds
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 2,  # backstop: the dispatcher ends answers first
        server_header=False,  # the backend's own Server header is relayed
        proxy_headers=False,  # nothing reads the client address: no X-Forwarded-* rewrite per request
        date_header=True,
    )
    return ProxyServer(config, grace_s=settings.shutdown_grace_s)
