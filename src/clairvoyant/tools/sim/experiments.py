"""Runs: conditions x seeds over one workload setup, and the paper's named reproductions.

``run_conditions`` draws each seed's workload and scores once and runs every condition on them
(common random numbers): differences between conditions are paired per seed, so "SJF vs FCFS"
changes are computed per seed and then averaged.

Named experiments (paper 000, sections 5.4 and 5.5):

- ``tau_sweep``: lambda = 0.12/s, N(3.5, 0.8) Short / N(8.9, 2.0) Long 50/50, n = 2,000, 5 seeds;
  FCFS, SJF with tau in {0.5, 1, 2, 3, 5, 10} x mu_short, and pure SJF (tau = inf).
- ``spectrum``: the same service times at rho in {0.3, 0.5, 0.6, 0.74, 0.85}; Short P50 sojourn
  reduction of SJF (tau = 3 x mu_short) vs FCFS.

mu_short is ambiguous in the paper (3.4 defines it as the mean Short *sojourn* under load; the
RTX example and Figure 3 use 3.5 s, the mean Short *service* time). These functions take
``mu_short_s`` as a number (default 3.5) or the string "fcfs": the mean Short sojourn measured under
FCFS in the same run (mean over seeds). Both values are always reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clairvoyant.scheduling.policy import PolicyParams
from clairvoyant.scheduling.service_time import ServiceTimeModel
from clairvoyant.scheduling.slowdown import AdaptiveSlowdown
from clairvoyant.tools.sim.engine import Beliefs, simulate
from clairvoyant.tools.sim.predictors import OracleScorer, Scorer, pairwise_accuracy
from clairvoyant.tools.sim.report import aggregate, run_metrics
from clairvoyant.tools.sim.workload import (
    NormalService,
    ServiceModel,
    Workload,
    make_workload,
    score_stream,
    two_tenant_workload,
    with_deadlines,
    with_models,
)

__all__ = [
    "PAPER",
    "Condition",
    "ConditionResult",
    "Setup",
    "changes_vs",
    "paper_service",
    "relative_change",
    "run_conditions",
    "spectrum",
    "tau_sweep",
]

# What the paper reports (section 5.5 text and Figure 3; Table 9's body is not in our copy).
PAPER: dict[str, Any] = {
    "sjf_inf_short_p50_s": 5.97,
    "sjf_inf_short_p50_change": -0.38,
    "sjf_inf_long_p95_s": 79.3,
    "sjf_inf_long_p95_change": 0.53,
    "tau3_short_p50_change": -0.17,
    "tau3_long_p95_change": 0.17,
    "spectrum_reduction": {"0.74": 0.17, "0.85": 0.10, "below_0.5": "< 0.03"},
}

DEFAULT_MULTIPLES: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
DEFAULT_RHOS: tuple[float, ...] = (0.3, 0.5, 0.6, 0.74, 0.85)
PAPER_MU_SHORT_S = 3.5  # the paper's RTX 4090 value (3.4, Figure 3)

Progress = Callable[[int], Any]  # called with the number of finished runs (e.g. tqdm.update)


def paper_service(floor_s: float = 0.05) -> NormalService:
    """Paper 5.5: N(3.5 s, 0.8 s) Short, N(8.9 s, 2.0 s) Long, 50/50, clipped at ``floor_s``."""
    return NormalService({"short": (3.5, 0.8), "long": (8.9, 2.0)}, {"short": 0.5, "long": 0.5}, floor_s)


@dataclass(frozen=True, slots=True)
class Condition:
    """One scheduling configuration: a policy, its parameters, a starvation timeout, fair share."""

    name: str  # label in tables, e.g. "fcfs", "sjf tau=3x", "sjf tau=inf"
    policy: str  # a name known to clairvoyant.scheduling.policy.make_policy
    tau_s: float = math.inf  # starvation timeout, seconds (inf: none)
    tau_multiple: float | None = None  # tau / mu_short, when defined that way
    fair_share: bool = False  # one queue per tenant, shared in predicted seconds
    slowdown: float = 0.0  # guard deadline = tau + slowdown x predicted seconds
    learn_service_time: bool = False  # predicted seconds from the online service-time model (proxy-like)
    adaptive_slowdown: bool = False  # slowdown = the given one x (1 + CV^2) of measured service times
    params: PolicyParams = field(default_factory=PolicyParams)
    model_switch_bound_s: float = 0.0  # group requests by model, a switch put off at most this long (0: off)
    model_switch_rule: str = "weighed"  # how a backend weighs a switch before the bound (affinity.SWITCH_RULES)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "policy": self.policy, "tau_s": self.tau_s, "tau_multiple": self.tau_multiple,
            "fair_share": self.fair_share, "starvation_slowdown": self.slowdown,
            "learn_service_time": self.learn_service_time, "adaptive_slowdown": self.adaptive_slowdown, "boost_gamma_per_s": self.params.boost_gamma_per_s,
            "boost_auto_gamma": self.params.boost_auto_gamma, "boost_max_s": self.params.boost_max_s,
            "model_switch_bound_s": self.model_switch_bound_s, "model_switch_rule": self.model_switch_rule,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Setup:
    """A workload recipe: service model, arrivals, size, seeds, predictor and servers."""

    service: ServiceModel
    n: int = 2000
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    arrivals: str = "poisson"  # "poisson", "burst", "tenants" (two_tenant_workload) or "tenants-alone"
    rate_per_s: float | None = None  # give this or rho for poisson arrivals
    rho: float | None = None
    slots: int = 1
    scorer: Scorer = field(default_factory=OracleScorer)
    models: int = 1  # models the requests ask for, in equal shares (a slot holds one at a time)
    switch_s: float = 0.0  # seconds a slot takes to load a model it does not hold
    max_wait_s: tuple[float, ...] = ()  # queue deadlines drawn uniformly from these (seconds; empty: none)

    def describe(self) -> dict[str, Any]:
        mean_s = self.service.mean_service_s()
        rate = self.rate_per_s if self.rate_per_s is not None else (self.rho or 0.0) * self.slots / mean_s
        return {
            "service": _describe_service(self.service),
            "mean_service_s": mean_s,
            "n": self.n,
            "seeds": list(self.seeds),
            "arrivals": self.arrivals,
            "rate_per_s": rate if self.arrivals == "poisson" else None,
            "rho_nominal": rate * mean_s / self.slots if self.arrivals == "poisson" else None,
            "slots": self.slots,
            "models": self.models,
            "switch_s": self.switch_s,
            "max_wait_s": list(self.max_wait_s),
            "predictor": self.scorer.name,
            **({"target_accuracy": self.scorer.accuracy} if hasattr(self.scorer, "accuracy") else {}),
        }


def _describe_service(service: ServiceModel) -> dict[str, Any]:
    kind = type(service).__name__
    out: dict[str, Any] = {"model": kind}
    for attr in ("params", "mix", "floor_s", "c0_s", "c_tok_s"):
        if hasattr(service, attr):
            out[attr] = getattr(service, attr)
    if hasattr(service, "samples"):
        out["measured_counts"] = {k: len(v) for k, v in service.samples.items()}
    if hasattr(service, "records"):
        out["prompt_records"] = len(service.records)
    return out


@dataclass(slots=True)
class ConditionResult:
    condition: Condition
    per_seed: list[dict[str, float]] = field(default_factory=list)  # run_metrics + "seed", "accuracy"

    @property
    def summary(self) -> dict[str, dict[str, float]]:
        return aggregate(self.per_seed)

    def mean(self, key: str) -> float:
        return float(np.mean([run[key] for run in self.per_seed]))

    def as_dict(self) -> dict[str, Any]:
        return {**self.condition.as_dict(), "summary": self.summary, "per_seed": self.per_seed}


def run_conditions(
    setup: Setup, conditions: Sequence[Condition], progress: Progress | None = None
) -> list[ConditionResult]:
    """Every condition on every seed's workload. Deterministic in ``setup.seeds``."""
    results = [ConditionResult(c) for c in conditions]
    for seed in setup.seeds:
        workload = setup_workload(setup, seed)
        beliefs = _beliefs(setup.scorer, workload, seed)
        accuracy = pairwise_accuracy(beliefs.score, workload.class_idx)
        for result in results:
            c = result.condition
            schedule = simulate(
                workload, beliefs, policy=c.policy, starvation_timeout_s=c.tau_s,
                starvation_slowdown=AdaptiveSlowdown(c.slowdown) if c.adaptive_slowdown else c.slowdown,
                slots=setup.slots,
                fair_share=c.fair_share, params=c.params,
                service_time=ServiceTimeModel() if c.learn_service_time else None,
                model_switch_bound_s=c.model_switch_bound_s, switch_s=setup.switch_s,
                model_switch_rule=c.model_switch_rule,
            )  # fmt: skip
            result.per_seed.append({"seed": float(seed), "accuracy": accuracy, **run_metrics(workload, schedule)})
            if progress is not None:
                progress(1)
    return results


