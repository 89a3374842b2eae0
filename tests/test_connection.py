"""The client connection (proxy/connection.py): the proxy's own HTTP/1.1 server.

Each test drives a real proxy (``running_proxy``) with raw client sockets against a raw fake
backend (tests/fake_backend.py), and reads the answers as the proxy framed them (``RawClient``):
keep-alive, pipelining, request bodies (chunked, 100-continue, over the limit), heads over the
limit, answer framing (HEAD, chunked, close-delimited), refusals, the Date header, and a client
that leaves while its request waits. The limits' timeouts and the idle close are in
test_hardening.py.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fake_backend import FakeBackend
from proxy_harness import MarkerPredictor, metric_value, queue_snapshot, running_proxy, wait_until

from clairvoyant.config import Settings

CHAT = "/v1/chat/completions"
MAX_BODY_BYTES = 1024  # the smallest Settings allows
MAX_HEADER_BYTES = 4096
TAGS = {"models": [{"name": "m"}]}  # the backend's GET /api/tags answer (a fixed length)
READ_TIMEOUT_S = 10.0  # a raw socket's reads: an answer or a close that never comes fails the test


# --- raw HTTP/1.x on a socket -----------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]  # names in lower case, in order
    body: bytes  # de-chunked
    framing: str  # "length", "chunked", "close" (ended by the connection's end) or "none" (no body)

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    def header(self, name: str) -> str | None:
        found = self.values(name)
        assert len(found) <= 1, f"{name} sent {len(found)} times"
        return found[0] if found else None

    def json(self) -> Any:
        return json.loads(self.body)


class RawClient:
    """One client connection to the proxy: writes bytes as given, reads answers framed as the
    HTTP/1.1 rules say (Content-Length, chunked, or up to the close; none for HEAD and 1xx)."""

    def __init__(self, base: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(READ_TIMEOUT_S)
        self.buffer = b""
        self.eof = False

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def fill(self) -> bool:
        if self.eof:
            return False
        data = self.sock.recv(65536)
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not self.fill():
                raise AssertionError(f"the connection closed {n - len(self.buffer)} bytes short")
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if not self.fill():
                raise AssertionError(f"the connection closed inside a line: {self.buffer!r}")
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def read_answer(self, *, head_only: bool = False) -> Answer:
        """The next answer (a 1xx interim answer is one too)."""
        while b"\r\n\r\n" not in self.buffer:
            if not self.fill():
                raise AssertionError(f"the connection closed before an answer's head: {self.buffer!r}")
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ", 2)
        assert version in ("HTTP/1.1", "HTTP/1.0"), lines[0]
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            assert sep and name == name.strip(), f"malformed header line {line!r}"
            headers.append((name.lower(), value.strip()))
        answer = Answer(int(status), headers, b"", "none")
        if head_only or answer.status < 200 or answer.status in (204, 304):
            return answer
        length = answer.header("content-length")
        chunked = "chunked" in (answer.header("transfer-encoding") or "").lower()
        assert not (length is not None and chunked), "both Content-Length and chunked"
        if length is not None:
            answer.body, answer.framing = self._take(int(length)), "length"
        elif chunked:
            answer.body, answer.framing = self._chunked_body(), "chunked"
        else:
            answer.body, answer.framing = self.read_to_close(), "close"
        return answer

    def _chunked_body(self) -> bytes:
        body = b""
        while size := int(self._line().split(b";", 1)[0], 16):
            body += self._take(size)
            assert self._take(2) == b"\r\n", "a chunk not followed by CRLF"
        while self._line():  # trailers, up to the empty line
            pass
        return body

    def next_answer(self) -> Answer | None:
        """The next answer, or None when the proxy closes the connection before one begins."""
        while not self.buffer:
            if not self.fill():
                return None
        return self.read_answer()

    def read_to_close(self) -> bytes:
        """Everything up to the proxy's close (a read timeout fails the test: it stayed open)."""
        while self.fill():
            pass
        data, self.buffer = self.buffer, b""
        return data


