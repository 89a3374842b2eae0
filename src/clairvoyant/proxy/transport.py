"""What a transport is, in the manner of httpx's ``_transports/base.py``: the ``Transport``
interface, its one error (``TransportError``) and the types it shares with ``Upstream``.

The transports (aiohttp_transport.py, the served one; tests/httpx_transport.py, tests' injected
one) import this module and never their caller, ``upstream.py``, which imports them: no circle.
"""

from __future__ import annotations

import errno
from typing import Literal, Protocol

__all__ = [
    "KEEPALIVE_EXPIRY_S", "FirstByteTimeout", "Headers", "Transport", "TransportError", "UpstreamResponse",
    "header", "was_reset",
]  # fmt: skip

Headers = list[tuple[str, str]]  # (name, value) pairs as text (latin-1), names in lower case
FailureKind = Literal["connect", "connect_timeout", "build", "timeout", "failed"]

# Pooled connections idle longer than this are dropped, below the 5 s idle timeout of llama.cpp's
# server and of uvicorn (Ollama's is Go's, 5 s too): closing first ourselves avoids racing the backend's close of an idle connection.
KEEPALIVE_EXPIRY_S = 2.0
_RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})


class FirstByteTimeout(TimeoutError):
    """No answer's head within the first-byte deadline (a transport's ``TransportError`` cause)."""


class TransportError(Exception):
    """A transport's failure, classified for ``Upstream``: ``connect`` (refused or not opened),
    ``connect_timeout`` (not accepted in time) and ``build`` (the request could not be made; waiting
    will not help) sent nothing; then ``timeout`` and ``failed``. ``never_read``: the backend provably
    did not act on the request, as when it reset the connection before answering (it closed with our
    bytes unread: a socket closed after reading everything sends a FIN). A clean close after the
    request went out is never resent: the backend may have read it and be generating."""

    def __init__(self, kind: FailureKind, cause: BaseException, *, never_read: bool = False) -> None:
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


class UpstreamResponse(Protocol):
    """The backend's status and headers, with the body not yet read. Read it with ``read_chunk``
    (raw, undecoded bytes as they arrive, b"" at its end; raises ``TransportError``); always
    ``aclose``."""

    status_code: int
    raw_headers: list[tuple[bytes, bytes]]  # as received; names in the backend's case

    async def read_chunk(self) -> bytes: ...

    async def aclose(self) -> None: ...


def header(response: UpstreamResponse, name: bytes) -> str:
    """One response header's value ('' when absent); ``name`` in lower case."""
    for k, v in response.raw_headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return ""


class Transport(Protocol):
    """Moves one request to the backend. ``send`` raises only ``TransportError``."""

    async def send(
        self, method: str, url: str, headers: Headers, body: bytes, *, first_byte_timeout_s: float | None = None
    ) -> UpstreamResponse:
        """``url``: already encoded, sent as it is. ``headers``: sent as they are (Host and
        Content-Length are the transport's). Raises ``TransportError``; ``timeout`` with a
        ``FirstByteTimeout`` cause when no answer's head came within ``first_byte_timeout_s``."""
        ...

    async def aclose(self) -> None: ...
