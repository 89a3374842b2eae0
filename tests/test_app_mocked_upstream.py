"""The proxy against respx-mocked upstreams: both dialects, streaming and not, errors, faults,
ordering, disconnects. (The real llama.cpp server is exercised in test_e2e_llamacpp.py; Ollama's
native API cannot run here, so its shapes are mocked.)"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import respx
from polling import until, wait_until
from proxy_harness import (
    BackgroundPosts,
    HeldBackend,
    MarkerPredictor,
    broken_sse,
    gate_wait,
    metric_value,
    mock_transport,
    queue_snapshot,
    running_proxy,
)

from clairvoyant.config import Settings

UPSTREAM = "http://upstream.test"


def make_settings(**overrides: Any) -> Settings:
    return Settings(upstream_url=UPSTREAM, **overrides)


def proxy(router: respx.MockRouter, **settings: Any) -> Any:
    return running_proxy(
        make_settings(**settings), predictor=MarkerPredictor(), upstream_transport=mock_transport(router)
    )


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


# --- OpenAI dialect -------------------------------------------------------------------------------


def test_openai_chat_non_streaming_round_trip_keeps_body_headers_and_status() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    route = router.post("/v1/chat/completions").respond(
        201, json={"id": "x", "choices": [{"message": {"content": "hi"}}]}, headers={"x-upstream": "yes"}
    )
    raw = json.dumps(chat_body("[short] hello", temperature=0)).encode()
    with proxy(router) as base:
        r = httpx.post(
            f"{base}/v1/chat/completions?trace=1",
            content=raw,
            headers={
                "Authorization": "Bearer sk-test",
                "Content-Type": "application/json",
                "Connection": "keep-alive, x-hop",
                "x-hop": "drop-me",
                "X-Request-Id": "abc-123",
            },
        )
    assert r.status_code == 201
    assert r.json()["choices"][0]["message"]["content"] == "hi"
    assert r.headers["x-upstream"] == "yes"
    assert r.headers["x-request-id"] == "abc-123"
    assert float(r.headers["x-clairvoyant-p-long"]) == pytest.approx(0.02)
    assert float(r.headers["x-clairvoyant-queue-wait-ms"]) >= 0
    sent = route.calls.last.request
    assert sent.content == raw  # forwarded byte for byte
    assert sent.url.query == b"trace=1"
    assert sent.headers["authorization"] == "Bearer sk-test"
    assert sent.headers["x-request-id"] == "abc-123"
    assert "x-hop" not in sent.headers  # named in Connection: hop-by-hop


def test_openai_streaming_passes_chunks_through_as_they_arrive() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    release = threading.Event()

    async def sse() -> AsyncIterator[bytes]:
        yield b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        await gate_wait(release)  # the second chunk waits until the client has seen the first
        yield b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
        yield b"data: [DONE]\n\n"

    router.post("/v1/chat/completions").mock(
        return_value=httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse())
    )
    with (
        proxy(router) as base,
        httpx.stream("POST", f"{base}/v1/chat/completions", json=chat_body("hi", stream=True)) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert '"a"' in first  # arrived while the backend still held the rest
        release.set()
        rest = [line for line in lines if line]
    assert rest == ['data: {"choices":[{"delta":{"content":"b"}}]}', "data: [DONE]"]


def test_proxy_only_field_is_stripped_and_other_fields_kept() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    route = router.post("/v1/completions").respond(200, json={"choices": [{"text": "x"}]})
    with proxy(router) as base:
        r = httpx.post(
            f"{base}/v1/completions", json={"prompt": "p", "n_predict": 5, "clairvoyant": {"output_tokens": 5}}
        )
    assert r.status_code == 200
    assert json.loads(route.calls.last.request.content) == {"prompt": "p", "n_predict": 5}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": []}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": ["hi"]}).encode(), "messages.0"),
        (
            json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(),
            "stream",
        ),
    ],
)
def test_openai_bad_requests_get_400_in_openai_shape_and_are_never_sent(body: bytes, param: str | None) -> None:
    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    route = router.post("/v1/chat/completions").respond(200, json={})
    with proxy(router) as base:
        r = httpx.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        rejected = metric_value(base, "clairvoyant_rejections_total", 'reason="bad_request"')
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert not route.called
    assert rejected == 1


def test_body_over_the_limit_is_413() -> None:
    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    router.post("/v1/chat/completions").respond(200, json={})
    with proxy(router, max_body_bytes=2048) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=chat_body("x" * 5000))
        small = httpx.post(f"{base}/v1/chat/completions", json=chat_body("x"))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert small.status_code == 200


def test_upstream_error_status_and_body_pass_through() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").respond(
        404, json={"error": {"message": "model 'nope' not found", "type": "not_found"}}
    )
    with proxy(router) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=chat_body("hi"))
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "model 'nope' not found"


def test_upstream_down_is_502_and_timeout_504_in_each_dialect() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=httpx.ConnectError("refused"))
    router.post("/api/generate").mock(side_effect=httpx.ConnectTimeout("slow"))
    with proxy(router, backend_wait_s=0) as base:  # no waiting for the backend to come back
        down = httpx.post(f"{base}/v1/chat/completions", json=chat_body("hi"))
        slow = httpx.post(f"{base}/api/generate", json={"model": "m", "prompt": "hi"})
        after = httpx.get(f"{base}/healthz")
        errors = metric_value(base, "clairvoyant_upstream_errors_total", 'kind="unavailable"')
    assert down.status_code == 502 and down.json()["error"]["code"] == "upstream_unavailable"
    assert slow.status_code == 504 and isinstance(slow.json()["error"], str)  # Ollama's shape
    assert after.status_code == 200  # the proxy lives on
    assert errors == 1


def test_upstream_dying_mid_stream_ends_the_sse_with_an_error_event() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)

    router.post("/v1/chat/completions").mock(
        return_value=httpx.Response(200, headers={"content-type": "text/event-stream"}, content=broken_sse())
    )
    with proxy(router) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=chat_body("hi", stream=True))
        # The slot was released: the next request is served.
        router.post("/v1/chat/completions").respond(200, json={"ok": True})
        again = httpx.post(f"{base}/v1/chat/completions", json=chat_body("hi"))
    events = [line for line in r.text.splitlines() if line]
    assert r.status_code == 200  # already sent before the failure
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "upstream_unavailable"
    assert again.json() == {"ok": True}


# --- Ollama dialect -------------------------------------------------------------------------------


def test_ollama_chat_streams_ndjson_by_default() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    lines = [
        {"model": "m", "message": {"role": "assistant", "content": "he"}, "done": False},
        {"model": "m", "message": {"role": "assistant", "content": "llo"}, "done": False},
        {"model": "m", "done": True, "eval_count": 2},
    ]

    async def ndjson() -> AsyncIterator[bytes]:
        for line in lines:
            yield json.dumps(line).encode() + b"\n"

    route = router.post("/api/chat").mock(
        return_value=httpx.Response(200, headers={"content-type": "application/x-ndjson"}, content=ndjson())
    )
    with proxy(router) as base:
        r = httpx.post(f"{base}/api/chat", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-ndjson"
    assert [json.loads(x) for x in r.text.splitlines()] == lines
    assert "stream" not in json.loads(route.calls.last.request.content)  # body untouched


def test_ollama_generate_non_streaming_and_missing_model() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/api/generate").respond(200, json={"model": "m", "response": "ok", "done": True})
    with proxy(router) as base:
        ok = httpx.post(f"{base}/api/generate", json={"model": "m", "prompt": "hi", "stream": False})
        bad = httpx.post(f"{base}/api/generate", json={"prompt": "hi"})
    assert ok.json()["response"] == "ok"
    assert bad.status_code == 400
    assert bad.json() == {"error": "'model' is a required property"}


def test_passthrough_paths_are_forwarded_unqueued_with_query_headers_and_streams() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    models = router.get("/v1/models").respond(200, json={"data": [{"id": "m"}]})
    router.head("/").respond(200, headers={"x-head": "1"})
    router.get("/api/tags").respond(200, json={"models": []})

    async def progress() -> AsyncIterator[bytes]:
        for status in ("pulling manifest", "downloading", "success"):
            yield json.dumps({"status": status}).encode() + b"\n"

    pull = router.post("/api/pull").mock(
        return_value=httpx.Response(200, headers={"content-type": "application/x-ndjson"}, content=progress())
    )
    router.post("/v1/embeddings").respond(200, json={"data": [{"embedding": [0.1]}]})
    with proxy(router) as base:
        m = httpx.get(f"{base}/v1/models?x=1", headers={"Authorization": "Bearer k"})
        h = httpx.head(f"{base}/")
        tags = httpx.get(f"{base}/api/tags")
        p = httpx.post(f"{base}/api/pull", json={"model": "m"})
        e = httpx.post(f"{base}/v1/embeddings", json={"model": "m", "input": "x"})
        snapshot = queue_snapshot(base)
    assert m.json()["data"][0]["id"] == "m"
    assert models.calls.last.request.url.query == b"x=1"
    assert models.calls.last.request.headers["authorization"] == "Bearer k"
    assert h.status_code == 200 and h.headers["x-head"] == "1"
    assert tags.json() == {"models": []}
    assert [json.loads(x)["status"] for x in p.text.splitlines()] == ["pulling manifest", "downloading", "success"]
    assert json.loads(pull.calls.last.request.content) == {"model": "m"}
    assert e.json()["data"][0]["embedding"] == [0.1]
    assert "x-clairvoyant-p-long" not in m.headers  # not scheduled
    assert snapshot["waiting"] == [] and snapshot["in_flight"] == []


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"), ("GET", "/api/chat"), ("DELETE", "/api/generate")],
)
def test_a_scheduled_path_answers_another_method_405_with_allow_in_its_dialect(method: str, path: str) -> None:
    """A completion path takes POST only, on every backend: any other method gets 405 with Allow
    (what clients and nginx expect), not the backend's 404; an OPTIONS preflight still passes."""
    router = respx.MockRouter(base_url=UPSTREAM)
    anything = router.route(path=path).respond(404, json={"error": "the backend's own"})
    with proxy(router) as base:
        r = httpx.request(method, f"{base}{path}")
        preflight = httpx.options(
            f"{base}{path}", headers={"Origin": "http://x", "Access-Control-Request-Method": "POST"}
        )
    assert r.status_code == 405 and r.headers["allow"] == "OPTIONS, POST"
    error = r.json()["error"]
    if path.startswith("/api/"):  # Ollama's shape: the message alone
        assert isinstance(error, str) and "POST" in error
    else:
        assert error["code"] == "method_not_allowed" and "POST" in error["message"]
    assert preflight.status_code == 404  # passed through: the mocked backend's answer
    assert [c.request.method for c in anything.calls] == ["OPTIONS"]


