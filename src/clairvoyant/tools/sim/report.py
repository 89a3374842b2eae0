"""Numbers out of schedules: per-class percentiles, mean +/- std over seeds, JSON/CSV files, plots.

Metric names are flat strings ``"<class>.<measure>.<stat>"``: class in short/medium/long/all,
measure ``sojourn`` (arrival to completion) or ``wait`` (arrival to dispatch), stat p50/p95/p99/mean/max.
Percentiles use numpy's default (linear interpolation) over one seed's requests; the spread over
seeds is the sample standard deviation (ddof = 1; 0 for a single seed). No prompt text is ever
part of these outputs: only classes, times and scores' summary statistics.

Plotting imports matplotlib (Agg backend) inside the plotting functions only.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.tools.sim.engine import Schedule
from clairvoyant.tools.sim.workload import CLASS_NAMES, Workload

__all__ = [
    "MEASURES",
    "PERCENTILES",
    "aggregate",
    "changes_table",
    "conditions_table",
    "metric",
    "run_metrics",
    "seed_rows",
    "spectrum_table",
    "summary_rows",
    "switch_table",
    "write_csv",
    "write_json",
]

MEASURES: tuple[str, str] = ("sojourn", "wait")
PERCENTILES: tuple[int, int, int] = (50, 95, 99)
GROUPS: tuple[str, ...] = (*CLASS_NAMES, "all")


def metric(group: str, measure: str, stat: str) -> str:
    """The flat metric name, e.g. ``metric("short", "sojourn", "p50") == "short.sojourn.p50"``."""
    return f"{group}.{measure}.{stat}"


def run_metrics(workload: Workload, schedule: Schedule) -> dict[str, float]:
    """Per-class and overall percentiles and means of sojourn and wait for one run.

    Classes with no request in the workload are omitted; multi-tenant workloads add groups
    ``tenant<id>`` (e.g. ``tenant1.wait.p95``). Also reports ``<class>.n``,
    ``promotions``, ``makespan_s`` and ``utilisation`` (busy time / makespan, per slot). Two-model
    workloads add ``switches`` (dispatches to a slot holding the other model) and ``load_s`` (seconds
    spent loading). With queue deadlines, percentiles are over the requests served; ``deadline.met``
    is the share of requests with a deadline that were dispatched before it, ``deadline.n`` how many
    had one, ``expired`` how many were withdrawn.
    """
    out: dict[str, float] = {}
    values = {"sojourn": schedule.sojourn_s(workload), "wait": schedule.wait_s(workload)}
    served = ~np.isnan(schedule.start_s)
    groups: list[tuple[str, np.ndarray]] = [
        (g, np.ones(len(workload), bool) if g == "all" else workload.class_idx == CLASS_NAMES.index(g)) for g in GROUPS
    ]
    if workload.tenant is not None:
        groups += [(f"tenant{t}", workload.tenant == t) for t in sorted(set(workload.tenant.tolist()))]
    for group, rows in groups:
        rows = rows & served
        count = int(rows.sum())
        if count == 0:
            continue
        out[f"{group}.n"] = float(count)
        for measure, v in values.items():
            sel = v[rows]
            for q, p in zip(PERCENTILES, np.percentile(sel, PERCENTILES), strict=True):
                out[metric(group, measure, f"p{q}")] = float(p)
            out[metric(group, measure, "mean")] = float(sel.mean())
            out[metric(group, measure, "max")] = float(sel.max())
    out["promotions"] = float(schedule.promotions)
    span = float(np.nanmax(schedule.end_s) - min(0.0, float(workload.arrival_s.min())))
    slots = int(schedule.slot.max()) + 1
    out["makespan_s"] = span
    busy = float(workload.service_s[served].sum()) + (0.0 if schedule.load_s is None else float(schedule.load_s.sum()))
    out["utilisation"] = busy / (span * slots) if span > 0 else math.nan
    if schedule.load_s is not None:
        out["switches"] = float(schedule.switches)
        out["load_s"] = float(schedule.load_s.sum())
    if workload.max_wait_s is not None:
        with_deadline = np.isfinite(workload.max_wait_s)
        out["deadline.n"] = float(with_deadline.sum())
        out["deadline.met"] = float((with_deadline & served).sum() / max(1, with_deadline.sum()))
        out["expired"] = float((~served).sum())
    return out


def aggregate(per_seed: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """``{metric: {"mean": m, "std": s}}`` over seeds, for the metrics every seed has."""
    if not per_seed:
        return {}
    keys = [k for k in per_seed[0] if all(k in run for run in per_seed)]
    out: dict[str, dict[str, float]] = {}
    for key in keys:
        vals = np.array([run[key] for run in per_seed], dtype=np.float64)
        std = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
        out[key] = {"mean": float(vals.mean()), "std": std}
    return out


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
        return float(f"{obj:.6g}")  # 6 significant digits: keeps result files small
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    return obj


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as JSON (floats to 6 significant digits, infinities as "inf"/"-inf", NaN as null)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(dict(data)), indent=1) + "\n")
    return path


def write_csv(path: Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write dict rows as CSV with the union of their keys as header (first-seen order)."""
    rows = list(rows)
    header: dict[str, None] = {}
    for row in rows:
        header.update(dict.fromkeys(row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(header))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(v) for k, v in row.items()})
    return path


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.6g}"
    return value


# -- markdown tables (printed by the command, pasted into docs/simulation.md) -------------------


