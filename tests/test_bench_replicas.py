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

import bench_replica_order  # noqa: E402
import bench_replicas  # noqa: E402
from bench_replicas import Answer  # noqa: E402
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


# -- the figures the scripts compute ---------------------------------------------------------------


def test_most_in_window_counts_a_sliding_window_with_both_ends_included() -> None:
    assert bench_replicas.most_in_window([0.0, 30.0, 60.0, 61.0, 119.0], 60.0) == 3  # 0, 30, 60
    assert bench_replicas.most_in_window([0.0, 60.5, 121.0], 60.0) == 1
    assert bench_replicas.most_in_window([], 60.0) == 0


def test_freed_to_next_skips_a_request_read_before_the_slot_was_freed() -> None:
    served = [Served("a", 1, 0.0, end_s=1.0), Served("b", 1, 1.002, end_s=2.0), Served("c", 1, 1.5, end_s=3.0)]
    gaps = bench_replicas.freed_to_next_ms(served)
    assert gaps == pytest.approx([2.0], abs=1e-6)  # c started before b ended: an oversubscription, no gap


def test_slots_back_counts_from_the_kill_to_a_survivors_start_on_each_backend_the_killed_one_held() -> None:
    held, idle = RecordingBackend(slots=1), RecordingBackend(slots=1)
    held.served = [Served("dead|q1", 9, 9.0, end_s=10.5), Served("live|q2", 9, 26.0, end_s=27.0)]
    idle.served = [Served("live|q3", 9, 10.2, end_s=11.0)]
    assert bench_replicas.slots_back_s([held, idle], "dead", kill_s=10.0) == pytest.approx(16.0)
    assert bench_replicas.slots_back_s([idle], "dead", kill_s=10.0) == 0.0  # it held nothing there
    held.served = held.served[:1]
    assert bench_replicas.slots_back_s([held], "dead", kill_s=10.0) is None  # never came back


def test_answered_once_counts_the_unanswered_and_the_served_twice_among_the_survivors_only() -> None:
    answers = [
        Answer("q1", "r0", status=200, done=True), Answer("q2", "r0"),  # q2: no answer
        Answer("q3", "r1", status=503, code="queue_full"), Answer("q4", "dead"),
    ]  # fmt: skip
    served = [Served("r0|q1", 1, 0.0), Served("r1|q1", 1, 1.0), Served("dead|q4", 1, 0.0), Served("r1|q3", 1, 2.0)]
    figures = bench_replicas.answered_once(answers, served, {"r0", "r1"})
    assert figures["sent_to_survivors"] == 3 and figures["unanswered"] == 1 and figures["whole_200"] == 1
    assert figures["served_twice"] == 1 and figures["other_answers"] == {"503 queue_full": 1}
    assert figures["failed_after_backend_read"] == 1  # q3: read by a backend, then not a whole answer


def test_resumed_after_waits_for_every_replica_to_answer_not_degraded() -> None:
    readyz = [(9.0, "a", 200, True), (10.5, "a", 200, False), (10.2, "b", 200, True), (11.4, "b", 200, False)]
    assert bench_replicas.resumed_after(readyz, ["a", "b"], resume_at=10.0) == pytest.approx(1.4)
    assert bench_replicas.resumed_after(readyz[:3], ["a", "b"], resume_at=10.0) == "never"


def test_oracle_share_is_the_part_of_the_oracles_cut_reached() -> None:
    assert bench_replica_order.oracle_share(10.0, 4.0, 2.0) == pytest.approx(0.75)
    assert bench_replica_order.oracle_share(10.0, 12.0, 2.0) == pytest.approx(-0.25)  # worse than fcfs
    assert bench_replica_order.oracle_share(10.0, 4.0, 10.0) != bench_replica_order.oracle_share(10.0, 4.0, 10.0)


def test_summary_pairs_each_repetitions_figures_before_taking_medians() -> None:
    rep = {"fcfs": 10.0, "one": 4.0, "oracle": 2.0, "cluster": 4.4}
    reps = [{n: {"short_p50_s": v * k, "short_p50_of_makespan": v / 20} for n, v in rep.items()} for k in (1, 2, 3)]
    result = bench_replica_order.summarize(reps)
    assert result["short_p50_over_one"]["cluster"] == pytest.approx(1.1)
    assert result["oracle_share"]["cluster"] == pytest.approx(0.7)
    assert result["oracle_share"]["one"] == pytest.approx(0.75)
    assert result["oracle_share_of_makespan"]["cluster"] == pytest.approx(0.7)


def test_serve_accepts_reads_the_trees_own_help() -> None:
    from harness.proxy_process import serve_accepts

    assert serve_accepts("--slots") and serve_accepts("--max-queue")
    assert not serve_accepts("--no-such-flag") and not serve_accepts("--slot")  # whole flags only