def request(
    method: str, path: str, body: bytes | None = None, *, version: str = "1.1", headers: tuple[str, ...] = ()
) -> bytes:
    """A request's bytes; a body gets its Content-Length unless ``headers`` frame it."""
    lines = [f"{method} {path} HTTP/{version}", "Host: proxy", *headers]
    framed = any(h.lower().startswith(("content-length:", "transfer-encoding:")) for h in headers)
    if body is not None and not framed:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def chat_body(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def chunked(body: bytes, size: int) -> bytes:
    """``body`` in chunked transfer coding, ``size`` bytes a chunk."""
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def delivered_texts(backend: FakeBackend) -> list[str]:
    """The user texts of the chat requests the backend read, in order."""
    return [json.loads(body)["messages"][-1]["content"] for path, body in backend.delivered if path == CHAT]


# --- the proxy under test ---------------------------------------------------------------------


class GatedStreamBackend(FakeBackend):
    """A FakeBackend whose chunked answers (``("stream", n, _)``) send their head and first event,
    then wait for one ``release()`` of ``gate`` before the rest: the proxy has begun relaying
    before the answer is whole, whatever the machine's pace."""

    def __init__(self, script: Callable[[str, int], Any]) -> None:
        super().__init__(script)
        self.gate = threading.Semaphore(0)

    def _stream(self, conn: socket.socket, n_events: int, interval_s: float) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        events = [b'data: {"choices":[{"delta":{"content":"x%d"}}]}\n\n' % i for i in range(n_events)]
        events.append(b"data: [DONE]\n\n")
        conn.sendall(b"%x\r\n%b\r\n" % (len(events[0]), events[0]))
        if not self.gate.acquire(timeout=READ_TIMEOUT_S):
            return
        conn.sendall(b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events[1:]) + b"0\r\n\r\n")


STREAM_PATH = "/api/ps"  # a pass-through GET the backend answers chunked (GatedStreamBackend)


def _script(path: str, n: int) -> Any:
    if path == "/api/tags":
        return ("json", TAGS)
    if path == STREAM_PATH:
        return ("stream", 2, 0.0)
    return "ok"


@dataclass
class Site:
    backend: GatedStreamBackend
    base: str


def serve(backend: FakeBackend, **overrides: Any) -> Any:
    defaults: dict[str, Any] = {
        "max_body_bytes": MAX_BODY_BYTES,
        "max_header_bytes": MAX_HEADER_BYTES,
        "keep_alive_timeout_s": 60,  # a connection the proxy should close but keeps fails a read, not this
        "client_timeout_s": 30,
    }
    settings = Settings(upstream_url=backend.url, **{**defaults, **overrides})
    return running_proxy(settings, predictor=MarkerPredictor())


@pytest.fixture
def site() -> Iterator[Site]:
    backend = GatedStreamBackend(_script)
    with backend, serve(backend) as base:
        yield Site(backend, base)


# --- keep-alive ---------------------------------------------------------------------------------


def test_two_requests_on_one_connection_get_two_answers(site: Site) -> None:
    with RawClient(site.base) as client:
        client.send(request("POST", CHAT, chat_body("first")))
        first = client.read_answer()
        client.send(request("POST", CHAT, chat_body("second")))
        second = client.read_answer()
        client.send(request("GET", "/healthz"))
        third = client.read_answer()
    assert [first.status, second.status, third.status] == [200, 200, 200]
    assert [first.json()["n"], second.json()["n"]] == [0, 1]
    assert first.header("connection") is None and second.header("connection") is None
    assert delivered_texts(site.backend) == ["first", "second"]


@pytest.mark.parametrize("path", [CHAT, "/healthz", "/api/tags"], ids=["scheduled", "own", "passthrough"])
def test_connection_close_from_the_client_closes_after_the_answer(site: Site, path: str) -> None:
    method, body = ("POST", chat_body("hi")) if path == CHAT else ("GET", None)
    with RawClient(site.base) as client:
        client.send(request(method, path, body, headers=("Connection: close",)))
        answer = client.read_answer()
        rest = client.read_to_close()
    assert answer.status == 200 and answer.framing == "length"
    assert answer.header("connection") == "close"
    assert rest == b""


@pytest.mark.parametrize("path", [CHAT, "/healthz", "/api/tags"], ids=["scheduled", "own", "passthrough"])
def test_an_http10_request_without_keep_alive_is_answered_and_closed(site: Site, path: str) -> None:
    method, body = ("POST", chat_body("hi")) if path == CHAT else ("GET", None)
    with RawClient(site.base) as client:
        client.send(request(method, path, body, version="1.0"))
        answer = client.read_answer()
        rest = client.read_to_close()
    assert answer.status == 200 and answer.header("connection") == "close"
    assert answer.header("transfer-encoding") is None  # not an HTTP/1.0 coding
    assert rest == b""
    if path == "/api/tags":
        assert answer.json() == TAGS


