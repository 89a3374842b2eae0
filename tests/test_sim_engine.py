"""The simulator's event loop (clairvoyant.tools.sim.engine) against hand-computed schedules and M/G/1 theory."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clairvoyant.tools.sim import NoisyScorer, OracleScorer, Workload, make_workload, paper_service, simulate
from clairvoyant.tools.sim.workload import score_stream


def workload(arrivals: list[float], services: list[float], classes: list[int] | None = None) -> Workload:
    n = len(arrivals)
    return Workload(
        np.asarray(arrivals, dtype=np.float64),
        np.asarray(services, dtype=np.float64),
        np.asarray(classes if classes is not None else [0] * n, dtype=np.int8),
        np.full(n, -1, dtype=np.int64),
    )


def test_fcfs_matches_a_hand_computed_schedule() -> None:
    # t=0 A(3) starts; B arrives 1, C 2 wait; A ends 3 -> B runs 3..4, C 4..6; idle; D arrives 10.
    w = workload([0.0, 1.0, 2.0, 10.0], [3.0, 1.0, 2.0, 1.0])
    s = simulate(w, w.service_s, policy="fcfs")
    assert s.start_s.tolist() == [0.0, 3.0, 4.0, 10.0]
    assert s.end_s.tolist() == [3.0, 4.0, 6.0, 11.0]
    assert s.wait_s(w).tolist() == [0.0, 2.0, 2.0, 0.0]
    assert s.sojourn_s(w).tolist() == [3.0, 3.0, 4.0, 1.0]
    assert s.order.tolist() == [0, 1, 2, 3]


def test_fcfs_ignores_scores() -> None:
    w = workload([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    s = simulate(w, np.array([9.0, 1.0, 5.0]), policy="fcfs")
    assert s.order.tolist() == [0, 1, 2]


def test_sjf_orders_a_burst_by_score() -> None:
    # All arrive at t=0: every arrival is queued before the first pop, so the shortest goes first.
    w = workload([0.0] * 4, [5.0, 1.0, 3.0, 2.0])
    s = simulate(w, w.service_s, policy="sjf")
    assert s.order.tolist() == [1, 3, 2, 0]
    assert s.start_s.tolist() == [6.0, 0.0, 3.0, 1.0]
    assert s.end_s.max() == 11.0


def test_sjf_ties_go_by_arrival() -> None:
    w = workload([0.0] * 3, [2.0, 2.0, 2.0])
    assert simulate(w, np.array([1.0, 0.5, 0.5]), policy="sjf").order.tolist() == [1, 2, 0]


def test_two_slots_hand_schedule() -> None:
    # At 0 slot 0 pops first and gets the shorter B(1), slot 1 gets A(4). C arrives 0.5: slot 0
    # frees at 1, C runs 1..3. D (1 s) and E (5 s) arrive at 2: slot 0 frees at 3 -> D, the shorter,
    # 3..4. Slots 0 and 1 both free at 4: the lower index takes E.
    w = workload([0.0, 0.0, 0.5, 2.0, 2.0], [4.0, 1.0, 2.0, 1.0, 5.0])
    s = simulate(w, w.service_s, policy="sjf", slots=2)
    assert s.start_s.tolist() == [0.0, 0.0, 1.0, 3.0, 4.0]
    assert s.slot.tolist() == [1, 0, 0, 0, 0]


def starvation_workload() -> Workload:
    # R (service 5) runs from 0; L (long, score 100) arrives at 0.5; a short job (score 1) arrives
    # every second from 1 to 30, each 5 s long. Dispatch decisions fall at 5, 10, 15, ...
    arrivals = [0.0, 0.5] + [float(t) for t in range(1, 31)]
    services = [5.0, 5.0] + [5.0] * 30
    return workload(arrivals, services)


def test_starvation_promotes_the_oldest_in_virtual_time() -> None:
    w = starvation_workload()
    scores = np.array([0.0, 100.0] + [1.0] * 30)
    # tau = 10: at t=5 L waited 4.5, at t=10 9.5 (< tau, shorts go), at t=15 14.5 > 10: promoted.
    s = simulate(w, scores, policy="sjf", starvation_timeout_s=10.0)
    assert s.start_s[1] == 15.0
    assert s.promoted[1] and s.promoted.sum() >= 1
    # after L, every waiting short is older than tau at each decision: they go in arrival order.
    after = s.order.tolist()[s.order.tolist().index(1) + 1 :]
    assert after == sorted(after)
    # tau = 4.4 fires at the first decision (t=5, waited 4.5).
    assert simulate(w, scores, policy="sjf", starvation_timeout_s=4.4).start_s[1] == 5.0
    # without a timeout L goes last.
    pure = simulate(w, scores, policy="sjf")
    assert pure.order[-1] == 1 and pure.promotions == 0


def test_starvation_rule_is_strict_at_exactly_tau() -> None:
    # At t=10 L has waited exactly 9.5; tau = 9.5 does not fire ("waited longer than tau").
    w = starvation_workload()
    scores = np.array([0.0, 100.0] + [1.0] * 30)
    assert simulate(w, scores, policy="sjf", starvation_timeout_s=9.5).start_s[1] == 15.0


def test_rejects_bad_arguments() -> None:
    w = workload([0.0], [1.0])
    with pytest.raises(ValueError):
        simulate(w, np.array([1.0, 2.0]))
    with pytest.raises(ValueError):
        simulate(w, np.array([1.0]), slots=0)
    with pytest.raises(ValueError):
        simulate(w, np.array([1.0]), policy="nope")


def test_fcfs_mean_wait_matches_pollaczek_khinchine() -> None:
    # M/G/1 at rho = 0.5 with the paper's service mix: Wq = lambda E[S^2] / (2 (1 - rho)).
    service = paper_service()
    rho = 0.5
    lam = rho / service.mean_service_s()
    es2 = 0.5 * (3.5**2 + 0.8**2) + 0.5 * (8.9**2 + 2.0**2)
    expected = lam * es2 / (2 * (1 - rho))
    w = make_workload(11, 150_000, service, rho=rho)
    got = float(simulate(w, w.service_s, policy="fcfs").wait_s(w).mean())
    assert got == pytest.approx(expected, rel=0.03)


def test_class_priority_matches_cobham_formula() -> None:
    # A perfect class predictor under SJF is a non-preemptive two-class priority queue:
    # W_short = W0 / (1 - rho_s), W_long = W0 / ((1 - rho_s)(1 - rho)), W0 = lambda E[S^2] / 2.
    service = paper_service()
    rho = 0.5
    lam = rho / service.mean_service_s()
    w0 = lam * (0.5 * (3.5**2 + 0.8**2) + 0.5 * (8.9**2 + 2.0**2)) / 2
    rho_s = lam * 0.5 * 3.5
    w = make_workload(12, 150_000, service, rho=rho)
    scores = NoisyScorer(1.0).scores(w, score_stream(12))
    wait = simulate(w, scores, policy="sjf").wait_s(w)
    assert wait[w.class_idx == 0].mean() == pytest.approx(w0 / (1 - rho_s), rel=0.04)
    assert wait[w.class_idx == 2].mean() == pytest.approx(w0 / ((1 - rho_s) * (1 - rho)), rel=0.04)


def test_same_seed_same_schedule_and_different_seed_differs() -> None:
    service = paper_service()
    runs = []
    for seed in (3, 3, 4):
        w = make_workload(seed, 500, service, rate_per_s=0.12)
        scores = NoisyScorer(0.8).scores(w, score_stream(seed))
        runs.append((w, simulate(w, scores, policy="sjf", starvation_timeout_s=10.5)))
    (w1, s1), (w2, s2), (w3, s3) = runs
    assert np.array_equal(w1.arrival_s, w2.arrival_s) and np.array_equal(s1.end_s, s2.end_s)
    assert np.array_equal(s1.order, s2.order)
    assert not np.array_equal(w1.arrival_s, w3.arrival_s)


def test_workload_is_shared_across_predictors() -> None:
    # The arrival and service streams do not depend on which scorer runs (paired comparisons).
    service = paper_service()
    w = make_workload(5, 300, service, rate_per_s=0.12)
    a = OracleScorer().scores(w, score_stream(5))
    b = NoisyScorer(0.9).scores(w, score_stream(5))
    assert np.array_equal(a, w.service_s) and not np.array_equal(a, b)
    assert math.isclose(float(w.service_s.mean()), 6.2, rel_tol=0.1)


def test_the_online_service_time_model_learns_from_each_completion() -> None:
    from clairvoyant.scheduling.service_time import ServiceTimeModel
    from clairvoyant.tools.sim.engine import Beliefs

    w = make_workload(5, 300, paper_service(), rate_per_s=0.12)
    tokens = np.where(w.class_idx == 0, 100.0, 800.0)
    beliefs = Beliefs(tokens, np.maximum(tokens * 0.02, 1e-3), np.zeros(300, dtype=np.int64), tokens)
    model = ServiceTimeModel()
    simulate(w, beliefs, policy="sjf", service_time=model)
    # Every request but the last one in flight was completed before the run ended and taught it.
    assert model.coefficients(None)["observations"] == 299
    # Paper service: ~3.5 s for 100 predicted tokens, ~8.9 s for 800: the fit moves off the defaults.
    assert model.predict_s(None, 0, 100) == pytest.approx(3.5, abs=0.8)
    assert model.predict_s(None, 0, 800) == pytest.approx(8.9, abs=0.8)


@pytest.mark.parametrize("slots", [1, 2])
def test_fair_share_with_one_tenant_is_the_plain_guarded_queue(slots: int) -> None:
    # Single-tenant workloads must not change when fair share is on: the share clock is the wall
    # clock with one tenant, and there is no other tenant to interleave.
    from clairvoyant.scheduling.slowdown import AdaptiveSlowdown

    w = make_workload(7, 600, paper_service(), rho=0.8, slots=slots)
    scores = NoisyScorer(0.8).scores(w, score_stream(7))
    runs = [
        simulate(
            w,
            scores,
            policy="sjf",
            starvation_timeout_s=1.0,
            starvation_slowdown=AdaptiveSlowdown(2.56),
            slots=slots,
            fair_share=fair,
        )
        for fair in (False, True)
    ]
    assert runs[0].promotions > 0  # the guard fires, so its clock matters
    assert np.array_equal(runs[0].order, runs[1].order) and np.array_equal(runs[0].start_s, runs[1].start_s)


def test_a_flooding_tenant_does_not_make_the_other_tenants_guard_fifo() -> None:
    # Tenant 0 floods at t = 0; tenant 1's requests arrive in a Poisson stream. With fair share each
    # tenant's guard ages on the share clock (half speed while both wait): tenant 1's P95 wait stays
    # within 2x of its wait alone (the target docs/simulation.md states; one seed here, five in simulate compare).
    from clairvoyant.tools.sim.predictors import LabelScorer
    from clairvoyant.tools.sim.workload import two_tenant_workload

    p95 = {}
    for only in (None, 1):
        w = two_tenant_workload(0, 2000, paper_service(), interactive_rho=0.3, only=only)
        beliefs = LabelScorer(0.8).beliefs(w, score_stream(0))
        s = simulate(w, beliefs, policy="sjf", starvation_timeout_s=1.0, starvation_slowdown=3.2, fair_share=True)
        mine = w.tenant == 1
        p95[only] = float(np.percentile(s.wait_s(w)[mine], 95))
    assert 1.0 < p95[None] / p95[1] < 2.0, p95
