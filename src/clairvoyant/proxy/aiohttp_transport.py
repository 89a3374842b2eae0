"""The production transport behind ``Upstream``: aiohttp's client, through its public API.

aiohttp keeps a pool of keep-alive connections per backend (idle ones dropped after
``KEEPALIVE_EXPIRY_S``), never retries a POST itself, and leaves the body undecoded
(``auto_decompress=False``): the proxy relays the backend's bytes as they are. It adds none of its
own default headers (User-Agent, Accept, Accept-Encoding, Content-Type): the backend sees the
client's. URLs are sent as given (``encoded=True``), so the target the proxy checked is the one the
backend reads.

This module only moves bytes and classifies aiohttp's failures as ``TransportError``; the rules
(resend, timeouts, error translation) are ``Upstream``'s.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
from yarl import URL

from clairvoyant.proxy.keepalive import tcp_keepalive
from clairvoyant.proxy.transport import (
    KEEPALIVE_EXPIRY_S,
    FirstByteTimeout,
    Headers,
    TransportError,
    UpstreamResponse,
    was_reset,
)

__all__ = ["AiohttpTransport"]

_SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


class _AiohttpResponse:
    __slots__ = ("status_code", "raw_headers", "_response")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.status_code = response.status
        self.raw_headers = list(response.raw_headers)
        self._response = response

    async def read_chunk(self) -> bytes:
        try:
            return await self._response.content.readany()
        except TimeoutError as exc:  # aiohttp's read timeout (a ClientError too)
            raise TransportError("timeout", exc) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise TransportError("failed", exc) from exc

    async def aclose(self) -> None:
        # Read to its end, the connection goes back to the pool; cut short, it is closed (the
        # backend sees the close: llama.cpp and Ollama stop generating).
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


def _keepalive_sockets(idle_s: float) -> Callable[[Any], socket.socket]:
    """aiohttp's ``socket_factory``: sockets with TCP keepalive (``keepalive.tcp_keepalive``)."""

    def make(addr_info: Any) -> socket.socket:
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        tcp_keepalive(sock, idle_s)
        return sock

    return make


class AiohttpTransport:
    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float | None, keepalive_s: float = 0.0) -> None:
        """``keepalive_s``: TCP keepalive idle seconds on backend connections (0: the system's)."""
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None  # made on first use, on the running loop

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            factory = _keepalive_sockets(self._keepalive_s) if self._keepalive_s > 0 else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S, socket_factory=factory),
                timeout=self._timeout,
                auto_decompress=False,
                skip_auto_headers=_SKIP_AUTO_HEADERS,
            )
        return self._session

    async def send(
        self, method: str, url: str, headers: Headers, body: bytes, *, first_byte_timeout_s: float | None = None
    ) -> UpstreamResponse:
        try:
            target = URL(url, encoded=True)
        except ValueError as exc:
            raise TransportError("build", exc) from exc
        try:
            request = self._client().request(method, target, headers=headers, data=body or None, allow_redirects=False)
            if first_byte_timeout_s is None:
                response = await request
            else:
                async with asyncio.timeout(first_byte_timeout_s):
                    response = await request
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                raise TransportError("connect_timeout", exc) from exc
            if isinstance(exc, aiohttp.ServerTimeoutError):
                raise TransportError("timeout", exc) from exc
            raise TransportError("timeout", FirstByteTimeout(f"no answer within {first_byte_timeout_s} s")) from exc
        except aiohttp.ClientConnectorError as exc:
            raise TransportError("connect", exc) from exc
        except (aiohttp.InvalidURL, ValueError) as exc:
            raise TransportError("build", exc) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise TransportError("failed", exc, never_read=was_reset(exc)) from exc
        return _AiohttpResponse(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
