"""Hardening: client limits, no duplicated generations, backend faults, secrets, shutdown.

The proxy runs on its real server (proxy/server.py) and talks to real sockets: a raw fake backend
(tests/fake_backend.py) for faults, and raw client sockets for misbehaving clients. The slow and
load versions of these cases are in benchmarks/bench_hardening.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_backend import FakeBackend
from polling import wait_until
from proxy_harness import MarkerPredictor, answering, metric_value, queue_snapshot, running_proxy

from clairvoyant.config import Settings
from clairvoyant.proxy.scheduled import HOLD_MAX_S, SLOTS_POLL_S

CHAT = "/v1/chat/completions"
ROOT = Path(__file__).resolve().parents[1]


def settings(upstream: str, **overrides: Any) -> Settings:
    return Settings(upstream_url=upstream, **overrides)


def proxy(upstream: str, **overrides: Any) -> Any:
    return running_proxy(settings(upstream, **overrides), predictor=MarkerPredictor())


def chat(text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def raw_exchange(base: str, payload: bytes, *, read_timeout_s: float = 10.0) -> tuple[bytes, float]:
    """Send ``payload`` on a fresh connection, read until the proxy closes it; (bytes, seconds)."""
    host, port = base.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(read_timeout_s)
        sock.sendall(payload)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received, time.monotonic() - started


# --- never resend what the backend may have started ------------------------------------------


def test_a_backend_that_reads_then_closes_gets_the_request_exactly_once() -> None:
    with FakeBackend(lambda path, n: "close") as backend, proxy(backend.url) as base:
        r = httpx.post(f"{base}{CHAT}", json=chat())
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
    assert backend.posts(CHAT) == 1


def test_a_reused_connection_that_dies_after_the_request_is_not_resent() -> None:
    # The first request is answered on a kept-alive connection; the second goes out on it, is read,
    # and the backend closes: it may be generating, so the proxy answers 502 once.
    with FakeBackend(lambda path, n: "ok" if n == 0 else "close") as backend, proxy(backend.url) as base:
        with httpx.Client() as client:
            first = client.post(f"{base}{CHAT}", json=chat())
            second = client.post(f"{base}{CHAT}", json=chat())
    assert first.status_code == 200 and second.status_code == 502
    assert backend.posts(CHAT) == 2
    assert backend.connections <= 2  # the health check's connection, and the one the two posts shared


def test_a_reused_connection_reset_unread_is_resent_once() -> None:
    # A reset (not a clean close) means the backend's socket still held our unread bytes.
    with FakeBackend(lambda path, n: "reset" if n == 1 else "ok") as backend, proxy(backend.url) as base:
        with httpx.Client() as client:
            first = client.post(f"{base}{CHAT}", json=chat())
            second = client.post(f"{base}{CHAT}", json=chat())
    assert first.status_code == 200 and second.status_code == 200
    assert second.json() == {"ok": True, "n": 2}  # answered by the resend
    assert backend.resets == 1 and backend.posts(CHAT) == 2


def test_a_connection_asked_to_close_is_never_reused_even_when_the_backend_closes_it_late() -> None:
    # A scheduled stream asks the backend to close (Connection: close); the backend answers without
    # saying it will, and its close reaches the proxy only once a next request went out on that
    # connection (the race llama.cpp's server runs after every stream). Sent there, the next
    # request would meet a clean close, unread, that nothing may resend: a 502 on a healthy backend.
    script = lambda path, n: ("stream", 2, 0.0) if path == CHAT else "ok"  # noqa: E731
    with FakeBackend(script, silent_close=True) as backend, proxy(backend.url) as base:
        with httpx.Client(timeout=30) as client:
            answers = [client.post(f"{base}{CHAT}", json=chat(stream=True)) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert all(a.text.rstrip().endswith("data: [DONE]") for a in answers)
    assert backend.sent_after_close == 0 and backend.posts(CHAT) == 3


def test_a_backend_that_never_answers_is_a_504_after_the_first_byte_timeout() -> None:
    with FakeBackend(lambda path, n: "hang") as backend, proxy(backend.url, first_byte_timeout_s=0.5) as base:
        r = httpx.post(f"{base}/api/chat", json=chat(), timeout=10)
        after = httpx.get(f"{base}/queue").json()
    assert r.status_code == 504 and isinstance(r.json()["error"], str)  # Ollama's error shape
    assert after["in_flight"] == [] and backend.posts("/api/chat") == 1  # the slot is free again


def test_after_a_first_byte_timeout_the_next_request_waits_for_a_health_check() -> None:
    # The backend hung on the first request: the next one is not sent into the hang, but waits until
    # /health answers (here held back until the test releases it).
    backend = FakeBackend(lambda path, n: "hang" if n == 0 else "ok")
    with backend, proxy(backend.url, first_byte_timeout_s=0.5, backend_wait_s=20) as base:
        # The proxy's start-up check passes (else it would leave the backend suspect already).
        wait_until(lambda: backend.health_checks >= 1, what="the proxy's start-up health check")
        backend.health_gate = threading.Event()
        assert httpx.post(f"{base}{CHAT}", json=chat(), timeout=10).status_code == 504
        second = threading.Thread(
            target=lambda: setattr(second, "result", httpx.post(f"{base}{CHAT}", json=chat(), timeout=30))
        )
        second.start()
        wait_until(lambda: backend.health_checks >= 2, what="a health check before the second request")
        assert backend.posts(CHAT) == 1  # not sent into the hang
        backend.health_gate.set()
        second.join(30)
    assert second.result.status_code == 200  # type: ignore[attr-defined]
    assert backend.posts(CHAT) == 2


def test_a_request_queued_behind_a_hung_backend_is_never_sent_into_the_hang() -> None:
    # The backend accepts and never answers, /health included. The first request meets its
    # first-byte deadline (504); the one queued behind it finds the backend suspect, waits
    # backend_wait_s for a health check that never passes, and is answered 503 with Retry-After in
    # its own dialect (Ollama's here), never sent.
    backend = FakeBackend(lambda path, n: "hang")
    with backend, proxy(backend.url, first_byte_timeout_s=1, backend_wait_s=1) as base:
        # The start-up check passes (else it would leave the backend suspect already); then /health hangs too.
        wait_until(lambda: backend.health_checks >= 1, what="the proxy's start-up health check")
        backend.health_gate = threading.Event()  # never set
        first = _Post(base, chat(), timeout_s=30)
        first.start()
        wait_until(lambda: backend.posts(CHAT) == 1, what="the first request at the backend")
        second = threading.Thread(
            target=lambda: setattr(second, "result", httpx.post(f"{base}/api/chat", json=chat(), timeout=30))
        )
        second.start()
        wait_until(lambda: queue_snapshot(base)["waiting"], what="the second request queued behind the first")
        first.join(30)
        second.join(30)
        health_checks = backend.health_checks
    assert first.result is not None and first.result.status_code == 504
    refused: httpx.Response = second.result  # type: ignore[attr-defined]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert isinstance(refused.json()["error"], str)  # Ollama's error shape
    assert health_checks >= 2  # it was health-checked, not refused blindly
    assert backend.posts(CHAT) == 1 and backend.posts("/api/chat") == 0  # never sent into the hang


def test_in_a_pool_a_request_for_a_suspect_backend_that_stays_unhealthy_goes_to_another() -> None:
    from clairvoyant.metrics import Metrics
    from clairvoyant.prediction.dialects import Dialect
    from clairvoyant.proxy.relay import PassThrough, Relay, Responder, UpstreamRequest
    from clairvoyant.proxy.upstream import Upstream

    hung = FakeBackend(lambda path, n: "hang")
    hung.health_gate = threading.Event()  # never set: its health check never passes
    sent: list[dict[str, Any]] = []

    async def scenario() -> tuple[str, str]:
        suspect, other = Upstream(hung.url, name="hung"), Upstream(healthy.url, name="other")
        suspect.suspect = True  # as a first-byte deadline leaves it

        class Pool:  # what a pass-through relay tells its pool: nothing to keep here
            def refused(self, upstream: Upstream) -> None: ...
            def answered(self, upstream: Upstream) -> None: ...
            def broken(self, upstream: Upstream) -> None: ...

        async def send(message: Any) -> None:
            sent.append(message)

        request = UpstreamRequest(
            "POST", CHAT, [("content-type", "application/json")], b"{}", Dialect.OPENAI, wait_s=0.2
        )
        passing = PassThrough([0] * 32, Pool(), [suspect, other])
        relay = Relay(suspect, request, Metrics(), passing, passing)
        try:
            await asyncio.wait_for(relay.run(Responder(send)), 30)
        finally:
            await suspect.aclose()
            await other.aclose()
        return relay.upstream.name, relay.record.status.outcome

    with hung, FakeBackend(lambda path, n: "ok") as healthy:
        served_by, outcome = asyncio.run(scenario())
        assert hung.health_checks >= 1 and hung.posts(CHAT) == 0 and healthy.posts(CHAT) == 1
    assert (served_by, outcome) == ("other", "completed")
    assert sent[0]["status"] == 200


def test_a_health_check_against_a_backend_that_never_answers_is_bounded() -> None:
    from clairvoyant.proxy.upstream import Upstream

    backend = FakeBackend(lambda path, n: "hang")
    backend.health_gate = threading.Event()  # never set: /health is read and never answered

    async def scenario() -> str | None:
        upstream = Upstream(backend.url)
        try:
            return await asyncio.wait_for(upstream.probe(timeout_s=0.2), 10)  # the 10 s guard: a failure, not a hang
        finally:
            await upstream.aclose()

    with backend:
        problem = asyncio.run(scenario())
        assert backend.health_checks == 1
    assert problem is not None and problem.endswith("TimeoutError")  # no answer within its bound


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_request_waits_for_a_backend_that_comes_back() -> None:
    port = _closed_port()
    up: list[FakeBackend] = []

    def start_later() -> None:
        wait_until(lambda: queue_snapshot(base)["in_flight"], what="the request waiting for the backend")
        up.append(FakeBackend(lambda path, n: "ok", port=port))  # the backend comes back on its port

    with proxy(f"http://127.0.0.1:{port}", backend_wait_s=10) as base:
        threading.Thread(target=start_later, daemon=True).start()
        r = httpx.post(f"{base}{CHAT}", json=chat(), timeout=15)
    assert r.status_code == 200
    assert up and up[0].posts(CHAT) == 1
    up[0].close()


def test_a_backend_still_loading_its_model_is_waited_for() -> None:
    with (
        FakeBackend(lambda path, n: "loading" if n < 2 else "ok") as backend,
        proxy(backend.url, backend_wait_s=10) as base,
    ):
        r = httpx.post(f"{base}{CHAT}", json=chat(), timeout=15)
    assert r.status_code == 200 and r.json()["n"] == 2
    assert backend.posts(CHAT) == 3  # two 503s (nothing generated), then the answer


def test_a_backend_that_keeps_answering_503_is_not_flooded_with_resends() -> None:
    # Its health check passes, but every POST gets 503 (its own queue is full): within
    # backend_wait_s = 1 the request is sent again after 0.25 s, 0.5 s, then at the deadline, and
    # the last 503 is relayed. Without the pause each passing health check sent it again at once.
    with FakeBackend(lambda path, n: "loading") as backend, proxy(backend.url, backend_wait_s=1) as base:
        r = httpx.post(f"{base}{CHAT}", json=chat(), timeout=15)
    assert r.status_code == 503
    assert 2 <= backend.posts(CHAT) <= 5


def test_a_client_that_leaves_while_the_backend_is_down_is_never_sent() -> None:
    port = _closed_port()
    with proxy(f"http://127.0.0.1:{port}", backend_wait_s=30) as base:
        with pytest.raises(httpx.ReadTimeout):  # non-streamed: the mode that would otherwise drain
            httpx.post(f"{base}{CHAT}", json=chat(), timeout=0.5)
        with FakeBackend(lambda path, n: "ok", port=port) as backend:
            wait_until(lambda: not queue_snapshot(base)["in_flight"], timeout_s=10, what="the slot to be free")
            after = httpx.post(f"{base}{CHAT}", json=chat(), timeout=10)
    assert after.status_code == 200
    assert backend.posts(CHAT) == 1  # only the second request: the abandoned one was never sent


def test_requests_queued_during_an_outage_share_its_deadline() -> None:
    # backend_wait_s counts from the outage's start, not from each request's turn: three requests
    # behind one slot all get their 502 about backend_wait_s after the first failure, not 3 x.
    with proxy(f"http://127.0.0.1:{_closed_port()}", backend_wait_s=1.5) as base:
        started = time.monotonic()
        posts = _post_in_background(base, 3)
        for thread in posts:
            thread.join(timeout=30)
        took_s = time.monotonic() - started
    assert [t.result.status_code for t in posts] == [502, 502, 502]  # type: ignore[union-attr]
    assert took_s < 3.5  # 1.5 s for the whole queue (each waiting its own 1.5 s would be 4.5 s)


@contextlib.contextmanager
def _unaccepting_port() -> Iterator[int]:
    """A port whose accept queue is full: it listens with a backlog of 0 and never accepts, and one
    connection fills the queue, so a new connection is neither accepted nor refused (its SYN is
    dropped): the connect times out."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = int(listener.getsockname()[1])
        filler = socket.create_connection(("127.0.0.1", port))
        try:
            yield port
        finally:
            filler.close()


