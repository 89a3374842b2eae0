"""The HTTP client to the backend (Ollama or llama.cpp's server).

Every httpx exception is translated here into ``UpstreamUnavailable`` (502) or ``UpstreamTimeout``
(504); nothing above this module sees an httpx error type. Client-facing messages never name the
backend's address (it may carry credentials); the log detail does, with userinfo redacted.

Timeouts: connect ``connect_timeout_s``; the response headers within ``first_byte_timeout_s`` of
sending (a cold model load, or a whole non-streamed answer); between body bytes ``read_timeout_s``
(none by default: long answers take minutes).

A request is sent again only when the backend cannot have acted on it (see ``_never_read``):
nothing is ever resent after the backend may have read it, so a generation is never duplicated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

from clairvoyant.errors import RequestError, UpstreamTimeout, UpstreamUnavailable

__all__ = ["HOP_BY_HOP", "Upstream", "forwardable_headers", "redact_url", "response_headers"]

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
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host",
    }
)


def redact_url(url: str) -> str:
    """The URL with any user:password replaced by ``***`` (for logs and status pages)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def forwardable_headers(
    headers: Iterable[tuple[str, str]], *, keep_content_length: bool = False
) -> list[tuple[str, str]]:
    """End-to-end headers only (drops hop-by-hop ones and those named in Connection).

    Request bodies are re-sent by httpx, which sets its own Content-Length; response bodies are
    relayed byte for byte, so theirs stays valid and is kept.
    """
    pairs = [(k, v) for k, v in headers]
    if not keep_content_length:
        pairs = [(k, v) for k, v in pairs if k.lower() != "content-length"]
    named = {
        token.strip().lower()
        for k, v in pairs
        if k.lower() == "connection"
        for token in v.split(",")
    }
    return [(k, v) for k, v in pairs if k.lower() not in HOP_BY_HOP and k.lower() not in named]


