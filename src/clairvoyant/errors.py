"""The error tree. Each HTTP-facing class knows its status and its OpenAI error type.

    ClairvoyantError
    ├── ConfigError                  bad settings or config file (start-up)
    ├── ModelError                   model file or card missing, corrupt or mismatched (start-up)
    └── RequestError                 answered to a client
        ├── BadRequest               400 malformed JSON, missing or ill-typed fields
        ├── Unauthorized             401 a missing or unknown API key (carries WWW-Authenticate)
        ├── Forbidden                403 a pass-through path outside the allowlist
        ├── MethodNotAllowed         405 a method the proxy does not relay
        ├── RequestTimeout           408 headers or body not received within client_timeout_s
        ├── PayloadTooLarge          413 body over the configured limit
        ├── HeadersTooLarge          431 request headers over max_header_bytes
        ├── IncompleteBody           400 the body ended early (the client left) or its chunked framing is broken
        ├── UnsupportedCoding        501 a transfer coding other than chunked
        ├── QueueFull                503 the waiting queue is at capacity (carries Retry-After)
        ├── BodyBudgetExhausted      503 the process holds as many request bodies as it may (Retry-After)
        ├── QueueDeadline            503 the request's queue deadline came before it could be sent (Retry-After)
        ├── Superseded               409 a newer request with the same X-Clairvoyant-Supersede key replaced it
        ├── LimitExceeded            429 the tenant is at one of its limits (Retry-After)
        ├── GenerationTimeLimit      504 the answer ran longer than max_generation_s
        ├── UpstreamUnavailable      502 backend refused or dropped the connection
        ├── UpstreamTimeout          504 backend did not connect/answer in time
        └── UpstreamNotReady         503 backend failed its health check until backend_wait_s ran out (Retry-After)

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
    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None
    retry_after_s: int | None = None  # seconds: sent as Retry-After when set (by the class or the raiser)

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


class BadRequest(RequestError):
    status_code = 400
    error_type = "invalid_request_error"
    code = "bad_request"


class Unauthorized(RequestError):
    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"

    @property
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(RequestError):
    status_code = 403
    error_type = "invalid_request_error"
    code = "forbidden"


class MethodNotAllowed(RequestError):
    status_code = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow  # the methods the path takes (RFC 9110 15.5.6: a 405 carries Allow)

    @property
    def headers(self) -> dict[str, str]:
        return {"Allow": self.allow}


class RequestTimeout(RequestError):
    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class HeadersTooLarge(RequestError):
    status_code = 431
    error_type = "invalid_request_error"
    code = "request_header_fields_too_large"


class IncompleteBody(BadRequest):
    """The body ended before it was whole: the client left mid-upload, or its chunked framing is
    broken (the server reports both alike). Answered 400; a client that left never reads it."""

    code = "incomplete_body"


class PayloadTooLarge(RequestError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedCoding(RequestError):
    status_code = 501
    error_type = "invalid_request_error"
    code = "unsupported_transfer_coding"


class BodyBudgetExhausted(RequestError):
    status_code = 503
    error_type = "server_error"
    code = "body_budget_exhausted"
    retry_after_s = 1  # held bodies leave as their requests are answered


class QueueFull(RequestError):
    status_code = 503
    error_type = "server_error"
    code = "queue_full"
    retry_after_s = 1  # the raiser gives the queue tail's ETA


class QueueDeadline(RequestError):
    """The request said how long it would wait before dispatch; that time came first (or, at its
    arrival, the queue's ETA already passed it). It was never sent to a backend."""

    status_code = 503
    error_type = "server_error"
    code = "queue_deadline"
    retry_after_s = 1


class Superseded(RequestError):
    """A newer request of the same tenant with the same ``X-Clairvoyant-Supersede`` key replaced it."""

    status_code = 409
    error_type = "invalid_request_error"
    code = "superseded"

    @classmethod
    def by_newer(cls) -> Superseded:
        """The error a replaced request gets, on whichever replica it waits or runs."""
        return cls("a newer request with the same X-Clairvoyant-Supersede key replaced this one")


class LimitExceeded(RequestError):
    """The tenant is at one of its limits: ``code`` is ``rate_limited`` (requests per minute, tokens
    per day) or ``concurrency_limited``."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, code: str, limit: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = code
        self.limit = limit  # max_concurrent, requests_per_minute or tokens_per_day


class GenerationTimeLimit(RequestError):
    status_code = 504
    error_type = "server_error"
    code = "generation_time_limit"


class LeaseLost(RequestError):
    """With replicas: this proxy could no longer renew its hold on the backend's slot (Redis cut
    off), so it ended the answer rather than run beyond the backend's slots."""

    status_code = 503
    error_type = "server_error"
    code = "slot_lease_lost"
    retry_after_s = 1


class UpstreamUnavailable(RequestError):
    status_code = 502
    error_type = "server_error"
    code = "upstream_unavailable"

    def __init__(self, message: str, *, detail: str | None = None, never_sent: bool = False) -> None:
        super().__init__(message, detail=detail)
        self.never_sent = never_sent  # the connection could not be opened: the backend never saw it


class UpstreamTimeout(RequestError):
    status_code = 504
    error_type = "server_error"
    code = "upstream_timeout"

    def __init__(self, message: str, *, detail: str | None = None, never_sent: bool = False) -> None:
        super().__init__(message, detail=detail)
        self.never_sent = never_sent  # the connection was not accepted in time: the backend never saw it


class UpstreamNotReady(RequestError):
    """The backend let a first-byte deadline pass (it may be hung) and its health check did not pass
    within ``backend_wait_s``: the request was never sent into the hang."""

    status_code = 503
    error_type = "server_error"
    code = "upstream_not_ready"
    retry_after_s = 1  # the raiser gives backend_wait_s
