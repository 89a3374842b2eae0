"""Summaries of benchmark results: per-run percentiles, then mean +/- std over runs, and reductions.

A *cell* is (mode, rho, condition, class). Each run gives one P50/P95/P99 per metric per cell;
the report gives the mean and the sample standard deviation of those over runs, the number of runs
and the number of requests pooled in the cell. Failed requests are counted, never averaged in.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "PERCENTILES",
    "CellSummary",
    "mean_std",
    "paired_reductions",
    "per_run_percentile",
    "percentile",
    "realized_utilization",
    "reduction",
    "summarize",
]

PERCENTILES = (50, 95, 99)
METRICS = ("e2e", "ttft")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0.0 for one value); NaNs are ignored."""
    data = [v for v in values if not math.isnan(v)]
    if not data:
        return math.nan, math.nan
    mean = sum(data) / len(data)
    if len(data) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in data) / (len(data) - 1))


def reduction(baseline: float, value: float) -> float:
    """Fractional reduction of ``value`` against ``baseline`` (0.7 = 70% lower; negative = higher)."""
    if baseline == 0 or math.isnan(baseline) or math.isnan(value):
        return math.nan
    return (baseline - value) / baseline


@dataclass(frozen=True, slots=True)
class CellSummary:
    mode: str
    rho: float | None  # None for a burst
    condition: str
    cls: str
    runs: int
    n: int  # successful requests pooled over runs
    failed: int
    stats: dict[str, tuple[float, float]]  # "e2e_p50" -> (mean over runs, std over runs)

    def row(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mode": self.mode,
            "rho": "" if self.rho is None else self.rho,
            "condition": self.condition,
            "class": self.cls,
            "runs": self.runs,
            "n": self.n,
            "failed": self.failed,
        }
        for name, (mean, std) in self.stats.items():
            out[f"{name}_mean"] = round(mean, 4)
            out[f"{name}_std"] = round(std, 4)
        return out


def summarize(rows: Iterable[dict[str, object]]) -> list[CellSummary]:
    """Cells from per-request rows with keys mode, rho, condition, run, cls, ok, e2e_s, ttft_s."""
    grouped: dict[tuple, dict[int, list[dict[str, object]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        rho = row.get("rho")
        key = (row["mode"], None if rho in (None, "") else float(rho), row["condition"], row["cls"])  # type: ignore[arg-type]
        grouped[key][int(row["run"])].append(row)  # type: ignore[call-overload]
    cells = []
    for (mode, rho, condition, cls), runs in sorted(grouped.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        per_metric: dict[str, list[float]] = defaultdict(list)
        n = failed = 0
        for run_rows in runs.values():
            ok = [r for r in run_rows if r["ok"] in (True, "True", "true", 1)]
            failed += len(run_rows) - len(ok)
            n += len(ok)
            for metric in METRICS:
                values = [float(r[f"{metric}_s"]) for r in ok if r[f"{metric}_s"] not in (None, "")]  # type: ignore[arg-type]
                for q in PERCENTILES:
                    per_metric[f"{metric}_p{q}"].append(percentile(values, q))
        stats = {name: mean_std(values) for name, values in per_metric.items()}
        cells.append(CellSummary(str(mode), rho, str(condition), str(cls), len(runs), n, failed, stats))
    return cells


def per_run_percentile(
    rows: Iterable[dict[str, object]],
    *,
    metric: str = "e2e",
    q: float = 50,
    cls: str = "short",
) -> dict[tuple[str, float | None, str], dict[int, float]]:
    """(mode, rho, condition) -> run -> the ``q``-th percentile of ``metric`` for class ``cls``."""
    values: dict[tuple[str, float | None, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["cls"] != cls or row["ok"] not in (True, "True", "true", 1):
            continue
        value = row.get(f"{metric}_s")
        if value in (None, ""):
            continue
        rho = row.get("rho")
        key = (str(row["mode"]), None if rho in (None, "") else float(rho), str(row["condition"]))  # type: ignore[arg-type]
        values[key][int(row["run"])].append(float(value))  # type: ignore[call-overload, arg-type]
    return {key: {run: percentile(v, q) for run, v in runs.items()} for key, runs in values.items()}


def paired_reductions(
    rows: Sequence[dict[str, object]],
    *,
    metric: str = "e2e",
    q: float = 50,
    cls: str = "short",
    baseline: str = "fcfs",
) -> dict[tuple[str, float | None, str], tuple[float, float, int]]:
    """(mode, rho, condition) -> (mean, std, runs) of the per-run reduction against ``baseline``.

    Each run's reduction compares the two conditions on that run's identical workload (paired).
    A negative value is an increase (e.g. Long P95 going up under SJF).
    """
    table = per_run_percentile(rows, metric=metric, q=q, cls=cls)
    out = {}
    for (mode, rho, condition), runs in table.items():
        base = table.get((mode, rho, baseline), {})
        values = [reduction(base[r], v) for r, v in runs.items() if r in base]
        mean, std = mean_std(values)
        out[(mode, rho, condition)] = (mean, std, len(values))
    return out


def realized_utilization(
    rows: Iterable[dict[str, object]], *, condition: str = "fcfs"
) -> dict[tuple[str, float | None], tuple[float, float, int]]:
    """(mode, rho) -> (mean, std, runs) of the backend utilisation actually reached under ``condition``.

    On a serial backend, a request's service starts at the later of its send and the previous
    completion; utilisation = summed service / (last completion - first send). For Poisson runs this
    checks the calibrated target rho.
    """
    runs: dict[tuple[str, float | None], dict[int, list[dict[str, object]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if (
            row["condition"] == condition
            and row["ok"] in (True, "True", "true", 1)
            and row.get("done_s") not in (None, "")
        ):
            rho = row.get("rho")
            runs[(str(row["mode"]), None if rho in (None, "") else float(rho))][int(row["run"])].append(row)  # type: ignore[arg-type, call-overload]
    out = {}
    for key, by_run in runs.items():
        values = []
        for run_rows in by_run.values():
            ordered = sorted(run_rows, key=lambda r: float(r["done_s"]))  # type: ignore[arg-type]
            busy, previous = 0.0, 0.0
            for r in ordered:
                start = max(float(r["sent_s"]), previous)  # type: ignore[arg-type]
                busy += float(r["done_s"]) - start  # type: ignore[arg-type]
                previous = float(r["done_s"])  # type: ignore[arg-type]
            span = previous - min(float(r["sent_s"]) for r in ordered)  # type: ignore[arg-type]
            values.append(busy / span if span > 0 else math.nan)
        mean, std = mean_std(values)
        out[key] = (mean, std, len(values))
    return out
