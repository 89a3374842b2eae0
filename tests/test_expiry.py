"""Queue deadlines (scheduling/expiry.py): explicit deadlines in, the due ones out, soonest first."""

from __future__ import annotations

import math

from clairvoyant.scheduling.expiry import Expiry, expired
from clairvoyant.scheduling.job_queue import HeapQueue, Job


def test_due_jobs_come_out_soonest_first_and_only_once() -> None:
    queue: HeapQueue[str] = HeapQueue(lambda j: j.arrival_s)
    index: Expiry[str] = Expiry()
    jobs = [Job(name, 0.0, expires_s=at) for name, at in [("c", 30.0), ("a", 10.0), ("none", math.inf), ("b", 20.0)]]
    for job in jobs:
        queue.push(job)
        index.add(job)
    assert len(index) == 3  # a job without a deadline costs nothing
    assert index.next_s() == 10.0
    assert index.due(9.999) == []
    assert [j.payload for j in index.due(20.0)] == ["a", "b"]  # at its deadline a job is due
    assert index.due(20.0) == []
    assert expired(jobs[0], 30.0) and not expired(jobs[0], 29.0) and not expired(jobs[2], 1e12)


def test_jobs_that_left_the_queue_are_skipped_and_dropped() -> None:
    queue: HeapQueue[int] = HeapQueue(lambda j: j.arrival_s)
    index: Expiry[int] = Expiry()
    jobs = [Job(i, float(i), expires_s=100.0 + i) for i in range(1000)]
    for job in jobs:
        queue.push(job)
        index.add(job)
        if job.payload % 10:  # dispatched or withdrawn soon after
            assert queue.remove(job)
    assert len(index) < 300  # rebuilt as it grew: entries stay within twice the waiting ones (100) + 64
    assert index.next_s() == 100.0
    assert [j.payload for j in index.due(1e9)] == list(range(0, 1000, 10))
    assert index.next_s() == math.inf