# --- scheduling -----------------------------------------------------------------------------------


def test_queued_requests_run_shortest_predicted_first_one_at_a_time() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    with proxy(router, starvation_timeout_s=600) as base:
        holder = BackgroundPosts(base, "[long] holder")
        wait_until(lambda: backend.order == ["[long] holder"], what="holder at the backend")
        texts = ["[p=0.9] L1", "[p=0.02] S1", "[p=0.5] M1", "[p=0.8] L2", "[p=0.01] S2"]
        batch = BackgroundPosts(base, *texts)
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 5, what="5 queued")
        snapshot = queue_snapshot(base)
        assert len(snapshot["in_flight"]) == 1  # slots=1: one at a time
        backend.gate.set()
        holder.join(10)
        batch.join(10)
    assert backend.order == ["[long] holder", "[p=0.01] S2", "[p=0.02] S1", "[p=0.5] M1", "[p=0.8] L2", "[p=0.9] L1"]
    assert [r.status_code for r in batch.responses] == [200] * 5
    assert [w["p_long"] for w in snapshot["waiting"]] == [0.01, 0.02, 0.5, 0.8, 0.9]
    assert all("[" not in json.dumps(w) for w in snapshot["waiting"])  # no prompt text in /queue


def test_fcfs_policy_keeps_arrival_order() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    with proxy(router, policy="fcfs") as base:
        holder = BackgroundPosts(base, "[long] holder")
        wait_until(lambda: backend.order == ["[long] holder"], what="holder at the backend")
        threads = []
        for text in ["[long] L1", "[short] S1", "[long] L2"]:  # arrive one after another
            threads.append(BackgroundPosts(base, text))
            queued = len(threads)
            wait_until(lambda n=queued: len(queue_snapshot(base)["waiting"]) == n, what="queued")
        backend.gate.set()
        for t in [holder, *threads]:
            t.join(10)
    assert backend.order == ["[long] holder", "[long] L1", "[short] S1", "[long] L2"]


