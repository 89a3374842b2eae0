"""The request target and Host, checked once, before anything else reads them.

The server hands the app the target twice: ``raw_path`` as sent and ``path`` percent-decoded. The
proxy routes and checks the decoded one and forwards the raw one, which is only safe when the two
cannot disagree about where a segment ends or what it names. So a raw target is refused (400) with:

- a dot segment, plain or percent-encoded: a path-normalising front would resolve it after the
  allowlist was checked (``/v1/models/%2e%2e/%2e%2e/slots``);
- an encoded ``/``, ``?``, ``#`` or ``\\``: decoded, it would move a segment's or the query's
  boundary (``/v1/chat/completions%3Fx=1`` would be routed as unknown and reach the backend as
  a scheduled one);
- a control character once decoded, or bytes that are not UTF-8.

Host (RFC 9112 3.2): exactly one, well formed, as nginx demands; HTTP/1.0 may leave it out. The
head's size is checked exactly here (431): the server's parser bounds it only roughly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from clairvoyant.errors import BadRequest, HeadersTooLarge

__all__ = ["Target", "check_head_size", "check_host", "check_target", "http_version"]

# A raw path segment that decodes to "." or "..": any mix of "." and "%2e".
_DOT_SEGMENT = re.compile(rb"(?:^|/)(?:\.|%2e){1,2}(?:/|$)", re.IGNORECASE)
# Encoded characters that would change the target's structure once decoded.
_ENCODED_DELIMITER = re.compile(rb"%(?:2f|3f|23|5c)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# RFC 3986 host (IP-literal, IPv4 or reg-name) and an optional port.
_HOST = re.compile(rb"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]+)(?::[0-9]{0,5})?$")


@dataclass(frozen=True, slots=True)
class Target:
    path: str  # percent-decoded: what the proxy routes and checks
    raw_path: str  # as the client sent it (ASCII): what goes to the backend
    query: str  # raw, without the "?"


def check_target(method: str, raw_path: bytes, query: bytes) -> Target:
    """The checked target of a request (not ``*``: the caller answers that first). Raises
    ``BadRequest`` for a target this module refuses (see its docstring)."""
    if not raw_path.startswith(b"/"):
        raise BadRequest("the request target must be a path")
    if b"\\" in raw_path or (b"." in raw_path and _DOT_SEGMENT.search(raw_path)):
        raise BadRequest("the request path may not hold dot segments or encoded '/', '?', '#' or '\\'")
    try:
        raw = raw_path.decode("ascii")
        if b"%" not in raw_path:  # nothing encoded: the path is its raw form
            return Target(raw, raw, query.decode("latin-1"))
        if _DOT_SEGMENT.search(raw_path) or _ENCODED_DELIMITER.search(raw_path):
            raise BadRequest("the request path may not hold dot segments or encoded '/', '?', '#' or '\\'")
        path = unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the request path is not valid UTF-8") from None
    if _CONTROL.search(path):
        raise BadRequest("the request path may not hold control characters")
    return Target(path, raw, query.decode("latin-1"))


def http_version(scope_version: str) -> str:
    """The version as ASGI spells it ("1.0", "1.1", "2"): Granian says "1" for HTTP/1.0."""
    return "1.0" if scope_version == "1" else scope_version


def check_host(http_version: str, headers: list[tuple[bytes, bytes]]) -> None:
    """Raise ``BadRequest`` unless the request's Host is as RFC 9112 requires (module docstring)."""
    hosts = [value for name, value in headers if name == b"host"]
    if len(hosts) > 1:
        raise BadRequest("more than one Host header")
    if not hosts or not hosts[0]:
        if http_version == "1.0":
            return
        raise BadRequest("an HTTP/1.1 request needs a Host header")
    if not _HOST.match(hosts[0].strip(b" \t")):
        raise BadRequest("the Host header is malformed")


def check_head_size(raw_path: bytes, query: bytes, headers: list[tuple[bytes, bytes]], max_bytes: int) -> None:
    """Raise ``HeadersTooLarge`` when the target and header lines (as sent) exceed ``max_bytes``."""
    size = len(raw_path) + len(query) + sum(len(name) + len(value) + 4 for name, value in headers)
    if size > max_bytes:
        raise HeadersTooLarge(f"the request's headers are larger than {max_bytes} bytes")
