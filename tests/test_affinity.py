"""Model affinity (scheduling/affinity.py), with time as data: explicit arrivals in, expected order out.

A tiny serial backend is played here by hand (``serve``): one slot, each request takes its
predicted seconds, a request for a model the backend does not hold first pays the load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clairvoyant.scheduling.affinity import FREE_LOAD_S, Lane, ModelAffinity
from clairvoyant.scheduling.job_queue import Job, JobQueue
from clairvoyant.scheduling.policy import build_queue, make_policy

NOTHING = object()  # held by a lane's backend that holds no model at all
GUARD = {"starvation_timeout_s": 1.0, "starvation_slowdown": 2.56 * 1.25}  # the default guard before data


def job(name: str, arrival_s: float, model: str | None, *, score: float = 0.5, predicted_s: float = 1.0) -> Job[str]:
    return Job(name, arrival_s, score=score, predicted_s=predicted_s, model=model)


@dataclass(frozen=True)
class Held:
    """What a lane's backend holds: ``held`` (matched exactly)."""

    held: object  # a model name, None (the default model) or NOTHING
    switched_s: float = -math.inf

    def holds(self, model: str | None) -> bool:
        return model == self.held


@dataclass(frozen=True)
class Serving:
    """A lane's backend: holds ``held``, serves ``serving`` (None: any model)."""

    held: Held
    serving: str | None = None

    def serves(self, model: str | None) -> bool:
        return self.serving is None or model == self.serving


def lane(held: str | None, switched_s: float = -math.inf, load_s: float = 3.0) -> Lane:
    return Lane(Serving(Held(held, switched_s)), lambda m: load_s)


def serve(
    queue: JobQueue[str], jobs: list[Job[str]], load_s: float = 3.0, held: str | None = None
) -> list[tuple[str, str | None, float]]:
    """Every job pushed at its arrival, one slot that holds ``held`` at first: (name, model, start)
    in dispatch order. A job for a model the backend does not hold starts after the load."""
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    switched_s = -math.inf
    t = 0.0
    out = []
    while pending or len(queue):
        while pending and pending[0].arrival_s <= t:
            queue.push(pending.pop(0))
        if not len(queue):
            t = pending[0].arrival_s
            continue
        pop_for = getattr(queue, "pop_for", None)
        got = pop_for(t, [lane(held, switched_s, load_s)]) if pop_for else queue.pop(t)
        assert got is not None
        chosen = got[0]
        if chosen.model != held:
            held, switched_s = chosen.model, t
            t += load_s
        out.append((chosen.payload, chosen.model, t))
        t += chosen.predicted_s
        queue.done(chosen)
    return out


def switches(order: list[tuple[str, str | None, float]]) -> int:
    models = [model for _, model, _ in order]
    return sum(a != b for a, b in zip(models, models[1:]))


def burst(n: int, predicted_s: float) -> list[Job[str]]:
    """n requests for a and n for b, sent at once: alternately, a millisecond apart."""
    return [
        job(f"{m}{i}", (2 * i + k) * 0.001, m, score=(i * 7 % n) / n, predicted_s=predicted_s)
        for i in range(n)
        for k, m in enumerate("ab")
    ]


def test_a_burst_of_two_models_is_served_in_groups_within_the_bound() -> None:
    sjf = make_policy("sjf")
    plain = serve(build_queue(sjf, **GUARD), burst(12, 4.0))
    grouped = serve(build_queue(sjf, **GUARD, model_switch_bound_s=30.0), burst(12, 4.0))
    assert switches(plain) == 23  # the guard makes the burst overdue: arrival order alternates models
    # a is held from the first request (t = 0, load 3 s); b, waiting since 1 ms, is due at 30.001 s:
    # the first slot free after that (31 s) switches to b; a is then due at 31 + 30 = 61 s (the slot
    # frees at 62 s), and so on.
    assert "".join(model or "" for _, model, _ in grouped) == "a" * 7 + "b" * 7 + "a" * 5 + "b" * 5
    starts = [start for _, _, start in grouped]
    assert starts[7] == 31.0 + 3.0 and starts[14] == 62.0 + 3.0
    assert switches(grouped) == 3


