"""Queue deadlines, tenants' limits, superseded requests and the generation bound, end to end: the
proxy with the shipped predictor in front of a REAL llama.cpp server (one slot). Output lengths
are forced (max_tokens + ignore_eos), so what the backend generated is known exactly from its
own /metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from polling import wait_until
from proxy_harness import metric_value, queue_snapshot, running_proxy

from clairvoyant.config import Settings
from clairvoyant.prediction.predictor import OnnxPredictor
from clairvoyant.proxy.access import hash_key
from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

KEY_A, KEY_B = "cv-test-key-a", "cv-test-key-b"


@pytest.fixture(scope="module")
def predictor() -> OnnxPredictor:
    return OnnxPredictor()


def tokens_generated(server: EmbeddedLlamaServer) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total "):
            return float(line.split()[1])
    raise AssertionError("llamacpp:tokens_predicted_total not in llama.cpp's /metrics")


def body(text: str, tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
        "ignore_eos": True, **extra,
    }  # fmt: skip


class Post(threading.Thread):
    """One request in the background: its answer (or exception) and when it came."""

    def __init__(self, url: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.payload, self.headers = url, payload, headers or {}
        self.response: httpx.Response | None = None
        self.sent_s = self.answered_s = 0.0
        self.start()

    def run(self) -> None:
        self.sent_s = time.monotonic()
        self.response = httpx.post(self.url, json=self.payload, headers=self.headers, timeout=120)
        self.answered_s = time.monotonic()


def holding(base: str, tokens: int = 200, headers: dict[str, str] | None = None) -> Post:
    """A request that holds the one slot while it generates ``tokens``; returns once it holds it."""
    holder = Post(f"{base}/v1/chat/completions", body("Tell me a long story.", tokens), headers)
    wait_until(lambda: queue_snapshot(base, headers)["in_flight"], timeout_s=30, what="the holder at the backend")
    return holder


@pytest.fixture
def proxy(llama_server: EmbeddedLlamaServer, predictor: OnnxPredictor) -> Iterator[Any]:
    """A proxy in front of the shared llama.cpp, with ``overrides``; yields its URL."""

    def start(**overrides: Any) -> Any:
        settings = Settings(upstream_url=llama_server.base_url, encoder=False, **overrides)
        return running_proxy(settings, predictor=predictor)

    yield start


def test_a_request_that_cannot_start_within_its_deadline_gets_503_and_is_never_sent(
    proxy: Any, llama_server: EmbeddedLlamaServer
) -> None:
    with proxy() as base:
        before = tokens_generated(llama_server)
        holder = holding(base, tokens=200)
        started = time.monotonic()
        late = httpx.post(
            f"{base}/v1/chat/completions", json=body("What is 2+2?", 5), headers={"X-Clairvoyant-Deadline": "2"},
            timeout=30,
        )  # fmt: skip
        took_s = time.monotonic() - started
        ollama = httpx.post(
            f"{base}/api/chat", json=body("What is 3+3?", 5), headers={"X-Clairvoyant-Deadline": "0.5"}, timeout=30
        )
        holder.join(120)
    assert late.status_code == 503 and late.json()["error"]["code"] == "queue_deadline"
    assert int(late.headers["retry-after"]) >= 1 and took_s < 2.5
    assert ollama.status_code == 503 and "queue deadline of 0.5 s" in ollama.json()["error"]  # Ollama's shape
    assert holder.response is not None and holder.response.status_code == 200
    assert tokens_generated(llama_server) - before == 200  # the holder's: neither late request was sent


def test_a_keys_concurrency_limit_refuses_its_third_request_and_not_another_keys(
    proxy: Any, llama_server: EmbeddedLlamaServer
) -> None:
    keys = [
        {"hash": hash_key(KEY_A), "tenant": "a", "max_concurrent": 2},
        {"hash": hash_key(KEY_B), "tenant": "b", "max_concurrent": 2},
    ]
    with proxy(api_keys=keys, policy="fcfs") as base:
        a = {"Authorization": f"Bearer {KEY_A}"}
        holder = holding(base, tokens=150, headers=a)
        waiting = Post(f"{base}/v1/chat/completions", body("What is 2+2?", 3), a)
        wait_until(lambda: queue_snapshot(base, a)["waiting_count"] == 1, what="a's second request waiting")
        third = httpx.post(f"{base}/v1/chat/completions", json=body("What is 3+3?", 3), headers=a, timeout=30)
        other = Post(f"{base}/v1/chat/completions", body("What is 4+4?", 3), {"X-Api-Key": KEY_B})
        tenants = queue_snapshot(base, a)["tenants"]
        for thread in (holder, waiting, other):
            thread.join(120)
        metrics = httpx.get(f"{base}/metrics", headers=a).text
    assert third.status_code == 429 and third.json()["error"]["code"] == "concurrency_limited"
    assert int(third.headers["retry-after"]) >= 1
    assert [t.response.status_code for t in (holder, waiting, other) if t.response is not None] == [200, 200, 200]
    assert tenants["a"]["in_system"] == 2 and tenants["a"]["limits"] == {"max_concurrent": 2}
    assert 'clairvoyant_tenant_refusals_total{limit="max_concurrent",tenant="a"} 1.0' in metrics


def test_tokens_per_day_counts_what_the_backend_reported(proxy: Any, tmp_path: Any) -> None:
    keys = [{"hash": hash_key(KEY_A), "tenant": "a", "tokens_per_day": 10}]
    a = {"Authorization": f"Bearer {KEY_A}"}
    with proxy(api_keys=keys, learner_state_path=tmp_path / "learner.npz") as base:
        first = httpx.post(f"{base}/v1/chat/completions", json=body("Count to twenty.", 12), headers=a, timeout=60)
        second = httpx.post(f"{base}/v1/chat/completions", json=body("Count to ten.", 3), headers=a, timeout=60)
        tenants = queue_snapshot(base, a)["tenants"]
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 12
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limited"
    assert 0 < int(second.headers["retry-after"]) <= 86_400  # until UTC midnight
    assert tenants["a"]["tokens_today"] == 12
    saved = (tmp_path / "learner.limits.json").read_text()  # written at shutdown, beside the learner's state
    assert '"a": 12' in saved


def superseded(base: str) -> float:
    return metric_value(base, "clairvoyant_request_status_changes_total", 'status="superseded"')


def test_a_superseded_request_is_answered_409_and_only_the_last_reaches_the_backend(
    proxy: Any, llama_server: EmbeddedLlamaServer
) -> None:
    with proxy() as base:
        before = tokens_generated(llama_server)
        holder = holding(base, tokens=120)
        edits = []
        for i in range(5):
            edits.append(Post(f"{base}/v1/completions", {
                "model": "smollm2", "prompt": f"def f{i}(x):", "max_tokens": 7, "ignore_eos": True,
            }, {"X-Clairvoyant-Supersede": "editor:file.py"}))  # fmt: skip
            # The next keystroke once this one has reached the proxy (it replaced the one before).
            wait_until(lambda i=i: superseded(base) == i, timeout_s=30, what=f"edit {i} at the proxy")
        for thread in (holder, *edits):
            thread.join(120)
    statuses = [e.response.status_code for e in edits if e.response is not None]
    assert statuses == [409, 409, 409, 409, 200]
    for older in edits[:-1]:
        assert older.response is not None and older.response.json()["error"]["code"] == "superseded"
        # Answered when replaced, while the holder still runs: not left waiting for a free slot.
        assert older.answered_s < holder.answered_s
    assert tokens_generated(llama_server) - before == 120 + 7  # the holder and the last edit only


def test_with_supersede_running_a_running_request_is_ended_too(proxy: Any) -> None:
    with proxy(supersede_running=True) as base:
        events: list[str] = []

        def stream() -> None:
            with httpx.stream(
                "POST", f"{base}/v1/chat/completions", json=body("Tell me a story.", 300, stream=True),
                headers={"X-Clairvoyant-Supersede": "k"}, timeout=60,
            ) as r:  # fmt: skip
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        first = threading.Thread(target=stream, daemon=True)
        first.start()
        wait_until(lambda: queue_snapshot(base)["in_flight"], timeout_s=30, what="the first one running")
        second = httpx.post(
            f"{base}/v1/chat/completions", json=body("Hi", 3), headers={"X-Clairvoyant-Supersede": "k"}, timeout=60
        )
        first.join(60)
    assert second.status_code == 200
    assert '"code": "superseded"' in events[-1] and len(events) < 300


def test_an_answer_longer_than_max_generation_s_ends_with_the_dialects_error(proxy: Any) -> None:
    with proxy(max_generation_s=1.0) as base:
        started = time.monotonic()
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=body("Tell me a story.", 400, stream=True), timeout=60
        ) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        took_s = time.monotonic() - started
    assert '"code": "generation_time_limit"' in events[-1] and took_s < 5
