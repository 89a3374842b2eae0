"""The HTTP client to the backend (Ollama or llama.cpp's server).

``Upstream`` owns the rules; a ``Transport`` only moves bytes and classifies its own failures.
The production transport is the proxy's own HTTP/1.1 client on asyncio Protocols
(``clairvoyant.proxy.backend_connection``): an O(1) pool of keep-alive connections per backend and
httptools' parser, with no task per request (it replaced aiohttp, which had replaced httpx:
docs/design.md, "The upstream client"). Tests may inject an httpx transport
(``httpx.MockTransport``), adapted by ``clairvoyant.proxy.httpx_transport``. No module outside
those two sees a client library.

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
from collections.abc import AsyncIterator, Callable, Container, Iterable
from typing import Any, Literal, Protocol
from urllib.parse import unquote, urlsplit, urlunsplit

from clairvoyant.errors import RequestError, UpstreamTimeout, UpstreamUnavailable

__all__ = [
    "HOP_BY_HOP", "FirstByteTimeout", "Transport", "TransportError", "Upstream", "UpstreamResponse",
    "forwardable_headers", "header_bytes", "header_value", "redact_url", "rendered_headers", "response_headers",
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
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
    }
)
_NOT_FORWARDED = HOP_BY_HOP | {b"content-length"}  # the body is sent whole, with our own length
_RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})


def header_bytes(text: str) -> bytes:
    """A header's (or request line's) text as bytes: latin-1, UTF-8 beyond it (a configured
    credential or host name)."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode()


def _connection_tokens(value: bytes) -> list[bytes]:
    """The header names a Connection header lists (hop-by-hop for this message too)."""
    return [token.strip().lower() for token in value.split(b",")]