def test_queue_full_answers_503_with_retry_after_in_the_dialect() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    with proxy(router, max_queue=1, retry_after_s=3) as base:
        threads = [BackgroundPosts(base, "[long] a")]
        wait_until(lambda: len(backend.order) == 1, what="first at the backend")
        threads.append(BackgroundPosts(base, "[long] b"))
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 1, what="second queued")
        tail_eta_s = queue_snapshot(base)["tail_eta_s"]  # the in-flight [long] job's predicted remainder
        full = httpx.post(f"{base}/v1/chat/completions", json=chat_body("[short] c"))
        full_ollama = httpx.post(
            f"{base}/api/chat", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
        )
        rejected = metric_value(base, "clairvoyant_rejections_total", 'reason="queue_full"')
        backend.gate.set()
        for t in threads:
            t.join(10)
    # Retry-After is the queue tail's ETA (not a constant), never below the configured floor.
    assert tail_eta_s > 3
    assert full.status_code == 503 and int(full.headers["retry-after"]) in (
        math.ceil(tail_eta_s),
        math.ceil(tail_eta_s) - 1,
    )
    assert full.json()["error"]["code"] == "queue_full"
    assert full_ollama.status_code == 503 and "queue is full" in full_ollama.json()["error"]
    assert rejected == 2
    assert backend.order == ["[long] a", "[long] b"]