@pytest.mark.parametrize(("path", "ollama_shape"), [(CHAT, False), ("/api/generate", True)])
def test_a_backend_that_never_accepts_the_connection_is_a_504_in_the_dialects_shape(
    path: str, ollama_shape: bool
) -> None:
    body = {"model": "m", "prompt": "hi"} if ollama_shape else chat()
    with (
        _unaccepting_port() as port,
        proxy(f"http://127.0.0.1:{port}", connect_timeout_s=0.5, backend_wait_s=1) as base,
    ):
        r = httpx.post(f"{base}{path}", json=body, timeout=30)
        timeouts = metric_value(base, "clairvoyant_upstream_errors_total", 'kind="timeout"')
    assert r.status_code == 504
    error = r.json()["error"]
    if ollama_shape:
        assert error == "the backend did not accept the connection in time"
    else:
        assert (
            error["code"] == "upstream_timeout"
            and error["message"] == "the backend did not accept the connection in time"
        )
    assert timeouts == 1  # one answer, counted as a timeout (its wait is measured in bench_hardening.py)


def test_with_no_backend_wait_a_down_backend_is_an_immediate_502() -> None:
    with proxy(f"http://127.0.0.1:{_closed_port()}", backend_wait_s=0) as base:
        r = httpx.post(f"{base}{CHAT}", json=chat(), timeout=15)
    assert r.status_code == 502 and r.json()["error"]["message"] == "the backend is unreachable"