def test_a_switch_is_never_put_off_past_the_bound() -> None:
    # A steady stream for a keeps a busy: b's one request is switched to at the first slot free
    # once it has waited 20 s, though a's requests keep coming and are shorter.
    queue = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=20.0)
    jobs = [job(f"a{i}", i * 2.0, "a", score=0.1, predicted_s=2.0) for i in range(30)]
    jobs.append(job("b0", 1.0, "b", score=0.9, predicted_s=2.0))
    order = serve(queue, jobs, load_s=5.0)
    b_start = next(start for name, _, start in order if name == "b0")
    # a held since t = 0 (its load ends at 5 s, then a slot frees every 2 s); b, put off from 1 s, is
    # due at 21 s, when the slot frees: it is switched to then, and starts after its load.
    assert b_start == 21.0 + 5.0
    assert switches(order) == 2  # a -> b -> a


def test_a_switch_that_costs_nothing_is_not_put_off() -> None:
    queue = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=60.0)
    assert isinstance(queue, ModelAffinity)
    queue.push(job("long-a", 0.0, "a", score=0.9))
    queue.push(job("short-b", 0.0, "b", score=0.1))
    free = Lane(Serving(Held("a")), lambda m: 0.0)
    got = queue.pop_for(0.0, [free])  # both fit: b costs nothing to switch to, and it is shorter
    assert got is not None and got[0].payload == "short-b"
    costly = lane("a", load_s=FREE_LOAD_S * 2)
    got = queue.pop_for(0.0, [costly])
    assert got is not None and got[0].payload == "long-a"


def test_fcfs_stays_arrival_order_whatever_the_bound() -> None:
    queue = build_queue(make_policy("fcfs"), **GUARD, model_switch_bound_s=30.0)
    assert not isinstance(queue, ModelAffinity)
    assert [name for name, _, _ in serve(queue, burst(3, 1.0))] == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_backend_that_holds_nothing_loads_the_model_of_the_oldest_request() -> None:
    queue = build_queue(make_policy("sjf"), model_switch_bound_s=30.0)
    queue.push(job("b-old", 0.0, "b", score=0.9))
    queue.push(job("a-short", 1.0, "a", score=0.1))
    got = queue.pop_for(1.0, [lane(None)])  # type: ignore[attr-defined]
    assert got is not None and got[0].payload == "b-old"


def test_without_a_lane_the_policy_orders_the_heads_of_all_models() -> None:
    queue = build_queue(make_policy("sjf"), model_switch_bound_s=30.0)
    for name, model, score in [("a1", "a", 0.5), ("b1", "b", 0.2), ("a2", "a", 0.1), ("c1", None, 0.3)]:
        queue.push(job(name, 0.0, model, score=score))
    assert [queue.pop(0.0)[0].payload for _ in range(4)] == ["a2", "b1", "c1", "a1"]  # type: ignore[index]
    assert queue.pop(0.0) is None


def test_a_backend_that_serves_only_some_models_takes_only_theirs() -> None:
    queue: ModelAffinity[str] = ModelAffinity(lambda: build_queue(make_policy("sjf")), 30.0)
    queue.push(job("a", 0.0, "a", score=0.1))
    queue.push(job("b", 0.0, "b", score=0.9))
    only_b = Lane(Serving(Held(NOTHING), serving="b"), lambda m: 3.0)
    got = queue.pop_for(0.0, [only_b])
    assert got is not None and got[0].payload == "b"
    none = Lane(Serving(Held(NOTHING), serving="c"), lambda m: 3.0)
    queue.push(job("b2", 0.0, "b"))
    assert queue.pop_for(0.0, [none]) is None and len(queue) == 2


def test_ollama_names_with_and_without_latest_are_one_model() -> None:
    queue: ModelAffinity[str] = ModelAffinity(lambda: build_queue(make_policy("fcfs")), 30.0)
    queue.push(job("x", 0.0, "llama3.2"))
    queue.push(job("y", 1.0, "llama3.2:latest"))
    assert queue.waiting_by_model() == {"llama3.2": 2}


