"""Benchmark outputs: per-request CSV, summary CSV/JSON, markdown tables, plots.

Files written by :func:`write_outputs` into the output directory::

    requests.csv     one row per request and condition and run (the raw data)
    summary.csv      one row per cell: P50/P95/P99 of end-to-end time and TTFT, mean and std over runs
    summary.json     the same cells, the paired reductions against fcfs, and the run's metadata
    summary.md       the same tables in markdown, as the command prints them
    cdf_*.png        latency CDF per class and condition, one per (mode, rho)
    reduction_vs_rho.png   Short P50 reduction vs rho (Poisson runs only)
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clairvoyant.tools.bench.stats import CellSummary, paired_reductions, realized_utilization, summarize

__all__ = [
    "REDUCTIONS",
    "format_mean_std",
    "load_rows",
    "markdown_summary",
    "reductions_table",
    "write_outputs",
]

# (label, metric, percentile, class): what "reduction" rows report; negative = an increase.
REDUCTIONS = (
    ("Short P50", "e2e", 50, "short"),
    ("Short P95", "e2e", 95, "short"),
    ("Short TTFT P50", "ttft", 50, "short"),
    ("Long P50", "e2e", 50, "long"),
    ("Long P95", "e2e", 95, "long"),
)


def format_mean_std(pair: tuple[float, float], digits: int = 2) -> str:
    mean, std = pair
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:+.0f}%"


def reductions_table(
    rows: Sequence[dict[str, Any]],
) -> dict[str, dict[tuple[str, float | None, str], tuple[float, float, int]]]:
    """label -> (mode, rho, condition) -> (mean, std, runs) of the paired reduction against fcfs."""
    return {label: paired_reductions(rows, metric=metric, q=q, cls=cls) for label, metric, q, cls in REDUCTIONS}


def _cell_keys(cells: Sequence[CellSummary]) -> list[tuple[str, float | None]]:
    keys = sorted({(c.mode, c.rho) for c in cells}, key=lambda k: (k[0], -1.0 if k[1] is None else k[1]))
    return keys


def markdown_summary(rows: Sequence[dict[str, Any]], cells: Sequence[CellSummary] | None = None) -> str:
    """Markdown: per (mode, rho), a latency table (s, mean ± std over runs) and a reduction table."""
    cells = list(cells) if cells is not None else summarize(rows)
    reductions = reductions_table(rows)
    utilization = realized_utilization(rows)
    out: list[str] = []
    order = {"direct": 0, "fcfs": 1, "sjf": 2, "oracle": 3}
    for mode, rho in _cell_keys(cells):
        heading = "Burst" if rho is None else f"Poisson, rho = {rho:g}"
        chosen = sorted(
            (c for c in cells if c.mode == mode and c.rho == rho),
            key=lambda c: (c.cls != "short", order.get(c.condition, 9)),
        )
        out.append(f"#### {heading}\n")
        if (mode, rho) in utilization and rho is not None:
            mean, std, n = utilization[(mode, rho)]
            out.append(f"Backend utilisation actually reached under fcfs: {mean:.2f} ± {std:.2f} ({n} runs).\n")
        out.append(
            "| class | condition | runs | n | P50 (s) | P95 (s) | P99 (s) | TTFT P50 (s) | TTFT P95 (s) | TTFT P99 (s) |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for c in chosen:
            s = c.stats
            failed = f" ({c.failed} failed)" if c.failed else ""
            out.append(
                f"| {c.cls} | {c.condition} | {c.runs} | {c.n}{failed} | {format_mean_std(s['e2e_p50'])} | "
                f"{format_mean_std(s['e2e_p95'])} | {format_mean_std(s['e2e_p99'])} | {format_mean_std(s['ttft_p50'])} | "
                f"{format_mean_std(s['ttft_p95'])} | {format_mean_std(s['ttft_p99'])} |"
            )
        out.append("")
        conditions = sorted({c.condition for c in chosen if c.condition != "fcfs"}, key=lambda n: order.get(n, 9))
        out.append("| reduction vs fcfs (paired per run, mean ± std) | " + " | ".join(conditions) + " |")
        out.append("|---|" + "---|" * len(conditions))
        for label, *_ in REDUCTIONS:
            cols = []
            for condition in conditions:
                mean, std, _ = reductions[label].get((mode, rho, condition), (math.nan, math.nan, 0))
                cols.append("-" if math.isnan(mean) else f"{100 * mean:+.0f}% ± {100 * std:.0f}")
            out.append(f"| {label} | " + " | ".join(cols) + " |")
        out.append("\n(positive = lower than fcfs; negative = higher)\n")
    return "\n".join(out)


def _plain(value: Any) -> Any:
    """JSON-safe: inf/nan become strings (standard JSON has no Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``requests.csv`` with their types back (to regenerate the summaries and plots)."""
    ints = {"run", "position", "index", "answer_tokens", "n_predict", "completion_tokens", "status", "finish_rank"}
    floats = {"rho", "offset_s", "sent_s", "ttft_s", "e2e_s", "done_s"}
    rows = []
    with path.open(newline="") as fh:
        for raw in csv.DictReader(fh):
            row: dict[str, Any] = {}
            for key, value in raw.items():
                if value == "":
                    row[key] = "" if key == "rho" else None
                elif key in ints:
                    row[key] = int(value)
                elif key in floats:
                    row[key] = float(value)
                elif key == "ok":
                    row[key] = value == "True"
                else:
                    row[key] = value
            rows.append(row)
    return rows


def write_outputs(
    rows: Sequence[dict[str, Any]], out_dir: Path, *, meta: dict[str, Any], plots: bool = True, plot_prefix: str = ""
) -> dict[str, Path]:
    """Write every output file for ``rows`` into ``out_dir``; return name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    fields = list(rows[0].keys()) if rows else []
    paths["requests.csv"] = out_dir / "requests.csv"
    with paths["requests.csv"].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: ("" if v is None else (round(v, 4) if isinstance(v, float) else v)) for k, v in row.items()}
            )
    cells = summarize(rows)
    summary_rows = [c.row() for c in cells]
    paths["summary.csv"] = out_dir / "summary.csv"
    with paths["summary.csv"].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(summary_rows[0].keys()) if summary_rows else ["mode"])
        writer.writeheader()
        writer.writerows(summary_rows)
    reductions = reductions_table(rows)
    paths["summary.json"] = out_dir / "summary.json"
    paths["summary.json"].write_text(
        json.dumps(
            _plain(
                {
                    "meta": meta,
                    "cells": summary_rows,
                    "reductions_vs_fcfs": [
                        {
                            "what": label,
                            "mode": mode,
                            "rho": rho,
                            "condition": cond,
                            "mean": round(m, 4),
                            "std": round(s, 4),
                            "runs": n,
                        }
                        for label, table in reductions.items()
                        for (mode, rho, cond), (m, s, n) in sorted(table.items(), key=str)
                        if cond != "fcfs" and not math.isnan(m)
                    ],
                    "realized_utilization_fcfs": [
                        {"mode": mode, "rho": rho, "mean": round(m, 3), "std": round(s, 3), "runs": n}
                        for (mode, rho), (m, s, n) in sorted(realized_utilization(rows).items(), key=str)
                    ],
                }
            ),
            indent=1,
            default=str,
            allow_nan=False,
        )
    )
    paths["summary.md"] = out_dir / "summary.md"
    paths["summary.md"].write_text(markdown_summary(rows, cells))
    if plots and rows:
        from clairvoyant.tools.bench import plots as plotting

        for mode, rho in _cell_keys(cells):
            subset = [
                r for r in rows if r["mode"] == mode and (r["rho"] in ("", None) if rho is None else r["rho"] == rho)
            ]
            name = f"{plot_prefix}cdf_{mode}" + ("" if rho is None else f"_rho{rho:g}") + ".png"
            where = "burst" if rho is None else f"Poisson rho={rho:g}"
            title = f"{where}: end-to-end latency CDF ({meta.get('backend_label', 'backend')})"
            paths[name] = plotting.latency_cdf(subset, out_dir / name, title=title)
        if any(r["mode"] == "poisson" for r in rows):
            name = f"{plot_prefix}reduction_vs_rho.png"
            paths[name] = plotting.reduction_vs_rho(
                reductions["Short P50"],
                out_dir / name,
                title="Short P50 reduction vs fcfs, Poisson arrivals",
                paper={0.74: 0.17, 0.85: 0.10},
            )
    return paths
