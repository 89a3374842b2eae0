"""benchmarks/bench_hardening.py: the pure helpers that decide a verdict (no timing asserts; the
benchmark itself is run by hand, see docs/benchmarks.md "Hardening")."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hardening.py"
_spec = importlib.util.spec_from_file_location("bench_hardening", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_hardening"] = bench  # dataclasses resolve their module by name
_spec.loader.exec_module(bench)


def test_status_of_reads_the_status_line_only() -> None:
    assert bench.status_of(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 2\r\n\r\n{}") == 408
    assert bench.status_of(b"HTTP/1.0 503 Service Unavailable\r\n") == 503
    assert bench.status_of(b"") is None
    assert bench.status_of(b'{"status":"ok"}') is None  # the rest of an earlier answer is no status


def test_percentile_interpolates() -> None:
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert bench.percentile([5.0], 0.9) == 5.0
    assert bench.percentile([], 0.5) != bench.percentile([], 0.5)  # NaN


def test_latency_rule_allows_factor_or_slack() -> None:
    assert bench.latency_kept(0.010, 0.019)  # under 2x
    assert not bench.latency_kept(0.010, 0.021)
    assert bench.latency_kept(0.001, 0.0055)  # under +5 ms although above 2x
    assert not bench.latency_kept(0.001, 0.0065)


def test_sse_outcome() -> None:
    done = 'data: {"choices": []}\n\ndata: [DONE]\n\n'
    error = 'data: {"choices": []}\n\ndata: {"error": {"message": "shutting down"}}\n\n'
    assert bench.sse_outcome(done) == "done"
    assert bench.sse_outcome(error) == "error"
    assert bench.sse_outcome('data: {"choices": []}\n\n') == "cut"
    assert bench.sse_outcome("") == "cut"


def test_duplicates_counts_extra_and_stray_deliveries() -> None:
    expected = {"a", "b", "c"}
    assert bench.duplicates(Counter({"a": 1, "b": 1, "c": 1}), expected) == (0, 0)
    assert bench.duplicates(Counter({"a": 2, "b": 1, "x": 1}), expected) == (1, 1)


LLAMA_LOG = """\
0.13.728.659 I slot launch_slot_: id  0 | task 351 | processing task, is_child = 0
0.14.728.739 W srv          stop: cancel task, id_task = 351
0.14.752.068 I slot      release: id  0 | task 351 | stop processing: n_tokens = 76, truncated = 0
0.14.752.394 I slot launch_slot_: id  0 | task 373 | processing task, is_child = 0
0.15.035.963 I slot      release: id  0 | task 373 | stop processing: n_tokens = 36, truncated = 0
1.02.000.500 I slot launch_slot_: id  0 | task 400 | processing task, is_child = 0
"""


def test_llama_tasks_from_the_server_log() -> None:
    tasks = bench.llama_tasks(LLAMA_LOG.splitlines())
    assert [t.task for t in tasks] == [351, 373, 400]
    first, second, third = tasks
    assert first.cancelled and not second.cancelled
    assert first.context_tokens == 76 and second.context_tokens == 36
    assert first.release_s is not None and first.release_s - first.launch_s == pytest.approx(1.023409)
    assert third.launch_s == pytest.approx(62.0005) and third.release_s is None


def test_fake_backend_counts_deliveries_and_streams() -> None:
    """The fake backend the verdicts rely on: one delivery per request, complete SSE streams."""
    backend = bench.FakeBackend().start()
    try:
        url = f"{backend.base_url}/v1/chat/completions"
        with httpx.Client(timeout=10) as client:
            plain = client.post(url, json=bench.chat_body("t-plain"))
            streamed = client.post(url, json=bench.chat_body("t-stream", stream=True, max_tokens=3))
            with pytest.raises(httpx.RemoteProtocolError):
                client.post(url, json=bench.chat_body("t-close", model="close-after-read"))
        assert plain.json()["choices"][0]["message"]["content"] == "ok t-plain"
        assert bench.sse_outcome(streamed.text) == "done"
        assert streamed.text.count("chat.completion.chunk") == 3
        assert backend.tags("t-") == Counter({"t-plain": 1, "t-stream": 1, "t-close": 1})
        assert [d.nth_on_connection for d in backend.deliveries] == [1, 2, 3]  # one kept-alive connection
    finally:
        backend.stop()


def test_raw_exchange_sees_eof_and_data() -> None:
    backend = bench.FakeBackend().start()
    try:
        request = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        result = asyncio.run(bench.raw_exchange(backend.port, request, wait_s=5))
    finally:
        backend.stop()
    assert bench.status_of(result.data) == 200
    assert json.loads(result.data.split(b"\r\n\r\n", 1)[1]) == {"status": "ok"}
    assert result.closed_s is not None and not result.reset
