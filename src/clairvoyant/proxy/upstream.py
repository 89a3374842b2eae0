"""The HTTP client to the backend (Ollama or llama.cpp's server).

``Upstream`` owns the rules; a ``Transport`` only moves bytes and classifies its own failures.
The production transport is aiohttp's (``AiohttpTransport``): its pool hands out an idle
connection in O(1), where httpx/httpcore checked every pooled connection's socket on each request
(~45% of the proxy's CPU at 64 concurrent requests; docs/design.md, "The upstream client").
Tests may inject an httpx transport (``httpx.MockTransport``), adapted by
``clairvoyant.proxy.httpx_transport``. No module outside these two sees either client library.

Every transport failure is translated here into ``UpstreamUnavailable`` (502) or
``UpstreamTimeout`` (504). Client-facing messages never name the backend's address (it may carry
credentials); the log detail does, with userinfo redacted.

Timeouts: connect ``connect_timeout_s``; the response headers within ``first_byte_timeout_s`` of
sending (a cold model load, or a whole non-streamed answer); between body bytes ``read_timeout_s``
(none by default: long answers take minutes).

A request is sent again only when the backend cannot have acted on it (see ``TransportError``):
nothing is ever resent after the backend may have read it, so a generation is never duplicated.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Literal, Protocol
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp

from clairvoyant.errors import RequestError, UpstreamTimeout, UpstreamUnavailable

__all__ = [
    "HOP_BY_HOP", "AiohttpTransport", "Transport", "TransportError", "Upstream", "UpstreamResponse",
    "forwardable_headers", "redact_url", "response_headers",
]  # fmt: skip

logger = logging.getLogger(__name__)

# Resends of a request the backend provably never read (a reused connection it had closed).
UNREAD_RETRIES = 2
# Pooled connections idle longer than this are dropped, below the 5 s idle timeout of llama.cpp's
# server and uvicorn: closing first ourselves avoids racing the backend's close of an idle connection.
KEEPALIVE_EXPIRY_S = 2.0
HEALTH_PATH = "/health"  # llama.cpp: 503 while the model loads; other backends 404 (alive is enough)

# RFC 9110 7.6.1 hop-by-hop headers, plus those the proxy recomputes itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
_HOP_BY_HOP_BYTES = frozenset(name.encode() for name in HOP_BY_HOP)
_RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})


def redact_url(url: str) -> str:
    """The URL with any user:password replaced by ``***`` (for logs and status pages)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def forwardable_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """A request's end-to-end headers only: drops hop-by-hop ones, those named in Connection, and
    Content-Length (the body is re-sent whole and the client library sets its own)."""
    pairs = [(k, v) for k, v in headers if k.lower() != "content-length"]
    named = {token.strip().lower() for k, v in pairs if k.lower() == "connection" for token in v.split(",")}
    if not named:
        return [(k, v) for k, v in pairs if k.lower() not in HOP_BY_HOP]
    return [(k, v) for k, v in pairs if k.lower() not in HOP_BY_HOP and k.lower() not in named]


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The backend's end-to-end response headers as ASGI pairs (lower-case names), less its Date
    (the proxy's server sets one; its Server header is off, so the backend's stays the only one).
    Content-Length is kept: the body is relayed byte for byte."""
    pairs = [(k.lower(), v) for k, v in raw]
    named = {token.strip().lower() for k, v in pairs if k == b"connection" for token in v.split(b",")}
    return [(k, v) for k, v in pairs if k not in _HOP_BY_HOP_BYTES and k not in named and k != b"date"]


class TransportError(Exception):
    """A transport's failure, classified for ``Upstream``: ``connect`` (the connection could not be
    opened: nothing was sent), ``timeout``, or ``failed``. ``never_read`` is True only when the
    backend provably did not act on the request: it was not fully written, or the backend reset
    the connection before answering. A reset means the backend closed with our bytes unread in its
    socket (a socket closed after reading everything sends a FIN, not a reset), and a backend
    cannot act on a request it has not read whole. This holds on any connection: a reused one the
    backend had closed, the spare opened ahead, or a new one accepted by a backend that was dying.
    A clean close after the request went out is never resent: the backend may have read it and be
    generating."""

    def __init__(
        self, kind: Literal["connect", "timeout", "failed"], cause: BaseException, *, never_read: bool = False
    ) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.kind = kind
        self.cause = cause
        self.never_read = never_read


def was_reset(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause chain) is a connection reset or a broken pipe."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ConnectionResetError, BrokenPipeError)):
            return True
        if isinstance(seen, OSError) and seen.errno in _RESET_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class UpstreamResponse:
    """The backend's status and headers, with the body not yet read. Read it with ``aiter_raw``
    (raw, undecoded bytes as they arrive; raises ``TransportError``); always ``aclose``."""

    __slots__ = ("status_code", "raw_headers")

    def __init__(self, status_code: int, raw_headers: list[tuple[bytes, bytes]]) -> None:
        self.status_code = status_code
        self.raw_headers = raw_headers  # as received; names in the backend's case

    def header(self, name: bytes) -> str:
        """One header's value ('' when absent); ``name`` in lower case."""
        for k, v in self.raw_headers:
            if k.lower() == name:
                return v.decode("latin-1")
        return ""

    def aiter_raw(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class Transport(Protocol):
    """Moves one request to the backend. ``send`` raises only ``TransportError``."""

    async def send(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes, *, close_connection: bool
    ) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


# --- aiohttp ---------------------------------------------------------------------------------


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, which never pools a connection it asked to close, and keeps one SPARE
    connection opened ahead. A request that asks the backend to close
    (a stream: llama.cpp closes after every stream) always needs a new connection, whose opening
    cost about 0.4 ms of the proxy's CPU on the critical path (measured: docs/benchmarks.md
    section 6). So when one is opened, the next is opened in the background while the backend
    works, and handed to the next request that needs a new connection. A spare is used only while
    younger than ``KEEPALIVE_EXPIRY_S`` and still connected (a backend killed meanwhile resets it,
    and the event loop may not have seen that yet: the reset is resent like any other)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._spare: tuple[float, Any] | None = None  # (time.monotonic() when opened, its protocol)
        self._spare_task: asyncio.Task[None] | None = None

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        conn = await super().connect(req, traces, timeout)
        if req.headers.get("Connection", "").lower() == "close":
            # aiohttp pools a connection by the ANSWER's headers only, and llama.cpp closes after
            # a stream without saying so: never pool one we asked to close.
            if conn.protocol is not None:
                conn.protocol.force_close()
            self._open_spare_later(req, timeout)
        return conn

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        proto = self._take_spare()
        if proto is None:
            proto = await super()._create_connection(req, traces, timeout)
        return proto

    def _take_spare(self) -> Any:
        if self._spare is None:
            return None
        opened_s, proto = self._spare
        self._spare = None
        if time.monotonic() - opened_s < KEEPALIVE_EXPIRY_S and proto.is_connected() and not proto.should_close:
            return proto
        proto.close()
        return None

    def _open_spare_later(self, req: Any, timeout: Any) -> None:
        if self.closed or self._spare is not None or (self._spare_task is not None and not self._spare_task.done()):
            return
        self._spare_task = asyncio.get_running_loop().create_task(self._open_spare(req, timeout))

    async def _open_spare(self, req: Any, timeout: Any) -> None:
        try:
            proto = await super()._create_connection(req, [], timeout)
        except Exception as exc:  # the next request opens its own (and reports what fails)
            logger.debug("could not open a spare backend connection: %s", type(exc).__name__)
            return
        if self.closed or self._spare is not None:
            proto.close()
            return
        self._spare = (time.monotonic(), proto)

    def _close(self, *args: Any, **kwargs: Any) -> Any:  # under aiohttp's close()
        if self._spare_task is not None:
            self._spare_task.cancel()
        if self._spare is not None:
            self._spare[1].close()
            self._spare = None
        return super()._close(*args, **kwargs)


