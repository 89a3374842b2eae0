"""Paper reproductions at small size (clairvoyant.tools.sim.experiments)."""

from __future__ import annotations

from clairvoyant.tools.sim import Condition, Setup, paper_service, run_conditions, tau_sweep


def test_pure_sjf_beats_fcfs_on_short_p50_and_worsens_long_p95() -> None:
    setup = Setup(paper_service(), n=1500, seeds=(0, 1), rate_per_s=0.12)
    fcfs, sjf = run_conditions(setup, [Condition("fcfs", "fcfs"), Condition("sjf", "sjf")])
    for f, s in zip(fcfs.per_seed, sjf.per_seed, strict=True):
        assert s["short.sojourn.p50"] < 0.8 * f["short.sojourn.p50"]
        assert s["long.sojourn.p95"] > f["long.sojourn.p95"]
        # work conservation: same makespan and total busy time under both policies
        assert s["makespan_s"] == f["makespan_s"]


def test_tau_sweep_is_monotone_between_fcfs_and_pure_sjf() -> None:
    result = tau_sweep(Setup(paper_service(), n=1500, seeds=(0, 1), rate_per_s=0.12), multiples=(0.5, 3, 10))
    names = [c["name"] for c in result["conditions"]]
    assert names == ["fcfs", "sjf tau=0.5x", "sjf tau=3x", "sjf tau=10x", "sjf tau=inf"]
    p50 = [c["summary"]["short.sojourn.p50"]["mean"] for c in result["conditions"]]
    assert p50[0] >= p50[1] >= p50[2] >= p50[3] >= p50[4]
    promotions = [c["summary"]["promotions"]["mean"] for c in result["conditions"]]
    assert promotions[0] == 0 and promotions[-1] == 0 and promotions[1] > promotions[3] > 0
    assert 10 < result["fcfs_mean_short_sojourn_s"] < 25  # M/G/1: 3.5 + Wq(11.3) ~ 14.8
    assert result["conditions"][2]["tau_s"] == 10.5


def test_tau_from_measured_fcfs_sojourn() -> None:
    result = tau_sweep(Setup(paper_service(), n=800, seeds=(0,), rate_per_s=0.12), mu_short_s="fcfs", multiples=(1,))
    assert result["mu_short_s"] == result["fcfs_mean_short_sojourn_s"]
    assert result["conditions"][1]["tau_s"] == result["mu_short_s"]