def test_an_http10_request_with_keep_alive_stays_open(site: Site) -> None:
    with RawClient(site.base) as client:
        client.send(request("POST", CHAT, chat_body("one"), version="1.0", headers=("Connection: keep-alive",)))
        first = client.read_answer()
        client.send(request("GET", "/healthz", version="1.0", headers=("Connection: keep-alive",)))
        second = client.read_answer()
    assert first.status == 200 and first.framing == "length" and first.header("connection") != "close"
    assert second.status == 200


# --- pipelining ---------------------------------------------------------------------------------


def test_pipelined_requests_in_one_write_are_answered_in_order_and_framed(site: Site) -> None:
    pipelined = (
        request("POST", CHAT, chat_body("a"), headers=("X-Request-Id: req-a",))
        + request("GET", "/healthz")
        + request("POST", CHAT, chat_body("b"), headers=("X-Request-Id: req-b",))
    )
    with RawClient(site.base) as client:
        client.send(pipelined)
        answers = [client.read_answer() for _ in range(3)]
        assert client.buffer == b""  # nothing beyond the three answers' framing
        client.send(request("GET", "/healthz", headers=("Connection: close",)))
        last = client.read_answer()
        assert client.read_to_close() == b""
    assert [a.status for a in answers] == [200, 200, 200]
    assert [a.framing for a in answers] == ["length", "length", "length"]
    assert [answers[0].header("x-request-id"), answers[2].header("x-request-id")] == ["req-a", "req-b"]
    assert [answers[0].json()["n"], answers[2].json()["n"]] == [0, 1]
    assert answers[1].json() == last.json()  # the health answer, between the two chats
    assert delivered_texts(site.backend) == ["a", "b"]


# --- request bodies -----------------------------------------------------------------------------


def test_a_chunked_request_body_is_read_whole_and_forwarded(site: Site) -> None:
    body = chat_body("a chunked prompt " + "x" * 300)
    head = request("POST", CHAT, headers=("Content-Type: application/json", "Transfer-Encoding: chunked"))
    coded = chunked(body, 64)
    with RawClient(site.base) as client:
        client.send(head + coded[:100])  # the body spans several reads
        client.send(coded[100:250])
        client.send(coded[250:])
        answer = client.read_answer()
    assert answer.status == 200 and answer.json()["ok"] is True
    assert [path for path, _ in site.backend.delivered] == [CHAT]
    assert json.loads(site.backend.delivered[0][1]) == json.loads(body)


def test_expect_100_continue_gets_100_before_the_answer(site: Site) -> None:
    body = chat_body("after the interim answer")
    with RawClient(site.base) as client:
        client.send(request("POST", CHAT, headers=(f"Content-Length: {len(body)}", "Expect: 100-continue")))
        interim = client.read_answer()
        assert interim.status == 100 and client.buffer == b""  # nothing else before the body is sent
        client.send(body)
        final = client.read_answer()
    assert final.status == 200 and final.json()["ok"] is True
    assert delivered_texts(site.backend) == ["after the interim answer"]


def test_expect_100_continue_from_an_http10_client_is_ignored(site: Site) -> None:
    body = chat_body("hi")
    with RawClient(site.base) as client:
        client.send(request("POST", CHAT, body, version="1.0", headers=("Expect: 100-continue",)))
        first = client.read_answer()
        final = client.read_answer() if first.status == 100 else first  # read whole: a clean teardown
    assert final.status == 200
    assert first.status == 200, "an interim 100 Continue sent to an HTTP/1.0 client"


@pytest.mark.parametrize("path", [CHAT, "/api/chat"], ids=["openai", "ollama"])
def test_expect_100_continue_over_the_body_limit_gets_413_and_no_100(site: Site, path: str) -> None:
    before = metric_value(site.base, "clairvoyant_rejections_total", 'reason="too_large"')
    with RawClient(site.base) as client:
        client.send(request("POST", path, headers=(f"Content-Length: {MAX_BODY_BYTES + 1}", "Expect: 100-continue")))
        answer = client.read_answer()
        rest = client.read_to_close()
    assert answer.status == 413 and rest == b""  # the 413 is the first thing written, then the close
    error = answer.json()["error"]
    if path == CHAT:
        assert error["code"] == "request_too_large"
    else:
        assert isinstance(error, str)  # Ollama's {"error": "..."}
    assert metric_value(site.base, "clairvoyant_rejections_total", 'reason="too_large"') == before + 1
    assert site.backend.delivered == []