def test_models_are_retired_once_nothing_of_theirs_waits_or_runs() -> None:
    queue: ModelAffinity[str] = ModelAffinity(lambda: build_queue(make_policy("sjf"), **GUARD), 30.0)
    a, b = job("a", 0.0, "a"), job("b", 0.0, "b")
    queue.push(a)
    queue.push(b)
    assert queue.remove(b) and not queue.remove(b)
    got = queue.pop_for(0.0, [lane("a")])
    assert got is not None and got[0] is a
    assert queue.waiting_by_model() == {} and len(queue._groups) == 1  # a is in flight
    queue.done(a)
    queue.done(a)  # reported twice: no harm
    assert queue._groups == {} and len(queue._spare) == 2  # both models' queues kept for reuse
    c = job("c", 1.0, "c")
    queue.take_now(c, 1.0)
    assert len(queue) == 0 and len(queue._spare) == 1
    queue.done(c)
    assert queue._groups == {}


def test_ordered_for_replays_what_the_backend_will_do() -> None:
    jobs = burst(12, 4.0)
    queue = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=30.0)
    for j in jobs:
        queue.push(j)
    now = 0.024  # everyone has arrived
    replayed = [j.payload for j in queue.ordered_for(now, lane(None))]  # type: ignore[attr-defined]
    assert len(replayed) == 24 and len(queue) == 24
    # What the backend then does, nothing else arriving, predicted seconds as service seconds:
    fresh = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=30.0)
    served = serve(fresh, [job(j.payload, now, j.model, score=j.score, predicted_s=4.0) for j in jobs])
    assert "".join(name[0] for name in replayed) == "".join(model or "" for _, model, _ in served)


# -- weighing a switch, and a guard that does not count a wait for a load -----------------------------


def names(order: list[tuple[str, str | None, float]]) -> list[str]:
    return [name for name, _, _ in order]


@pytest.mark.parametrize("fair_share", [False, True])
def test_a_guard_does_not_count_the_time_its_model_was_put_off_for_a_switch(fair_share: bool) -> None:
    # a holds the backend with 25 s of work. b's long request (arrived at 0.5 s) is overdue on the wall
    # clock by 0.5 + 1 + 3.2 x 6 = 20.7 s; its wait until a's work is done is a wait for the switch,
    # which the bound accounts for: after the switch b's requests go shortest first.
    jobs = [job(f"a{i}", 0.0, "a", score=0.5, predicted_s=5.0) for i in range(5)]
    jobs += [job("b-long", 0.5, "b", score=0.9, predicted_s=6.0)]
    jobs += [job(f"b-short{i}", 0.6, "b", score=0.1, predicted_s=1.0) for i in range(2)]
    queue = build_queue(make_policy("sjf"), **GUARD, fair_share=fair_share, model_switch_bound_s=30.0)
    order = serve(queue, jobs, held="a")
    assert names(order) == ["a0", "a1", "a2", "a3", "a4", "b-short0", "b-short1", "b-long"]
    # The rule before weighing counts every second: b's long request is overdue, and goes first.
    before = build_queue(
        make_policy("sjf"), **GUARD, fair_share=fair_share, model_switch_bound_s=30.0, model_switch_rule="bound"
    )
    assert names(serve(before, jobs, held="a"))[5] == "b-long"


def test_the_guard_still_bounds_a_wait_behind_shorter_requests_of_the_held_model() -> None:
    # a is held throughout, a short request (1 s) arriving every second: its long request, arrived at
    # 0.5 s, is overdue at 0.5 + 1 + 3.2 x 6 = 20.7 s and goes at the first slot free after that.
    jobs = [job(f"a-short{i}", float(i), "a", score=0.1, predicted_s=1.0) for i in range(40)]
    jobs.append(job("a-long", 0.5, "a", score=0.9, predicted_s=6.0))
    jobs.append(job("b", 0.0, "b", score=0.1, predicted_s=1.0))  # another model, put off within the bound
    order = serve(build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=60.0), jobs, held="a")
    start = {name: t for name, _, t in order}
    assert 20.7 < start["a-long"] <= 20.7 + 1.0