# --- no secrets or internal addresses to clients ---------------------------------------------


def test_backend_credentials_and_address_never_reach_clients_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    port = _closed_port()
    caplog.set_level(logging.DEBUG)
    with proxy(f"http://admin:s3cr3t-pw@127.0.0.1:{port}", backend_wait_s=0) as base:
        failed = httpx.post(f"{base}{CHAT}", json=chat())
        ollama = httpx.post(f"{base}/api/generate", json={"model": "m", "prompt": "hi"})
        passthrough = httpx.get(f"{base}/api/tags")
        ready = httpx.get(f"{base}/readyz")
    for r in (failed, ollama, passthrough, ready):
        assert "s3cr3t" not in r.text and str(port) not in r.text and "127.0.0.1" not in r.text
    assert failed.status_code == 502 and ollama.status_code == 502 and ready.status_code == 503
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "s3cr3t" not in logged
    assert f"***@127.0.0.1:{port}" in logged  # the log keeps the detail, redacted


def test_a_client_that_closes_at_the_streams_end_event_leaves_a_completed_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The OpenAI SDK reads a stream to its `data: [DONE]` event and closes, while the body's own end
    # (here held back 2 s) is still to come: the answer was whole, so it completes and its length
    # is learned; the client's leaving is no mid-stream disconnect.
    caplog.set_level(logging.INFO, logger="clairvoyant")
    with FakeBackend(lambda path, n: ("stream", 5, 0.0, 2.0)) as backend, proxy(backend.url) as base:
        with httpx.stream("POST", f"{base}{CHAT}", json=chat(stream=True), timeout=30) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    break  # closes the connection with the body's end unread
        wait_until(lambda: not queue_snapshot(base)["in_flight"], timeout_s=10, what="the stream's end")
        disconnects = metric_value(base, "clairvoyant_client_disconnects_total", 'stage="streaming"')
    lines = [r.fields for r in caplog.records if getattr(r, "fields", None)]  # type: ignore[attr-defined]
    assert [(line["outcome"], line["output_tokens"]) for line in lines] == [("completed", 5)]
    assert disconnects == 0


