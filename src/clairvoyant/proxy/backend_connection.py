"""The proxy's HTTP/1.1 client to a backend: keep-alive connections on asyncio Protocols, answers
read with httptools' response parser (llhttp). The production ``Transport`` (``upstream.py``).

Why not a client library: section 9 of docs/benchmarks.md measured what the request path costs
on uvicorn + ASGI + aiohttp against callbacks on Protocols (4,159 against 20,900 requests/s, 0.203
against 0.030 ms of CPU a request); this module is the client half of that step. Per request it
does one pool pop, one write, the parser's callbacks and one future for the head; no task, no
timer unless ``read_timeout_s`` is set (docs/design.md, "The upstream client").

What it does, and the rules it keeps (``Upstream`` keeps the rest: resends, the first-byte
timeout, error translation):

- **The pool.** One per origin (scheme, host, port), of idle keep-alive connections, handed out
  last in, first out (O(1): the list stays ordered by idle time, so expiry sweeps its front).
  A connection idle ``keepalive_expiry_s`` is closed. It is pooled again only when its answer was
  read to the end by the caller, the backend keeps it alive, and the request did not ask to close.
- **The spare.** A request that asks the backend to close (a stream: llama.cpp closes after every
  stream) leaves the next request without a pooled connection; so one connection is opened ahead,
  in the background, and handed to the next request that finds the pool empty (worth ~0.4 ms of
  CPU on the critical path: docs/benchmarks.md section 6). It is used only while younger than
  ``keepalive_expiry_s`` and still connected.
- **Framing.** Content-Length, chunked (de-chunked: the caller gets the payload bytes, as aiohttp's
  ``readany`` gave) and read-until-close bodies; no body for HEAD, 204 and 304; 1xx answers are
  skipped; trailers are dropped; a head larger than ``MAX_HEAD_BYTES`` fails. Nothing is
  decompressed: bytes are relayed as the backend sent them.
- **Timeouts.** ``connect_timeout_s`` to open a connection (a ``timeout``, as aiohttp classified
  it); ``read_timeout_s`` (None: none) between bytes read from the backend, the head included, as
  aiohttp's ``sock_read``. Time spent paused for a slow reader does not count.
- **Backpressure.** Above ``HIGH_WATER_BYTES`` of an answer buffered and not yet taken by the
  caller, the connection stops reading the backend (``pause_reading``) until the caller takes it:
  a slow client never makes the proxy buffer a whole answer.
- **Failures** are ``TransportError`` only: ``connect`` (the connection could not be opened:
  nothing sent), ``timeout``, ``failed``. ``never_read`` exactly as ``TransportError`` defines it:
  the request was not fully handed to the kernel, or the backend reset the connection before any
  byte of an answer.
- **Closing.** ``aclose`` of an answer not read to its end closes the connection (the backend sees
  it and stops generating); so does a cancelled ``send``.
- https backends (the system's default certificate checks, SNI); names resolved once per
  ``DNS_TTL_S``. No proxies from the environment (aiohttp's ``trust_env`` was off), no redirects,
  no cookies, no headers of its own but Host and Content-Length.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import ssl
import time
from collections.abc import AsyncIterator
from typing import Literal
from urllib.parse import quote

import httptools

from clairvoyant.proxy.keepalive import tcp_keepalive
from clairvoyant.proxy.upstream import (
    KEEPALIVE_EXPIRY_S,
    FirstByteTimeout,
    TransportError,
    UpstreamResponse,
    header_bytes,
    rendered_headers,
    was_reset,
)

__all__ = ["HIGH_WATER_BYTES", "MAX_HEAD_BYTES", "ProtocolTransport"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # an answer's status line and headers (aiohttp: 8,190 a line, 128 headers)
HIGH_WATER_BYTES = 64 * 1024  # an answer's bytes buffered for the caller before the backend is paused
DNS_TTL_S = 10.0  # a backend's name is resolved again after this long (aiohttp's default cache)
_DETACHED_PARSER = httptools.HttpResponseParser(object())  # a closed connection's: bound to nothing, never fed
HEAD_TICK_S = 0.1  # seconds between a pool's checks of its first-byte deadlines (none per request)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # a Content-Length even when empty
# What may stand in a request target as it is; anything else is percent-encoded (a decoded ASGI
# path may hold spaces or non-ASCII characters, which aiohttp's URL quoting encoded too).
_UNSAFE_TARGET = re.compile(r"[^A-Za-z0-9\-._~/:@!$&'()*+,;=%?]")


class _Closed(ConnectionError):
    """The backend closed the connection (a FIN) before the answer was complete."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection to the backend; carries one exchange at a time. The answer's
    state lives here (the ``_Answer`` handed out only points at it) until ``release``."""

    __slots__ = (
        "pool", "loop", "transport", "parser", "lost", "idle_since_s", "answer", "head_waiter",
        "body_waiter", "chunks", "buffered", "complete", "error", "keep_alive", "written",
        "received", "head_bytes", "head_done", "head_only", "informational", "headers", "paused",
        "read_timeout_s", "last_read_s", "timer", "swap_parser", "head_deadline_s",
    )  # fmt: skip

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False  # connection_lost seen (or we closed it)
        self.idle_since_s = 0.0  # loop.time() when pooled
        self.answer: _Answer | None = None  # the exchange in progress
        self.head_waiter: asyncio.Future[_Answer] | None = None
        self.body_waiter: asyncio.Future[None] | None = None
        self.chunks: list[bytes] = []  # body bytes not yet taken by the caller
        self.buffered = 0  # their length
        self.complete = False  # the whole answer was received
        self.error: TransportError | None = None  # how the answer's body ended, if it failed
        self.keep_alive = False  # the backend keeps the connection alive after this answer
        self.written = True  # the request is all in the kernel's hands
        self.received = 0  # bytes of this exchange's answer received
        self.head_bytes = 0  # the head's bytes parsed so far (headers of 1xx answers included)
        self.head_done = False
        self.head_only = False  # a HEAD request: the answer has no body whatever its headers say
        self.informational = False  # parsing a 1xx answer (skipped)
        self.headers: list[tuple[bytes, bytes]] = []
        self.paused = False  # reading paused (backpressure)
        self.read_timeout_s = pool.read_timeout_s
        self.last_read_s = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.swap_parser = False
        self.head_deadline_s = 0.0  # loop seconds by which the answer's head must come (in pool.heads)

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # 0: pause_writing is called whenever anything is left unsent, resume_writing when it all
        # went to the kernel: "fully written" is known without polling.
        transport.set_write_buffer_limits(0)  # type: ignore[attr-defined]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - a socket that refuses it still works
                pass
            if self.pool.tcp_keepalive_s > 0:
                tcp_keepalive(sock, self.pool.tcp_keepalive_s)  # a backend whose host vanished mid-answer

    def pause_writing(self) -> None:
        self.written = False

    def resume_writing(self) -> None:
        self.written = True

    def data_received(self, data: bytes) -> None:
        if self.answer is None and self.head_waiter is None:
            self.close()  # bytes on an idle connection: nobody asked for them
            return
        self.received += len(data)
        if self.read_timeout_s is not None:
            self.last_read_s = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # one of ours failed the answer
            cause = exc.__context__ if isinstance(exc.__context__, Exception) else exc
            self.fail("failed", cause)
            return
        except httptools.HttpParserError as exc:
            self.fail("failed", exc)
            return
        if not self.head_done:
            if self.received > MAX_HEAD_BYTES:  # one header still growing inside the parser
                self.fail("failed", ValueError(f"the answer's head exceeds {MAX_HEAD_BYTES} bytes"))
        elif self.swap_parser:  # after a HEAD answer the parser still expects its announced body
            self.swap_parser = False
            self.parser = httptools.HttpResponseParser(self)

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost(None) ends the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        self.parser = _DETACHED_PARSER  # it holds this protocol: freed now, not by a collection of the cycle
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.head_waiter is not None:
            # No answer yet. A reset means the backend closed with our bytes unread: never read.
            never_read = not self.written or (exc is not None and self.received == 0 and was_reset(exc))
            cause: BaseException = exc if exc is not None else _Closed("the backend closed the connection")
            self._fail_head(TransportError("failed", cause, never_read=never_read))
        elif self.answer is not None and not self.complete and self.error is None:
            if exc is None and self.head_done and self._until_close():
                self.complete = True  # a read-until-close body ends here
                self.keep_alive = False
            else:
                cause = exc if exc is not None else _Closed("the backend closed the connection mid-answer")
                self.error = TransportError("failed", cause)
            self._wake()

    # --- httptools callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: the connection is not to be trusted
            raise ValueError("the backend sent more than one answer")
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # after the head: a chunked body's trailers, dropped
            self.headers.append((name, value))
            self.head_bytes += len(name) + len(value) + 4
            if self.head_bytes > MAX_HEAD_BYTES:
                raise ValueError(f"the answer's head exceeds {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.informational = True  # 100 Continue, 103 Early Hints...: the real answer follows
            return
        self.head_done = True
        waiter = self.head_waiter
        answer = self.answer = _Answer(status, self.headers, self)
        self.head_waiter = None
        self.pool.heads.discard(self)
        if self.head_only:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()
            self.swap_parser = True
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def on_body(self, body: bytes) -> None:
        if self.head_only:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        if not self.head_only:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()
            self._wake()

    # --- the exchange ----------------------------------------------------------------------------
    def start(self, data: bytes, head_only: bool) -> asyncio.Future[_Answer]:
        """Write the request; the future gets the answer's head (or a ``TransportError``)."""
        self.answer = None
        self.chunks = []
        self.buffered = 0
        self.complete = self.head_done = self.informational = self.swap_parser = False
        self.error = None
        self.received = self.head_bytes = 0
        self.head_only = head_only
        waiter = self.head_waiter = self.loop.create_future()
        self.transport.write(data)  # type: ignore[union-attr]
        if self.read_timeout_s is not None:
            self.last_read_s = self.loop.time()
            self.timer = self.loop.call_at(self.last_read_s + self.read_timeout_s, self._on_timer)
        return waiter

    def take(self) -> bytes:
        """The body bytes received and not yet taken (reading resumes if it was paused)."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.lost:
                if self.read_timeout_s is not None:
                    self.last_read_s = self.loop.time()
                self.transport.resume_reading()
        return data

    def release(self, reuse: bool) -> None:
        """The caller is done with the answer: pool the connection when it is clean, else close it."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        clean = reuse and self.complete and not self.chunks and self.keep_alive and self.error is None
        self.answer = None
        self.body_waiter = None
        self.chunks = []
        if clean and not self.lost:
            self.pool.put(self)
        else:
            self.close()

    def fail(self, kind: Literal["timeout", "failed"], cause: BaseException) -> None:
        """End the exchange with a ``TransportError`` and close the connection."""
        if self.head_waiter is not None:
            never_read = kind == "failed" and not self.written
            self._fail_head(TransportError(kind, cause, never_read=never_read))
        elif self.answer is not None and self.error is None and not self.complete:
            self.error = TransportError(kind, cause)
            self._wake()
        self.close()

    def close(self) -> None:
        self.lost = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()

    def _fail_head(self, error: TransportError) -> None:
        waiter, self.head_waiter = self.head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _wake(self) -> None:
        waiter = self.body_waiter
        if waiter is not None:
            self.body_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _until_close(self) -> bool:
        """Whether the answer's body ends when the backend closes (no length, not chunked)."""
        for name, value in self.answer.raw_headers if self.answer is not None else ():
            low = name.lower()
            if low == b"content-length" or (low == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True

    def _on_timer(self) -> None:
        self.timer = None
        if self.lost or (self.answer is None and self.head_waiter is None) or self.complete:
            return
        timeout_s = self.read_timeout_s
        assert timeout_s is not None
        now = self.loop.time()
        if self.paused:  # waiting for our own reader, not for the backend
            self.last_read_s = now
        elif now - self.last_read_s >= timeout_s:
            self.fail("timeout", TimeoutError(f"no byte from the backend within {timeout_s} s"))
            return
        self.timer = self.loop.call_at(self.last_read_s + timeout_s, self._on_timer)


class _Answer(UpstreamResponse):
    """The answer's status and headers; the body is read from its connection."""

    __slots__ = ("_conn", "_reuse")

    def __init__(self, status_code: int, raw_headers: list[tuple[bytes, bytes]], conn: _Connection) -> None:
        super().__init__(status_code, raw_headers)
        self._conn: _Connection | None = conn
        self._reuse = True  # set False when the request asked the backend to close

    def ready(self) -> bytes:
        conn = self._conn
        return conn.take() if conn is not None and conn.chunks else b""

    def complete(self) -> bool:
        conn = self._conn
        return conn is not None and conn.complete and not conn.chunks and conn.error is None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while conn is not None:
            if conn.chunks:
                yield conn.take()
            elif conn.error is not None:
                raise conn.error
            elif conn.complete:
                return
            else:
                waiter = conn.body_waiter = conn.loop.create_future()
                await waiter
                conn = self._conn  # None once closed meanwhile

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.release(self._reuse)


class _Pool:
    """The connections to one origin: idle ones (LIFO), the spare, and every live one."""

    __slots__ = (
        "loop", "scheme", "host", "port", "ssl", "connect_timeout_s", "read_timeout_s", "keepalive_expiry_s",
        "tcp_keepalive_s", "idle", "live", "spare", "spare_task", "sweeper", "closed", "_addresses", "heads",
        "head_ticker",
    )  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        scheme: str,
        host: str,
        port: int,
        *,
        connect_timeout_s: float,
        read_timeout_s: float | None,
        keepalive_expiry_s: float,
        tcp_keepalive_s: float = 0.0,
    ) -> None:
        self.loop = loop
        self.scheme = scheme
        self.host = host
        self.port = port
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if scheme == "https" else None
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_expiry_s = keepalive_expiry_s  # seconds an idle pooled connection is kept (HTTP)
        self.tcp_keepalive_s = tcp_keepalive_s  # TCP keepalive idle seconds (proxy/keepalive.py); 0 = off
        self.idle: list[_Connection] = []  # ordered by idle_since_s: pooled at the end, taken from the end
        self.live: set[_Connection] = set()  # every open connection (closed with the pool)
        self.spare: _Connection | None = None
        self.spare_task: asyncio.Task[None] | None = None
        self.sweeper: asyncio.TimerHandle | None = None
        self.closed = False
        self._addresses: tuple[float, list[tuple[int, str]]] | None = None  # (expiry, (family, address))
        self.heads: set[_Connection] = set()  # waiting for an answer's head, with a first-byte deadline
        self.head_ticker: asyncio.TimerHandle | None = None

    def await_head(self, conn: _Connection, timeout_s: float) -> None:
        """Fail ``conn``'s exchange (``timeout``, a ``FirstByteTimeout``) unless its answer's head
        comes within ``timeout_s``: checked every ``HEAD_TICK_S`` by one timer for the pool, not
        one per request (so it fires up to that late)."""
        conn.head_deadline_s = self.loop.time() + timeout_s
        self.heads.add(conn)
        if self.head_ticker is None:
            self.head_ticker = self.loop.call_later(HEAD_TICK_S, self._check_heads)

    def _check_heads(self) -> None:
        now_s = self.loop.time()
        for conn in list(self.heads):
            if conn.head_waiter is None:  # answered, failed or closed
                self.heads.discard(conn)
            elif now_s >= conn.head_deadline_s:
                self.heads.discard(conn)
                conn.fail("timeout", FirstByteTimeout("no response headers from the backend in time"))
        self.head_ticker = self.loop.call_later(HEAD_TICK_S, self._check_heads) if self.heads else None

    def take(self) -> _Connection | None:
        """An idle connection (the most recently pooled), else the spare, else None."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            if conn.lost:
                continue
            if self.loop.time() - conn.idle_since_s < self.keepalive_expiry_s:
                return conn
            conn.close()  # expired, and so is every one below it
            for older in idle:
                older.close()
            idle.clear()
        spare, self.spare = self.spare, None
        if spare is not None:
            if not spare.lost and self.loop.time() - spare.idle_since_s < self.keepalive_expiry_s:
                return spare
            spare.close()
        return None

    def put(self, conn: _Connection) -> None:
        if self.closed:
            conn.close()
            return
        conn.idle_since_s = self.loop.time()
        self.idle.append(conn)
        if self.sweeper is None:
            self.sweeper = self.loop.call_later(self.keepalive_expiry_s, self._sweep)

    def forget(self, conn: _Connection) -> None:
        self.live.discard(conn)

    def _sweep(self) -> None:
        """Close the connections idle longer than ``keepalive_expiry_s`` (the front of the list)."""
        self.sweeper = None
        idle = self.idle
        cutoff_s = self.loop.time() - self.keepalive_expiry_s
        expired = 0
        while expired < len(idle) and (idle[expired].idle_since_s <= cutoff_s or idle[expired].lost):
            idle[expired].close()
            expired += 1
        del idle[:expired]
        if idle and not self.closed:
            when_s = idle[0].idle_since_s + self.keepalive_expiry_s
            self.sweeper = self.loop.call_at(when_s, self._sweep)

    async def _resolve(self) -> list[tuple[int, str]]:
        try:
            address = ipaddress.ip_address(self.host)
        except ValueError:
            pass
        else:
            return [(socket.AF_INET6 if address.version == 6 else socket.AF_INET, self.host)]
        now_s = time.monotonic()
        if self._addresses is not None and self._addresses[0] > now_s:
            return self._addresses[1]
        infos = await self.loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys((int(family), str(sockaddr[0])) for family, _, _, _, sockaddr in infos))
        self._addresses = (now_s + DNS_TTL_S, addresses)
        return addresses

    async def open(self) -> _Connection:
        """A new connection. Raises ``TransportError``: ``connect``, or ``timeout`` past
        ``connect_timeout_s``."""
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                addresses = await self._resolve()
                last: OSError | None = None
                for _family, address in addresses:
                    try:
                        _, conn = await self.loop.create_connection(
                            lambda: _Connection(self),
                            address,
                            self.port,
                            ssl=self.ssl,
                            server_hostname=self.host if self.ssl is not None else None,
                        )
                        break
                    except OSError as exc:  # ssl.SSLError is one: a certificate refused
                        last = exc
                else:
                    raise last or OSError(f"no address for {self.host}")
        except TimeoutError as exc:
            raise TransportError("timeout", exc) from exc
        except (OSError, ValueError) as exc:  # ValueError: a malformed address or name
            raise TransportError("connect", exc) from exc
        if self.closed:
            conn.close()
            raise TransportError("connect", ConnectionError("the transport is closed"))
        self.live.add(conn)
        return conn

    def open_spare_later(self) -> None:
        if self.closed or self.spare is not None or (self.spare_task is not None and not self.spare_task.done()):
            return
        self.spare_task = self.loop.create_task(self._open_spare())

    async def _open_spare(self) -> None:
        try:
            conn = await self.open()
        except TransportError as exc:  # the next request opens its own (and reports what fails)
            logger.debug("could not open a spare backend connection: %s", type(exc.cause).__name__)
            return
        if self.closed or self.spare is not None:
            conn.close()
            return
        conn.idle_since_s = self.loop.time()
        self.spare = conn

    def close(self) -> None:
        self.closed = True
        if self.spare_task is not None:
            self.spare_task.cancel()
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None
        if self.head_ticker is not None:
            self.head_ticker.cancel()
            self.head_ticker = None
        for conn in list(self.live):
            conn.close()
        self.idle.clear()
        self.spare = None


class ProtocolTransport:
    """``upstream.Transport`` on asyncio Protocols: one pool per backend origin, unlimited
    connections, idle ones closed after ``keepalive_expiry_s``. The pools are made on first use,
    inside the running loop."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float | None,
        keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S,
        tcp_keepalive_s: float = 0.0,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._keepalive_expiry_s = keepalive_expiry_s
        self._tcp_keepalive_s = tcp_keepalive_s
        self._pools: dict[str, tuple[_Pool, str]] = {}  # scheme://netloc -> (its pool, its Host header)
        self._closed = False

    def pool(self, url: str) -> _Pool:
        """The pool of ``url``'s origin (made on first use)."""
        return self._origin(url)[0][0]

    def _origin(self, url: str) -> tuple[tuple[_Pool, str], str]:
        """(pool, Host header) of ``url``'s origin, and its request target."""
        scheme_end = url.find("://")
        path_start = url.find("/", scheme_end + 3)
        if path_start < 0:
            path_start = len(url)
        origin = url[:path_start]
        target = url[path_start:] or "/"
        entry = self._pools.get(origin)
        if entry is None:
            entry = self._new_pool(origin)
        return entry, target

    def _new_pool(self, origin: str) -> tuple[_Pool, str]:
        if self._closed:
            raise TransportError("connect", ConnectionError("the transport is closed"))
        scheme, _, netloc = origin.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https") or not netloc or "@" in netloc:
            raise TransportError("connect", ValueError("not an http(s) URL without userinfo"))
        host, port = netloc, 443 if scheme == "https" else 80
        if netloc.startswith("["):  # [IPv6]:port
            end = netloc.find("]")
            host, rest = netloc[1:end], netloc[end + 1 :]
            if rest.startswith(":"):
                port = int(rest[1:])
        elif ":" in netloc:
            host, _, port_text = netloc.rpartition(":")
            try:
                port = int(port_text)
            except ValueError as exc:
                raise TransportError("connect", exc) from exc
        pool = _Pool(
            asyncio.get_running_loop(), scheme, host, port, connect_timeout_s=self._connect_timeout_s,
            read_timeout_s=self._read_timeout_s, keepalive_expiry_s=self._keepalive_expiry_s,
            tcp_keepalive_s=self._tcp_keepalive_s,
        )  # fmt: skip
        entry = (pool, netloc)
        self._pools[origin] = entry
        return entry

    async def send(
        self,
        method: str,
        url: str,
        headers: bytes | list[tuple[str, str]],
        body: bytes,
        *,
        close_connection: bool,
        first_byte_timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """``headers``: header lines written as they are, or (name, value) pairs (encoded latin-1)."""
        (pool, host), target = self._origin(url)
        if _UNSAFE_TARGET.search(target) is not None:
            target = quote(target, safe="/:@!$&'()*+,;=%?~")
        parts = [
            header_bytes(f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"),
            headers if isinstance(headers, bytes) else rendered_headers(headers),
        ]
        if body or method in _BODY_METHODS:
            parts.append(b"Content-Length: %d\r\n" % len(body))
        parts += (b"\r\n", body)
        data = b"".join(parts)
        conn = pool.take()
        if conn is None:
            conn = await pool.open()
        if close_connection:
            pool.open_spare_later()
        waiter = conn.start(data, method == "HEAD")
        if first_byte_timeout_s is not None:
            pool.await_head(conn, first_byte_timeout_s)
        try:
            answer = await waiter
        except asyncio.CancelledError:  # the first-byte deadline, or the client left: the backend stops
            conn.close()
            raise
        answer._reuse = not close_connection
        return answer

    async def aclose(self) -> None:
        self._closed = True
        for pool, _ in self._pools.values():
            pool.close()
        self._pools.clear()
        await asyncio.sleep(0)  # one loop turn: the closed transports' connection_lost callbacks run
