"""The production transport behind ``Upstream``: aiohttp's client, through its public API.

aiohttp keeps a pool of keep-alive connections per backend (idle ones dropped after
``KEEPALIVE_EXPIRY_S``), never retries a POST itself, and leaves the body undecoded
(``auto_decompress=False``): the proxy relays the backend's bytes as they are. It adds none of its
own default headers: the backend sees the client's. URLs are sent as given (``encoded=True``), so
the target the proxy checked is the one the backend reads. The rules (resend, timeouts, error
translation) are ``Upstream``'s; this module only moves bytes and classifies aiohttp's failures.

A request that says ``Connection: close`` goes on a connection of its own, closed after its answer
(RFC 9112 9.6: a client that sends "close" must not send another request on that connection).
aiohttp's pool reads only the answer's Connection header, and a backend that closes as asked
without saying so (llama.cpp's server after a stream; the close is allowed to be silent) would
leave a connection in the pool that its close has not reached yet: the next request sent on it
meets "Server disconnected", unread, a 502 that nothing may resend (a clean close cannot be told
from a backend that read the request and died). httpx's h11 honours the request's header the same way.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
from yarl import URL

from clairvoyant.proxy.transport import (
    KEEPALIVE_EXPIRY_S,
    FirstByteTimeout,
    Headers,
    TransportError,
    UpstreamResponse,
    was_reset,
)

__all__ = ["AiohttpTransport", "tcp_keepalive"]

_SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def tcp_keepalive(sock: Any, idle_s: float) -> None:
    """Find a peer whose host vanished without a FIN or a reset (a laptop asleep, a network gone)
    in about 2 x ``idle_s``, where the system takes hours (keepalive) or ~15 minutes
    (unacknowledged bytes): keepalive probes after ``idle_s`` of silence, 4 of them ``idle_s`` / 4
    apart, and TCP_USER_TIMEOUT 2 x ``idle_s`` for bytes in flight. A peer that is there answers
    probes and acknowledges bytes, however long it takes to generate."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # ``sock``: a transport's "socket" (None, or a Unix one: nothing to set)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux (macOS has TCP_KEEPALIVE for the idle time only)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(idle_s)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(idle_s / 4)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; milliseconds
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(2000 * idle_s)))
    except OSError:  # a socket that refuses them still serves; the system's default applies
        pass


def _asks_close(headers: Headers) -> bool:
    """Whether the request's Connection header names "close" (names are in lower case)."""
    return any(name == "connection" and "close" in value.lower() for name, value in headers)


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


class AiohttpTransport:
    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float | None, keepalive_s: float = 0.0) -> None:
        """``keepalive_s``: TCP keepalive idle seconds on backend connections (0: the system's)."""
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._keepalive_s = keepalive_s
        # Made on first use, on the running loop: the pooled one, and one whose every connection
        # closes after its answer (requests that say Connection: close).
        self._session: aiohttp.ClientSession | None = None
        self._closing_session: aiohttp.ClientSession | None = None

    def _socket(self, addr_info: Any) -> socket.socket:
        """aiohttp's ``socket_factory``: a socket with ``tcp_keepalive``."""
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        tcp_keepalive(sock, self._keepalive_s)
        return sock

    def _client(self, headers: Headers) -> aiohttp.ClientSession:
        if _asks_close(headers):
            if self._closing_session is None:
                self._closing_session = self._new_session(force_close=True)
            return self._closing_session
        if self._session is None:
            self._session = self._new_session(force_close=False)
        return self._session

    def _new_session(self, *, force_close: bool) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=0,
            force_close=force_close,
            keepalive_timeout=None if force_close else KEEPALIVE_EXPIRY_S,  # aiohttp refuses both
            socket_factory=self._socket if self._keepalive_s > 0 else None,
        )
        return aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False, skip_auto_headers=_SKIP_AUTO_HEADERS
        )

    async def send(
        self, method: str, url: str, headers: Headers, body: bytes, *, first_byte_timeout_s: float | None = None
    ) -> UpstreamResponse:
        try:
            target = URL(url, encoded=True)
        except ValueError as exc:
            raise TransportError("build", exc) from exc
        try:
            session = self._client(headers)
            request = session.request(method, target, headers=headers, data=body or None, allow_redirects=False)
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
        for session in (self._session, self._closing_session):
            if session is not None:
                await session.close()
