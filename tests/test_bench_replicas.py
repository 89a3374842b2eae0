"""The instruments of benchmarks/bench_replicas.py and bench_replica_order.py: the real
redis-server they start and fault (harness/redis_process.py), the backend that keeps its own slot
count (harness/recording_backend.py), and the figures the scripts compute from what it recorded."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from polling import wait_until

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from harness.recording_backend import RecordingBackend, Served, most_at_once  # noqa: E402
from harness.redis_process import RedisProcess  # noqa: E402


def _chat(tag: str, tokens: int, *, stream: bool = True) -> dict[str, Any]:
    return {"model": "m", "user": tag, "stream": stream, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "Say OK."}]}  # fmt: skip


@pytest.fixture
def redis_server(tmp_path: Path) -> Any:
    server = RedisProcess(tmp_path).start()
    yield server
    server.stop()


def test_redis_restarted_empty_answers_on_the_same_port_with_no_keys(redis_server: RedisProcess) -> None:
    client = redis_server.client()
    client.set("lease", "r1")
    port = redis_server.port
    redis_server.restart_empty()
    assert redis_server.port == port
    assert redis_server.client().ping() and redis_server.dbsize() == 0


def test_a_paused_redis_times_out_without_refusing_and_keeps_its_keys(redis_server: RedisProcess) -> None:
    redis_server.client().set("lease", "r1")
    redis_server.pause()
    try:
        with pytest.raises(redis.TimeoutError):  # neither answered nor refused
            redis_server.client(timeout_s=0.3).get("lease")
    finally:
        redis_server.resume()
    assert redis_server.client().get("lease") == b"r1"


def test_redis_stopped_with_its_state_comes_back_with_it(redis_server: RedisProcess) -> None:
    redis_server.client().set("lease", "r1")
    redis_server.stop(save=True)
    with pytest.raises(redis.ConnectionError):
        redis_server.client(timeout_s=0.3).ping()
    redis_server.start(keep_state=True)
    assert redis_server.client().get("lease") == b"r1"


def test_the_backend_counts_every_moment_above_its_slots() -> None:
    backend = RecordingBackend(slots=1, token_s=0.01).start()
    url = f"{backend.base_url}/v1/chat/completions"
    try:
        # One at a time: never above one slot.
        for i in range(3):
            assert httpx.post(url, json=_chat(f"seq-{i}", 3), timeout=10).status_code == 200
        assert backend.violations == 0 and backend.max_in_progress == 1
        # Two at once (held apart from finishing by their length): the second start is a violation.
        threads = [
            threading.Thread(target=httpx.post, args=(url,), kwargs={"json": _chat(f"par-{i}", 200), "timeout": 30})
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        wait_until(lambda: backend.max_in_progress == 2, timeout_s=10, what="two requests at the backend")
        for thread in threads:
            thread.join(30)
    finally:
        backend.stop()
    assert backend.violations == 1
    assert [s.tag for s in backend.served[:3]] == ["seq-0", "seq-1", "seq-2"]
    assert all(s.completed and s.end_s is not None for s in backend.served)
    assert most_at_once(backend.served[:3]) == 1 and most_at_once(backend.served) == 2


def test_a_forced_answer_has_exactly_max_tokens_events_streamed_or_not() -> None:
    backend = RecordingBackend(slots=1, token_s=0.001).start()
    url = f"{backend.base_url}/v1/chat/completions"
    try:
        streamed = httpx.post(url, json=_chat("s", 7), timeout=10).text
        whole = httpx.post(url, json=_chat("w", 7, stream=False), timeout=10).json()
    finally:
        backend.stop()
    assert streamed.count('"delta"') == 7 and streamed.rstrip().endswith("data: [DONE]")
    assert whole["choices"][0]["message"]["content"] == "ok w"
    first, second = backend.served
    assert first.first_byte_s is not None and first.end_s is not None
    assert first.start_s <= first.first_byte_s <= first.end_s <= second.start_s


def test_a_request_whose_client_left_ends_at_the_backend_not_completed() -> None:
    backend = RecordingBackend(slots=1, token_s=0.01).start()
    try:
        with httpx.stream("POST", f"{backend.base_url}/v1/chat/completions", json=_chat("gone", 1000)) as response:
            next(response.iter_lines())
        wait_until(lambda: backend.in_progress == 0, timeout_s=10, what="the backend to see the client leave")
    finally:
        backend.stop()
    (served,) = backend.served
    assert not served.completed and served.end_s is not None


def test_most_at_once_counts_an_end_and_a_start_at_one_instant_as_one() -> None:
    served = [Served("a", 1, 0.0, end_s=1.0), Served("b", 1, 1.0, end_s=2.0), Served("c", 1, 1.5, end_s=3.0)]
    assert most_at_once(served) == 2
    assert most_at_once([Served("x", 1, 0.0)]) == 1  # still running
    assert most_at_once([]) == 0
