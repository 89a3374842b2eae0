"""proxy/target.py: the request target and Host, checked once."""

from __future__ import annotations

import pytest

from clairvoyant.errors import BadRequest, HeadersTooLarge
from clairvoyant.proxy.target import check_head_size, check_host, check_target, http_version


@pytest.mark.parametrize(
    "raw",
    [
        b"/v1/models/../../slots",
        b"/v1/models/%2e%2e/%2e%2e/slots",
        b"/v1/models/%2E%2e/slots",
        b"/v1/models/.%2e/slots",
        b"/v1/models/./x",
        b"/v1/models/%2e",
        b"/..",
        b"/v1/models/..%2f..%2fslots",
        b"/v1/chat/completions%3Fx=1",
        b"/api/generate%3F",
        b"/v1/x%23frag",
        b"/v1/x%5c..%5cslots",
        b"/v1/x\\..\\slots",
        b"/v1/%00x",
        b"/v1/%0d%0aX-Injected:%20yes",
        b"/v1/%ff",
        b"*",
        b"http://host/v1/x",
    ],
)
def test_targets_that_could_mean_two_things_are_refused(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        check_target("GET", raw, b"")


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (b"/v1/chat/completions", "/v1/chat/completions"),
        (b"/api/show", "/api/show"),
        (b"/v1/models/llama3.2:3b", "/v1/models/llama3.2:3b"),
        (b"/v1/models/a..b", "/v1/models/a..b"),  # dots inside a name are not a dot segment
        (b"/v1/models/.hidden", "/v1/models/.hidden"),
        (b"/v1/models/%252e%252e", "/v1/models/%2e%2e"),  # one decode: the backend reads the same text
        (b"/v1/models/caf%C3%A9", "/v1/models/café"),
        (b"/", "/"),
    ],
)
def test_plain_targets_are_decoded_once_and_forwarded_raw(raw: bytes, path: str) -> None:
    target = check_target("GET", raw, b"a=1&b=%20")
    assert target.path == path
    assert target.raw_path == raw.decode()
    assert target.query == "a=1&b=%20"


def test_the_servers_spelling_of_http10_is_read_as_10() -> None:
    assert [http_version(v) for v in ("1", "1.0", "1.1", "2")] == ["1.0", "1.0", "1.1", "2"]
    check_host(http_version("1"), [(b"host", b"")])  # Granian's HTTP/1.0 without Host: an empty stand-in


def test_host_rules() -> None:
    check_host("1.1", [(b"host", b"localhost:8080")])
    check_host("1.1", [(b"host", b"[::1]:8080")])
    check_host("1.1", [(b"host", b"example.com")])
    check_host("1.0", [])  # HTTP/1.0 may leave it out
    for headers in (
        [],  # missing
        [(b"host", b"")],  # empty (the server's stand-in for a missing one)
        [(b"host", b"a"), (b"host", b"b")],  # duplicate
        [(b"host", b"a b")],
        [(b"host", b"a/b")],
        [(b"host", b"a@b")],
        [(b"host", b"a:80:80")],
        [(b"host", b"a:port")],
    ):
        with pytest.raises(BadRequest):
            check_host("1.1", headers)


def test_the_head_size_is_counted_as_sent() -> None:
    headers = [(b"host", b"x"), (b"x-big", b"a" * 80)]  # 5 + 85 + 8 bytes with ": " and CRLF
    check_head_size(b"/v1", b"a=1", headers, 3 + 3 + 98)
    with pytest.raises(HeadersTooLarge):
        check_head_size(b"/v1", b"a=1", headers, 3 + 3 + 97)