def test_client_leaving_while_queued_is_never_sent() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    with proxy(router) as base:
        holder = BackgroundPosts(base, "[long] holder")
        wait_until(lambda: backend.order == ["[long] holder"], what="holder at the backend")

        async def leave_while_queued() -> None:
            async with httpx.AsyncClient() as client:
                task = asyncio.create_task(client.post(f"{base}/v1/chat/completions", json=chat_body("[short] gone")))
                await until(lambda: len(queue_snapshot(base)["waiting"]) == 1, what="the leaver queued")
                task.cancel()  # closes the connection
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(leave_while_queued())
        wait_until(lambda: queue_snapshot(base)["waiting"] == [], what="withdrawn")
        left = metric_value(base, "clairvoyant_client_disconnects_total", 'stage="queued"')
        backend.gate.set()
        holder.join(10)
        after = httpx.post(f"{base}/v1/chat/completions", json=chat_body("[short] next"))
    assert left == 1
    assert after.status_code == 200
    assert backend.order == ["[long] holder", "[short] next"]  # "gone" never reached the backend


@pytest.mark.parametrize("mode", ["abort", "drain"])
def test_client_leaving_mid_stream_frees_the_slot(mode: str) -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    events: list[str] = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            for i in range(40):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.01)  # a backend's pace: the stream outlasts the client's stay
            events.append("stream-ended")
        finally:
            events.append("stream-closed")

    def respond(request: httpx.Request) -> httpx.Response:
        text = json.loads(request.content)["messages"][-1]["content"]
        events.append(f"start {text}")
        if text == "first":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=endless())
        return httpx.Response(200, json={"ok": True})

    router.post("/v1/chat/completions").mock(side_effect=respond)
    with proxy(router, disconnect_mode=mode) as base:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=chat_body("first", stream=True)) as r:
            next(r.iter_lines())  # one chunk, then leave
        nxt = httpx.post(f"{base}/v1/chat/completions", json=chat_body("second"), timeout=10)
        left = metric_value(base, "clairvoyant_client_disconnects_total", 'stage="streaming"')
    assert nxt.json() == {"ok": True}
    assert left == 1
    start_second = events.index("start second")
    if mode == "abort":  # the backend stream was cut short, before the next request started
        assert "stream-ended" not in events
        assert events.index("stream-closed") < start_second
    else:  # drained to its natural end first: the slot was held until the backend was free
        assert events.index("stream-ended") < start_second