def test_a_shutdown_after_a_streams_end_event_leaves_it_completed(caplog: pytest.LogCaptureFixture) -> None:
    # The grace period ends while the body's end is still to come, after the stream's end event: the
    # answer was whole, so it stays completed, with no error event after [DONE].
    caplog.set_level(logging.INFO, logger="clairvoyant")
    with FakeBackend(lambda path, n: ("stream", 3, 0.0, 10.0)) as backend, httpx.Client(timeout=30) as client:
        with proxy(backend.url, shutdown_grace_s=0.2) as base:
            request = client.build_request("POST", f"{base}{CHAT}", json=chat(stream=True))
            response = client.send(request, stream=True)
            lines = response.iter_lines()
            for line in lines:
                if line == "data: [DONE]":
                    break
        rest: list[str] = []  # the proxy has stopped: what came after [DONE]
        with contextlib.suppress(httpx.HTTPError):  # the body's end never came
            rest.extend(lines)
        response.close()
    assert not any(line.startswith("data:") for line in rest), rest
    fields = [r.fields for r in caplog.records if getattr(r, "fields", None)]  # type: ignore[attr-defined]
    assert [(line["outcome"], line["output_tokens"]) for line in fields] == [("completed", 3)]


def test_an_answer_carries_one_date_and_one_server_header() -> None:
    with FakeBackend(lambda path, n: "ok") as backend, proxy(backend.url) as base:
        answers = [
            httpx.post(f"{base}{CHAT}", json=chat()),
            httpx.get(f"{base}/api/tags"),
            httpx.get(f"{base}/healthz"),
        ]
    for r in answers:
        assert len(r.headers.get_list("date")) == 1
        assert r.headers.get_list("server") == ["granian"]  # the proxy's server's, not the backend's too


