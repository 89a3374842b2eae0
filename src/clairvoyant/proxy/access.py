"""Who may use the proxy, and for what (docs/operations.md, "Keys, tenants and what passes
through"), checked for every request by ``AccessControl.admit``: one SHA-256 and one dict lookup.

- **Keys** (``api_keys``; none: off). ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``
  (llama-server's two forms), stored only as ``sha256:<hex>``: keys are random (``clairvoyant keys
  add``), so a plain hash is enough. Missing or unknown: 401. The key's ``Identity`` goes with the
  request; the key itself is not forwarded unless ``forward_client_key``.
- **The pass-through allowlist** (``passthrough_allow``). Unset: every path while the proxy listens
  on loopback only, else ``DEFAULT_PASSTHROUGH_ALLOW`` (never pull, push, create, copy or delete).
  Refused: 403.
- ``/healthz``, ``/readyz`` and the live page's files (they hold no data) are always open; GET
  ``/queue``, ``/queue/{id}``, ``/metrics`` and ``/history`` need a key when ``status_requires_key``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from clairvoyant.config import Settings
from clairvoyant.errors import Forbidden, RequestError, Unauthorized
from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS

__all__ = ["DEFAULT_PASSTHROUGH_ALLOW", "AccessControl", "Denied", "Identity", "hash_key", "new_key"]

# "METHOD /path" exact, or "METHOD /prefix/*"; "*" as the method allows any.
DEFAULT_PASSTHROUGH_ALLOW = (
    "GET /", "HEAD /", "GET /v1/models", "GET /v1/models/*", "POST /v1/embeddings",
    "GET /api/tags", "POST /api/show", "GET /api/ps", "GET /api/version", "POST /api/embed", "POST /api/embeddings",
    "GET /health", "GET /props", "POST /tokenize", "POST /detokenize",
)  # fmt: skip
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
STATUS_PATHS = frozenset({"/queue", "/metrics", "/history"})  # and /queue/{id}
PAGE_PATH = "/ui"  # the live page: /ui and the files under /ui/
READ_METHODS = frozenset({"GET", "HEAD"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    min_priority: int
    max_priority: int
    weight: float


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "cv-" + secrets.token_urlsafe(32)


def _rules(entries: Iterable[str]) -> tuple[set[tuple[str, str]], list[tuple[str, str]]]:
    exact: set[tuple[str, str]] = set()
    prefixes: list[tuple[str, str]] = []
    for entry in entries:
        method, _, path = entry.strip().partition(" ")
        if path.endswith("/*"):
            prefixes.append((method.upper(), path[:-1]))
        else:
            exact.add((method.upper(), path))
    return exact, prefixes


class Denied(Exception):
    """``error`` is the refused request's answer, ``outcome`` its log line's."""

    def __init__(self, error: RequestError, outcome: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.outcome = outcome


class AccessControl:
    def __init__(self, settings: Settings) -> None:
        self.keys = {k.hash: Identity(k.tenant, k.min_priority, k.max_priority, k.weight) for k in settings.api_keys}
        self.status_requires_key = settings.status_requires_key
        self.forward_client_key = settings.forward_client_key
        allow = settings.passthrough_allow
        if allow is None and settings.host not in LOOPBACK_HOSTS:
            allow = list(DEFAULT_PASSTHROUGH_ALLOW)
        self.allow_all = allow is None or "*" in allow
        self.exact, self.prefixes = _rules(allow or ())

    def admit(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]]
    ) -> tuple[Identity | None, list[tuple[bytes, bytes]]]:
        """The key's identity (None: keys are off, or the path is open) and the headers to go on
        with. Raises ``Denied``: 403 outside the allowlist, 401 without a valid key."""
        if method in READ_METHODS and (path in OPEN_PATHS or _page_path(path)):
            return None, headers
        status_path = method in READ_METHODS and _status_path(path)
        if not status_path and path not in SCHEDULED_ENDPOINTS and not self._allowed(method, path):
            raise Denied(Forbidden(f"{method} {path} is not allowed through this proxy"), "not_allowed")
        if not self.keys or (status_path and not self.status_requires_key):
            return None, headers
        presented = _presented_key(headers)
        identity = self.keys.get(hash_key(presented)) if presented else None
        if identity is None:
            error = Unauthorized("a valid API key is required (Authorization: Bearer KEY or X-Api-Key)")
            raise Denied(error, "unknown_key" if presented else "missing_key")
        if not self.forward_client_key:
            headers = [(k, v) for k, v in headers if k not in (b"authorization", b"x-api-key")]
        return identity, headers

    def _allowed(self, method: str, path: str) -> bool:
        if self.allow_all or (method, path) in self.exact or ("*", path) in self.exact:
            return True
        return any((m == method or m == "*") and path.startswith(prefix) for m, prefix in self.prefixes)


def _page_path(path: str) -> bool:
    return path == PAGE_PATH or path.startswith(PAGE_PATH + "/")


def _status_path(path: str) -> bool:
    """/queue, /metrics, /history, or /queue/{id} (one segment): the proxy's own data."""
    if path in STATUS_PATHS:
        return True
    return path.startswith("/queue/") and len(path) > 7 and "/" not in path[7:]


def _presented_key(headers: Iterable[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-api-key":
            return value.decode("latin-1").strip()
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].decode("latin-1").strip()
    return ""
