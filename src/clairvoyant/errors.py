"""The error tree. Each HTTP-facing class knows its status and its OpenAI error type.

    ClairvoyantError
    ├── ConfigError                  bad settings or config file (start-up)
    ├── ModelError                   model file or card missing, corrupt or mismatched (start-up)
    └── RequestError                 answered to a client
        ├── BadRequest               400 malformed JSON, missing or ill-typed fields
        ├── PayloadTooLarge          413 body over the configured limit
        ├── QueueFull                503 the waiting queue is at capacity (carries Retry-After)
        ├── UpstreamUnavailable      502 backend refused or dropped the connection
        └── UpstreamTimeout          504 backend did not connect/answer in time

The app maps a RequestError to the client's dialect (OpenAI or Ollama) in one handler.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "ClairvoyantError",
    "ConfigError",
    "ModelError",
    "PayloadTooLarge",
    "QueueFull",
    "RequestError",
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

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(RequestError):
    status_code = 400
    error_type = "invalid_request_error"
    code = "bad_request"


class PayloadTooLarge(RequestError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class QueueFull(RequestError):
    status_code = 503
    error_type = "server_error"
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class UpstreamUnavailable(RequestError):
    status_code = 502
    error_type = "server_error"
    code = "upstream_unavailable"


class UpstreamTimeout(RequestError):
    status_code = 504
    error_type = "server_error"
    code = "upstream_timeout"