def test_an_http10_request_without_host_is_answered() -> None:
    # HTTP/1.0 lets a client leave Host out (old tools and health checkers do); the server reports
    # the version in its own spelling, which the proxy must read as 1.0.
    body = json.dumps(chat()).encode()
    head = b"POST %s HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
        CHAT.encode(),
        len(body),
    )
    with FakeBackend(lambda path, n: "ok") as backend, proxy(backend.url) as base:
        received, _ = raw_exchange(base, head + body)
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.split(b" ")[1] == b"200", received[:200]
    assert rest.endswith(b'{"ok": true, "n": 0}')
    assert backend.posts(CHAT) == 1


# --- client limits --------------------------------------------------------------------------


@pytest.fixture
def limited_proxy() -> Any:
    with (
        FakeBackend(lambda path, n: "ok") as backend,
        proxy(backend.url, client_timeout_s=0.5, max_header_bytes=8192) as base,
    ):
        yield base


def test_headers_that_never_end_close_the_connection_within_the_client_timeout(limited_proxy: str) -> None:
    answer, took_s = raw_exchange(limited_proxy, b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Le")
    assert answer == b""  # the server closes it: there is no request to answer
    assert took_s < 0.5 + 1.0  # client_timeout_s + 1 s, not this socket's 10 s read timeout


def test_headers_trickled_a_byte_at_a_time_are_cut_off_at_the_deadline(limited_proxy: str) -> None:
    # One byte every 50 ms would take 10 s: the deadline counts from the head's start, not per byte.
    host, port = limited_proxy.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port))) as sock:
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
            try:
                sock.send(bytes([byte]))
                readable, _, _ = select.select([sock], [], [], 0.05)
                if readable and sock.recv(1) == b"":  # the server closed it
                    break
            except OSError:  # reset, or a broken pipe: closed too
                break
    assert time.monotonic() - started < 0.5 + 1.0


def test_a_body_shorter_than_its_content_length_gets_408_not_a_hang(limited_proxy: str) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    answer, took_s = raw_exchange(limited_proxy, head + b'{"messages":')
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"  # OpenAI's shape
    assert took_s < 0.5 + 1.0
    assert metric_value(limited_proxy, "clairvoyant_client_rejections_total", 'reason="client_timeout"') == 1


def test_oversized_headers_get_431(limited_proxy: str) -> None:
    payload = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n"
    answer, _ = raw_exchange(limited_proxy, payload)
    assert answer.startswith(b"HTTP/1.1 431 ")
    normal = httpx.get(f"{limited_proxy}/healthz", headers={"X-Small": "a" * 1000})
    assert normal.status_code == 200  # headers under the limit pass


def test_a_kept_alive_connections_next_request_that_stalls_is_closed(limited_proxy: str) -> None:
    host, port = limited_proxy.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow")  # the next request stalls
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
    assert first.startswith(b"HTTP/1.1 200 ") and rest == b""
    assert time.monotonic() - started < 0.5 + 1.0


def test_an_idle_keep_alive_connection_is_closed(limited_proxy: str) -> None:
    answer, took_s = raw_exchange(limited_proxy, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ") and took_s < 0.5 + 1.0  # closed after client_timeout_s


def test_an_aborted_upload_is_a_client_disconnect_not_a_500(caplog: pytest.LogCaptureFixture) -> None:
    head = b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    with FakeBackend(lambda path, n: "ok") as backend, proxy(backend.url) as base:
        host, port = base.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(head + b'{"messages":')
        wait_until(lambda: metric_value(base, "clairvoyant_client_disconnects_total", 'stage="upload"') == 3)
        metrics = httpx.get(f"{base}/metrics").text
    assert 'status="500"' not in metrics
    assert backend.posts("/api/chat") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]  # no tracebacks


