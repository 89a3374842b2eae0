"""The error tree: ``ClairvoyantError``; under it ``ConfigError`` and ``ModelError`` (start-up),
and ``RequestError``, answered to a client, whose subclasses each know their status, OpenAI error
type and code.

The app maps a RequestError to the client's dialect (OpenAI or Ollama) in one handler. A
RequestError whose ``retry_after_s`` is set (by its class, or by the raiser) carries Retry-After.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "BodyBudgetExhausted",
    "ClairvoyantError",
    "GenerationTimeLimit",
    "HeadersTooLarge",
    "IncompleteBody",
    "LimitExceeded",
    "LeaseLost",
    "ConfigError",
    "Forbidden",
    "MethodNotAllowed",
    "ModelError",
    "PayloadTooLarge",
    "QueueDeadline",
    "QueueFull",
    "RequestError",
    "RequestTimeout",
    "Superseded",
    "Unauthorized",
    "UnsupportedCoding",
    "UpstreamNotReady",
    "UpstreamTimeout",
    "UpstreamUnavailable",
]


class ClairvoyantError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(ClairvoyantError):
    """Invalid settings; the message names the setting."""


class ModelError(ClairvoyantError):
    """The predictor model cannot be used (missing, unreadable, or its card does not match)."""


class RequestError(ClairvoyantError):
    """An error answered to a client. A subclass gives its status (and code, and a default
    Retry-After) as class arguments; its OpenAI ``error_type`` follows from the status unless the
    class sets its own: rate_limit_error for 429, invalid_request_error for another 4xx,
    server_error for a 5xx."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None
    retry_after_s: int | None = None  # seconds: sent as Retry-After when set (by the class or the raiser)

    def __init_subclass__(
        cls, status_code: int | None = None, code: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init_subclass__()
        if status_code is not None:
            cls.status_code = status_code
            if "error_type" not in vars(cls):
                client = "rate_limit_error" if status_code == 429 else "invalid_request_error"
                cls.error_type = client if status_code < 500 else "server_error"
        cls.code = code or cls.code
        cls.retry_after_s = retry_after_s or cls.retry_after_s

    def __init__(
        self, message: str, *, param: str | None = None, detail: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message  # sent to the client: never an internal address or a secret
        self.param = param
        self.detail = detail or message  # for the proxy's own log only
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


class BadRequest(RequestError, status_code=400, code="bad_request"):
    """Malformed JSON, missing or ill-typed fields."""


class Unauthorized(RequestError, status_code=401, code="invalid_api_key"):
    """A missing or unknown API key."""

    @property
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(RequestError, status_code=403, code="forbidden"):
    """A pass-through path outside the allowlist."""


class MethodNotAllowed(RequestError, status_code=405, code="method_not_allowed"):
    """A method the proxy does not relay."""

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow  # the methods the path takes (RFC 9110 15.5.6: a 405 carries Allow)

    @property
    def headers(self) -> dict[str, str]:
        return {"Allow": self.allow}


class RequestTimeout(RequestError, status_code=408, code="request_timeout"):
    """Headers or body not received within client_timeout_s."""


class HeadersTooLarge(RequestError, status_code=431, code="request_header_fields_too_large"):
    """Request headers over max_header_bytes."""


class IncompleteBody(BadRequest, code="incomplete_body"):
    """The body ended before it was whole: the client left mid-upload, or its chunked framing is
    broken (the server reports both alike). Answered 400; a client that left never reads it."""


class PayloadTooLarge(RequestError, status_code=413, code="request_too_large"):
    """A body over max_body_bytes."""


class UnsupportedCoding(RequestError, status_code=501, code="unsupported_transfer_coding"):
    """A transfer coding other than chunked: the client's to change, whatever the status says."""

    error_type = "invalid_request_error"


class BodyBudgetExhausted(RequestError, status_code=503, code="body_budget_exhausted", retry_after_s=1):
    """The process holds as many request bodies as it may (they leave as their requests are answered)."""


class QueueFull(RequestError, status_code=503, code="queue_full", retry_after_s=1):
    """The waiting queue is at capacity (the raiser gives the queue tail's ETA as Retry-After)."""


class QueueDeadline(RequestError, status_code=503, code="queue_deadline", retry_after_s=1):
    """The request said how long it would wait before dispatch; that time came first (or, at its
    arrival, the queue's ETA already passed it). It was never sent to a backend."""


class Superseded(RequestError, status_code=409, code="superseded"):
    """A newer request of the same tenant with the same ``X-Clairvoyant-Supersede`` key replaced it."""

    @classmethod
    def by_newer(cls) -> Superseded:
        """The error a replaced request gets, on whichever replica it waits or runs."""
        return cls("a newer request with the same X-Clairvoyant-Supersede key replaced this one")


class LimitExceeded(RequestError, status_code=429):
    """The tenant is at one of its limits: ``code`` is ``rate_limited`` (requests per minute, tokens
    per day) or ``concurrency_limited``."""

    def __init__(self, message: str, *, code: str, limit: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = code
        self.limit = limit  # max_concurrent, requests_per_minute or tokens_per_day


class GenerationTimeLimit(RequestError, status_code=504, code="generation_time_limit"):
    """The answer ran longer than max_generation_s."""


class LeaseLost(RequestError, status_code=503, code="slot_lease_lost", retry_after_s=1):
    """With replicas: this proxy could no longer renew its hold on the backend's slot (Redis cut
    off), so it ended the answer rather than run beyond the backend's slots."""


class _UpstreamFailure(RequestError):
    def __init__(self, message: str, *, detail: str | None = None, never_sent: bool = False) -> None:
        super().__init__(message, detail=detail)
        self.never_sent = never_sent  # the backend never saw it: the request may go elsewhere


class UpstreamUnavailable(_UpstreamFailure, status_code=502, code="upstream_unavailable"):
    """The backend refused or dropped the connection (``never_sent``: it could not be opened)."""


class UpstreamTimeout(_UpstreamFailure, status_code=504, code="upstream_timeout"):
    """The backend did not connect or answer in time (``never_sent``: the connection was not accepted)."""


class UpstreamNotReady(RequestError, status_code=503, code="upstream_not_ready", retry_after_s=1):
    """The backend let a first-byte deadline pass (it may be hung) and its health check did not pass
    within ``backend_wait_s``: the request was never sent into the hang (the raiser gives
    backend_wait_s as Retry-After)."""
