"""``clairvoyant simulate swaps``: model switches on mixed-length work, against fcfs, the switch rule
before weighing, and the best order there is.

One serial backend holds one model at a time and takes ``switch_s`` (3 s) to load another (its
first load too). Service times: Short N(1, 0.3) s and Long N(6, 1.5) s, half and half, so a model's
share of a burst outlasts the starvation guard many times over. Workloads, with 2 and 3 models:

- ``burst``: ``burst_n`` (24) requests at t = 0, exactly half Short, in a shuffled order, models
  assigned in turn (the through-the-proxy benchmark's shape, ``benchmarks/bench_model_swaps.py``);
- ``poisson``: ``n`` (2,000) requests, Poisson at rho 0.6 counted without loads, each model drawn
  at random;
- ``small``: ``small_n`` (7) requests, as a burst and as Poisson arrivals at rho 1.5, where every
  order is tried (``best_mean_s``): the lowest mean sojourn any non-preemptive order reaches, idling
  allowed, every load paid, every arrival known in advance. That is the physical limit the rule is
  measured against; the best order that never idles while a request waits is shown beside it (on a
  burst the two are one).

Conditions: fcfs; the proxy's default with the switch rule before weighing (``model_switch_rule``
"bound": hold the model until a request for another one has been put off the bound, the guard on the
wall clock); the proxy's default (rule "weighed"). Predictors: the oracle (true seconds), and a
class label right 80% of the time (predicted seconds = its class's mean) on the larger workloads.

Every figure is a sojourn (arrival to end of service, load included), mean over seeds: Short P50,
mean and P99 of every request, switches, and the longest a request was put off past its bound
(``put_off_past_bound_s``: per stretch of its wait during which the backend held another model, the
put-off minus ``bound_s`` and the rest of the request in flight when the bound ran out; at most 0
when the bound holds).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from clairvoyant.tools.sim.compare import _default_condition
from clairvoyant.tools.sim.engine import Beliefs, Schedule, simulate
from clairvoyant.tools.sim.experiments import Condition, Progress, _beliefs
from clairvoyant.tools.sim.predictors import LabelScorer, OracleScorer, Scorer
from clairvoyant.tools.sim.report import aggregate, run_metrics
from clairvoyant.tools.sim.workload import (
    NormalService,
    Workload,
    class_index,
    make_workload,
    with_models,
)

__all__ = ["SWAP_SERVICE", "best_mean_s", "put_off_past_bound_s", "swap_conditions", "swaps", "swaps_markdown"]

SWAP_SERVICE = NormalService({"short": (1.0, 0.3), "long": (6.0, 1.5)}, {"short": 0.5, "long": 0.5})
SWITCH_S = 3.0  # seconds a load takes
POISSON_RHO = 0.6  # counted without loads
SMALL_RHO = 1.5  # small Poisson cases: arrivals overlap, so the order matters


def swap_conditions() -> list[Condition]:
    """fcfs, the default with the switch rule before weighing, the default."""
    default = _default_condition()
    before = replace(default, name="default, rule before weighing", model_switch_rule="bound")
    return [Condition("fcfs", "fcfs"), before, replace(default, name="default")]


def burst_workload(seed: int, n: int, models: int) -> Workload:
    """``n`` requests at t = 0, half Short and half Long in a shuffled order, models in turn."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 42]))
    cls = np.array([class_index("short")] * (n // 2) + [class_index("long")] * (n - n // 2), dtype=np.int8)
    rng.shuffle(cls)
    params = SWAP_SERVICE.params
    mean = np.where(cls == class_index("short"), params["short"][0], params["long"][0])
    std = np.where(cls == class_index("short"), params["short"][1], params["long"][1])
    service = np.maximum(mean + std * rng.standard_normal(n), SWAP_SERVICE.floor_s)
    return Workload(
        np.zeros(n), service, cls, np.full(n, -1, dtype=np.int64), model=(np.arange(n) % models).astype(np.int8)
    )


def poisson_workload(seed: int, n: int, models: int, rho: float) -> Workload:
    """``n`` Poisson arrivals at ``rho`` (loads not counted), each model drawn at random."""
    return with_models(make_workload(seed, n, SWAP_SERVICE, rho=rho), seed, [1.0] * models)


def best_mean_s(workload: Workload, switch_s: float, *, idle: bool = True) -> float:
    """The lowest mean sojourn of any order on one serial backend that holds nothing at first: every
    order of the requests tried, each served from max(its arrival, the previous end), a load of
    ``switch_s`` before each request whose model is not the one held. ``idle`` False: only orders
    that never leave the backend idle while a request waits (work-conserving, as every policy here).
    Both know every arrival in advance. Exponential: a few requests only."""
    n = len(workload)
    if n > 9:
        raise ValueError("every order of more than 9 requests is too many to try")
    arrival = workload.arrival_s.tolist()
    service = workload.service_s.tolist()
    model = [0] * n if workload.model is None else workload.model.tolist()
    best = math.inf
    for order in itertools.permutations(range(n)):
        t, held, total = 0.0, -1, 0.0
        for k, i in enumerate(order):
            if arrival[i] > t:
                if not idle and any(arrival[j] <= t for j in order[k + 1 :]):
                    break  # it idles while a request waits
                t = arrival[i]
            if model[i] != held:
                t += switch_s
                held = model[i]
            t += service[i]
            total += t - arrival[i]
            if total >= best:
                break
        else:
            best = total
    return best / n


def put_off_past_bound_s(workload: Workload, schedule: Schedule, bound_s: float) -> tuple[float, float]:
    """(the longest put-off, the most any put-off went past its allowance), seconds, on one slot.

    A request is put off while it waits and the backend holds another model: from max(its arrival,
    that model's switch) to the next switch. Its allowance is ``bound_s``, or up to the end of the
    request in flight when the bound ran out (the backend finishes it, then switches)."""
    assert workload.model is not None
    order = schedule.order
    starts = schedule.start_s[order].tolist()
    ends = schedule.end_s[order].tolist()
    models = workload.model[order].tolist()
    switches: list[float] = []  # dispatches that found another model held
    held: list[int] = []
    for start, model in zip(starts, models, strict=True):
        if not held or held[-1] != model:
            switches.append(start)
            held.append(model)
    longest, past = 0.0, -math.inf
    for i in range(len(workload)):
        arrival, dispatched, model = float(workload.arrival_s[i]), float(schedule.start_s[i]), int(workload.model[i])
        first = max(0, bisect.bisect_right(switches, arrival) - 1)
        for k in range(first, len(switches)):
            switch = switches[k]
            if switch >= dispatched:
                break
            until = switches[k + 1] if k + 1 < len(switches) else math.inf
            if held[k] == model or until <= arrival:
                continue
            begin = max(arrival, switch)
            put_off = until - begin
            due = begin + bound_s
            j = bisect.bisect_left(starts, due) - 1  # the last request dispatched before the bound ran out
            running_end = ends[j] if j >= 0 and due < ends[j] else due
            allowed = max(bound_s, running_end - begin)
            longest, past = max(longest, put_off), max(past, put_off - allowed)
    return longest, (past if math.isfinite(past) else 0.0)


@dataclass(frozen=True, slots=True)
class Case:
    """One workload family of the experiment."""

    name: str  # "burst", "poisson", "small burst", "small poisson"
    models: int
    scorer: Scorer
    seeds: tuple[int, ...]
    brute_force: bool = False  # also the best order (small cases)


def _workload(case: Case, seed: int, *, n: int, burst_n: int, small_n: int) -> Workload:
    if case.name == "burst":
        return burst_workload(seed, burst_n, case.models)
    if case.name == "poisson":
        return poisson_workload(seed, n, case.models, POISSON_RHO)
    if case.name == "small burst":
        return burst_workload(seed, small_n, case.models)
    return poisson_workload(seed, small_n, case.models, SMALL_RHO)


def swaps(
    *,
    n: int = 2000,
    burst_n: int = 24,
    small_n: int = 7,
    seeds: int = 5,
    small_cases: int = 40,
    models: Sequence[int] = (2, 3),
    switch_s: float = SWITCH_S,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every condition on every case; JSON-ready per-case summaries (mean and std over seeds)."""
    conditions = swap_conditions()
    bound_s = conditions[-1].model_switch_bound_s
    cases: list[Case] = []
    for k in models:
        for scorer in (OracleScorer(), LabelScorer(0.8)):
            cases.append(Case("burst", k, scorer, tuple(range(seeds * 4))))
            cases.append(Case("poisson", k, scorer, tuple(range(seeds))))
        for name in ("small burst", "small poisson"):
            cases.append(Case(name, k, OracleScorer(), tuple(range(small_cases)), brute_force=True))
    out = []
    for case in cases:
        per_condition: dict[str, list[dict[str, float]]] = {c.name: [] for c in conditions}
        for seed in case.seeds:
            workload = _workload(case, seed, n=n, burst_n=burst_n, small_n=small_n)
            beliefs: Beliefs = _beliefs(case.scorer, workload, seed)
            best = best_mean_s(workload, switch_s) if case.brute_force else math.nan
            busy = best_mean_s(workload, switch_s, idle=False) if case.brute_force else math.nan
            for c in conditions:
                schedule = simulate(
                    workload, beliefs, policy=c.policy, starvation_timeout_s=c.tau_s,
                    starvation_slowdown=_slowdown(c), fair_share=c.fair_share, params=c.params,
                    model_switch_bound_s=c.model_switch_bound_s, switch_s=switch_s,
                    model_switch_rule=c.model_switch_rule,
                )  # fmt: skip
                metrics = run_metrics(workload, schedule)
                longest, past = put_off_past_bound_s(workload, schedule, bound_s)
                row = {"seed": float(seed), **metrics, "put_off_max_s": longest, "put_off_past_bound_s": past}
                if case.brute_force:
                    row["best.mean"] = best
                    row["vs_best"] = metrics["all.sojourn.mean"] / best
                    row["vs_best_busy"] = metrics["all.sojourn.mean"] / busy
                per_condition[c.name].append(row)
                if progress is not None:
                    progress(1)
        out.append(
            {
                "workload": case.name,
                "models": case.models,
                "predictor": case.scorer.name,
                "seeds": len(case.seeds),
                "conditions": [
                    {
                        **c.as_dict(),
                        "summary": aggregate(per_condition[c.name]),
                        "worst_vs_best": max(
                            (r.get("vs_best", math.nan) for r in per_condition[c.name]), default=math.nan
                        ),
                        "put_off_past_bound_max_s": max(r["put_off_past_bound_s"] for r in per_condition[c.name]),
                    }
                    for c in conditions
                ],
            }  # fmt: skip
        )
    setup = {
        "service": {"short": SWAP_SERVICE.params["short"], "long": SWAP_SERVICE.params["long"], "mix": SWAP_SERVICE.mix},
        "switch_s": switch_s, "bound_s": bound_s, "n": n, "burst_n": burst_n, "small_n": small_n,
        "poisson_rho": POISSON_RHO, "small_rho": SMALL_RHO,
    }  # fmt: skip
    return {"experiment": "swaps", "setup": setup, "cases": out}


def _slowdown(c: Condition) -> Any:
    from clairvoyant.scheduling.slowdown import AdaptiveSlowdown

    return AdaptiveSlowdown(c.slowdown) if c.adaptive_slowdown else c.slowdown


def runs(*, seeds: int = 5, small_cases: int = 40, models: Sequence[int] = (2, 3)) -> int:
    """How many simulations ``swaps`` runs (for a progress bar)."""
    per_model = 2 * (seeds * 4 + seeds) + 2 * small_cases
    return per_model * len(models) * len(swap_conditions())


def swaps_markdown(data: dict[str, Any]) -> str:
    setup = data["setup"]
    lines = [
        f"One serial backend, a {setup['switch_s']:g} s load to switch models, switch bound {setup['bound_s']:g} s; "
        f"Short N{tuple(setup['service']['short'])} s, Long N{tuple(setup['service']['long'])} s, half and half. "
        "Sojourn seconds, mean ± std over seeds; 'past bound' is the most any request was put off past its "
        "bound (at most 0: the bound holds).",
    ]
    for case in data["cases"]:
        small = case["workload"].startswith("small")
        lines += [
            "",
            f"### {case['workload']}, {case['models']} models, {case['predictor']} predictor ({case['seeds']} seeds)",
            "",
            "| condition | switches | Short P50 | mean | all P99 | past bound |"
            + (" best order's mean | mean / best (mean, worst) | mean / best work-conserving order |" if small else ""),
            "|---|---|---|---|---|---|" + ("---|---|---|" if small else ""),
        ]
        for c in case["conditions"]:
            s = c["summary"]
            row = (
                f"| {c['name']} | {_cell(s, 'switches', 1)} | {_cell(s, 'short.sojourn.p50')} | "
                f"{_cell(s, 'all.sojourn.mean')} | {_cell(s, 'all.sojourn.p99')} | {c['put_off_past_bound_max_s']:.2f} |"
            )
            if small:
                row += (
                    f" {_cell(s, 'best.mean')} | {s['vs_best']['mean']:.3f}, {c['worst_vs_best']:.3f} |"
                    f" {s['vs_best_busy']['mean']:.3f} |"
                )
            lines.append(row)
    return "\n".join(lines)


def _cell(summary: dict[str, dict[str, float]], key: str, digits: int = 2) -> str:
    s = summary.get(key)
    return "" if s is None else f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"