class _AiohttpResponse(UpstreamResponse):
    __slots__ = ("_response", "_close")

    def __init__(self, response: aiohttp.ClientResponse, close: bool) -> None:
        super().__init__(response.status, list(response.raw_headers))
        self._response = response
        self._close = close

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            kind: Literal["timeout", "failed"] = "timeout" if isinstance(exc, TimeoutError) else "failed"
            raise TransportError(kind, exc) from exc

    async def aclose(self) -> None:
        response = self._response
        if self._close or not response.content.at_eof():
            response.close()  # an unread answer: closes the connection (the backend stops generating)
        else:
            response.release()  # back to the pool (a connection asked to close never is: _Connector)


class AiohttpTransport:
    """One aiohttp session and pool for the backend: unlimited connections, kept alive
    ``KEEPALIVE_EXPIRY_S``; no cookies, no redirects, no decompression (bodies relayed raw), and
    no Accept-Encoding or Content-Type of its own (the client's headers say what it accepts)."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float | None) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _open_session(self) -> aiohttp.ClientSession:
        # Made on first use, inside the running loop (aiohttp binds the loop at construction).
        connector = _Connector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout_s, sock_read=self._read_timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "Content-Type"),
        )
        session._retry_connection = (
            False  # the resend rule is Upstream's alone (aiohttp would resend idempotent methods)
        )
        self._session = session
        return session

    async def send(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes, *, close_connection: bool
    ) -> UpstreamResponse:
        session = self._session or self._open_session()
        try:
            response = await session.request(method, url, headers=headers, data=body or None, allow_redirects=False)
        except aiohttp.ClientConnectorError as exc:
            raise TransportError("connect", exc) from exc
        except TimeoutError as exc:
            raise TransportError("timeout", exc) from exc
        except (aiohttp.ClientError, OSError) as exc:
            # Not fully written: aiohttp refuses to write to a closing transport (a reset error)
            # or fails writing the body (an OSError with the socket's errno): both count as resets.
            raise TransportError("failed", exc, never_read=was_reset(exc)) from exc
        return _AiohttpResponse(response, close_connection)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


# --- the rules -------------------------------------------------------------------------------


class Upstream:
    """The backend, for the proxy's lifetime (created in the lifespan, closed on shutdown)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float | None = None,
        first_byte_timeout_s: float | None = None,
        api_key: str | None = None,
        transport: Any = None,
        name: str = "default",
    ) -> None:
        """``transport``: None (aiohttp), a ``Transport``, or an httpx transport (tests)."""
        self.name = name  # the backend's name in the pool
        self.display_url = redact_url(base_url.rstrip("/"))
        # Credentials in the URL become an Authorization header: the URL the client library holds
        # (and may log) has none. The backend's own key (``api_key``) wins over them.
        parts = urlsplit(base_url.rstrip("/"))
        self._authorization: tuple[str, str] | None = None
        if parts.username is not None or parts.password is not None:
            userinfo = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            self._authorization = ("Authorization", "Basic " + base64.b64encode(userinfo.encode()).decode())
            parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
        if api_key is not None:
            self._authorization = ("Authorization", f"Bearer {api_key}")
        self.base_url = urlunsplit(parts)
        self.down_since_s: float | None = None  # time.monotonic() of the first refused connection of an outage
        self.first_byte_timeout_s = first_byte_timeout_s
        self._transport: Transport
        if transport is None:
            self._transport = AiohttpTransport(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        elif hasattr(transport, "handle_async_request"):  # an httpx transport: tests only
            from clairvoyant.proxy.httpx_transport import HttpxTransport

            self._transport = HttpxTransport(
                transport, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s
            )
        else:
            self._transport = transport

    def _translate(self, exc: BaseException, what: str) -> RequestError:
        cause = exc.cause if isinstance(exc, TransportError) else exc
        detail = f"{what} at {self.display_url}: {type(cause).__name__}: {cause}"
        if isinstance(exc, TimeoutError) or (isinstance(exc, TransportError) and exc.kind == "timeout"):
            return UpstreamTimeout(f"the backend did not answer in time ({what})", detail=detail)
        return UpstreamUnavailable(f"the backend failed ({what})", detail=detail)  # its cause in the log only

    async def open(
        self,
        method: str,
        path: str,
        *,
        query: str = "",
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        close_connection: bool = False,
    ) -> UpstreamResponse:
        """Send a request and return the response with its body not yet read. Close it with ``aclose``.

        ``close_connection`` asks the backend to close the connection after this answer (for
        streamed answers: llama.cpp's server closes its connection after every stream without
        saying so, and a request sent on it in that instant would meet a close it cannot tell
        from a backend that read it and died); the proxy closes it too, never pooling it.

        Raises ``UpstreamUnavailable`` (``never_sent`` when the connection could not be opened) or
        ``UpstreamTimeout``.
        """
        url = self.base_url + path + (f"?{query}" if query else "")
        forwarded = forwardable_headers(headers)
        if self._authorization is not None:  # the backend's own credentials replace the client's
            forwarded = [(k, v) for k, v in forwarded if k.lower() != "authorization"]
            forwarded.append(self._authorization)
        if close_connection:
            forwarded.append(("Connection", "close"))
        send = self._transport.send
        for attempt in range(UNREAD_RETRIES + 1):
            try:
                if self.first_byte_timeout_s is None:
                    response = await send(method, url, forwarded, body, close_connection=close_connection)
                else:
                    async with asyncio.timeout(self.first_byte_timeout_s):
                        response = await send(method, url, forwarded, body, close_connection=close_connection)
                self.down_since_s = None
                return response
            except TimeoutError as exc:  # the first-byte deadline (transports raise TransportError)
                raise self._translate(exc, f"no response headers within {self.first_byte_timeout_s} s") from None
            except TransportError as exc:
                if exc.kind == "connect":
                    if self.down_since_s is None:
                        self.down_since_s = time.monotonic()
                    detail = f"{method} {path} at {self.display_url}: {type(exc.cause).__name__}: {exc.cause}"
                    raise UpstreamUnavailable("the backend is unreachable", detail=detail, never_sent=True) from exc
                if exc.kind == "failed" and attempt < UNREAD_RETRIES and exc.never_read:
                    logger.debug("the backend closed a reused connection without reading (%s); resending", exc)
                    continue
                raise self._translate(exc, f"{method} {path}") from exc
        raise AssertionError("unreachable")

    async def iter_body(self, response: UpstreamResponse) -> AsyncIterator[bytes]:
        """The raw (undecoded) body as it arrives; errors translated."""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except TransportError as exc:
            raise self._translate(exc, "reading the answer") from exc

    async def probe(self, timeout_s: float = 2.0) -> str | None:
        """One health check: None when the backend is ready, else why not. Ready = ``/health``
        answers anything but 503 (llama.cpp answers 503 while its model loads; Ollama, which has no
        such path, 404)."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.open("GET", HEALTH_PATH)
                await response.aclose()
        except TimeoutError as exc:
            return self._translate(exc, f"GET {HEALTH_PATH}").detail
        except RequestError as exc:
            return exc.detail
        return "the backend answered 503 (loading or busy)" if response.status_code == 503 else None

    async def get_json(self, path: str, timeout_s: float = 2.0) -> Any:
        """``GET path``'s JSON body when it answers 200, else None (unreachable, an error status,
        not JSON, or no answer within ``timeout_s``)."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.open("GET", path)
                try:
                    body = b"".join([chunk async for chunk in self.iter_body(response)])
                finally:
                    await response.aclose()
            return json.loads(body) if response.status_code == 200 else None
        except (TimeoutError, RequestError, ValueError):
            return None

    async def busy_slots(self) -> int | None:
        """How many of llama.cpp's slots are processing (``GET /slots``), or None where the backend
        has no such endpoint or does not answer."""
        slots = await self.get_json("/slots")
        if not isinstance(slots, list):
            return None
        return sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing"))

    def outage_deadline_s(self, wait_s: float) -> float:
        """When a request that could not reach the backend stops waiting: ``wait_s`` after the
        outage began (shared by every request, so the queue behind does not wait ``wait_s`` each)."""
        start_s = self.down_since_s if self.down_since_s is not None else time.monotonic()
        return start_s + wait_s

    async def wait_until_ready(self, deadline_s: float, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Probe with backoff (0.1 s doubling to 2 s) until the backend is ready, ``deadline_s``
        (time.monotonic seconds) passes or ``give_up()``. True when ready."""
        delay_s = 0.1
        while not give_up():
            if await self.probe() is None:
                self.down_since_s = None
                return True
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                return False
            await asyncio.sleep(min(delay_s, remaining_s))
            delay_s = min(2.0, delay_s * 2)
        return False

    async def aclose(self) -> None:
        await self._transport.aclose()