def setup_workload(setup: Setup, seed: int) -> Workload:
    """The workload of one seed (two-tenant arrivals use ``rho`` as the interactive tenant's own
    load; rho counts service seconds only, never loads)."""
    if setup.arrivals in ("tenants", "tenants-alone"):
        workload = two_tenant_workload(
            seed, setup.n, setup.service, interactive_rho=setup.rho or 0.3,
            only=1 if setup.arrivals == "tenants-alone" else None,
        )  # fmt: skip
    else:
        workload = make_workload(
            seed, setup.n, setup.service, arrivals=setup.arrivals, rate_per_s=setup.rate_per_s,
            rho=setup.rho, slots=setup.slots,
        )  # fmt: skip
    if setup.models > 1:
        workload = with_models(workload, seed, [1.0] * setup.models)
    if setup.max_wait_s:
        workload = with_deadlines(workload, seed, setup.max_wait_s)
    return workload


def _beliefs(scorer: Scorer, workload: Workload, seed: int) -> Beliefs:
    beliefs = getattr(scorer, "beliefs", None)
    if beliefs is not None:
        return beliefs(workload, score_stream(seed))  # type: ignore[no-any-return]
    return Beliefs.from_scores(scorer.scores(workload, score_stream(seed)))


def relative_change(result: ConditionResult, baseline: ConditionResult, key: str) -> dict[str, float]:
    """Per-seed ``result/baseline - 1`` of metric ``key``, as mean and std over seeds.

    A zero baseline (e.g. a median wait of 0 at low load) gives 0 if the result is 0 too, else NaN.
    """
    changes = [_ratio(r[key], b[key]) for r, b in zip(result.per_seed, baseline.per_seed, strict=True)]
    vals = np.array(changes)
    return {"mean": float(vals.mean()), "std": float(vals.std(ddof=1)) if len(vals) > 1 else 0.0}