def test_a_chunked_body_over_the_limit_gets_413_and_the_connection_closes(site: Site) -> None:
    before = metric_value(site.base, "clairvoyant_rejections_total", 'reason="too_large"')
    body = chat_body("y" * (MAX_BODY_BYTES + 200))
    head = request("POST", CHAT, headers=("Content-Type: application/json", "Transfer-Encoding: chunked"))
    with RawClient(site.base) as client:
        client.send(head + chunked(body, 256))
        answer = client.read_answer()
        rest = client.read_to_close()
    assert answer.status == 413 and answer.header("connection") == "close"
    assert answer.header("content-type") == "application/json"
    error = answer.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert rest == b""
    assert metric_value(site.base, "clairvoyant_rejections_total", 'reason="too_large"') == before + 1
    assert site.backend.delivered == []


# --- heads over the limit -------------------------------------------------------------------------


def test_the_next_request_on_a_kept_alive_connection_with_a_head_over_the_limit_gets_431(site: Site) -> None:
    big = "X-Big: " + "a" * (MAX_HEADER_BYTES + 500)
    with RawClient(site.base) as client:
        client.send(request("GET", "/healthz"))
        first = client.read_answer()
        client.send(request("POST", CHAT, chat_body("too big a head"), headers=(big,)))  # one write
        second = client.read_answer()
        rest = client.read_to_close()
    assert first.status == 200
    assert second.status == 431 and second.header("connection") == "close"
    assert second.json()["error"]["code"] == "request_header_fields_too_large"
    assert rest == b""
    assert site.backend.delivered == []


def test_a_pipelined_request_with_a_head_over_the_limit_is_not_served(site: Site) -> None:
    big = "X-Big: " + "a" * (MAX_HEADER_BYTES + 500)
    pipelined = request("GET", "/healthz") + request("POST", CHAT, chat_body("too big a head"), headers=(big,))
    with RawClient(site.base) as client:
        client.send(pipelined)
        first = client.read_answer()
        # Refused while the first answer runs: the proxy ends the connection after it (or answers 431).
        second = client.next_answer()
    assert first.status == 200
    assert second is None or second.status == 431, second
    assert site.backend.delivered == []


# --- answers' framing -------------------------------------------------------------------------------


def test_head_of_a_passthrough_path_gets_the_backends_length_and_no_body(site: Site) -> None:
    length = len(json.dumps(TAGS))
    with RawClient(site.base) as client:
        client.send(request("HEAD", "/api/tags"))
        head = client.read_answer(head_only=True)
        client.send(request("GET", "/healthz", headers=("Connection: close",)))
        after = client.read_answer()  # the next bytes are this answer's: the HEAD sent no body
        assert client.read_to_close() == b""
    assert head.status == 200 and head.header("content-length") == str(length)
    assert head.header("transfer-encoding") is None and head.header("connection") is None
    assert after.status == 200
    assert [path for path, _ in site.backend.delivered] == ["/api/tags"]


def test_an_asgi_answer_to_head_sends_no_body(site: Site) -> None:
    # The own endpoints' app writes a body for HEAD too; the connection drops it.
    with RawClient(site.base) as client:
        client.send(request("HEAD", "/healthz"))
        head = client.read_answer(head_only=True)
        client.send(request("GET", "/healthz", headers=("Connection: close",)))
        after = client.read_answer()
        assert client.read_to_close() == b""
    assert head.header("content-length") not in (None, "0")  # a body was announced, and not sent
    assert after.status == 200


def test_head_of_an_own_endpoint_gets_its_get_headers(site: Site) -> None:
    with RawClient(site.base) as client:
        client.send(request("GET", "/healthz"))
        get = client.read_answer()
        client.send(request("HEAD", "/healthz"))
        head = client.read_answer(head_only=True)
    assert head.status == 200 and head.header("content-length") == str(len(get.body))


def test_a_backend_answer_without_length_reaches_an_http11_client_chunked(site: Site) -> None:
    with RawClient(site.base) as client:
        client.send(request("GET", STREAM_PATH))
        while b"x0" not in client.buffer:  # the head and the first event, before the backend ends
            assert client.fill(), "closed before the first event"
        assert b"transfer-encoding: chunked" in client.buffer.lower()
        site.backend.gate.release()
        answer = client.read_answer()
        client.send(request("GET", "/healthz"))  # the chunked answer ended; the connection is kept
        after = client.read_answer()
    assert answer.status == 200 and answer.framing == "chunked"
    assert answer.header("content-length") is None and answer.header("connection") is None
    assert answer.body.startswith(b'data: {"choices":[{"delta":{"content":"x0"}}]}\n\n')
    assert answer.body.endswith(b"data: [DONE]\n\n") and answer.body.count(b"data: ") == 3
    assert after.status == 200


