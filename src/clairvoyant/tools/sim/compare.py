"""``clairvoyant simulate compare``: every policy on three workloads: the paper's,
heavy-tailed, and two tenants.

Workloads (n requests x seeds each; common random numbers across conditions):

- ``paper``: paper 5.5, Poisson lambda = 0.12/s (rho 0.74), N(3.5, 0.8) s Short / N(8.9, 2.0) s Long.
- ``heavy``: real ShareGPT answer lengths (the prompts file's reference answers) at a fixed decode
  speed, s = c0 + c_tok x answer tokens, Poisson at rho 0.74; the real predictor scores the real
  prompts. Also the default with predicted seconds from the online service-time model, taught
  each completion as the proxy does ("learned S"; the real predictor only, which has tokens).
- ``tenants``: tenant 0 floods (half the requests in one batch at t = 0), tenant 1 is interactive
  (Poisson at rho 0.3 on its own), paper service times; also tenant 1 alone, for the 2x target.
- ``models``: two models 50/50 on one serial backend that holds one model at a time and takes
  ``switch_s`` (5 s) to load the other; paper service times, Poisson at rho 0.6 counted without
  loads. Conditions: fcfs, the paper's rule, the default without model affinity and the default.
- ``deadlines``: the ``models`` workload with a queue deadline on every request, drawn from
  10, 30, 60 and 120 s: a request not dispatched by then is withdrawn, never sent.

Predictors: ``oracle`` (true seconds), ``label`` (class label right 80% of the time), ``noisy``
(pairwise accuracy 0.8), ``onnx`` (the shipped model; heavy workload only).

The conditions are the registry's policies at their settings, plus the paper's tau = 10.5 s and the
configured default. Tables: per class Short/Long P50/P95 sojourn, max wait, all-request P99, changes
vs FCFS, and per-tenant P50/P95 wait.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from clairvoyant.scheduling.policy import PolicyParams
from clairvoyant.tools.sim.experiments import (
    Condition,
    ConditionResult,
    Setup,
    paper_service,
    relative_change,
    run_conditions,
)
from clairvoyant.tools.sim.predictors import LabelScorer, NoisyScorer, OracleScorer, PredictorScorer, Scorer
from clairvoyant.tools.sim.workload import PromptService, load_prompts

__all__ = ["compare", "compare_json", "compare_markdown", "default_conditions", "switch_conditions"]


def _default_condition() -> Condition:
    """The proxy's default settings, as a simulator condition (model affinity included)."""
    from clairvoyant.config import Settings  # config is below the proxy layers: no app import

    defaults = {name: f.default for name, f in Settings.model_fields.items()}  # defaults only, no environment
    params = PolicyParams(defaults["boost_gamma_per_s"], defaults["boost_auto_gamma"], defaults["boost_max_s"])
    adaptive = defaults["starvation_slowdown_adaptive"]
    slowdown = f"{defaults['starvation_slowdown']:g}x(1+CV2)" if adaptive else f"{defaults['starvation_slowdown']:g}"
    return Condition(
        f"default ({defaults['policy']} tau={defaults['starvation_timeout_s']:g}+{slowdown}xS, "
        f"switch bound {defaults['model_switch_bound_s']:g} s)",
        defaults["policy"], defaults["starvation_timeout_s"], slowdown=defaults["starvation_slowdown"],
        fair_share=defaults["fair_share"], params=params, adaptive_slowdown=adaptive,
        model_switch_bound_s=defaults["model_switch_bound_s"],
    )  # fmt: skip


def switch_conditions() -> list[Condition]:
    """fcfs, the paper's rule, the default without model affinity, the default."""
    default = _default_condition()
    unaffined = replace(default, name="default, no model affinity", model_switch_bound_s=0.0)
    return [Condition("fcfs", "fcfs"), Condition("sjf tau=10.5 (paper)", "sjf", 10.5), unaffined, default]


SWITCH_S = 5.0  # the models workload's load, seconds
SWITCH_RHO = 0.6  # its utilisation, counted without loads
DEADLINES_S = (10.0, 30.0, 60.0, 120.0)  # the deadlines workload's queue deadlines, drawn uniformly