def test_starvation_timeout_promotes_a_waiting_long_request() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    with proxy(router, starvation_timeout_s=0.2, starvation_slowdown=0) as base:  # the paper's rule
        holder = BackgroundPosts(base, "[long] holder")
        wait_until(lambda: len(backend.order) == 1, what="holder at the backend")
        threads = [BackgroundPosts(base, "[long] old")]
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 1, what="long queued")
        time.sleep(0.3)  # let the long one wait longer than tau (time is the point of this test)
        threads.append(BackgroundPosts(base, "[short] new"))
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 2, what="short queued")
        backend.gate.set()
        for t in [holder, *threads]:
            t.join(10)
        promotions = metric_value(base, "clairvoyant_starvation_promotions_total")
    assert backend.order == ["[long] holder", "[long] old", "[short] new"]
    assert promotions == 1


def test_health_and_readiness() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    # The start-up check, then: Ollama (no /health: 404 means alive), down, llama.cpp loading its model.
    health = router.get("/health").mock(side_effect=[
        httpx.Response(404), httpx.Response(404, text="404 page not found"), httpx.ConnectError("down"),
        httpx.Response(503, json={"error": {"message": "Loading model"}}),
    ])  # fmt: skip
    with proxy(router) as base:
        assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
        wait_until(lambda: health.call_count == 1, what="the start-up check")
        ready = httpx.get(f"{base}/readyz")
        down = httpx.get(f"{base}/readyz")
        loading = httpx.get(f"{base}/readyz")
    assert ready.status_code == 200 and ready.json()["upstream"] is True
    assert down.status_code == 503 and down.json()["upstream"] is False
    assert loading.status_code == 503 and loading.json()["upstream"] is False
    assert "upstream.test" not in down.text  # no internal address
    assert health.call_count == 4


def test_client_leaving_a_passthrough_stream_closes_the_backend_stream() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    closed = threading.Event()

    async def progress() -> AsyncIterator[bytes]:
        try:
            for i in range(1000):
                yield json.dumps({"status": "downloading", "completed": i}).encode() + b"\n"
                await asyncio.sleep(0.01)  # a download's pace: it outlasts the client's stay
        finally:
            closed.set()

    router.post("/api/pull").mock(
        return_value=httpx.Response(200, headers={"content-type": "application/x-ndjson"}, content=progress())
    )
    with proxy(router) as base:
        with httpx.stream("POST", f"{base}/api/pull", json={"model": "m"}) as r:
            first = json.loads(next(r.iter_lines()))
        wait_until(closed.is_set, what="backend stream closed")
        left = metric_value(base, "clairvoyant_client_disconnects_total", 'stage="streaming"')
    assert first["status"] == "downloading"
    assert left == 1


# --- priorities and tenants --------------------------------------------------------------------