CHANGE_KEYS: tuple[str, ...] = ("short.sojourn.p50", "long.sojourn.p95", "short.wait.p50", "long.wait.p95")


def changes_vs(results: Sequence[ConditionResult], baseline: ConditionResult) -> dict[str, dict[str, dict[str, float]]]:
    """``{condition: {metric: change}}`` vs ``baseline`` for the headline metrics (Short P50, Long P95)."""
    return {r.condition.name: {key: relative_change(r, baseline, key) for key in CHANGE_KEYS} for r in results}


def _ratio(value: float, base: float) -> float:
    if base == 0:
        return 0.0 if value == 0 else math.nan
    return value / base - 1.0


def _resolve_mu_short(mu_short_s: float | str, fcfs: ConditionResult) -> tuple[float, float]:
    measured = fcfs.mean("short.sojourn.mean")
    if mu_short_s == "fcfs":
        return measured, measured
    value = float(mu_short_s)
    if not value > 0:
        raise ValueError("mu_short must be > 0 or 'fcfs'")
    return value, measured


def tau_conditions(mu_short_s: float, multiples: Sequence[float]) -> list[Condition]:
    """SJF at each tau multiple, then pure SJF."""
    out = [Condition(f"sjf tau={m:g}x", "sjf", m * mu_short_s, m) for m in multiples]
    return [*out, Condition("sjf tau=inf", "sjf")]


