"""The backend (Ollama, llama.cpp's server, vLLM, any OpenAI-compatible server) and the rules for
talking to it: ``Upstream`` owns them; a ``Transport`` (proxy/transport.py: aiohttp's, or tests'
over ``httpx.MockTransport``) only moves one request. No other module sees a client library.

Every transport failure becomes ``UpstreamUnavailable`` (502) or ``UpstreamTimeout`` (504). What
the client reads never names the backend's address (it may carry credentials); the log does,
redacted. A request is sent again only when the backend cannot have acted on it (see
``TransportError``), so a generation is never duplicated. Timeouts: ``connect_timeout_s``;
``first_byte_timeout_s`` for the answer's head (a cold model load, or a whole non-streamed
answer), after which the backend is *suspect* (it may be hung: the next request waits for its
health check); ``read_timeout_s`` between body bytes (none by default: answers take minutes).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import time
from collections.abc import Callable, Container, Iterable
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from clairvoyant.errors import RequestError, UpstreamTimeout, UpstreamUnavailable
from clairvoyant.proxy.aiohttp_transport import AiohttpTransport
from clairvoyant.proxy.backend_kinds import AUTO, BackendKind
from clairvoyant.proxy.transport import FirstByteTimeout, Headers, Transport, TransportError, UpstreamResponse

__all__ = ["Upstream", "forwardable_headers", "response_headers"]

logger = logging.getLogger(__name__)

# Resends of a request the backend provably never read (a reused connection it had closed).
UNREAD_RETRIES = 2
PROBE_TIMEOUT_S = 2.0  # one health check's bound: a backend that accepts and never answers fails it
LAST_PROBE_S = 0.5  # the bound of a health check made with its waiter's deadline (nearly) passed

# RFC 9110 7.6.1 hop-by-hop headers, plus those the proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
        "trailer", "trailers", "transfer-encoding", "upgrade", "host",
    }
)  # fmt: skip
# Never forwarded upstream: the body goes whole with our own length, and Expect was answered by
# the proxy's server (a backend must not answer it a second time).
_NOT_FORWARDED = HOP_BY_HOP | {"content-length", "expect"}
# Never relayed to the client: the proxy's server sets its own Date and Server.
_NOT_RELAYED = HOP_BY_HOP | {"date", "server"}


def forwardable_headers(
    raw: Iterable[tuple[bytes, bytes]], drop: Container[str] = ()
) -> tuple[Headers, str | None, dict[str, str]]:
    """A request's end-to-end headers (the server's raw pairs), its Authorization value (None:
    none; kept apart, a backend's own credentials replace it), and the first value of each header
    in ``drop`` (the proxy's own: read, not forwarded). Dropped too: hop-by-hop headers, those
    named in Connection, Content-Length and Expect."""
    pairs = [(name.decode("latin-1").lower(), value.decode("latin-1")) for name, value in raw]
    named = {t.strip().lower() for n, v in pairs if n == "connection" for t in v.split(",")}  # hop-by-hop too
    kept: Headers = []
    dropped: dict[str, str] = {}
    authorization: str | None = None
    for name, value in pairs:
        if name in _NOT_FORWARDED or name in named:
            continue
        if name in drop:
            dropped.setdefault(name, value)
        elif name == "authorization":
            authorization = value if authorization is None else authorization
        else:
            kept.append((name, value))
    return kept, authorization, dropped


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The backend's end-to-end response headers (lower-case names), less the ones the proxy's
    server sets itself. Content-Length is kept: the body is relayed byte for byte."""
    pairs = [(name.lower(), value) for name, value in raw]
    named = {t.strip().lower() for n, v in pairs if n == b"connection" for t in v.split(b",")}
    return [(name, value) for name, value in pairs if name.decode("latin-1") not in _NOT_RELAYED and name not in named]


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
        transport: Transport | None = None,
        name: str = "default",
        kind: BackendKind = AUTO,
        keepalive_s: float = 0.0,  # TCP keepalive idle seconds on its connections (aiohttp_transport.tcp_keepalive); 0 = off
    ) -> None:
        """``transport``: None (aiohttp's, with these timeouts and keepalive), or tests' own."""
        self.name = name  # the backend's name in the pool
        self.kind = kind  # what it is (the pool finds out when ``auto``): its health path and slot probe
        self.display_url = base_url.rstrip("/")  # for logs and status pages: credentials as ***
        # Credentials in the URL become an Authorization header: the URL the client library holds
        # (and may log) has none. The backend's own key (``api_key``) wins over them.
        parts = urlsplit(base_url.rstrip("/"))
        self._authorization: str | None = None  # the backend's own Authorization value
        if "@" in parts.netloc:
            userinfo = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            self._authorization = "Basic " + base64.b64encode(userinfo.encode()).decode()
            parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
            self.display_url = urlunsplit(parts._replace(netloc="***@" + parts.netloc))
        if api_key is not None:
            self._authorization = "Bearer " + api_key
        self.base_url = urlunsplit(parts)
        self.down_since_s: float | None = None  # time.monotonic() of the first failure of an outage
        self.suspect = False  # a first-byte deadline passed: health-checked before the next request
        self.first_byte_timeout_s = first_byte_timeout_s
        if transport is None:
            transport = AiohttpTransport(
                connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, keepalive_s=keepalive_s
            )
        self._transport = transport

    def _translate(self, exc: TransportError | TimeoutError, what: str) -> RequestError:
        cause = exc.cause if isinstance(exc, TransportError) else exc
        detail = f"{what} at {self.display_url}: {describe(cause)}"
        if isinstance(exc, TimeoutError) or exc.kind == "timeout":
            return UpstreamTimeout(f"the backend did not answer in time ({what})", detail=detail)
        return UpstreamUnavailable(f"the backend failed ({what})", detail=detail)  # its cause in the log only

    async def open(
        self,
        method: str,
        target: str,
        *,
        headers: Iterable[tuple[str, str]] = (),
        authorization: str | None = None,
        body: bytes = b"",
        close_connection: bool = False,
    ) -> UpstreamResponse:
        """The response, its body not yet read (``aclose`` it). ``target``: the raw path and query.
        ``authorization``: the client's, sent unless the backend has credentials of its own.
        ``close_connection``: llama.cpp's server closes its connection after every stream without
        saying so; a request sent on it in that instant would meet a close it cannot tell from a
        backend that read it and died (so the transport sends no other request on it). Raises
        ``UpstreamUnavailable`` or ``UpstreamTimeout`` (``never_sent`` when the connection was
        refused or not accepted in time)."""
        forwarded = list(headers)
        if self._authorization is not None:  # the backend's own credentials replace the client's
            forwarded.append(("authorization", self._authorization))
        elif authorization is not None:
            forwarded.append(("authorization", authorization))
        if close_connection:
            forwarded.append(("connection", "close"))
        url = self.base_url + target
        timeout_s = self.first_byte_timeout_s
        for attempt in range(UNREAD_RETRIES + 1):
            attempt_s = time.monotonic()
            try:
                response = await self._transport.send(method, url, forwarded, body, first_byte_timeout_s=timeout_s)
            except TransportError as exc:
                if isinstance(exc.cause, FirstByteTimeout):  # the deadline the transport keeps for us
                    self.suspect = True
                    raise self._translate(exc, f"no response headers within {timeout_s} s") from None
                if exc.kind in ("connect", "connect_timeout"):
                    detail = f"{method} {target} at {self.display_url}: {describe(exc.cause)}"
                    if self.down_since_s is None:  # an outage begins: said once, at once
                        # From this attempt's start: a connection not accepted within the connect
                        # timeout was down all along, and backend_wait_s counts from then.
                        self.down_since_s = attempt_s
                        logger.warning("backend %s unreachable (%s); requests wait for it", self.name, detail)
                    if exc.kind == "connect_timeout":
                        raise UpstreamTimeout(
                            "the backend did not accept the connection in time", detail=detail, never_sent=True
                        ) from exc
                    raise UpstreamUnavailable("the backend is unreachable", detail=detail, never_sent=True) from exc
                if exc.kind == "failed" and attempt < UNREAD_RETRIES and exc.never_read:
                    logger.debug("the backend closed a reused connection without reading (%s); resending", exc)
                    continue
                raise self._translate(exc, f"{method} {target}") from exc
            self.down_since_s = None
            self.suspect = False
            return response
        raise AssertionError("unreachable")

    async def read_chunk(self, response: UpstreamResponse) -> bytes:
        """The next raw (undecoded) bytes of the body as they arrive, b"" at its end; errors
        translated. (A method, not an async generator: one left unfinished, as at a body's known
        end, would cost the loop a finalizer call per request.)"""
        try:
            return await response.read_chunk()
        except TransportError as exc:
            raise self._translate(exc, "reading the answer") from exc

    async def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
        """One health check: None when the backend is ready (its kind's ``health_path`` answers
        anything but 503), else why not."""
        path = self.kind.health_path
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.open("GET", path)
                await response.aclose()
        except TimeoutError as exc:
            return self._translate(exc, f"GET {path}").detail
        except RequestError as exc:
            return exc.detail
        return "the backend answered 503 (loading or busy)" if response.status_code == 503 else None

    async def get_json(self, path: str, timeout_s: float = 2.0) -> Any:
        """``GET path``'s JSON body when it answers 200 within ``timeout_s``, else None."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.open("GET", path)
                try:
                    chunks = []
                    while chunk := await self.read_chunk(response):
                        chunks.append(chunk)
                    body = b"".join(chunks)
                finally:
                    await response.aclose()
            return json.loads(body) if response.status_code == 200 else None
        except (TimeoutError, RequestError, ValueError):
            return None

    async def busy_slots(self) -> int | None:
        """How many of llama.cpp's slots are processing, or None (no ``busy_slots_path``: it stops
        on disconnect; or no answer)."""
        if self.kind.busy_slots_path is None:
            return None
        slots = await self.get_json(self.kind.busy_slots_path)
        if not isinstance(slots, list):
            return None
        return sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing"))

    def outage_deadline_s(self, wait_s: float) -> float:
        """When a request that could not reach the backend stops waiting: ``wait_s`` after the
        outage began (shared by every request, so the queue behind does not wait ``wait_s`` each)."""
        start_s = self.down_since_s if self.down_since_s is not None else time.monotonic()
        return start_s + wait_s

    async def wait_until_ready(self, deadline_s: float, give_up: Callable[[], bool] = lambda: False) -> bool:
        """True once a probe (0.1 s apart, doubling to 2 s) passes; False at ``deadline_s``
        (time.monotonic) or ``give_up()``. Each probe is bounded by the time left (at least
        ``LAST_PROBE_S``): a backend that never answers holds the caller no later than the deadline."""
        delay_s = 0.1
        while not give_up():
            timeout_s = min(PROBE_TIMEOUT_S, max(LAST_PROBE_S, deadline_s - time.monotonic()))
            if await self.probe(timeout_s) is None:
                self.down_since_s = None
                self.suspect = False
                return True
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                return False
            await asyncio.sleep(min(delay_s, remaining_s))
            delay_s = min(2.0, delay_s * 2)
        return False

    async def diagnose(self, timeout_s: float = 2.0) -> str | None:
        """Why a backend that failed its health check may be misconfigured rather than down: its
        port speaks the other scheme (https:// in front of plain HTTP hangs in the TLS handshake;
        http:// in front of TLS gets no HTTP answer). None when neither is evident."""
        parts = urlsplit(self.base_url)
        host, tls = parts.hostname or "", parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(host, port, ssl=None if tls else context)
                try:
                    if not tls:
                        return "this port speaks TLS: use https://"
                    writer.write(
                        b"GET " + self.kind.health_path.encode() + b" HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n"
                    )
                    answer = await reader.read(16)
                    return "this port speaks plain HTTP: use http://" if answer.startswith(b"HTTP/") else None
                finally:
                    writer.close()
        except (OSError, TimeoutError, ssl.SSLError):
            return None

    async def aclose(self) -> None:
        await self._transport.aclose()


def describe(exc: BaseException) -> str:
    """An exception as log text that is never empty (``TimeoutError()`` prints as '')."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
