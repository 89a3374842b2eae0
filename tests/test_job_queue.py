"""The waiting queue, with time as data: explicit arrival times in, expected order out."""

from __future__ import annotations

import math

import pytest

from clairvoyant.errors import QueueFull
from clairvoyant.job_queue import JobQueue
from clairvoyant.policy import FcfsPolicy, SjfPolicy, make_policy


def drain(queue: JobQueue[str], now: float) -> list[str]:
    out = []
    while (job := queue.pop(now)) is not None:
        out.append(job.payload)
    return out


def test_sjf_orders_by_score_then_arrival() -> None:
    q: JobQueue[str] = JobQueue(SjfPolicy())
    q.push("long", 0.9, arrival_s=0.0)
    q.push("mid", 0.5, arrival_s=1.0)
    q.push("short-a", 0.1, arrival_s=2.0)
    q.push("short-b", 0.1, arrival_s=3.0)  # same score: arrival breaks the tie
    q.push("shortest", 0.05, arrival_s=4.0)
    assert drain(q, now=5.0) == ["shortest", "short-a", "short-b", "mid", "long"]


def test_fcfs_ignores_score() -> None:
    q: JobQueue[str] = JobQueue(FcfsPolicy())
    for i, score in enumerate([0.9, 0.1, 0.5]):
        q.push(f"r{i}", score, arrival_s=float(i))
    assert drain(q, now=10.0) == ["r0", "r1", "r2"]


def test_starvation_promotes_the_longest_waiting_only_after_tau() -> None:
    q: JobQueue[str] = JobQueue(SjfPolicy(), starvation_timeout_s=10.0)
    q.push("long", 0.9, arrival_s=0.0)
    q.push("short1", 0.1, arrival_s=1.0)
    q.push("short2", 0.1, arrival_s=2.0)
    # At t=10 the long job has waited exactly tau: not yet "longer than tau".
    assert q.pop(now=10.0).payload == "short1"
    assert q.promotions == 0
    # At t=10.5 it has waited longer than tau: it goes next regardless of its score.
    assert q.pop(now=10.5).payload == "long"
    assert q.promotions == 1
    assert q.pop(now=10.5).payload == "short2"
    assert q.pop(now=10.5) is None


def test_starved_head_of_heap_is_not_counted_as_promotion() -> None:
    q: JobQueue[str] = JobQueue(SjfPolicy(), starvation_timeout_s=1.0)
    q.push("short-old", 0.1, arrival_s=0.0)
    q.push("long", 0.9, arrival_s=0.5)
    assert q.pop(now=100.0).payload == "short-old"  # oldest and best: no promotion needed
    assert q.promotions == 0


def test_infinite_tau_is_pure_sjf() -> None:
    q: JobQueue[str] = JobQueue(make_policy("sjf"), starvation_timeout_s=math.inf)
    q.push("long", 0.9, arrival_s=0.0)
    q.push("short", 0.1, arrival_s=1.0)
    assert drain(q, now=1e9) == ["short", "long"]


def test_removed_waiters_are_never_popped() -> None:
    q: JobQueue[str] = JobQueue(SjfPolicy(), starvation_timeout_s=5.0)
    gone_old = q.push("gone-old", 0.9, arrival_s=0.0)
    q.push("stays", 0.5, arrival_s=1.0)
    gone_best = q.push("gone-best", 0.0, arrival_s=2.0)
    assert q.remove(gone_old) and q.remove(gone_best)
    assert not q.remove(gone_best)  # already gone
    assert len(q) == 1
    # gone-old would be starving at t=100, but it left: the remaining one goes.
    assert drain(q, now=100.0) == ["stays"]
    assert q.promotions == 0


def test_popped_job_cannot_be_removed() -> None:
    q: JobQueue[str] = JobQueue(SjfPolicy())
    job = q.push("a", 0.1, arrival_s=0.0)
    assert q.pop(now=0.0) is job
    assert not q.remove(job)


def test_bounded_queue_refuses_with_retry_after() -> None:
    q: JobQueue[str] = JobQueue(SjfPolicy(), max_size=2, retry_after_s=7)
    q.push("a", 0.1, arrival_s=0.0)
    q.push("b", 0.2, arrival_s=0.0)
    with pytest.raises(QueueFull) as info:
        q.push("c", 0.3, arrival_s=0.0)
    assert info.value.status_code == 503
    assert info.value.headers == {"Retry-After": "7"}
    q.pop(now=0.0)
    q.push("c", 0.3, arrival_s=0.0)  # room again
    assert len(q) == 2


def test_heap_stays_bounded_under_churn() -> None:
    q: JobQueue[int] = JobQueue(SjfPolicy())
    keeper = q.push(-1, 1.0, arrival_s=0.0)
    for i in range(10_000):
        q.remove(q.push(i, 0.5, arrival_s=float(i)))
    assert len(q) == 1
    assert len(q._heap) <= 130  # compacted, not 10,001 dead entries
    assert q.pop(now=0.0) is keeper


def test_iteration_is_key_order_without_popping() -> None:
    q: JobQueue[str] = JobQueue(SjfPolicy())
    q.push("b", 0.5, arrival_s=0.0)
    q.push("a", 0.1, arrival_s=1.0)
    assert [j.payload for j in q] == ["a", "b"]
    assert len(q) == 2


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        make_policy("lifo")