def test_a_backend_answer_without_length_reaches_an_http10_client_close_delimited(site: Site) -> None:
    with RawClient(site.base) as client:
        client.send(request("GET", STREAM_PATH, version="1.0"))
        while b"x0" not in client.buffer:
            assert client.fill(), "closed before the first event"
        site.backend.gate.release()
        answer = client.read_answer()
    assert answer.status == 200 and answer.framing == "close"
    assert answer.header("connection") == "close"
    assert answer.header("transfer-encoding") is None and answer.header("content-length") is None
    assert answer.body.startswith(b'data: {"choices":[{"delta":{"content":"x0"}}]}\n\n')
    assert answer.body.endswith(b"data: [DONE]\n\n") and answer.body.count(b"data: ") == 3


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["TRACE", "PROPFIND"])
def test_a_method_the_proxy_does_not_serve_gets_405_with_allow(site: Site, method: str) -> None:
    with RawClient(site.base) as client:
        client.send(request(method, "/x"))
        answer = client.read_answer()
        client.send(request("GET", "/healthz"))  # a complete answer: the connection is kept
        after = client.read_answer()
    assert answer.status == 405
    allowed = {m.strip() for m in (answer.header("allow") or "").split(",")}
    assert allowed == {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}
    assert after.status == 200
    assert site.backend.delivered == []


@pytest.mark.parametrize(
    "payload",
    [
        b"this is not http\r\n\r\n",
        b"GET /x HTTP/1.1 trailing\r\nHost: x\r\n\r\n",
        b"GET /x HTTP/1.1\r\nNo colon\r\n\r\n",
    ],
    ids=["garbage", "bad-request-line", "bad-header"],
)
def test_a_malformed_request_gets_400_and_the_connection_closes(site: Site, payload: bytes) -> None:
    with RawClient(site.base) as client:
        client.send(payload)
        answer = client.read_answer()
        rest = client.read_to_close()
    assert answer.status == 400 and answer.header("connection") == "close"
    assert rest == b""


