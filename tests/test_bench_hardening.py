"""benchmarks/bench_hardening.py: the helpers that decide a verdict (no timing asserts; the
benchmark itself runs by hand). Its shared parts are tested in test_bench_harness.py."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import bench_hardening as bench  # noqa: E402
from harness.fake_backend import FakeBackend  # noqa: E402
from harness.verdicts import status_of  # noqa: E402


def test_latency_rule_allows_factor_or_slack() -> None:
    assert bench.latency_kept(0.010, 0.019)  # under 2x
    assert not bench.latency_kept(0.010, 0.021)
    assert bench.latency_kept(0.001, 0.0055)  # under +5 ms although above 2x
    assert not bench.latency_kept(0.001, 0.0065)


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


def test_raw_exchange_sees_eof_and_data() -> None:
    backend = FakeBackend().start()
    try:
        request = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        result = asyncio.run(bench.raw_exchange(backend.port, request, wait_s=5))
    finally:
        backend.stop()
    assert status_of(result.data) == 200
    assert json.loads(result.data.split(b"\r\n\r\n", 1)[1]) == {"status": "ok"}
    assert result.closed_s is not None and not result.reset


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


def test_kept_client_reads_its_answer_and_keeps_the_connection() -> None:
    backend = FakeBackend().start()

    async def scenario() -> tuple[int | None, bool, int]:
        client = await bench.KeptClient(backend.port, bench.post_request(bench.chat_body("t-kept"))).open()
        answered = await bench.wait_for_count(lambda: int(client.answered_s is not None), 1, 5.0)
        second = await bench.KeptClient(backend.port, bench.post_request(bench.chat_body("t-kept-2"))).open()
        await bench.wait_for_count(lambda: int(second.answered_s is not None), 1, 5.0)
        client.close()
        second.close()
        return status_of(client.raw), bool(answered), backend._connections

    try:
        status, answered, connections = asyncio.run(scenario())
    finally:
        backend.stop()
    assert answered and status == 200
    assert connections == 2  # one connection each: the first stayed open, unused by the second
    assert backend.tags("t-kept") == Counter({"t-kept": 1, "t-kept-2": 1})
