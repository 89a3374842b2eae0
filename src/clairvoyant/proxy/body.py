"""Reading a request's body whole, so that it goes upstream with the proxy's own Content-Length
and no framing of the client's reaches the backend (no request smuggling). What that costs is
bounded: ``max_body_bytes`` per request (413, at once when Content-Length says so),
``client_timeout_s`` for the whole body (408), and ``BodyBudget`` for all bodies held at once
(503 with Retry-After: else N clients each just under the limit would hold N times the limit).
The server sends ``100 Continue`` only when ``read_body`` first asks for the body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from clairvoyant.errors import (
    BadRequest,
    BodyBudgetExhausted,
    IncompleteBody,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedCoding,
)

__all__ = ["BodyBudget", "check_framing", "declared_length", "read_body"]

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class BodyBudget:
    """The bytes of request bodies the process holds at once, against a limit."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def take(self, n_bytes: int) -> None:
        """Hold ``n_bytes`` more, or raise ``BodyBudgetExhausted`` (holding nothing more)."""
        if self.held_bytes + n_bytes > self.limit_bytes:
            raise BodyBudgetExhausted("the proxy holds as many request bodies as it may; retry shortly")
        self.held_bytes += n_bytes

    def give_back(self, n_bytes: int) -> None:
        self.held_bytes -= n_bytes


def check_framing(http_version: str, headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse a body framing the server would accept but the proxy must not (RFC 9112 6.1): a
    transfer coding other than chunked is 501 (its bytes would reach the app still encoded);
    chunked applied twice, not last, or on HTTP/1.0 is 400."""
    codings = [
        coding.strip().lower()
        for name, value in headers
        if name == b"transfer-encoding"
        for coding in value.split(b",")
        if coding.strip()
    ]
    if not codings:
        return
    if http_version == "1.0":
        raise BadRequest("Transfer-Encoding is not allowed in an HTTP/1.0 request")
    if codings.count(b"chunked") != 1 or codings[-1] != b"chunked":
        raise BadRequest("the request's Transfer-Encoding must end with chunked, applied once")
    if len(codings) > 1:
        raise UnsupportedCoding("only the chunked transfer coding is supported")


def declared_length(headers: list[tuple[bytes, bytes]], max_bytes: int) -> int | None:
    """The request's Content-Length (its form checked by the server), or None; ``PayloadTooLarge``
    above ``max_bytes``."""
    for name, value in headers:
        if name == b"content-length":
            if int(value) > max_bytes:
                raise PayloadTooLarge(f"the request body is larger than {max_bytes} bytes")
            return int(value)
    return None


async def read_body(
    receive: Receive, *, declared_bytes: int | None, max_bytes: int, timeout_s: float, budget: BodyBudget
) -> tuple[bytes, int]:
    """The whole body and the bytes taken from ``budget`` for it (given back by the caller when the
    request is over; on an exception, here). Raises ``PayloadTooLarge``, ``BodyBudgetExhausted``,
    ``RequestTimeout`` or ``IncompleteBody`` (the client left, or its chunked framing is broken)."""
    if declared_bytes is not None:  # ``declared_length``'s, within the limit
        budget.take(declared_bytes)
    taken = declared_bytes or 0
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise IncompleteBody("the request body ended before it was complete, or its chunks are malformed")
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > max_bytes:
                        raise PayloadTooLarge(f"the request body is larger than {max_bytes} bytes")
                    if size > taken:
                        budget.take(size - taken)
                        taken = size
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        budget.give_back(taken)
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except BaseException:
        budget.give_back(taken)
        raise
    return b"".join(chunks), taken
