"""Benchmark plots (matplotlib, Agg backend; imported only when plotting).

* :func:`latency_cdf`: end-to-end latency CDF per class (one panel each) and condition, pooled over runs.
* :func:`reduction_vs_rho`: Short P50 reduction against fcfs per condition vs rho (mean +/- std over runs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["latency_cdf", "reduction_vs_rho"]

COLORS = {"direct": "#7f7f7f", "fcfs": "#d62728", "sjf": "#1f77b4", "oracle": "#2ca02c"}
STYLES = {"direct": ":", "fcfs": "-", "sjf": "-", "oracle": "--"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdf(
    rows: Sequence[dict[str, Any]],
    path: Path,
    *,
    title: str,
    classes: Sequence[str] = ("short", "long"),
    metric: str = "e2e",
) -> Path:
    """Write the CDF of ``metric`` per class and condition to ``path`` (PNG); return ``path``."""
    plt = _pyplot()
    conditions = [c for c in COLORS if any(r["condition"] == c for r in rows)]
    fig, axes = plt.subplots(1, len(classes), figsize=(5.2 * len(classes), 3.8), squeeze=False)
    for ax, cls in zip(axes[0], classes):
        for condition in conditions:
            values = sorted(
                float(r[f"{metric}_s"])
                for r in rows
                if r["cls"] == cls and r["condition"] == condition and r["ok"] and r[f"{metric}_s"] is not None
            )
            if not values:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(
                values,
                ys,
                where="post",
                color=COLORS[condition],
                linestyle=STYLES[condition],
                label=f"{condition} (n={len(values)})",
                linewidth=1.8,
            )
        ax.set_title(f"{cls.capitalize()} requests")
        ax.set_xlabel("end-to-end latency (s)" if metric == "e2e" else "time to first token (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def reduction_vs_rho(
    reductions: dict[tuple[str, float | None, str], tuple[float, float, int]],
    path: Path,
    *,
    title: str,
    conditions: Sequence[str] = ("sjf", "oracle"),
    paper: dict[float, float] | None = None,
) -> Path:
    """Short P50 reduction (%) vs rho from ``stats.paired_reductions`` output (Poisson cells only)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for condition in conditions:
        points = sorted(
            (rho, mean, std)
            for (mode, rho, cond), (mean, std, _) in reductions.items()
            if mode == "poisson" and cond == condition and rho is not None and not math.isnan(mean)
        )
        if points:
            ax.errorbar(
                [p[0] for p in points],
                [100 * p[1] for p in points],
                yerr=[100 * p[2] for p in points],
                marker="o",
                capsize=3,
                color=COLORS[condition],
                label=f"{condition} vs fcfs (measured)",
            )
    if paper:
        xs = sorted(paper)
        ax.plot(xs, [100 * paper[x] for x in xs], "k^", label="paper (simulation, RTX 4090)")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("utilisation rho")
    ax.set_ylabel("Short P50 reduction vs fcfs (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