def test_a_method_llhttp_does_not_know_gets_501_and_the_connection_closes(site: Site) -> None:
    with RawClient(site.base) as client:
        client.send(b"BREW /pot HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        answer = client.read_answer()
        rest = client.read_to_close()
    assert answer.status == 501 and answer.header("connection") == "close"
    assert answer.body == b"Method not implemented."
    assert rest == b""
    assert site.backend.delivered == []


# --- one Date on every answer -----------------------------------------------------------------------


def test_every_answer_carries_exactly_one_date(site: Site) -> None:
    cases = {
        "scheduled": request("POST", CHAT, chat_body("hi")),
        "passthrough": request("GET", "/api/tags"),
        "own endpoint": request("GET", "/healthz"),
        "405": request("TRACE", "/x"),
        "413": request("POST", CHAT, headers=(f"Content-Length: {MAX_BODY_BYTES + 1}",)),
        "431": request("GET", "/healthz", headers=("X-Big: " + "a" * MAX_HEADER_BYTES,)),
    }
    dates = {}
    for name, payload in cases.items():
        with RawClient(site.base) as client:
            client.send(payload)
            dates[name] = client.read_answer().values("date")
    assert {name: len(found) for name, found in dates.items()} == dict.fromkeys(cases, 1)
    assert dates["passthrough"] != ["Sun, 22 Nov 2026 00:00:00 GMT"]  # the proxy's, not the backend's


def test_a_408_carries_exactly_one_date() -> None:
    with FakeBackend(_script) as backend, serve(backend, client_timeout_s=0.3) as base:
        with RawClient(base) as client:
            client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Len")  # never ends
            answer = client.read_answer()
    assert answer.status == 408 and len(answer.values("date")) == 1


def test_a_400_carries_exactly_one_date(site: Site) -> None:
    with RawClient(site.base) as client:
        client.send(b"this is not http\r\n\r\n")
        answer = client.read_answer()
    assert answer.status == 400 and len(answer.values("date")) == 1


# --- a client that leaves while its request waits ------------------------------------------------


class HoldFirstChat:
    """A FakeBackend script that holds the first chat request until ``release`` is set (``held``:
    it is at the backend); everything else is answered at once."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.release = threading.Event()

    def __call__(self, path: str, n: int) -> Any:
        if path == CHAT and n == 0:
            self.held.set()
            self.release.wait(READ_TIMEOUT_S)
        return "ok"


def test_a_client_that_leaves_while_queued_is_withdrawn_and_never_sent() -> None:
    script = HoldFirstChat()
    held, release = script.held, script.release

    with FakeBackend(script) as backend, serve(backend, slots=1) as base:
        before = metric_value(base, "clairvoyant_client_disconnects_total", 'stage="queued"')
        with RawClient(base) as first:
            first.send(request("POST", CHAT, chat_body("held"), headers=("X-Request-Id: held",)))
            wait_until(held.is_set, what="the first request at the backend")
            with RawClient(base) as leaver:
                leaver.send(request("POST", CHAT, chat_body("leaver"), headers=("X-Request-Id: leaver",)))
                wait_until(
                    lambda: [w["request_id"] for w in queue_snapshot(base)["waiting"]] == ["leaver"],
                    what="the second request waiting",
                )
            wait_until(lambda: queue_snapshot(base)["waiting"] == [], what="the leaver withdrawn")
            assert metric_value(base, "clairvoyant_client_disconnects_total", 'stage="queued"') == before + 1
            assert [f["request_id"] for f in queue_snapshot(base)["in_flight"]] == ["held"]
            release.set()
            answer = first.read_answer()
            first.send(request("POST", CHAT, chat_body("after"), headers=("X-Request-Id: after",)))
            after = first.read_answer()
        snapshot = queue_snapshot(base)
    assert answer.status == 200 and answer.json() == {"ok": True, "n": 0}
    assert after.status == 200 and after.json() == {"ok": True, "n": 1}  # the leaver took no turn
    assert delivered_texts(backend) == ["held", "after"]
    assert snapshot["waiting"] == [] and snapshot["in_flight"] == []


@pytest.mark.parametrize("park", [True, False])
def test_a_waiting_request_is_parked_and_its_answer_comes_on_the_resumed_connection(park: bool) -> None:
    # park_waiting: the waiting client's connection is a bare fd in the parking lot (counted by
    # clairvoyant_parked_connections), resumed at its grant; off, it stays a live connection.
    script = HoldFirstChat()
    held, release = script.held, script.release

    with FakeBackend(script) as backend, serve(backend, slots=1, park_waiting=park) as base:
        with RawClient(base) as first, RawClient(base) as waiter:
            first.send(request("POST", CHAT, chat_body("held")))
            wait_until(held.is_set, what="the first request at the backend")
            waiter.send(request("POST", CHAT, chat_body("waits"), headers=("X-Request-Id: waits",)))
            wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 1, what="the second request waiting")
            parked = metric_value(base, "clairvoyant_parked_connections")
            release.set()
            assert first.read_answer().status == 200
            answer = waiter.read_answer()
            waiter.send(request("GET", "/healthz"))  # the resumed connection is kept alive
            again = waiter.read_answer()
        after = metric_value(base, "clairvoyant_parked_connections")
    assert parked == (1 if park else 0) and after == 0
    assert answer.status == 200 and answer.json() == {"ok": True, "n": 1}
    assert answer.values("x-request-id") == ["waits"] and float(answer.values("x-clairvoyant-queue-wait-ms")[0]) > 0
    assert again.status == 200


@pytest.mark.parametrize("whole", [True, False])
def test_a_request_pipelined_behind_a_waiting_one_is_not_lost(whole: bool) -> None:
    # The waiting request's connection may not be parked with the next request's bytes already read
    # (they were taken from the socket): the next request, whole or in part, is answered after it.
    script = HoldFirstChat()
    held, release = script.held, script.release

    with FakeBackend(script) as backend, serve(backend, slots=1) as base:
        with RawClient(base) as first, RawClient(base) as client:
            first.send(request("POST", CHAT, chat_body("held")))
            wait_until(held.is_set, what="the first request at the backend")
            second = request("GET", "/healthz")
            client.send(request("POST", CHAT, chat_body("waits")) + (second if whole else second[:10]))
            wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 1, what="the POST waiting")
            if not whole:
                client.send(second[10:])
            release.set()
            assert first.read_answer().status == 200
            waited = client.read_answer()
            pipelined = client.read_answer()
    assert waited.status == 200 and waited.json() == {"ok": True, "n": 1}
    assert pipelined.status == 200 and pipelined.json() == {"status": "ok"}