def redact_url(url: str) -> str:
    """The URL with any user:password replaced by ``***`` (for logs and status pages)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def forwardable_headers(
    headers: Iterable[tuple[bytes, bytes]], drop: Container[bytes] = ()
) -> tuple[bytes, bytes | None, dict[bytes, bytes]]:
    """A request's end-to-end headers rendered as header lines (``name: value\\r\\n``, names in
    lower case: what the backend client writes as they are), its Authorization value (None:
    none; kept apart, a backend's own credentials replace it), and the first value of each header
    in ``drop`` (the proxy's own: read, not forwarded). Dropped too: hop-by-hop headers, those
    named in Connection, and Content-Length (the body is re-sent whole, with its own length)."""
    kept = []
    dropped: dict[bytes, bytes] = {}
    authorization: bytes | None = None
    named: list[bytes] | None = None
    for name, value in headers:
        name = name.lower()
        if name in _NOT_FORWARDED:
            if name == b"connection":
                named = (named or []) + _connection_tokens(value)
        elif name in drop:
            dropped.setdefault(name, value)
        elif name == b"authorization":
            authorization = value if authorization is None else authorization
        else:
            kept.append((name, value))
    if named:
        kept = [(k, v) for k, v in kept if k not in named]
        if b"authorization" in named:
            authorization = None
    return b"".join([b"%b: %b\r\n" % pair for pair in kept]), authorization, dropped


def rendered_headers(pairs: Iterable[tuple[str, str]]) -> bytes:
    """(name, value) pairs of text as header lines."""
    return b"".join([b"%b: %b\r\n" % (header_bytes(name), header_bytes(value)) for name, value in pairs])


def header_value(lines: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (lower case) in rendered header lines, or None."""
    at = lines.find(name + b": ")
    while at > 0 and lines[at - 1 : at] != b"\n":  # not at a line's start: part of another line
        at = lines.find(name + b": ", at + 1)
    if at < 0:
        return None
    start = at + len(name) + 2
    return lines[start : lines.find(b"\r\n", start)]


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> tuple[bytes, int]:
    """The backend's end-to-end response headers as header lines (lower-case names), less its Date
    (the proxy's server sets one; its Server header is off, so the backend's stays the only one),
    and its Content-Length (-1: none). Content-Length is kept: the body is relayed byte for byte."""
    out = []
    named: list[bytes] | None = None
    length = -1
    for name, value in raw:
        name = name.lower()
        if name in HOP_BY_HOP or name == b"date":
            if name == b"connection":
                named = (named or []) + _connection_tokens(value)
            continue
        if name == b"content-length":
            length = int(value) if value.isdigit() else -1
        out.append((name, value))
    if named:
        out = [(k, v) for k, v in out if k not in named]
        if b"content-length" in named:
            length = -1
    return b"".join([b"%b: %b\r\n" % pair for pair in out]), length


class FirstByteTimeout(TimeoutError):
    """No answer's head within the first-byte deadline (a transport's ``TransportError`` cause)."""


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

    def ready(self) -> bytes:
        """Body bytes already received, taken now without waiting (b"" when none): the relay sends
        them with the head, in one write."""
        return b""

    def complete(self) -> bool:
        """Whether the whole body has been received and taken (by ``ready``): nothing more to read."""
        return False

    def aiter_raw(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class Transport(Protocol):
    """Moves one request to the backend. ``send`` raises only ``TransportError``."""

    async def send(
        self,
        method: str,
        url: str,
        headers: bytes,
        body: bytes,
        *,
        close_connection: bool,
        first_byte_timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """``headers``: header lines, written as they are (Host and Content-Length are the
        transport's). Raises ``TransportError``; ``timeout`` with a ``FirstByteTimeout`` cause when
        no answer's head came within ``first_byte_timeout_s`` of sending."""
        ...

    async def aclose(self) -> None: ...


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
        keepalive_s: float = 0.0,  # TCP keepalive idle seconds on its connections (proxy/keepalive.py); 0 = off
    ) -> None:
        """``transport``: None (``backend_connection.ProtocolTransport``), a ``Transport``, or an
        httpx transport (tests)."""
        self.name = name  # the backend's name in the pool
        self.display_url = redact_url(base_url.rstrip("/"))
        # Credentials in the URL become an Authorization header: the URL the client library holds
        # (and may log) has none. The backend's own key (``api_key``) wins over them.
        parts = urlsplit(base_url.rstrip("/"))
        self._authorization: bytes | None = None  # the backend's own Authorization value
        if parts.username is not None or parts.password is not None:
            userinfo = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            self._authorization = b"Basic " + base64.b64encode(userinfo.encode())
            parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
        if api_key is not None:
            self._authorization = b"Bearer " + header_bytes(api_key)
        self.base_url = urlunsplit(parts)
        self.down_since_s: float | None = None  # time.monotonic() of the first refused connection of an outage
        self.first_byte_timeout_s = first_byte_timeout_s
        self._transport: Transport
        if transport is None:
            from clairvoyant.proxy.backend_connection import ProtocolTransport  # it builds on this module

            self._transport = ProtocolTransport(
                connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, tcp_keepalive_s=keepalive_s
            )
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
        headers: bytes | Iterable[tuple[str, str]] = b"",
        authorization: bytes | None = None,
        body: bytes = b"",
        close_connection: bool = False,
    ) -> UpstreamResponse:
        """Send a request and return the response with its body not yet read. Close it with ``aclose``.

        ``close_connection`` asks the backend to close the connection after this answer (for
        streamed answers: llama.cpp's server closes its connection after every stream without
        saying so, and a request sent on it in that instant would meet a close it cannot tell
        from a backend that read it and died); the proxy closes it too, never pooling it.

        ``headers``: the end-to-end header lines to forward (``forwardable_headers``: no
        hop-by-hop ones, no Content-Length, no Authorization), or (name, value) pairs of such
        headers; ``authorization``: the client's, sent unless the backend has credentials of its own.

        Raises ``UpstreamUnavailable`` (``never_sent`` when the connection could not be opened) or
        ``UpstreamTimeout``.
        """
        url = self.base_url + path + (f"?{query}" if query else "")
        forwarded = headers if isinstance(headers, bytes) else rendered_headers(headers)
        if self._authorization is not None:  # the backend's own credentials replace the client's
            forwarded += b"authorization: %b\r\n" % self._authorization
        elif authorization is not None:
            forwarded += b"authorization: %b\r\n" % authorization
        if close_connection:
            forwarded += b"connection: close\r\n"
        send = self._transport.send
        first_byte_timeout_s = self.first_byte_timeout_s
        for attempt in range(UNREAD_RETRIES + 1):
            try:
                response = await send(
                    method, url, forwarded, body, close_connection=close_connection,
                    first_byte_timeout_s=first_byte_timeout_s,
                )  # fmt: skip
                self.down_since_s = None
                return response
            except TransportError as exc:
                if isinstance(exc.cause, FirstByteTimeout):  # the deadline the transport keeps for us
                    raise self._translate(exc, f"no response headers within {first_byte_timeout_s} s") from None
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