def test_bodies_beyond_the_budget_get_503_and_the_budget_comes_back() -> None:
    # Two bodies of 600 KiB fit a 1 MiB budget one at a time, not together: the second waits in the
    # queue holding its body, so a third is refused until the queue has moved on.
    backend = FakeBackend(lambda path, n: ("stream", 20, 0.05))
    body = json.dumps(chat("x" * 600 * 1024)).encode()
    with backend, proxy(backend.url, body_budget_bytes=1024 * 1024, max_body_bytes=1024 * 1024) as base:
        first = threading.Thread(target=httpx.post, args=(f"{base}{CHAT}",), kwargs={"content": body, "timeout": 30})
        first.start()
        wait_until(lambda: backend.posts(CHAT) == 1, what="the first body at the backend")
        refused = httpx.post(f"{base}{CHAT}", content=body, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "body_budget_exhausted"
        first.join(30)
        assert httpx.post(f"{base}{CHAT}", content=body, timeout=30).status_code == 200
    assert backend.posts(CHAT) == 2


def test_requests_beyond_max_connections_wait_to_be_accepted() -> None:
    # Three pass-through requests held by a backend that never answers fill max_connections=3: a
    # fourth request is not accepted (no answer, no refusal) until one of them ends.
    with FakeBackend(lambda path, n: "hang" if path == "/slow" else "ok") as backend:
        with proxy(backend.url, max_connections=3) as base:
            host, port = base.removeprefix("http://").split(":")
            held = [socket.create_connection((host, int(port))) for _ in range(3)]
            try:
                for sock in held:
                    sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
                wait_until(lambda: sum(1 for p, _ in backend.delivered if p == "/slow") == 3, what="three held")
                with pytest.raises(httpx.TimeoutException):
                    httpx.get(f"{base}/healthz", timeout=1.0)
                held[0].close()  # its client leaves: its request ends, and there is room for one more
                assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
            finally:
                for sock in held:
                    sock.close()


# --- shutdown ---------------------------------------------------------------------------------


@pytest.mark.e2e  # `clairvoyant serve` as deployed, a real process
def test_sigterm_refuses_the_queue_at_once_and_ends_the_stream_after_the_grace_period(free_port: int) -> None:
    # One stream of 60 events x 0.1 s (6 s) is in flight; 5 requests wait; grace 1 s.
    with FakeBackend(lambda path, n: ("stream", 60, 0.1)) as backend:
        env = {**os.environ, "CLAIRVOYANT_UPSTREAM_URL": backend.url, "CLAIRVOYANT_PORT": str(free_port),
               "CLAIRVOYANT_SHUTDOWN_GRACE_S": "1", "CLAIRVOYANT_SLOTS": "1", "CLAIRVOYANT_LOG_LEVEL": "warning",
               "PYTHONPATH": str(ROOT / "src")}  # fmt: skip
        process = subprocess.Popen([sys.executable, "-m", "clairvoyant.cli", "serve"], env=env)
        base = f"http://127.0.0.1:{free_port}"
        try:
            # a start costs about 2 s of CPU, many times that on a loaded machine: wait for its event
            wait_until(lambda: process.poll() is not None or answering(base), timeout_s=120, what="the proxy to start")
            assert process.poll() is None, f"the proxy exited with code {process.returncode}"
            results: dict[str, Any] = {}
            stream_thread = threading.Thread(target=_read_stream, args=(base, results), daemon=True)
            stream_thread.start()
            wait_until(lambda: backend.posts(CHAT) == 1, what="the stream at the backend")
            queued = _post_in_background(base, 5)
            wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 5, what="5 waiting")
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            for thread in queued:
                thread.join(timeout=10)
            refused_s = time.monotonic() - signalled
            stream_thread.join(timeout=15)
            exit_code = process.wait(timeout=15)
            exited_s = time.monotonic() - signalled
        finally:
            process.kill()
            process.wait()
    statuses = [t.result.status_code for t in queued]  # type: ignore[attr-defined]
    assert statuses == [503] * 5
    assert all(t.result.json()["error"]["code"] == "shutting_down" for t in queued)  # type: ignore[attr-defined]
    assert all(t.result.headers["retry-after"] for t in queued)  # type: ignore[attr-defined]
    assert refused_s < results["stream_ended_s"] - signalled  # refused before the stream's end
    assert '"code": "shutting_down"' in results["last_event"] or "shut down" in results["last_event"]
    assert results["events"] < 60  # cut at the grace period, not served to its end
    assert exit_code == 0
    assert exited_s < 6  # the 6 s stream did not hold the exit: it ended at the 1 s grace
    assert backend.posts(CHAT) == 1  # nothing queued reached the backend


