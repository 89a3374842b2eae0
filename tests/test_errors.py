"""errors.py: each error's status, and Retry-After from one ``retry_after_s`` on the base class."""

from __future__ import annotations

import pytest

from clairvoyant.errors import (
    BadRequest,
    BodyBudgetExhausted,
    LimitExceeded,
    QueueDeadline,
    QueueFull,
    RequestError,
    Unauthorized,
    UpstreamUnavailable,
)
from clairvoyant.scheduling.dispatcher import ShuttingDown


@pytest.mark.parametrize(
    ("error", "headers"),
    [
        (BadRequest("no"), {}),
        (UpstreamUnavailable("gone"), {}),
        (Unauthorized("who?"), {"WWW-Authenticate": "Bearer"}),
        (BodyBudgetExhausted("full"), {"Retry-After": "1"}),
        (QueueDeadline("late"), {"Retry-After": "1"}),
        (QueueDeadline("late", retry_after_s=10), {"Retry-After": "10"}),
        (QueueFull("full", retry_after_s=42), {"Retry-After": "42"}),
        (
            LimitExceeded("slow down", code="rate_limited", limit="requests_per_minute", retry_after_s=7),
            {"Retry-After": "7"},
        ),
        (RequestError("any", retry_after_s=3), {"Retry-After": "3"}),
        (ShuttingDown("bye"), {"Retry-After": "5"}),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else "",
)
def test_retry_after_comes_from_the_class_or_the_raiser(error: RequestError, headers: dict[str, str]) -> None:
    assert error.headers == headers


def test_a_raisers_retry_after_stays_on_its_instance() -> None:
    QueueDeadline("late", retry_after_s=30)
    assert QueueDeadline("late").retry_after_s == 1  # the class's default is untouched


def test_limit_exceeded_keeps_its_code_and_limit() -> None:
    refused = LimitExceeded("busy", code="concurrency_limited", limit="max_concurrent", retry_after_s=2)
    assert (refused.status_code, refused.code, refused.limit, refused.retry_after_s) == (
        429, "concurrency_limited", "max_concurrent", 2,
    )  # fmt: skip