def test_three_short_requests_for_another_model_go_before_long_answers_for_the_held_one() -> None:
    # b's stretch: (3 s load + 3 x 1 s + 3 s back) / 3 = 3 s a request, against 6 s for a's next
    # request: serving b first spares each of b's three 18 s and costs each of a's three 9 s.
    queue = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=30.0)
    jobs = [job(f"a{i}", 0.0, "a", score=0.9, predicted_s=6.0) for i in range(3)]
    jobs += [job(f"b{i}", 0.0, "b", score=0.1, predicted_s=1.0) for i in range(3)]
    assert names(serve(queue, jobs, held="a")) == ["b0", "b1", "b2", "a0", "a1", "a2"]
    before = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=30.0, model_switch_rule="bound")
    assert names(serve(before, jobs, held="a")) == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_one_long_request_for_another_model_does_not_take_the_backend_from_short_ones() -> None:
    queue = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=30.0)
    jobs = [job(f"a{i}", 0.0, "a", score=0.1, predicted_s=1.0) for i in range(6)]
    jobs.append(job("b-long", 0.0, "b", score=0.9, predicted_s=10.0))
    order = serve(queue, jobs, held="a")
    assert names(order) == [f"a{i}" for i in range(6)] + ["b-long"] and switches(order) == 1


def test_a_switch_must_win_by_the_margin() -> None:
    # b: (3 + 1 + 3) / 1 = 7 s a request; a's next takes 10 s: 7 x 1.5 > 10, a stays. At 11 s it would go.
    for a_s, first in ((10.0, "a0"), (11.0, "b0")):
        queue = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=30.0)
        queue.push(job("a0", 0.0, "a", score=0.9, predicted_s=a_s))
        queue.push(job("b0", 0.0, "b", score=0.1, predicted_s=1.0))
        got = queue.pop_for(0.0, [lane("a")])  # type: ignore[attr-defined]
        assert got is not None and got[0].payload == first


def test_a_stretch_is_weighed_over_its_best_prefix() -> None:
    # b: three 1 s requests and one of 20 s. Its best stretch is the three: (3 + 3 + 3) / 3 = 3 s a
    # request, which beats a's 6 s by the margin; all four, (3 + 23 + 3) / 4 = 7.25 s, would not.
    queue = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=60.0)
    jobs = [job(f"a{i}", 0.0, "a", score=0.5, predicted_s=6.0) for i in range(3)]
    jobs += [job(f"b{i}", 0.0, "b", score=0.1, predicted_s=1.0) for i in range(3)]
    jobs.append(job("b-long", 0.0, "b", score=0.9, predicted_s=20.0))
    order = serve(queue, jobs, held="a")
    # after b's short ones, a's (3 + 18 + 3) / 3 = 8 s a request beats b's long one by the margin
    assert names(order) == ["b0", "b1", "b2", "a0", "a1", "a2", "b-long"]


def test_with_nothing_held_waiting_the_lowest_rate_is_loaded_not_the_oldest() -> None:
    queue = build_queue(make_policy("sjf"), **GUARD, model_switch_bound_s=30.0)
    queue.push(job("b-old", 0.0, "b", score=0.9, predicted_s=10.0))
    queue.push(job("c0", 1.0, "c", score=0.1, predicted_s=1.0))
    queue.push(job("c1", 1.0, "c", score=0.1, predicted_s=1.0))
    got = queue.pop_for(1.0, [lane("a")])  # type: ignore[attr-defined]
    assert got is not None and got[0].payload == "c0"  # (3 + 2) / 2 = 2.5 s a request against 13 s


def test_the_rule_is_named_and_checked() -> None:
    assert ModelAffinity(lambda: build_queue(make_policy("sjf")), 30.0).describe()["rule"] == "weighed"
    try:
        ModelAffinity(lambda: build_queue(make_policy("sjf")), 30.0, rule="sometimes")
    except ValueError as exc:
        assert "sometimes" in str(exc) and "weighed" in str(exc)
    else:
        raise AssertionError("an unknown rule was accepted")


# -- the bound, under adversarial arrivals, removals and pop times (hypothesis) ----------------------