def _read_stream(base: str, results: dict[str, Any]) -> None:
    events = []
    with httpx.stream("POST", f"{base}{CHAT}", json=chat(stream=True), timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
    results["stream_ended_s"] = time.monotonic()
    results["events"] = sum(1 for e in events if '"delta"' in e)
    results["last_event"] = events[-1] if events else ""


class _Post(threading.Thread):
    def __init__(self, base: str, body: dict[str, Any], *, timeout_s: float = 120) -> None:
        super().__init__(daemon=True)
        self.base, self.body, self.timeout_s = base, body, timeout_s
        self.result: httpx.Response | None = None
        self.error: httpx.HTTPError | None = None

    def run(self) -> None:
        try:
            self.result = httpx.post(f"{self.base}{CHAT}", json=self.body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            self.error = exc


def _post_in_background(base: str, n: int, body: dict[str, Any] | None = None) -> list[_Post]:
    threads = [_Post(base, body or chat()) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


# --- the real llama.cpp server ------------------------------------------------------------------


def test_a_non_streamed_leaver_keeps_its_llamacpp_slot_until_the_backend_is_idle(
    llama_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # llama.cpp notices a closed non-streamed request only when nothing else keeps its HTTP thread
    # busy, so the default (auto) mode closes the connection and then holds the slot until
    # /slots shows the backend idle: the next request's wait shows up in the queue, not hidden
    # inside the backend. Every time asserted is the proxy's own (its log fields, one clock), so
    # the test's own pace on a loaded machine does not move them.
    caplog.set_level(logging.INFO, logger="clairvoyant")
    long = chat("Write a long story.", max_tokens=200, ignore_eos=True, temperature=0)
    with proxy(llama_server.base_url, starvation_timeout_s=60) as base:
        leaver = _Post(base, long, timeout_s=0.5)  # its client leaves mid-generation
        leaver.start()
        wait_until(lambda: queue_snapshot(base)["in_flight"], timeout_s=60, what="the leaver's dispatch")
        nxt = _Post(base, chat("Say OK.", max_tokens=1))
        nxt.start()  # queued behind the leaver's slot (one slot), before or after its client leaves
        leaver.join(timeout=120)
        nxt.join(timeout=120)
        busy_after = httpx.get(f"{llama_server.base_url}/slots").json()
    assert isinstance(leaver.error, httpx.ReadTimeout)
    assert nxt.result is not None and nxt.result.status_code == 200
    assert not any(slot["is_processing"] for slot in busy_after)
    records = [r for r in caplog.records if getattr(r, "fields", None)]
    assert [r.fields["outcome"] for r in records] == ["client_left_watching", "completed"]  # type: ignore[attr-defined]
    left, nxt_line = (r.fields for r in records)  # type: ignore[attr-defined]
    # The leaver's slot was held past its client's leaving for at least one /slots poll: its
    # service time (dispatch to release) holds the hold's first sleep (without the hold: ~0.5 s),
    # and it ended because /slots showed the backend idle, not at the hold's cap.
    assert SLOTS_POLL_S * 1000 <= float(left["service_ms"]) < HOLD_MAX_S * 1000
    # The next request arrived while that slot was held and was dispatched when it was released,
    # not before: on the proxy's clock, arrival < release <= dispatch (the release is the leaver's
    # log line, written just after its lease ends, so up to a preempted thread's turn late: 0.1 s
    # of slack, against a hold of at least 1.5 s; the dispatch is the next one's end minus its
    # service).
    released = records[0].created
    dispatched = records[1].created - float(nxt_line["service_ms"]) / 1000
    arrived = dispatched - float(nxt_line["queue_wait_ms"]) / 1000
    assert arrived < released <= dispatched + 0.1, (arrived, released, dispatched)
    assert nxt.result.headers["x-clairvoyant-queue-wait-ms"] == nxt_line["queue_wait_ms"]


def test_drain_mode_reads_an_abandoned_answer_to_its_end(llama_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="clairvoyant")
    long = chat("Write a long story.", max_tokens=60, ignore_eos=True, temperature=0)
    with proxy(llama_server.base_url, disconnect_mode="drain") as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}{CHAT}", json=long, timeout=0.3)
        wait_until(lambda: not queue_snapshot(base)["in_flight"], timeout_s=60, what="the drained answer's end")
    lines = [r.fields for r in caplog.records if getattr(r, "fields", None)]  # type: ignore[attr-defined]
    assert len(lines) == 1 and lines[0]["outcome"] == "client_left_streaming" and lines[0]["output_tokens"] == 60


def test_requests_waiting_through_a_llamacpp_restart_are_all_answered(require_embedded_backend: None) -> None:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

    port = _closed_port()
    server = EmbeddedLlamaServer(port=port, n_threads=1)
    server.start()
    try:
        with proxy(server.base_url, backend_wait_s=60, starvation_timeout_s=60) as base:
            server.stop()  # the backend goes away; requests keep arriving
            queued = _post_in_background(base, 3, chat("Say OK.", max_tokens=4))
            wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 2, what="1 waiting for the backend, 2 queued")
            server.start()
            for thread in queued:
                thread.join(timeout=120)
    finally:
        server.stop()
    assert [t.result.status_code for t in queued] == [200, 200, 200]  # type: ignore[union-attr]


def test_back_to_back_streams_to_llamacpp_never_meet_its_closing_connection(llama_server: Any) -> None:
    # llama.cpp's server closes its connection after every stream without a Connection: close, so a
    # request sent at once on the pooled connection would meet that close (a 502: it cannot be told
    # from a backend that read it and died). Streamed requests therefore ask for the close themselves.
    body = chat("Say OK.", max_tokens=2, stream=True)
    with proxy(llama_server.base_url) as base, httpx.Client(timeout=60) as client:
        statuses = []
        for _ in range(12):
            with client.stream("POST", f"{base}{CHAT}", json=body) as r:
                r.read()
                statuses.append(r.status_code)
        errors = metric_value(base, "clairvoyant_upstream_errors_total", 'kind="unavailable"')
    assert statuses == [200] * 12 and errors == 0


def test_shutdown_during_a_held_slot_ends_it_quietly(caplog: pytest.LogCaptureFixture) -> None:
    # auto mode: the client of a non-streamed request left, its slot is held while /slots says the
    # backend is busy; the shutdown's interrupt must end that hold without an error.
    def script(path: str, n: int) -> Any:
        return ("json", [{"id": 0, "is_processing": True}]) if path == "/slots" else "hang"

    caplog.set_level(logging.INFO)
    with FakeBackend(script) as backend:
        with proxy(backend.url, shutdown_grace_s=0.5) as base:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{base}{CHAT}", json=chat(), timeout=0.5)
            wait_until(lambda: backend.posts("/slots") >= 1, timeout_s=10, what="the hold polling /slots")
        assert backend.posts(CHAT) == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    lines = [r.fields for r in caplog.records if getattr(r, "fields", None)]  # type: ignore[attr-defined]
    assert [line["outcome"] for line in lines] == ["shutdown"]


def test_a_request_that_cannot_be_built_is_one_502_and_no_health_check() -> None:
    # "*" appended to the base URL made the port unreadable: that is not an outage to wait out.
    from clairvoyant.errors import UpstreamUnavailable
    from clairvoyant.proxy.upstream import Upstream

    with FakeBackend(lambda path, n: "ok") as backend:

        async def scenario() -> UpstreamUnavailable:
            upstream = Upstream(backend.url)
            try:
                with pytest.raises(UpstreamUnavailable) as failed:
                    await upstream.open("GET", "*")
                return failed.value
            finally:
                await upstream.aclose()

        error = asyncio.run(scenario())
    assert not error.never_sent  # a 502 now, not a wait for the backend to come back
    assert backend.health_checks == 0 and backend.connections == 0


def test_an_answered_request_and_its_body_are_freed_without_the_cyclic_collector() -> None:
    # The body budget bounds memory only if a body leaves with its request: nothing may keep an
    # answered request alive in a reference cycle until the collector's next full pass.
    import gc

    from clairvoyant.proxy.scheduled import ScheduledRequest

    def alive() -> int:
        return sum(isinstance(o, ScheduledRequest) for o in gc.get_objects())

    with FakeBackend(lambda path, n: "ok") as backend, proxy(backend.url) as base:
        gc.collect()
        before = alive()  # an earlier test's proxy in this worker may still hold some
        gc.disable()
        try:
            for _ in range(5):
                assert httpx.post(f"{base}{CHAT}", json=chat("x" * 100_000)).status_code == 200
            # each look walks every object in the process: poll at a pace that leaves the proxy the CPU
            wait_until(lambda: alive() <= before, timeout_s=10, what="the answered requests freed", interval_s=0.1)
        finally:
            gc.enable()