def _pm(summary: Mapping[str, Mapping[str, float]], key: str, digits: int = 2) -> str:
    entry = summary.get(key)
    if entry is None:
        return "-"
    return f"{entry['mean']:.{digits}f} ± {entry['std']:.{digits}f}"


def _pct(change: Mapping[str, float], sign: int = 1) -> str:
    return f"{sign * 100 * change['mean']:+.1f}% ± {100 * change['std']:.1f}"


def _cond_label(cond: Mapping[str, Any]) -> str:
    if cond.get("starvation_slowdown") or cond.get("model_switch_bound_s") or cond["policy"] not in ("fcfs", "sjf"):
        return str(cond["name"])  # the new guard and policies: the condition's own name
    if cond["policy"] == "fcfs":
        return "FCFS"
    tau = cond["tau_s"]
    if tau in (math.inf, "inf"):
        return "SJF τ=∞"
    m = cond.get("tau_multiple")
    return f"SJF τ={m:g}×μ ({tau:.1f} s)" if m is not None else f"{cond['policy'].upper()} τ={tau:g} s"


def conditions_table(conditions: Sequence[Mapping[str, Any]], measure: str = "sojourn") -> str:
    """Markdown: one row per condition, Short and Long P50/P95/P99 of ``measure`` (mean ± std)."""
    groups = [g for g in CLASS_NAMES if f"{g}.{measure}.p50" in conditions[0]["summary"]]
    head = ["condition"] + [f"{g.capitalize()} P{q}" for g in groups for q in PERCENTILES] + ["promotions"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cond in conditions:
        s = cond["summary"]
        cells = [_cond_label(cond)] + [_pm(s, metric(g, measure, f"p{q}")) for g in groups for q in PERCENTILES]
        cells.append(f"{s['promotions']['mean']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def switch_table(conditions: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per condition, model switches, Short P50/P95, all-request P99 and mean sojourn,
    and the share of queue deadlines met (mean ± std over seeds; blank cells where not measured)."""
    head = ["condition", "swaps", "Short P50", "Short P95", "all P99", "mean", "deadlines met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cond in conditions:
        s = cond["summary"]
        met = s.get("deadline.met")
        cells = [
            _cond_label(cond), _pm(s, "switches", 1) if "switches" in s else "", _pm(s, "short.sojourn.p50"),
            _pm(s, "short.sojourn.p95"), _pm(s, "all.sojourn.p99"), _pm(s, "all.sojourn.mean"),
            "" if met is None else f"{met['mean'] * 100:.1f}% ± {met['std'] * 100:.1f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def changes_table(result: Mapping[str, Any]) -> str:
    """Markdown: per SJF condition, change vs FCFS (per seed, mean ± std) of Short P50 and Long P95."""
    head = ["condition", "Short P50 sojourn", "Long P95 sojourn", "Short P50 wait", "Long P95 wait"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cond in result["conditions"][1:]:
        ch = result["change_vs_fcfs"][cond["name"]]
        keys = ("short.sojourn.p50", "long.sojourn.p95", "short.wait.p50", "long.wait.p95")
        lines.append("| " + " | ".join([_cond_label(cond), *(_pct(ch[k]) for k in keys)]) + " |")
    return "\n".join(lines)


def spectrum_table(result: Mapping[str, Any]) -> str:
    """Markdown: per rho, FCFS and SJF Short P50, and the reductions (mean ± std over seeds)."""
    m = result["tau_multiple"]
    head = [
        "ρ", "λ (1/s)", "τ (s)", "FCFS Short P50 (s)", f"SJF τ={m:g}× Short P50 (s)",
        f"reduction, τ={m:g}×", "reduction, τ=∞", f"wait P50 reduction, τ={m:g}×", f"Long P95 change, τ={m:g}×",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in result["points"]:
        fcfs, sjf_tau, _ = p["conditions"]
        r = p["reduction"]
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{p['rho']:g}",
                    f"{p['rate_per_s']:.4f}",
                    f"{p['tau_s']:.1f}",
                    _pm(fcfs["summary"], "short.sojourn.p50"),
                    _pm(sjf_tau["summary"], "short.sojourn.p50"),
                    _pct(r["tau.short.sojourn.p50"]),
                    _pct(r["inf.short.sojourn.p50"]),
                    _pct(r["tau.short.wait.p50"]),
                    _pct(r["tau.long.sojourn.p95"], -1),
                ]  # fmt: skip
            )
            + " |"
        )
    return "\n".join(lines)


def summary_rows(experiment: str, conditions: Sequence[Mapping[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    """Long-format CSV rows: one per condition x metric, with mean, std and the number of seeds."""
    rows = []
    for cond in conditions:
        for key, entry in cond["summary"].items():
            rows.append(
                {
                    "experiment": experiment,
                    **extra,
                    "condition": cond["name"],
                    "policy": cond["policy"],
                    "tau_s": cond["tau_s"],
                    "metric": key,
                    "mean": entry["mean"],
                    "std": entry["std"],
                    "seeds": len(cond["per_seed"]),
                }  # fmt: skip
            )
    return rows


def seed_rows(experiment: str, conditions: Sequence[Mapping[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    """Wide-format CSV rows: one per condition x seed, every metric a column."""
    return [
        {
            "experiment": experiment,
            **extra,
            "condition": cond["name"],
            "policy": cond["policy"],
            "tau_s": cond["tau_s"],
            **run,
        }
        for cond in conditions
        for run in cond["per_seed"]
    ]
