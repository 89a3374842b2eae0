"""errors.py: each error's status, and Retry-After from one ``retry_after_s`` on the base class."""

from __future__ import annotations

import pytest

from clairvoyant.errors import (
    BadRequest,
    BodyBudgetExhausted,
    Forbidden,
    GenerationTimeLimit,
    HeadersTooLarge,
    IncompleteBody,
    LeaseLost,
    LimitExceeded,
    MethodNotAllowed,
    PayloadTooLarge,
    QueueDeadline,
    QueueFull,
    RequestError,
    RequestTimeout,
    Superseded,
    Unauthorized,
    UnsupportedCoding,
    UpstreamNotReady,
    UpstreamTimeout,
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


@pytest.mark.parametrize(
    ("error", "status_code", "error_type", "code", "retry_after_s"),
    [
        (BadRequest, 400, "invalid_request_error", "bad_request", None),
        (BodyBudgetExhausted, 503, "server_error", "body_budget_exhausted", 1),
        (Forbidden, 403, "invalid_request_error", "forbidden", None),
        (GenerationTimeLimit, 504, "server_error", "generation_time_limit", None),
        (HeadersTooLarge, 431, "invalid_request_error", "request_header_fields_too_large", None),
        (IncompleteBody, 400, "invalid_request_error", "incomplete_body", None),
        (LeaseLost, 503, "server_error", "slot_lease_lost", 1),
        (LimitExceeded, 429, "rate_limit_error", None, None),
        (MethodNotAllowed, 405, "invalid_request_error", "method_not_allowed", None),
        (PayloadTooLarge, 413, "invalid_request_error", "request_too_large", None),
        (QueueDeadline, 503, "server_error", "queue_deadline", 1),
        (QueueFull, 503, "server_error", "queue_full", 1),
        (RequestError, 500, "server_error", None, None),
        (RequestTimeout, 408, "invalid_request_error", "request_timeout", None),
        (Superseded, 409, "invalid_request_error", "superseded", None),
        (Unauthorized, 401, "invalid_request_error", "invalid_api_key", None),
        (UnsupportedCoding, 501, "invalid_request_error", "unsupported_transfer_coding", None),
        (UpstreamNotReady, 503, "server_error", "upstream_not_ready", 1),
        (UpstreamTimeout, 504, "server_error", "upstream_timeout", None),
        (UpstreamUnavailable, 502, "server_error", "upstream_unavailable", None),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else None,
)
def test_each_error_keeps_its_status_type_and_code(
    error: type[RequestError], status_code: int, error_type: str, code: str | None, retry_after_s: int | None
) -> None:
    # What clients read (the status, OpenAI's type and code) is the same as before the classes
    # gave them as class arguments.
    assert (error.status_code, error.error_type, error.code, error.retry_after_s) == (
        status_code, error_type, code, retry_after_s,
    )  # fmt: skip
