"""The tests' transport behind ``Upstream``: httpx's client over an injected httpx transport
(``httpx.MockTransport``, respx), for what cannot run here (Ollama's native API, faults). Passed to
``create_app(upstream_transport=...)``, it serves every backend of the pool. The proxy itself
serves with aiohttp (proxy/aiohttp_transport.py); the rules (resend, timeouts, error translation)
are ``Upstream``'s and the same for both: this module only moves bytes and classifies httpx's
failures as ``TransportError``, as the ``Transport`` interface (proxy/transport.py) asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import httpx

from clairvoyant.proxy.transport import KEEPALIVE_EXPIRY_S, FirstByteTimeout, Headers, TransportError, UpstreamResponse

__all__ = ["HttpxTransport"]


class _HttpxResponse:
    __slots__ = ("status_code", "raw_headers", "_response", "_chunks")

    def __init__(self, response: httpx.Response) -> None:
        self.status_code = response.status_code
        self.raw_headers = list(response.headers.raw)
        self._response = response
        self._chunks: AsyncGenerator[bytes] = response.aiter_raw()  # type: ignore[assignment]

    async def read_chunk(self) -> bytes:
        try:
            return await anext(self._chunks, b"")
        except httpx.HTTPError as exc:
            raise TransportError("timeout" if isinstance(exc, httpx.TimeoutException) else "failed", exc) from exc

    async def aclose(self) -> None:
        await self._chunks.aclose()
        await self._response.aclose()


class HttpxTransport:
    def __init__(self, transport: httpx.AsyncBaseTransport, *, connect_timeout_s: float = 10.0) -> None:
        """``connect_timeout_s``: also the write timeout; no read timeout (the settings' defaults)."""
        timeout = httpx.Timeout(connect=connect_timeout_s, read=None, write=connect_timeout_s, pool=None)
        self._client = httpx.AsyncClient(
            timeout=timeout,
            transport=transport,
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=32, keepalive_expiry=KEEPALIVE_EXPIRY_S
            ),
            follow_redirects=False,
        )

    async def send(
        self,
        method: str,
        url: str,
        headers: Headers,
        body: bytes,
        *,
        first_byte_timeout_s: float | None = None,
    ) -> UpstreamResponse:
        try:
            request = self._client.build_request(method, url, headers=headers, content=body)
        except (httpx.InvalidURL, ValueError) as exc:
            raise TransportError("build", exc) from exc
        try:
            async with asyncio.timeout(first_byte_timeout_s):
                return _HttpxResponse(await self._client.send(request, stream=True))
        except TimeoutError as exc:
            raise TransportError("timeout", FirstByteTimeout(f"no answer within {first_byte_timeout_s} s")) from exc
        except httpx.ConnectError as exc:
            raise TransportError("connect", exc) from exc
        except httpx.ConnectTimeout as exc:
            raise TransportError("connect_timeout", exc) from exc
        except httpx.TimeoutException as exc:
            raise TransportError("timeout", exc) from exc
        except httpx.HTTPError as exc:
            # A mock reports nothing of how far the request got: never provably unread, never resent.
            raise TransportError("failed", exc) from exc

    async def aclose(self) -> None:
        await self._client.aclose()
