"""Property tests (hypothesis) of the queues under adversarial arrivals, removals and pop times."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from clairvoyant.job_queue import Job, StarvationGuard
from clairvoyant.policy import POLICY_NAMES, BoostPolicy, PolicyParams, build_queue, make_policy
from clairvoyant.scheduling.boost import BoostTable, bucket_for

# One operation: (kind, time step, score, predicted seconds, priority, tenant)
op = st.tuples(
    st.sampled_from(["push", "push", "push", "pop", "pop", "remove"]),
    st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0, 10.0, 40.0]),  # time steps: bursts (0) and gaps
    st.floats(0.0, 1.0),
    st.floats(0.05, 60.0),
    st.integers(-1, 2),
    st.sampled_from(["a", "b", "c"]),
)
ops = st.lists(op, min_size=1, max_size=120)


def run(queue, operations, check=None):  # type: ignore[no-untyped-def]
    now = 0.0
    waiting: dict[int, Job[int]] = {}
    popped: list[int] = []
    pushed = 0
    for kind, step, score, pred, prio, tenant in operations:
        now += step
        if kind == "push":
            job = Job(pushed, now, score=score, predicted_s=pred, bucket=bucket_for(pred), priority=prio, tenant=tenant)
            pushed += 1
            queue.push(job)
            waiting[job.payload] = job
        elif kind == "remove" and waiting:
            victim = waiting.pop(sorted(waiting)[len(waiting) // 2])
            assert queue.remove(victim)
            assert not queue.remove(victim)
        elif kind == "pop":
            got = queue.pop(now)
            if not waiting:
                assert got is None
                continue
            assert got is not None
            job, promoted = got
            if check is not None:
                check(job, promoted, list(waiting.values()), now)
            assert waiting.pop(job.payload) is job
            popped.append(job.payload)
        assert len(queue) == len(waiting)
    rest = []
    while (got := queue.pop(now)) is not None:
        rest.append(got[0].payload)
    return popped, rest, waiting


@settings(max_examples=150, deadline=None)
@given(operations=ops, name=st.sampled_from(POLICY_NAMES), tau=st.sampled_from([math.inf, 5.0, 30.0]), fair=st.booleans())
def test_every_job_pops_exactly_once(operations, name, tau, fair) -> None:  # type: ignore[no-untyped-def]
    queue = build_queue(make_policy(name), starvation_timeout_s=tau, fair_share=fair)
    popped, rest, waiting = run(queue, operations)
    assert len(set(popped + rest)) == len(popped) + len(rest)
    assert sorted(rest) == sorted(waiting)


@settings(max_examples=150, deadline=None)
@given(operations=ops, name=st.sampled_from(POLICY_NAMES), tau=st.sampled_from([2.0, 5.0, 30.0]), slowdown=st.sampled_from([0.0, 1.0]))
def test_no_later_arrival_passes_an_overdue_job(operations, name, tau, slowdown) -> None:  # type: ignore[no-untyped-def]
    guard = StarvationGuard(make_policy(name).make_queue(), tau, slowdown)

    def check(job, promoted, waiting, now):  # type: ignore[no-untyped-def]
        for other in waiting:
            if other is job or not guard.is_overdue(other, now):
                continue
            # The stated bound: an overdue job is passed only by jobs that arrived no later than it.
            assert job.arrival_s <= other.arrival_s, (job, other, now)

    run(guard, operations, check)


@settings(max_examples=150, deadline=None)
@given(operations=ops, cap=st.sampled_from([1.0, 10.0, 60.0]), gamma=st.sampled_from([0.01, 0.1, 1.0]))
def test_boost_never_lets_a_job_arriving_cap_seconds_later_pass(operations, cap, gamma) -> None:  # type: ignore[no-untyped-def]
    policy = BoostPolicy(BoostTable(gamma, max_boost_s=cap))

    def check(job, promoted, waiting, now):  # type: ignore[no-untyped-def]
        for other in waiting:
            if other.priority == job.priority:
                assert job.arrival_s - other.arrival_s <= cap, (job, other)
        policy.observe(job, job.predicted_s * 1.3)  # the table learns as requests complete

    run(policy.make_queue(), operations, check)


@settings(max_examples=150, deadline=None)
@given(operations=ops, name=st.sampled_from(POLICY_NAMES), tau=st.sampled_from([math.inf, 5.0, 30.0]), fair=st.booleans())
def test_priority_classes_invert_only_by_the_starvation_bound(operations, name, tau, fair) -> None:  # type: ignore[no-untyped-def]
    def check(job, promoted, waiting, now):  # type: ignore[no-untyped-def]
        best = min(j.priority for j in waiting)
        if job.priority > best:
            assert promoted, "a lower class went first without a starvation decision"
            assert now - job.arrival_s > tau  # and only once it had waited past tau

    run(build_queue(make_policy(name, PolicyParams()), starvation_timeout_s=tau, fair_share=fair), operations, check)


def test_regression_an_overdue_head_passing_a_hidden_better_class_is_a_promotion() -> None:
    # Found by hypothesis: tenant b's class-0 jobs were hidden behind b's own promoted class-1 job,
    # so tenant a's overdue class-1 head went first without being reported as a starvation decision.
    q = build_queue(make_policy("fcfs"), starvation_timeout_s=5.0, fair_share=True)
    for name, arrival, prio, tenant in [("a1", 0.0, 1, "a"), ("b2", 0.0, 1, "b"), ("b3", 0.5, 0, "b")]:
        q.push(Job(name, arrival, priority=prio, tenant=tenant))
    job, promoted = q.pop(10.5)  # type: ignore[misc]
    assert job.priority == 1 and promoted
