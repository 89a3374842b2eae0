"""The waiting queues, with time as data: explicit arrival times in, expected order out (no clock, no sleeps)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from clairvoyant.scheduling.boost import BoostTable
from clairvoyant.scheduling.job_queue import FairShareQueue, HeapQueue, Job, JobQueue, ScanQueue, StarvationGuard
from clairvoyant.scheduling.policy import (
    POLICY_NAMES,
    BoostPolicy,
    FcfsPolicy,
    HrrnPolicy,
    PolicyParams,
    SjfPolicy,
    build_queue,
    make_policy,
)


def job(
    name: str,
    arrival_s: float,
    *,
    score: float = 0.5,
    predicted_s: float = 1.0,
    priority: int = 0,
    tenant: str = "",
) -> Job[str]:
    return Job(name, arrival_s, score=score, predicted_s=predicted_s, priority=priority, tenant=tenant)


def drain(queue: JobQueue[str], now: float) -> list[str]:
    out = []
    while (got := queue.pop(now)) is not None:
        out.append(got[0].payload)
    return out


def test_policy_names_come_from_the_registry() -> None:
    assert POLICY_NAMES == ("fcfs", "sjf", "boost", "hrrn")
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        make_policy("lifo")


def test_fcfs_is_arrival_order_whatever_the_score() -> None:
    q = FcfsPolicy().make_queue()
    for i, score in enumerate([0.9, 0.1, 0.5]):
        q.push(job(f"r{i}", float(i), score=score))
    assert drain(q, now=10.0) == ["r0", "r1", "r2"]


def test_sjf_orders_by_score_then_arrival() -> None:
    q = SjfPolicy().make_queue()
    q.push(job("long", 0.0, score=0.9))
    q.push(job("mid", 1.0, score=0.5))
    q.push(job("short-a", 2.0, score=0.1))
    q.push(job("short-b", 3.0, score=0.1))  # same score: arrival breaks the tie
    q.push(job("shortest", 4.0, score=0.05))
    assert drain(q, now=5.0) == ["shortest", "short-a", "short-b", "mid", "long"]


def test_boost_key_by_hand() -> None:
    # gamma = 0.1/s, no measurements yet: b(S) = -ln(1 - exp(-0.1 S)) / 0.1
    # b(10 s) = 4.587 s, b(1 s) = 23.52 s. Keys: A 0 - 4.587 = -4.59; B 15 - 23.52 = -8.52; C 20 - 23.52 = -3.52.
    policy = BoostPolicy(BoostTable(0.1, max_boost_s=1e9))
    assert policy.table.boost(0, 10.0) == pytest.approx(4.587, abs=1e-3)
    assert policy.table.boost(1, 1.0) == pytest.approx(23.52, abs=1e-2)
    q = policy.make_queue()
    q.push(job("A", 0.0, predicted_s=10.0))
    q.push(job("B", 15.0, predicted_s=1.0))
    q.push(job("C", 20.0, predicted_s=1.0))
    assert drain(q, now=20.0) == ["B", "A", "C"]


def test_boost_cap_bounds_overtaking() -> None:
    # Cap 5 s: B (1 s, arrives 6 s after A) cannot pass A any more however short it is.
    policy = BoostPolicy(BoostTable(0.1, max_boost_s=5.0))
    q = policy.make_queue()
    q.push(job("A", 0.0, predicted_s=1000.0))
    q.push(job("B", 6.0, predicted_s=1.0))
    q.push(job("C", 4.0 + 0.0, predicted_s=1.0))  # arrival order need not be monotone for the heap itself
    assert drain(q, now=10.0) == ["C", "A", "B"]


def test_bucket_conditioned_boost_shrinks_for_a_dispersed_bucket() -> None:
    # A bucket whose measured sizes are all over the place earns a smaller boost than a tight one
    # with the same prediction: a weak predictor degrades toward FCFS.
    table = BoostTable(0.05, max_boost_s=1e9)
    for _ in range(200):
        table.observe(1, 3.5)  # tight: always 3.5 s
        table.observe(2, 0.5)
        table.observe(2, 30.0)  # dispersed
    assert table.boost(1, 3.5) > table.boost(2, 3.5) + 5.0
    useless = BoostTable(0.05, max_boost_s=1e9)
    for s in (1.0, 20.0) * 100:  # both buckets see the same sizes: same boost, i.e. FCFS
        useless.observe(1, s)
        useless.observe(2, s)
    assert useless.boost(1, 1.0) == pytest.approx(useless.boost(2, 20.0), rel=0.05)


def test_hrrn_by_hand() -> None:
    q = HrrnPolicy().make_queue()
    q.push(job("A", 0.0, predicted_s=10.0))  # at t=10: (10 + 10) / 10 = 2
    q.push(job("B", 8.0, predicted_s=1.0))  # at t=10: (2 + 1) / 1 = 3
    q.push(job("C", 9.0, predicted_s=5.0))  # at t=10: (1 + 5) / 5 = 1.2
    assert q.pop(10.0)[0].payload == "B"  # type: ignore[index]
    # at t=11: A (11 + 10) / 10 = 2.1, C (2 + 5) / 5 = 1.4
    assert q.pop(11.0)[0].payload == "A"  # type: ignore[index]
    # HRRN ages: at t=11 a fresh 1 s job ratio 1.0 loses to C's 1.4; at t=1000 C's ratio is ~199
    q.push(job("D", 11.0, predicted_s=1.0))
    assert [j.payload for j in q.ordered(11.0)] == ["C", "D"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_priority_class_goes_first_in_every_policy(name: str) -> None:
    q = build_queue(make_policy(name))
    q.push(job("normal-old", 0.0, score=0.0, predicted_s=0.5))
    q.push(job("low", 0.5, score=0.0, predicted_s=0.5, priority=1))
    q.push(job("urgent-long", 1.0, score=1.0, predicted_s=100.0, priority=-1))
    assert drain(q, now=2.0) == ["urgent-long", "normal-old", "low"]


def test_guard_promotes_the_longest_waiting_only_after_tau() -> None:
    q = StarvationGuard(SjfPolicy().make_queue(), 10.0)
    long_job, s1, s2 = job("long", 0.0, score=0.9), job("short1", 1.0, score=0.1), job("short2", 2.0, score=0.1)
    for j in (long_job, s1, s2):
        q.push(j)
    assert q.pop(10.0) == (s1, False)  # the long job has waited exactly tau: not yet overdue
    assert q.pop(10.5) == (long_job, True)  # waited 10.5 > tau: goes before the later short2
    assert q.pop(10.5) == (s2, False)
    assert q.pop(10.5) is None


def test_guard_heap_orders_jobs_by_deadline_and_a_job_pushed_again_keeps_only_its_new_deadline() -> None:
    """The deadline heap holds the jobs themselves (``Job.__lt__``: deadline, then seq). A job
    pushed again while its first entry lingers (removed, not yet surfaced) is overdue at its new
    deadline: its old place must neither promote it early nor corrupt the heap."""
    a, b, c = job("a", 0.0), job("b", 0.0), job("c", 0.0)
    a.deadline_s, b.deadline_s, c.deadline_s = 2.0, 1.0, 1.0
    assert sorted([a, b, c]) == [b, c, a]  # c ties b's deadline and arrived after it
    q = StarvationGuard(SjfPolicy().make_queue(), 10.0)
    again = job("again", 0.0, score=0.9)
    q.push(again)  # deadline 10
    q.remove(again)
    again.arrival_s = 20.0
    q.push(again)  # deadline 30: its entry for 10 is gone
    better = job("better", 25.0, score=0.1)
    q.push(better)
    assert q.pop(26.0) == (better, False)  # past 10, before 30: not overdue
    assert q.pop(26.0) == (again, False)
    for i in range(200):  # the heap still pops in deadline order under churn
        q.push(job(f"j{i}", 30.0 + i, score=random.random()))
    heap = q._pending
    assert len(heap) >= 200 and all(not heap[i] < heap[(i - 1) // 2] for i in range(1, len(heap)))  # a heap


def test_guard_keeps_a_burst_in_policy_order() -> None:
    # Everyone arrived at t=0: all are overdue at t=100 but equally old, so SJF order stays.
    q = StarvationGuard(SjfPolicy().make_queue(), 1.0)
    for name, score in (("c", 0.9), ("a", 0.1), ("b", 0.5)):
        q.push(job(name, 0.0, score=score))
    q.push(job("late-best", 50.0, score=0.0))  # arrived later: may not pass the overdue burst
    assert drain(q, now=100.0) == ["a", "b", "c", "late-best"]


def test_guard_head_that_is_oldest_is_not_a_promotion() -> None:
    q = StarvationGuard(SjfPolicy().make_queue(), 1.0)
    old = job("short-old", 0.0, score=0.1)
    q.push(old)
    q.push(job("long", 0.5, score=0.9))
    assert q.pop(100.0) == (old, False)


def test_removed_jobs_are_never_popped_and_remove_is_idempotent() -> None:
    q = StarvationGuard(SjfPolicy().make_queue(), 5.0)
    gone_old, stays, gone_best = job("gone-old", 0.0, score=0.9), job("stays", 1.0), job("gone-best", 2.0, score=0.0)
    for j in (gone_old, stays, gone_best):
        q.push(j)
    assert q.remove(gone_old) and q.remove(gone_best)
    assert not q.remove(gone_best)
    assert len(q) == 1
    assert drain(q, now=100.0) == ["stays"]
    assert not q.remove(stays)  # popped: no longer waiting


def test_scan_queue_remove() -> None:
    q = HrrnPolicy().make_queue()
    a, b = job("a", 0.0), job("b", 0.0)
    q.push(a)
    q.push(b)
    assert q.remove(a) and not q.remove(a)
    assert drain(q, 1.0) == ["b"]


def test_heap_stays_bounded_under_churn() -> None:
    q = HeapQueue[int](lambda j: j.score)
    keeper = Job(-1, 0.0, score=1.0)
    q.push(keeper)
    for i in range(10_000):
        j = Job(i, float(i), score=0.5)
        q.push(j)
        q.remove(j)
    assert len(q) == 1
    assert len(q._heap) <= 130  # compacted, not 10,001 dead entries
    assert q.pop(0.0) == (keeper, False)


def test_fair_share_newcomer_is_not_queued_behind_a_batch() -> None:
    q = FairShareQueue(lambda: FcfsPolicy().make_queue())
    for i in range(5):
        q.push(job(f"batch{i}", 0.0, predicted_s=10.0, tenant="batch"))
    assert q.pop(0.0)[0].payload == "batch0"  # type: ignore[index]
    q.push(job("chat", 0.5, predicted_s=1.0, tenant="chat"))
    # batch has been served 10 predicted seconds, chat starts at the virtual time (0): chat next.
    assert q.pop(10.0)[0].payload == "chat"  # type: ignore[index]
    q.push(job("chat2", 10.5, predicted_s=1.0, tenant="chat"))
    # chat has had 1 predicted second, batch 10: chat2 first (start-time fair queuing).
    assert drain(q, 20.0) == ["chat2", "batch1", "batch2", "batch3", "batch4"]


def test_fair_share_tenant_in_service_keeps_its_tag_until_done() -> None:
    q = FairShareQueue(lambda: FcfsPolicy().make_queue())
    for i in range(3):
        q.push(job(f"batch{i}", 0.0, predicted_s=4.0, tenant="batch"))
    q.push(job("chat0", 0.0, predicted_s=4.0, tenant="chat"))
    # Equal start tags (0): chat has fewer waiting, so it goes first; its tag becomes 4.
    chat0 = q.pop(0.0)[0]  # type: ignore[index]
    assert chat0.payload == "chat0"
    # chat sends its next request while chat0 runs: it keeps tag 4, batch (tag 0) goes first.
    q.push(job("chat1", 1.0, predicted_s=4.0, tenant="chat"))
    assert q.pop(4.0)[0].payload == "batch0"  # type: ignore[index]
    assert q.pop(8.0)[0].payload == "chat1"  # type: ignore[index]  # tags 4 vs 4: chat has 1 waiting, batch 2
    assert q.tenants == {"batch": 4.0, "chat": 8.0}
    q.done(chat0)
    assert "chat" in q.tenants  # chat1 is still in service
    q.done(chat0)  # reported twice: ignored
    q.done(q.pop(12.0)[0])  # type: ignore[index]  # batch1 ran and left
    assert q.tenants == {"batch": 8.0, "chat": 8.0}


def test_fair_share_idle_tenant_restarts_at_the_virtual_time() -> None:
    q = FairShareQueue(lambda: FcfsPolicy().make_queue())
    for i in range(4):
        q.push(job(f"batch{i}", 0.0, predicted_s=4.0, tenant="batch"))
    q.push(job("chat0", 0.0, predicted_s=4.0, tenant="chat"))
    chat0 = q.pop(0.0)[0]  # type: ignore[index]
    q.done(chat0)  # finished before chat sends again: chat is idle and forgotten
    assert "chat" not in q.tenants
    assert q.pop(4.0)[0].payload == "batch0"  # type: ignore[index]  # virtual time is now 0 (batch0's start)
    q.push(job("chat1", 5.0, predicted_s=4.0, tenant="chat"))
    # chat restarts at the virtual time 0, below batch's 4: chat1 next, without its old tag (4).
    assert q.pop(8.0)[0].payload == "chat1"  # type: ignore[index]


def test_fair_share_is_weighted_by_predicted_seconds_not_counts() -> None:
    q = FairShareQueue(lambda: FcfsPolicy().make_queue())
    for i in range(6):
        q.push(job(f"small{i}", 0.0, predicted_s=1.0, tenant="small"))
    for i in range(2):
        q.push(job(f"big{i}", 0.0, predicted_s=3.0, tenant="big"))
    order = drain(q, 0.0)
    # Equal seconds: 3 small jobs for each big one. Equal start tags (0 s, then 3 s) go to the
    # tenant with fewer requests waiting: big.
    assert order == ["big0", "small0", "small1", "small2", "big1", "small3", "small4", "small5"]


def test_fair_share_lifts_a_promoted_low_priority_job_to_the_top_class() -> None:
    q = build_queue(FcfsPolicy(), starvation_timeout_s=5.0, fair_share=True)
    low, high = job("low", 0.0, priority=3, tenant="a"), job("high", 1.0, priority=0, tenant="b")
    q.push(low)
    q.push(high)
    # Two tenants wait from t = 1, so low's share clock runs at 1/2 from then: 1 + (t - 1) / 2 > 5
    # once t > 9 (k x tau of wall time, k = 2).
    assert q.peek(6.0) == (high, False)  # 5 s of wall time but 3.5 s of its share: class order
    assert q.peek(8.9) == (high, False)
    assert q.pop(9.1) == (low, True)  # overdue: counts as the top class, and tenant a is owed


def test_ordered_matches_the_pops() -> None:
    for name in POLICY_NAMES:
        q = build_queue(make_policy(name), starvation_timeout_s=30.0, fair_share=True)
        for i in range(20):
            q.push(
                job(
                    f"j{i}",
                    float(i),
                    score=(i * 7 % 10) / 10,
                    predicted_s=1.0 + (i * 3 % 7),
                    tenant="ab"[i % 2],
                    priority=i % 3 - 1,
                )
            )
        expected = [j.payload for j in q.ordered(20.0)]
        assert drain(q, 20.0) == expected, name


def test_build_queue_rejects_a_non_positive_timeout() -> None:
    with pytest.raises(ValueError):
        build_queue(FcfsPolicy(), starvation_timeout_s=0.0)
    assert isinstance(build_queue(FcfsPolicy(), starvation_timeout_s=math.inf), HeapQueue)
    assert isinstance(build_queue(HrrnPolicy(), starvation_timeout_s=math.inf), ScanQueue)
    assert isinstance(make_policy("boost", PolicyParams(boost_gamma_per_s=0.2)), BoostPolicy)


def test_fair_share_weights_give_a_tenant_its_multiple_of_backend_seconds() -> None:
    weights = {"gold": 2.0, "basic": 1.0}
    q = FairShareQueue(lambda: FcfsPolicy().make_queue(), weight_of=lambda tenant: weights[str(tenant)])
    for i in range(6):
        q.push(job(f"g{i}", 0.0, predicted_s=1.0, tenant="gold"))
        q.push(job(f"b{i}", 0.0, predicted_s=1.0, tenant="basic"))
    order = []
    for _ in range(9):
        got = q.pop(0.0)
        assert got is not None
        order.append(got[0].payload[0])
        q.done(got[0])
    assert order.count("g") == 6 and order.count("b") == 3  # two gold seconds for each basic one


def test_fair_share_charges_a_job_repriced_after_dispatch_its_true_seconds() -> None:
    # A job dispatched before its prediction is charged its default at the pop; ``repriced``
    # charges the rest, so a tenant whose long requests always find the queue empty gains nothing.
    q = FairShareQueue(lambda: FcfsPolicy().make_queue())
    early = job("early-long", 0.0, predicted_s=1.0, tenant="a")
    q.push(early)
    assert q.pop(0.0)[0] is early  # type: ignore[index]
    early.predicted_s = 60.0
    q.repriced(early, 1.0)
    assert q.tenants["a"] == 60.0
    q.push(job("a2", 1.0, predicted_s=1.0, tenant="a"))
    q.push(job("b1", 1.0, predicted_s=1.0, tenant="b"))
    assert q.pop(1.0)[0].payload == "b1"  # type: ignore[index]  # b starts at the virtual time, a is 60 s ahead


@pytest.mark.parametrize("fair_share", [False, True])
def test_rekeyed_job_moves_to_its_new_place_and_keeps_its_deadline(fair_share: bool) -> None:
    """A second opinion re-keys a waiting job: it goes by its new score, through the guard and fair
    share alike, and the starvation deadline promised at push does not move."""
    q = build_queue(SjfPolicy(), starvation_timeout_s=100.0, starvation_slowdown=2.0, fair_share=fair_share)
    jobs = {name: job(name, float(i), score=score, predicted_s=3.0) for i, (name, score) in enumerate(
        [("a", 0.2), ("b", 0.5), ("c", 0.8)])}  # fmt: skip
    for j in jobs.values():
        q.push(j)
    deadline = jobs["c"].deadline_s
    assert [j.payload for j in q.ordered(10.0)] == ["a", "b", "c"]
    jobs["c"].score = 0.1  # the encoder says c is the shortest
    jobs["c"].predicted_s = 30.0
    q.rekeyed(jobs["c"])
    assert jobs["c"].deadline_s == deadline
    assert [j.payload for j in q.ordered(10.0)] == ["c", "a", "b"]
    assert drain(q, now=10.0) == ["c", "a", "b"]


def test_rekeyed_is_a_no_op_for_a_job_not_waiting() -> None:
    q = SjfPolicy().make_queue()
    a, b = job("a", 0.0, score=0.2), job("b", 1.0, score=0.5)
    q.push(a)
    q.push(b)
    assert q.pop(2.0) == (a, False)
    a.score = 0.9
    q.rekeyed(a)  # already popped: nothing to move, nothing duplicated
    assert len(q) == 1
    assert drain(q, now=2.0) == ["b"]


def test_rekeyed_in_a_scan_queue_ranks_by_the_new_fields() -> None:
    q = HrrnPolicy().make_queue()
    short, long_ = job("short", 0.0, predicted_s=1.0), job("long", 0.0, predicted_s=10.0)
    q.push(long_)
    q.push(short)
    short.predicted_s = 100.0
    q.rekeyed(short)
    assert drain(q, now=5.0) == ["long", "short"]


def _at_once_run(seed: int, *, take_now: bool) -> list[Any]:
    """Random arrivals, pops, completions and re-pricings; an arrival that finds nothing waiting is
    dispatched at once (as the dispatcher does), by ``take_now`` or by push then pop. What the queue
    says after each step."""
    rng = random.Random(seed)
    name = POLICY_NAMES[seed % len(POLICY_NAMES)]
    q = build_queue(
        make_policy(name),
        starvation_timeout_s=rng.choice([math.inf, 0.5, 2.0]),
        starvation_slowdown=rng.choice([0.0, 1.5]),
        fair_share=rng.random() < 0.7,
        tenant_weights=rng.choice([None, {"a": 2.0}]),
    )
    now, n, out = 0.0, 0, []
    running: list[Job[int]] = []
    for _ in range(rng.randint(5, 120)):
        now += rng.choice([0.0, 0.1, 0.7, 3.0])
        op = rng.random()
        if op < 0.45:
            job = Job(n, now, score=rng.random(), predicted_s=rng.choice([0.1, 1.0, 5.0]), priority=rng.choice([0, 1]))
            job.tenant = rng.choice(["", "a", "b"])
            n += 1
            if len(q) == 0 and rng.random() < 0.7:  # a free slot and nobody waiting
                if take_now:
                    q.take_now(job, now)
                else:
                    q.push(job)
                    got = q.pop(now)
                    assert got is not None and got[0] is job
                running.append(job)
                out.append(("at once", job.payload, job.waiting))
            else:
                q.push(job)
        elif op < 0.7:
            got = q.pop(now)
            out.append(None if got is None else (got[0].payload, got[1]))
            if got is not None:
                running.append(got[0])
        elif running:
            j = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.3:
                old = j.predicted_s
                j.predicted_s = rng.choice([0.2, 4.0])
                q.repriced(j, old)
            q.done(j)
        tags = sorted(q.tenants.items(), key=str) if isinstance(q, FairShareQueue) else None
        out.append((len(q), [j.payload for j in q.ordered(now)], tags))
    return out


def test_take_now_leaves_the_queue_as_push_then_pop() -> None:
    for seed in range(400):
        assert _at_once_run(seed, take_now=True) == _at_once_run(seed, take_now=False), seed


def test_take_now_refuses_a_fair_share_queue_with_jobs_waiting() -> None:
    q = build_queue(make_policy("sjf"), fair_share=True)
    q.push(Job("waits", 0.0))
    with pytest.raises(RuntimeError):
        q.take_now(Job("late", 1.0), 1.0)