op = st.tuples(
    st.sampled_from(["push", "push", "push", "pop", "pop", "remove", "done"]),
    st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0, 10.0, 40.0]),  # time steps: bursts (0) and gaps
    st.sampled_from(["a", "b", "c", None]),
    st.floats(0.0, 1.0),
    st.floats(0.05, 60.0),
    st.sampled_from(["", "t"]),
)


@settings(max_examples=300, deadline=None)
@given(
    operations=st.lists(op, min_size=1, max_size=120),
    bound_s=st.sampled_from([1.0, 5.0, 30.0]),
    policy=st.sampled_from(["sjf", "boost", "hrrn"]),
    fair_share=st.booleans(),
    free=st.sampled_from([(), ("c",)]),  # models whose load costs nothing
)
def test_no_held_model_is_served_once_a_switch_is_due(
    operations: list[tuple[str, float, str | None, float, float, str]],
    bound_s: float,
    policy: str,
    fair_share: bool,
    free: tuple[str, ...],
) -> None:
    queue: Any = build_queue(make_policy(policy), **GUARD, fair_share=fair_share, model_switch_bound_s=bound_s)
    now = 0.0
    held: str | None = None
    switched_s = -math.inf
    waiting: dict[int, Job[int]] = {}
    in_service: list[Job[int]] = []
    pushed = 0
    for kind, step, model, score, pred, tenant in operations:
        now += step
        if kind == "push":
            j = Job(pushed, now, score=score, predicted_s=pred, model=model, tenant=tenant)
            pushed += 1
            queue.push(j)
            waiting[j.payload] = j
        elif kind == "remove" and waiting:
            victim = waiting.pop(sorted(waiting)[len(waiting) // 2])
            assert queue.remove(victim)
        elif kind == "done" and in_service:
            queue.done(in_service.pop(0))
        elif kind == "pop":
            the_lane = Lane(Serving(Held(held, switched_s)), lambda m: 0.0 if m in free else 3.0)
            got = queue.pop_for(now, [the_lane])
            if not waiting:
                assert got is None
                continue
            assert got is not None
            j, _ = got
            costly = [w for w in waiting.values() if w.model != held and w.model not in free]
            put_off = {w.payload: now - max(w.arrival_s, switched_s) for w in costly}
            due = [w for w in costly if put_off[w.payload] >= bound_s]
            if j.model == held or j.model in free:
                assert not due, (j.model, held, put_off)  # the bound: no held model once a switch is due
            elif due:  # a due switch goes to the model put off longest
                assert max(put_off[w.payload] for w in waiting.values() if w.model == j.model) == max(put_off.values())
            if j.model != held and j.model not in free:
                held, switched_s = j.model, now
            assert waiting.pop(j.payload) is j
            in_service.append(j)
    assert len(queue) == len(waiting)


def test_what_the_queues_retain_goes_back_to_nothing_once_every_request_is_done() -> None:
    # Fair share per model: tenants and groups are kept while a request waits or runs, and dropped
    # (or kept as a few spares, as new) once the last one is done, so a long-lived proxy holds
    # nothing per request it has served.
    queue = build_queue(make_policy("sjf"), starvation_timeout_s=1.0, fair_share=True, model_switch_bound_s=30.0)
    jobs = [Job(f"r{i}", float(i), predicted_s=1.0, tenant=f"t{i % 5}", model=f"m{i % 3}") for i in range(60)]
    for job in jobs:
        queue.push(job)
    assert queue.retained()["model_groups"] == 3 and queue.retained()["fair_share_tenants"] == 15
    running = [queue.pop(100.0) for _ in range(len(jobs))]
    for got in running[:-1]:
        assert got is not None
        queue.done(got[0])
    held = queue.retained()
    assert held["model_groups"] == 1 and held["fair_share_tenants"] == 1
    assert held["model_in_flight"] == 1 and held["fair_share_in_flight"] == 1
    last = running[-1]
    assert last is not None
    queue.done(last[0])
    left = {k: n for k, n in queue.retained().items() if n and not k.endswith("_spare")}
    assert left == {}
    assert queue.retained()["model_spare"] <= 8