class RecordingHeldBackend(HeldBackend):
    """Records each forwarded body and header set too."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        self.headers.append(request.headers)
        return await super().__call__(request)


def test_priority_orders_is_clamped_stripped_and_tenant_header_stays_here() -> None:
    backend = RecordingHeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    with proxy(router, policy="fcfs", min_priority=-2, max_priority=3) as base:
        holder = BackgroundPosts(base, "[long] holder")
        wait_until(lambda: len(backend.order) == 1, what="holder dispatched")
        posts = []

        def post(text: str, **kw: Any) -> None:
            def go() -> None:
                httpx.post(f"{base}/v1/chat/completions", timeout=30, **kw)

            t = threading.Thread(target=go, daemon=True)
            t.start()
            posts.append(t)
            n = len(posts)
            wait_until(lambda: len(queue_snapshot(base)["waiting"]) == n, what=f"{text} queued")

        post("low", json=chat_body("low", priority=99))  # clamped to 3
        post("normal", json=chat_body("normal"), headers={"x-clairvoyant-tenant": "team-a"})
        post("header", json=chat_body("header"), headers={"x-clairvoyant-priority": "-1"})
        post("urgent", json=chat_body("urgent", priority=-50))  # clamped to -2
        snapshot = queue_snapshot(base)
        first = snapshot["waiting"][0]["request_id"]
        one = httpx.get(f"{base}/queue/{first}").json()
        unknown = httpx.get(f"{base}/queue/no-such-request")
        bad = httpx.post(f"{base}/v1/chat/completions", json=chat_body("x", priority="high"))
        backend.gate.set()
        for t in [holder, *posts]:
            t.join(10)
    assert [w["priority"] for w in snapshot["waiting"]] == [-2, -1, 0, 3]
    assert [w["tenant"] for w in snapshot["waiting"]] == ["", "", "team-a", ""]
    assert backend.order == ["[long] holder", "urgent", "header", "normal", "low"]
    assert all("priority" not in body for body in backend.bodies)  # stripped before forwarding
    assert all("x-clairvoyant-tenant" not in h and "x-clairvoyant-priority" not in h for h in backend.headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert one["waiting"] and one["position"] == 0 and one["eta_s"] > 0
    assert unknown.status_code == 404 and unknown.json() == {"request_id": "no-such-request", "waiting": False}


def test_priority_is_forwarded_when_configured() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    route = router.post("/v1/chat/completions").respond(200, json={"ok": True})
    with proxy(router, forward_priority=True) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=chat_body("[short] x", priority=2))
    assert r.status_code == 200
    assert json.loads(route.calls.last.request.content)["priority"] == 2
    assert r.headers["x-clairvoyant-queue-position"] == "0"


def test_waiting_requests_forward_their_own_trace_headers_and_the_common_ones() -> None:
    # Each waiting request forwards its own headers: the ones new with every request (traceparent...)
    # and the ones the client sends with all of them.
    backend = RecordingHeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    common = {"user-agent": "OpenAI/Python 1.54.4", "x-stainless-lang": "python"}
    with proxy(router, policy="fcfs") as base:
        holder = BackgroundPosts(base, "[long] holder")
        wait_until(lambda: len(backend.order) == 1, what="holder dispatched")
        threads = []
        for i in range(3):
            trace = {"traceparent": f"00-{i:032x}-{i + 100:016x}-01", "tracestate": f"t={i}"}
            t = threading.Thread(
                target=httpx.post, args=(f"{base}/v1/chat/completions",),
                kwargs={"json": chat_body(f"waiter {i}"), "headers": {**common, **trace}, "timeout": 30}, daemon=True,
            )  # fmt: skip
            t.start()
            threads.append(t)
            wait_until(lambda n=i + 1: len(queue_snapshot(base)["waiting"]) == n, what=f"waiter {i} queued")
        backend.gate.set()
        for t in [holder, *threads]:
            t.join(10)
    assert backend.order == ["[long] holder", "waiter 0", "waiter 1", "waiter 2"]
    for i, headers in enumerate(backend.headers[1:]):
        assert headers["traceparent"] == f"00-{i:032x}-{i + 100:016x}-01"
        assert headers["tracestate"] == f"t={i}"
        assert headers["user-agent"] == "OpenAI/Python 1.54.4" and headers["x-stainless-lang"] == "python"
        assert len(headers.get_list("traceparent")) == 1


def test_a_passthrough_request_counts_the_statuses_it_enters() -> None:
    router = respx.MockRouter(base_url=UPSTREAM)
    router.get("/api/tags").respond(200, json={"models": []})
    with proxy(router) as base:
        assert httpx.get(f"{base}/api/tags").status_code == 200
        counted = {
            status: metric_value(base, "clairvoyant_request_status_changes_total", f'status="{status}"')
            for status in ("waiting", "dispatched", "streaming", "completed")
        }
    assert counted == {"waiting": 0, "dispatched": 1, "streaming": 1, "completed": 1}  # never queued