def default_conditions() -> list[Condition]:
    return [
        Condition("fcfs", "fcfs"),
        Condition("sjf tau=10.5 (paper)", "sjf", 10.5),
        Condition("sjf tau=inf", "sjf"),
        Condition("boost g=0.05", "boost", params=PolicyParams(0.05, False, 1e9)),
        Condition("boost g=0.02 tau=25", "boost", 25.0, params=PolicyParams(0.02, False, 1e9)),
        Condition("boost auto-gamma", "boost", params=PolicyParams(0.05, True, 1e9)),
        Condition("hrrn", "hrrn"),
        _default_condition(),
    ]


def _with_fair_share(conditions: Sequence[Condition]) -> list[Condition]:
    out = [Condition("fcfs (no fair share)", "fcfs")]
    for c in conditions:
        out.append(replace(c, name=c.name if c.fair_share else c.name + " +fair", fair_share=True))
    return out


def compare(
    *,
    n: int = 2000,
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    prompts: Path | None = None,
    model: Path | None = None,
    c0_s: float = 0.3,
    c_tok_s: float = 0.02,
    workloads: Sequence[str] = ("paper", "heavy", "tenants"),
    progress: Any = None,
    switch_s: float = SWITCH_S,
) -> dict[str, Any]:
    """Run every condition on every (workload, predictor) pair; JSON-ready results."""
    conditions = default_conditions()
    seeds = tuple(seeds)
    blocks: list[dict[str, Any]] = []

    def block(workload: str, setup: Setup, conds: list[Condition], extra: dict[str, Any] | None = None) -> None:
        results = run_conditions(setup, conds, progress)
        blocks.append({"workload": workload, "predictor": setup.scorer.name, "setup": setup.describe(),
                       "results": results, **(extra or {})})  # fmt: skip

    if "paper" in workloads:
        for scorer in (OracleScorer(), LabelScorer(0.8), NoisyScorer(0.8)):
            block("paper", Setup(paper_service(), n, seeds, rate_per_s=0.12, scorer=scorer), conditions)
    if "heavy" in workloads and prompts is not None:
        service = PromptService(load_prompts(prompts), c0_s, c_tok_s)
        from clairvoyant.prediction.predictor import OnnxPredictor

        scorers: list[Scorer] = [
            OracleScorer(),
            NoisyScorer(0.8),
            PredictorScorer(OnnxPredictor(model), service.records, c0_s=c0_s, c_tok_s=c_tok_s),
        ]
        d = conditions[-1]  # the default, with predicted seconds from the online service-time model
        learned = replace(d, name=d.name + " learned S", learn_service_time=True)
        for scorer in scorers:
            block("heavy", Setup(service, n, seeds, rho=0.74, scorer=scorer), [*conditions, learned])
    if "tenants" in workloads:
        scorer = LabelScorer(0.8)
        alone = run_conditions(
            Setup(paper_service(), n, seeds, "tenants-alone", rho=0.3, scorer=scorer), conditions, progress
        )
        block("tenants", Setup(paper_service(), n, seeds, "tenants", rho=0.3, scorer=scorer), _with_fair_share(conditions),
              {"alone": alone})  # fmt: skip
    for name, deadlines in (("models", ()), ("deadlines", DEADLINES_S)):
        if name in workloads:
            for scorer in (LabelScorer(0.8), OracleScorer()):
                setup = Setup(paper_service(), n, seeds, rho=SWITCH_RHO, scorer=scorer, models=2, switch_s=switch_s,
                              max_wait_s=deadlines)  # fmt: skip
                block(name, setup, switch_conditions())
    return {"experiment": "compare", "blocks": blocks}


def _cell(result: ConditionResult, key: str) -> str:
    s = result.summary.get(key)
    return "" if s is None else f"{s['mean']:.2f} ± {s['std']:.2f}"


def _change(result: ConditionResult, base: ConditionResult, key: str) -> str:
    c = relative_change(result, base, key)
    return f"{c['mean'] * 100:+.1f}% ± {c['std'] * 100:.1f}"