def tau_sweep(
    setup: Setup,
    *,
    mu_short_s: float | str = PAPER_MU_SHORT_S,
    multiples: Sequence[float] = DEFAULT_MULTIPLES,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Paper 5.5 / Table 9: FCFS, SJF at tau = m x mu_short for each m, pure SJF.

    Returns a JSON-ready dict: setup, mu_short used and measured, each condition's per-seed
    metrics and summary, and per-condition changes vs FCFS (Short P50, Long P95; sojourn and wait).
    """
    (fcfs,) = run_conditions(setup, [Condition("fcfs", "fcfs")], progress)
    mu, measured = _resolve_mu_short(mu_short_s, fcfs)
    results = [fcfs, *run_conditions(setup, tau_conditions(mu, multiples), progress)]
    changes = changes_vs(results[1:], fcfs)
    return {
        "experiment": "tau-sweep",
        "setup": setup.describe(),
        "mu_short_s": mu,
        "mu_short_source": "fcfs-measured" if mu_short_s == "fcfs" else "given",
        "fcfs_mean_short_sojourn_s": measured,
        "fcfs_mean_short_wait_s": fcfs.mean("short.wait.mean"),
        "conditions": [r.as_dict() for r in results],
        "change_vs_fcfs": changes,
        "paper": PAPER,
    }


def spectrum(
    setup: Setup,
    *,
    rhos: Sequence[float] = DEFAULT_RHOS,
    tau_multiple: float = 3.0,
    mu_short_s: float | str = PAPER_MU_SHORT_S,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Paper Figure 3: Short P50 sojourn reduction of SJF (tau = m x mu_short) vs FCFS at each rho.

    ``setup.rho`` / ``setup.rate_per_s`` are replaced per point. Pure SJF is run too, for reference.
    With ``mu_short_s="fcfs"`` tau follows the FCFS mean Short sojourn measured at each rho.
    """
    points = []
    for rho in rhos:
        point_setup = Setup(
            setup.service, setup.n, setup.seeds, "poisson", None, rho, setup.slots, setup.scorer
        )  # fmt: skip
        (fcfs,) = run_conditions(point_setup, [Condition("fcfs", "fcfs")], progress)
        mu, measured = _resolve_mu_short(mu_short_s, fcfs)
        sjf_tau, sjf_inf = run_conditions(
            point_setup,
            [
                Condition(f"sjf tau={tau_multiple:g}x", "sjf", tau_multiple * mu, tau_multiple),
                Condition("sjf tau=inf", "sjf"),
            ],
            progress,
        )
        reductions = {}
        for label, r in (("tau", sjf_tau), ("inf", sjf_inf)):
            for key in ("short.sojourn.p50", "short.wait.p50", "long.sojourn.p95"):
                ch = relative_change(r, fcfs, key)
                reductions[f"{label}.{key}"] = {"mean": -ch["mean"], "std": ch["std"]}
        points.append(
            {
                "rho": rho,
                "rate_per_s": point_setup.describe()["rate_per_s"],
                "mu_short_s": mu,
                "tau_s": tau_multiple * mu,
                "fcfs_mean_short_sojourn_s": measured,
                "reduction": reductions,  # 1 - sjf/fcfs per seed; Long P95 negative = inflation
                "conditions": [r.as_dict() for r in (fcfs, sjf_tau, sjf_inf)],
            }
        )
    return {
        "experiment": "spectrum",
        "setup": {**setup.describe(), "rate_per_s": None, "rho_nominal": None},
        "tau_multiple": tau_multiple,
        "mu_short_source": "fcfs-measured" if mu_short_s == "fcfs" else "given",
        "points": points,
        "paper": PAPER,
    }