class _SendTrace:
    """What httpcore reports of one attempt: a fresh connection, and how far the request got."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: set[str] = set()

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        self.events.add(event)

    def never_read(self, exc: httpx.HTTPError) -> bool:
        """True only when the backend provably did not act on the request: it went out on a REUSED
        connection (a fresh one that fails means the backend is down or broken: no resend), and
        either it was not fully written, or the backend reset the connection. A reset means the
        backend closed with our bytes unread in its socket (a clean close after reading would be a
        FIN, not a reset). A clean close after the request went out is never resent: the backend
        may have read it and be generating."""
        traced = "http11.send_request_headers.started" in self.events
        if not traced or "connection.connect_tcp.started" in self.events:
            return False  # no trace (a test transport) or a fresh connection: no proof
        if "http11.send_request_body.complete" not in self.events:
            return True
        return _was_reset(exc)


def _was_reset(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ConnectionResetError, BrokenPipeError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Upstream:
    """One pooled httpx client for the proxy's lifetime (created in the lifespan, closed on shutdown)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float | None = None,
        first_byte_timeout_s: float | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        # Credentials in the URL become basic auth: the URL httpx holds (and logs) has none.
        parts = urlsplit(base_url.rstrip("/"))
        auth = None
        if parts.username is not None or parts.password is not None:
            auth = httpx.BasicAuth(unquote(parts.username or ""), unquote(parts.password or ""))
            parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
        self.base_url = urlunsplit(parts)
        self.down_since_s: float | None = None  # time.monotonic() of the first refused connection of an outage
        # The backend's own key replaces whatever Authorization the client sent.
        self._authorization = None if api_key is None else ("Authorization", f"Bearer {api_key}")
        self.display_url = redact_url(base_url.rstrip("/"))
        self.first_byte_timeout_s = first_byte_timeout_s
        timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=connect_timeout_s, pool=None)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            auth=auth,
            timeout=timeout,
            transport=transport,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32, keepalive_expiry=KEEPALIVE_EXPIRY_S),
            follow_redirects=False,
        )

    def _translate(self, exc: httpx.HTTPError | TimeoutError, what: str) -> RequestError:
        detail = f"{what} at {self.display_url}: {type(exc).__name__}: {exc}"
        if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
            return UpstreamTimeout(f"the backend did not answer in time ({what})", detail=detail)
        kind = "unreachable" if isinstance(exc, httpx.ConnectError) else "failed"
        return UpstreamUnavailable(f"the backend is {kind} ({type(exc).__name__})", detail=detail)

    async def open(
        self,
        method: str,
        path: str,
        *,
        query: str = "",
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        close_connection: bool = False,
    ) -> httpx.Response:
        """Send a request and return the response with its body not yet read. Close it with ``close``.

        ``close_connection`` asks the backend to close the connection after this answer (for
        streamed answers: llama.cpp's server closes its connection after every stream without
        saying so, and a request sent on it in that instant would meet a close it cannot tell
        from a backend that read it and died).

        Raises ``UpstreamUnavailable`` (``never_sent`` when the connection could not be opened) or
        ``UpstreamTimeout``.
        """
        url = path + (f"?{query}" if query else "")
        forwarded = forwardable_headers(headers)
        if self._authorization is not None:
            forwarded = [(k, v) for k, v in forwarded if k.lower() != "authorization"]
            forwarded.append(self._authorization)
        if close_connection:
            forwarded.append(("Connection", "close"))
        for attempt in range(UNREAD_RETRIES + 1):
            trace = _SendTrace()
            request = self._client.build_request(method, url, headers=forwarded, content=body, extensions={"trace": trace})
            try:
                if self.first_byte_timeout_s is None:
                    response = await self._client.send(request, stream=True)
                else:
                    async with asyncio.timeout(self.first_byte_timeout_s):
                        response = await self._client.send(request, stream=True)
                self.down_since_s = None
                return response
            except TimeoutError as exc:
                raise self._translate(exc, f"no response headers within {self.first_byte_timeout_s:g} s") from None
            except httpx.ConnectError as exc:
                if self.down_since_s is None:
                    self.down_since_s = time.monotonic()
                detail = f"{method} {path} at {self.display_url}: {type(exc).__name__}: {exc}"
                raise UpstreamUnavailable("the backend is unreachable", detail=detail, never_sent=True) from exc
            except httpx.HTTPError as exc:
                if attempt < UNREAD_RETRIES and trace.never_read(exc):
                    logger.debug("the backend closed a reused connection without reading (%s); resending", exc)
                    continue
                raise self._translate(exc, f"{method} {path}") from exc
        raise AssertionError("unreachable")

    async def iter_body(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """The raw (undecoded) body as it arrives; errors translated."""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise self._translate(exc, "reading the answer") from exc

    async def get(self, path: str, *, timeout_s: float = 2.0) -> httpx.Response:
        """A short GET with a total timeout (readiness probes)."""
        try:
            headers = [] if self._authorization is None else [self._authorization]
            return await self._client.get(path, timeout=timeout_s, headers=headers)
        except httpx.HTTPError as exc:
            raise self._translate(exc, f"GET {path}") from exc

    async def probe(self, timeout_s: float = 2.0) -> str | None:
        """One health check: None when the backend is ready, else why not. Ready = ``/health``
        answers anything but 503 (llama.cpp answers 503 while its model loads; Ollama, which has no
        such path, 404)."""
        try:
            response = await self.get(HEALTH_PATH, timeout_s=timeout_s)
        except RequestError as exc:
            return exc.detail
        return "the backend answered 503 (loading or busy)" if response.status_code == 503 else None

    async def busy_slots(self) -> int | None:
        """How many of llama.cpp's slots are processing (``GET /slots``), or None where the backend
        has no such endpoint or does not answer."""
        try:
            response = await self.get("/slots", timeout_s=2.0)
            slots = response.json() if response.status_code == 200 else None
        except (RequestError, ValueError):
            return None
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
                if self.down_since_s is not None:
                    self.down_since_s = None
                return True
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                return False
            await asyncio.sleep(min(delay_s, remaining_s))
            delay_s = min(2.0, delay_s * 2)
        return False

    async def aclose(self) -> None:
        await self._client.aclose()


def response_headers(headers: Mapping[str, str] | httpx.Headers) -> list[tuple[str, str]]:
    """The backend's end-to-end response headers, less its Date (the proxy's server sets one; its
    Server header is off, so the backend's stays the only one)."""
    items = headers.multi_items() if isinstance(headers, httpx.Headers) else list(headers.items())
    return [(k, v) for k, v in forwardable_headers(items, keep_content_length=True) if k.lower() != "date"]
