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


def test_header_value_and_answer_complete_read_a_raw_answer() -> None:
    refused = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\ncontent-length: 2\r\n\r\n{}"
    assert bench.header_value(refused, "retry-after") == "1"
    assert bench.header_value(refused, "x-none") is None
    assert bench.answer_complete(refused)
    assert not bench.answer_complete(refused[:-1])
    assert not bench.answer_complete(b"HTTP/1.1 200 OK\r\ncontent-length: 2")  # the head is not over
    assert not bench.answer_complete(b"HTTP/1.1 200 OK\r\n\r\nabc")  # no Content-Length: never known whole


def test_error_code_reads_the_openai_error_object() -> None:
    timeout = b'HTTP/1.1 408 Request Timeout\r\n\r\n{"error": {"message": "m", "type": "t", "code": "request_timeout"}}'
    assert bench.error_code(timeout) == "request_timeout"
    assert bench.error_code(b"HTTP/1.1 408 Request Timeout\r\n\r\nRequest Timeout") is None  # not the dialect's
    assert bench.error_code(b'HTTP/1.1 400 Bad\r\n\r\n{"error": "ollama style"}') is None
    assert bench.error_code(b"") is None


def test_closed_in_window_is_neither_early_nor_late() -> None:
    def closed_after(seconds: float | None) -> bool:
        result = bench.RawResult(10.0, None if seconds is None else 10.0 + seconds, b"", False)
        return bool(bench.closed_in_window(result, 5.0))

    assert closed_after(5.0) and closed_after(4.1) and closed_after(5.9)
    assert not closed_after(3.5)  # cut before its deadline
    assert not closed_after(6.5)
    assert not closed_after(None)  # still open


def test_rows_state_the_settings_but_never_the_backend_url(tmp_path: Path) -> None:
    proxy = bench.ProxyProcess("t", "http://user:secret@127.0.0.1:1", tmp_path, slots=8, client_timeout_s=5)
    stated = proxy.stated()
    assert "slots=8" in stated and "client_timeout_s=5" in stated and "(others default)" in stated
    assert "secret" not in stated and "port=" not in stated
    row = bench.Row("1a", "target", "measured", True, {}, stated)
    assert row.as_json()["settings"] == stated and row.as_json()["verdict"] == "PASS"


def test_kept_client_reads_its_answer_and_keeps_the_connection() -> None:
    backend = bench.FakeBackend().start()

    async def scenario() -> tuple[int | None, bool, int]:
        client = await bench.KeptClient(backend.port, bench.post_request(bench.chat_body("t-kept"))).open()
        answered = await bench.wait_for_count(lambda: int(client.answered_s is not None), 1, 5.0)
        second = await bench.KeptClient(backend.port, bench.post_request(bench.chat_body("t-kept-2"))).open()
        await bench.wait_for_count(lambda: int(second.answered_s is not None), 1, 5.0)
        client.close()
        second.close()
        return bench.status_of(client.raw), bool(answered), backend._connections

    try:
        status, answered, connections = asyncio.run(scenario())
    finally:
        backend.stop()
    assert answered and status == 200
    assert connections == 2  # one connection each: the first stayed open, unused by the second
    assert backend.tags("t-kept") == Counter({"t-kept": 1, "t-kept-2": 1})
