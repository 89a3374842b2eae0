"""The HTTP client to the backend (Ollama or llama.cpp's server).

Every httpx exception is translated here into ``UpstreamUnavailable`` (502) or ``UpstreamTimeout``
(504); nothing above this module sees an httpx error type. There is no read timeout by default
(generation takes minutes), only a connect timeout.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping

import httpx

from clairvoyant.errors import UpstreamTimeout, UpstreamUnavailable

__all__ = ["HOP_BY_HOP", "Upstream", "forwardable_headers", "response_headers"]

logger = logging.getLogger(__name__)

# Resends after the server dropped a pooled connection without answering (see Upstream.open).
STALE_CONNECTION_RETRIES = 2

# RFC 9110 7.6.1 hop-by-hop headers, plus those the proxy recomputes itself.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host",
    }
)


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


def _translate(exc: httpx.HTTPError, base_url: str) -> Exception:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"the backend at {base_url} did not answer in time ({type(exc).__name__})")
    return UpstreamUnavailable(f"the backend at {base_url} is unreachable or failed: {type(exc).__name__}: {exc}")


class Upstream:
    """One pooled httpx client for the proxy's lifetime (created in the lifespan, closed on shutdown)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=connect_timeout_s, pool=None)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout,
            transport=transport,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
            follow_redirects=False,
        )

    async def open(
        self,
        method: str,
        path: str,
        *,
        query: str = "",
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> httpx.Response:
        """Send a request and return the response with its body not yet read. Close it with ``close``."""
        url = path + (f"?{query}" if query else "")
        request = self._client.build_request(method, url, headers=forwardable_headers(headers), content=body)
        for attempt in range(STALE_CONNECTION_RETRIES + 1):
            try:
                return await self._client.send(request, stream=True)
            except httpx.RemoteProtocolError as exc:
                # "Server disconnected without sending a response": a pooled keep-alive connection
                # the server had closed (llama.cpp's server closes some connections after a streamed
                # answer without saying so). Nothing was answered, so send again on a fresh one.
                if attempt == STALE_CONNECTION_RETRIES:
                    raise _translate(exc, self.base_url) from exc
                logger.debug("upstream connection was stale (%s); retrying", exc)
            except httpx.HTTPError as exc:
                raise _translate(exc, self.base_url) from exc
        raise AssertionError("unreachable")

    async def iter_body(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """The raw (undecoded) body as it arrives; errors translated."""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise _translate(exc, self.base_url) from exc

    async def get(self, path: str, *, timeout_s: float = 2.0) -> httpx.Response:
        """A short GET with a total timeout (readiness probes)."""
        try:
            return await self._client.get(path, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise _translate(exc, self.base_url) from exc

    async def aclose(self) -> None:
        await self._client.aclose()


def response_headers(headers: Mapping[str, str] | httpx.Headers) -> list[tuple[str, str]]:
    items = headers.multi_items() if isinstance(headers, httpx.Headers) else list(headers.items())
    return forwardable_headers(items, keep_content_length=True)
