"""FairShareQueue reuses a retired tenant's queues (reset to as-new) instead of building new ones:
the schedules are the same as with fresh queues every time."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from clairvoyant.scheduling import job_queue
from clairvoyant.scheduling.job_queue import FairShareQueue, HeapQueue, Job, ScanQueue, StarvationGuard
from clairvoyant.scheduling.policy import POLICY_NAMES, build_queue, make_policy


def build(seed: int, rng: random.Random) -> FairShareQueue[int]:
    q = build_queue(
        make_policy(POLICY_NAMES[seed % len(POLICY_NAMES)]),
        starvation_timeout_s=rng.choice([math.inf, 0.5, 2.0, 10.0]),
        starvation_slowdown=rng.choice([0.0, 1.5]),
        fair_share=True,
        tenant_weights=rng.choice([None, {"a": 2.0, "b": 0.5}]),
    )
    assert isinstance(q, FairShareQueue)
    return q


def run(seed: int, reused: FairShareQueue[int] | None = None) -> list[Any]:
    """Random pushes, pops, removals, re-keys, re-pricings and completions over four tenants; what
    the queue says after each step. Then every job is popped and done (the queue is idle); with
    ``reused``, that queue is used instead of the one built for ``seed`` (built the same way)."""
    rng = random.Random(seed)
    q = build(seed, rng)
    q = q if reused is None else reused
    now, n = 0.0, 0
    waiting: list[Job[int]] = []
    running: list[Job[int]] = []
    out: list[Any] = []
    for _ in range(rng.randint(5, 150)):
        now += rng.choice([0.0, 0.0, 0.1, 0.7, 3.0])
        op = rng.random()
        if op < 0.4:
            job = Job(
                n, now, score=rng.random(), predicted_s=rng.choice([0.1, 1.0, 5.0]), priority=rng.choice([0, 0, 1])
            )
            job.tenant = rng.choice(["", "a", "b", "c"])
            n += 1
            q.push(job)
            waiting.append(job)
        elif op < 0.65:
            got = q.pop(now)
            out.append(None if got is None else (got[0].payload, got[1]))
            if got is not None:
                waiting.remove(got[0])
                running.append(got[0])
        elif op < 0.75 and waiting:
            j = rng.choice(waiting)
            out.append(q.remove(j))
            waiting.remove(j)
        elif op < 0.9 and running:
            j = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.3:
                old = j.predicted_s
                j.predicted_s = rng.choice([0.2, 4.0])
                q.repriced(j, old)
            q.done(j)
        elif waiting:
            j = rng.choice(waiting)
            j.score, j.predicted_s = rng.random(), rng.choice([0.3, 2.0])
            q.rekeyed(j)
        out.append((len(q), [j.payload for j in q.ordered(now)], sorted(q.tenants.items(), key=str)))
    while (got := q.pop(now)) is not None:
        running.append(got[0])
    for j in running:
        q.done(j)
    return out


def test_reused_queues_schedule_as_fresh_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    seeds = range(300)
    reused = [run(seed) for seed in seeds]
    monkeypatch.setattr(job_queue, "_SPARE_TENANTS", 0)  # never reuse: a new queue per activation
    fresh = [run(seed) for seed in seeds]
    assert reused == fresh
    assert sum(1 for steps in fresh for step in steps if isinstance(step, tuple) and step[1]) > 300  # promotions


def test_an_idle_fair_share_queue_reset_schedules_as_a_fresh_one() -> None:
    # A model-affinity group reuses its fair-share queue once idle (one per request before).
    for seed in range(150):
        q = build(seed, random.Random(seed))
        q.push(Job(-1, 0.0, tenant="a"))
        assert not q.reset()  # a tenant is active
        got = q.pop(0.0)
        assert got is not None and not q.reset()  # still in service
        q.done(got[0])
        run(seed, q)  # used, then idle
        assert q.reset()
        assert run(seed, q) == run(seed)


def test_an_idle_tenant_gets_its_emptied_queues_back() -> None:
    q = build_queue(make_policy("sjf"), starvation_timeout_s=5.0, fair_share=True)
    assert isinstance(q, FairShareQueue)
    first = Job("a", 0.0)
    q.push(first)
    queue = q._tenants[""].queue
    assert isinstance(queue, StarvationGuard) and queue._pending  # the deadline entry
    assert q.pop(0.0) is not None
    assert queue._pending  # lazy: the popped job's deadline lingers until done
    q.done(first)
    assert not q._tenants and not queue._pending  # retired and reset
    q.push(Job("b", 1.0, tenant="other"))
    assert q._tenants["other"].queue is queue and queue.clock == q.share_clock_s


def test_reset_refuses_a_queue_with_a_job_waiting() -> None:
    for inner in (HeapQueue(lambda j: j.score), ScanQueue(lambda j, now: j.score)):
        guard = StarvationGuard(inner, 1.0)
        kept, gone = Job("kept", 0.0), Job("gone", 0.0)
        guard.push(kept)
        guard.push(gone)
        assert guard.remove(gone)
        assert not guard.reset() and not inner.reset()
        assert [j.payload for j in guard.ordered(0.0)] == ["kept"] and len(guard._pending) == 2
        assert guard.pop(0.0) is not None
        assert guard.reset() and not guard._pending and len(guard) == 0
