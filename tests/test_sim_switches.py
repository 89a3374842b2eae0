"""The simulator with two models on a backend that loads one at a time, and with queue deadlines:
hand-computed schedules, and the properties every run must have."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clairvoyant.scheduling.slowdown import AdaptiveSlowdown
from clairvoyant.tools.sim import Workload, make_workload, paper_service, simulate, swaps
from clairvoyant.tools.sim.compare import switch_conditions
from clairvoyant.tools.sim.experiments import Setup, run_conditions
from clairvoyant.tools.sim.predictors import LabelScorer
from clairvoyant.tools.sim.report import run_metrics
from clairvoyant.tools.sim.workload import with_deadlines, with_models


def workload(
    arrivals: list[float], services: list[float], models: list[int], max_wait: list[float] | None = None
) -> Workload:
    n = len(arrivals)
    return Workload(
        np.asarray(arrivals, dtype=np.float64),
        np.asarray(services, dtype=np.float64),
        np.zeros(n, dtype=np.int8),
        np.full(n, -1, dtype=np.int64),
        model=np.asarray(models, dtype=np.int8),
        max_wait_s=None if max_wait is None else np.asarray(max_wait, dtype=np.float64),
    )


def test_fcfs_pays_a_load_at_every_change_of_model() -> None:
    # a0 loads (3 s) and runs 0..4; b0 loads and runs 4..8; a1 loads again and runs 8..12.
    w = workload([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0, 1, 0])
    s = simulate(w, w.service_s, policy="fcfs", switch_s=3.0)
    assert s.start_s.tolist() == [0.0, 4.0, 8.0]
    assert s.end_s.tolist() == [4.0, 8.0, 12.0]
    assert s.load_s is not None and s.load_s.tolist() == [3.0, 3.0, 3.0]
    assert s.switches == 2  # the first load is not a switch
    assert run_metrics(w, s)["switches"] == 2.0


def test_the_simulator_groups_by_model_with_the_proxys_rule() -> None:
    # The same arrivals; with a switch bound, a1 follows a0 (a is held), then b0: one switch.
    w = workload([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0, 1, 0])
    s = simulate(w, w.service_s, policy="sjf", switch_s=3.0, model_switch_bound_s=30.0)
    assert s.order.tolist() == [0, 2, 1]
    assert s.end_s.tolist() == [4.0, 9.0, 5.0]
    assert s.switches == 1
    # A bound shorter than the wait: b0, waiting since 0, is due at 1 s; the slot frees at 4 s.
    s = simulate(w, w.service_s, policy="sjf", switch_s=3.0, model_switch_bound_s=1.0)
    assert s.order.tolist() == [0, 1, 2] and s.switches == 2


def test_a_request_is_withdrawn_at_its_deadline_and_never_served() -> None:
    # busy runs 0..10; late (max wait 5) expires; patient (max wait 60) runs 10..11.
    w = workload([0.0, 0.0, 0.0], [10.0, 1.0, 1.0], [0, 0, 0], [math.inf, 5.0, 60.0])
    s = simulate(w, w.service_s, policy="fcfs")
    assert s.expired is not None and s.expired.tolist() == [False, True, False]
    assert math.isnan(s.start_s[1]) and s.start_s[2] == 10.0
    m = run_metrics(w, s)
    assert m["deadline.met"] == 0.5 and m["deadline.n"] == 2.0 and m["expired"] == 1.0
    assert m["all.n"] == 2.0  # percentiles over the requests served


def test_a_request_whose_deadline_is_the_decision_instant_is_not_sent() -> None:
    w = workload([0.0, 0.0, 0.0], [10.0, 1.0, 1.0], [0, 0, 0], [math.inf, 10.0, math.inf])
    s = simulate(w, w.service_s, policy="fcfs")
    assert s.expired is not None and s.expired.tolist() == [False, True, False] and s.start_s[2] == 10.0


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "hrrn"])
def test_no_request_is_ever_sent_at_or_after_its_deadline(policy: str) -> None:
    for seed in range(3):
        w = make_workload(seed, 400, paper_service(), rho=0.9)
        w = with_deadlines(with_models(w, seed), seed, (0.0, 5.0, 20.0, math.inf))
        s = simulate(
            w, w.service_s, policy=policy, starvation_timeout_s=1.0, starvation_slowdown=AdaptiveSlowdown(2.56),
            fair_share=True, model_switch_bound_s=30.0, switch_s=5.0,
        )  # fmt: skip
        served = ~np.isnan(s.start_s)
        assert s.expired is not None and (served == ~s.expired).all()
        assert (s.start_s[served] < (w.arrival_s + w.max_wait_s)[served]).all()  # type: ignore[operator]
        assert not served[w.max_wait_s == 0.0].any()  # a deadline at arrival: never sent
        assert served[np.isinf(w.max_wait_s)].all()  # type: ignore[arg-type]
        assert len(s.order) == served.sum()


def test_models_and_deadlines_keep_the_arrivals_and_services_of_the_seed() -> None:
    base = make_workload(4, 200, paper_service(), rho=0.6)
    both = with_deadlines(with_models(base, 4), 4, (10.0, 30.0))
    assert (both.arrival_s == base.arrival_s).all() and (both.service_s == base.service_s).all()
    assert both.model is not None and 0.35 < both.model.mean() < 0.65
    assert both.max_wait_s is not None and set(both.max_wait_s.tolist()) == {10.0, 30.0}
    again = with_deadlines(with_models(base, 4), 4, (10.0, 30.0))
    assert (again.model == both.model).all() and (again.max_wait_s == both.max_wait_s).all()  # type: ignore[union-attr]


def test_the_default_groups_models_and_beats_the_default_without_affinity_on_the_switch_workload() -> None:
    setup = Setup(paper_service(), 600, (0, 1), rho=0.6, scorer=LabelScorer(0.8), models=2, switch_s=5.0)
    fcfs, paper, unaffined, default = run_conditions(setup, switch_conditions())
    assert default.condition.model_switch_bound_s > 0 and unaffined.condition.model_switch_bound_s == 0
    assert default.mean("switches") < 0.8 * unaffined.mean("switches")
    assert default.mean("all.sojourn.mean") < 0.8 * unaffined.mean("all.sojourn.mean")
    assert default.mean("all.sojourn.p99") <= unaffined.mean("all.sojourn.p99")
    assert fcfs.mean("switches") > 0.4 * 600  # models drawn 50/50: about every other request switches


# -- the model-swap experiment (tools/sim/swaps.py) --------------------------------------------------


def test_the_best_order_is_found_by_trying_every_one() -> None:
    # b (1 s) then a (5 s), one load each: ends 4 and 12, mean 8; a first: ends 8 and 12, mean 10.
    w = workload([0.0, 0.0], [5.0, 1.0], [0, 1])
    assert swaps.best_mean_s(w, 3.0) == pytest.approx(8.0, abs=1e-9)
    # one model; long arrives at 0, short at 1. Idling for the short one is best: it ends at 1 + 3 + 1
    # = 5, the long one at 10: sojourns 4 and 10, mean 7. Without idling the long one goes first: ends
    # 8 and 9, sojourns 8 and 8.
    w = workload([0.0, 1.0], [5.0, 1.0], [0, 0])
    assert swaps.best_mean_s(w, 3.0) == pytest.approx(7.0, abs=1e-9)
    assert swaps.best_mean_s(w, 3.0, idle=False) == pytest.approx(8.0, abs=1e-9)


def test_a_put_off_is_measured_per_stretch_against_the_bound_and_the_request_in_flight() -> None:
    # fcfs: a0 (0..13 with its load), a1 (13..23), b0 waits from 0 to the switch at 23: 23 s put off.
    w = workload([0.0, 0.0, 0.0], [10.0, 10.0, 1.0], [0, 0, 1])
    s = simulate(w, w.service_s, policy="fcfs", switch_s=3.0)
    # bound 5 s: due at 5 s, a0 in flight until 13 s: allowed 13 s, put off 23 s, 10 s past it
    assert swaps.put_off_past_bound_s(w, s, 5.0) == pytest.approx((23.0, 10.0), abs=1e-9)
    # bound 20 s: due at 20 s, a1 in flight until 23 s: allowed 23 s, exactly used
    assert swaps.put_off_past_bound_s(w, s, 20.0) == pytest.approx((23.0, 0.0), abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(
    gaps=st.lists(st.sampled_from([0.0, 0.0, 0.3, 1.0, 4.0, 15.0]), min_size=2, max_size=40),
    data=st.data(),
    bound_s=st.sampled_from([2.0, 10.0, 30.0]),
    rule=st.sampled_from(["weighed", "bound"]),
)
def test_no_request_is_put_off_past_the_bound_and_the_request_in_flight(
    gaps: list[float], data: st.DataObject, bound_s: float, rule: str
) -> None:
    n = len(gaps)
    services = data.draw(st.lists(st.floats(0.05, 20.0), min_size=n, max_size=n))
    models = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    noise = data.draw(st.lists(st.floats(0.25, 4.0), min_size=n, max_size=n))  # predictions off by up to 4x
    w = workload(np.cumsum(gaps).tolist(), services, models)
    default = swaps.swap_conditions()[-1]
    s = simulate(
        w, np.asarray(services) * np.asarray(noise), policy=default.policy, starvation_timeout_s=default.tau_s,
        starvation_slowdown=default.slowdown, fair_share=default.fair_share, model_switch_bound_s=bound_s,
        switch_s=3.0, model_switch_rule=rule,
    )  # fmt: skip
    _, past_s = swaps.put_off_past_bound_s(w, s, bound_s)
    assert past_s <= 1e-9


def test_the_default_comes_within_a_tenth_of_the_best_order_on_small_bursts() -> None:
    fcfs, before, default = swaps.swap_conditions()
    ratios: dict[str, list[float]] = {c.name: [] for c in (fcfs, before, default)}
    for seed in range(8):
        w = swaps.burst_workload(seed, 7, 2)
        best = swaps.best_mean_s(w, 3.0)
        for c in (fcfs, before, default):
            s = simulate(
                w, w.service_s, policy=c.policy, starvation_timeout_s=c.tau_s, starvation_slowdown=c.slowdown,
                fair_share=c.fair_share, model_switch_bound_s=c.model_switch_bound_s, switch_s=3.0,
                model_switch_rule=c.model_switch_rule,
            )  # fmt: skip
            ratios[c.name].append(float(s.end_s.mean()) / best)
    assert np.mean(ratios[default.name]) <= 1.10
    assert np.mean(ratios[default.name]) < np.mean(ratios[before.name]) < np.mean(ratios[fcfs.name])
