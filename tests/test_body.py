"""proxy/body.py: a request body read whole, within its deadline, its limit and the budget."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

from clairvoyant.errors import (
    BadRequest,
    BodyBudgetExhausted,
    IncompleteBody,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedCoding,
)
from clairvoyant.proxy.body import BodyBudget, check_framing, declared_length, read_body


def receiver(messages: Iterable[dict[str, Any]], *, then_hang: bool = False) -> Any:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        if then_hang:
            await asyncio.Event().wait()
        raise AssertionError("read past the body")

    return receive


def chunks(*parts: bytes) -> list[dict[str, Any]]:
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]


def read(receive: Any, budget: BodyBudget, declared: int | None = None, max_bytes: int = 100) -> tuple[bytes, int]:
    return asyncio.run(read_body(receive, declared_bytes=declared, max_bytes=max_bytes, timeout_s=0.2, budget=budget))


def test_a_chunked_body_is_joined_and_held_against_the_budget_until_given_back() -> None:
    budget = BodyBudget(1000)
    body, held = read(receiver(chunks(b"ab", b"", b"cd")), budget)
    assert (body, held, budget.held_bytes) == (b"abcd", 4, 4)
    budget.give_back(held)
    assert budget.held_bytes == 0


def test_a_declared_length_is_taken_from_the_budget_before_the_body_arrives() -> None:
    budget = BodyBudget(10)
    budget.take(5)
    with pytest.raises(BodyBudgetExhausted) as refused:
        read(receiver(chunks(b"x" * 6)), budget, declared=6)
    assert refused.value.status_code == 503 and refused.value.headers == {"Retry-After": "1"}
    assert budget.held_bytes == 5  # nothing more held


def test_a_chunked_body_beyond_the_budget_is_refused_and_gives_back_what_it_held() -> None:
    budget = BodyBudget(5)
    with pytest.raises(BodyBudgetExhausted):
        read(receiver(chunks(b"abc", b"def")), budget)
    assert budget.held_bytes == 0


def test_limits_deadlines_and_leavers() -> None:
    budget = BodyBudget(1000)
    with pytest.raises(PayloadTooLarge):
        read(receiver(chunks(b"x" * 60, b"x" * 60)), budget)
    with pytest.raises(PayloadTooLarge):
        declared_length([(b"content-length", b"101")], 100)
    assert declared_length([(b"content-length", b"100")], 100) == 100
    assert declared_length([(b"transfer-encoding", b"chunked")], 100) is None
    with pytest.raises(RequestTimeout):
        read(receiver([{"type": "http.request", "body": b"x", "more_body": True}], then_hang=True), budget)
    with pytest.raises(IncompleteBody):
        read(receiver([{"type": "http.request", "body": b"x", "more_body": True}, {"type": "http.disconnect"}]), budget)
    assert budget.held_bytes == 0


def test_framing_the_proxy_refuses_though_the_server_would_read_it() -> None:
    check_framing("1.1", [(b"transfer-encoding", b"chunked")])
    check_framing("1.1", [(b"content-length", b"3")])
    with pytest.raises(UnsupportedCoding):
        check_framing("1.1", [(b"transfer-encoding", b"gzip, chunked")])
    with pytest.raises(UnsupportedCoding):
        check_framing("1.1", [(b"transfer-encoding", b"gzip"), (b"transfer-encoding", b"chunked")])
    for value in (b"chunked, chunked", b"chunked, gzip", b"gzip"):
        with pytest.raises(BadRequest):
            check_framing("1.1", [(b"transfer-encoding", value)])
    with pytest.raises(BadRequest):
        check_framing("1.0", [(b"transfer-encoding", b"chunked")])