def compare_markdown(data: dict[str, Any]) -> str:
    lines: list[str] = []
    for b in data["blocks"]:
        results: list[ConditionResult] = b["results"]
        base = results[0]
        acc = results[0].mean("accuracy")
        lines += ["", f"### {b['workload']} workload, {b['predictor']} predictor"
                  + ("" if math.isnan(acc) else f" (Short-vs-Long pairwise accuracy {acc:.3f})"), ""]  # fmt: skip
        if b["workload"] in ("models", "deadlines"):
            lines += _switch_table(b, results)
            continue
        if b["workload"] == "tenants":
            alone = {r.condition.name: r for r in b["alone"]}
            lines += [
                "| condition | interactive P50 wait | interactive P95 wait | alone P95 wait | ratio | flood P50 wait | flood P95 wait |",
                "|---|---|---|---|---|---|---|",
            ]
            for r in results:
                name = r.condition.name.removesuffix(" +fair").removesuffix(" (no fair share)")
                own = alone[name]  # the same policy with the interactive tenant alone
                ratio = r.mean("tenant1.wait.p95") / max(own.mean("tenant1.wait.p95"), 1e-9)
                lines.append(
                    f"| {r.condition.name} | {_cell(r, 'tenant1.wait.p50')} | {_cell(r, 'tenant1.wait.p95')} | "
                    f"{_cell(own, 'tenant1.wait.p95')} | {ratio:.2f}x | {_cell(r, 'tenant0.wait.p50')} | {_cell(r, 'tenant0.wait.p95')} |"
                )
            continue
        lines += [
            "| condition | Short P50 | Short P95 | Long P50 | Long P95 | all P99 | max wait | Short P50 vs FCFS | Long P95 vs FCFS | all P99 vs FCFS |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            lines.append(
                f"| {r.condition.name} | {_cell(r, 'short.sojourn.p50')} | {_cell(r, 'short.sojourn.p95')} | "
                f"{_cell(r, 'long.sojourn.p50')} | {_cell(r, 'long.sojourn.p95')} | {_cell(r, 'all.sojourn.p99')} | "
                f"{_cell(r, 'all.wait.max')} | {_change(r, base, 'short.sojourn.p50')} | "
                f"{_change(r, base, 'long.sojourn.p95')} | {_change(r, base, 'all.sojourn.p99')} |"
            )
    lines.insert(
        0, "Sojourn times in seconds (arrival to completion), mean ± std over seeds; changes per seed vs FCFS."
    )
    return "\n".join(lines)


def _switch_table(block: dict[str, Any], results: list[ConditionResult]) -> list[str]:
    """Swaps, Short P50/P95, all-request P99, mean, deadlines met; ratios to the default without model affinity."""
    setup = block["setup"]
    base = next(r for r in results if r.condition.name == "default, no model affinity")
    deadlines = block["workload"] == "deadlines"
    lines = [
        f"two models 50/50, a {setup['switch_s']:g} s load to switch, rho {setup['rho_nominal']:.2f} without loads"
        + (f"; queue deadlines {', '.join(f'{d:g}' for d in setup['max_wait_s'])} s (percentiles over the requests served)" if deadlines else ""),
        "",
        "| condition | swaps | Short P50 | Short P95 | all P99 | mean | deadlines met | mean vs no affinity | all P99 vs no affinity |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in results:
        met = f"{r.mean('deadline.met') * 100:.1f}% ± {r.summary['deadline.met']['std'] * 100:.1f}" if deadlines else ""
        lines.append(
            f"| {r.condition.name} | {r.mean('switches'):.1f} ± {r.summary['switches']['std']:.1f} | {_cell(r, 'short.sojourn.p50')} | {_cell(r, 'short.sojourn.p95')} | "
            f"{_cell(r, 'all.sojourn.p99')} | {_cell(r, 'all.sojourn.mean')} | {met} | "
            f"{_ratio(r, base, 'all.sojourn.mean')} | {_ratio(r, base, 'all.sojourn.p99')} |"
        )  # fmt: skip
    return lines


def _ratio(result: ConditionResult, base: ConditionResult, key: str) -> str:
    """result / base per seed, mean ± std (x 100 %)."""
    c = relative_change(result, base, key)
    return f"{(1 + c['mean']) * 100:.1f}% ± {c['std'] * 100:.1f}"


def compare_json(data: dict[str, Any]) -> dict[str, Any]:
    out = []
    for b in data["blocks"]:
        out.append({**{k: v for k, v in b.items() if k not in ("results", "alone")},
                    "results": [_brief(r) for r in b["results"]],
                    **({"alone": [_brief(r) for r in b["alone"]]} if "alone" in b else {})})  # fmt: skip
    return {"experiment": "compare", "blocks": out}


def _brief(result: ConditionResult) -> dict[str, Any]:
    """A condition's settings and summary (mean and std over seeds) without the per-seed rows."""
    return {**result.condition.as_dict(), "summary": result.summary}
