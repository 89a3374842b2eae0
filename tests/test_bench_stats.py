"""clairvoyant.tools.bench.stats and .workload: percentiles, mean/std over runs, reductions, bursts."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from clairvoyant.tools.bench.prompt_set import BenchPrompt, class_of
from clairvoyant.tools.bench.stats import mean_std, paired_reductions, percentile, reduction, summarize
from clairvoyant.tools.bench.workload import burst, forced_length


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(1)
    for n in (1, 2, 5, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_mean_std_is_sample_std_and_ignores_nan() -> None:
    assert mean_std([1.0, 2.0, 3.0, math.nan]) == pytest.approx((2.0, 1.0))
    assert mean_std([4.0]) == (4.0, 0.0)
    assert all(math.isnan(x) for x in mean_std([]))


def test_reduction_sign() -> None:
    assert reduction(10.0, 3.0) == pytest.approx(0.7)
    assert reduction(10.0, 12.0) == pytest.approx(-0.2)
    assert math.isnan(reduction(0.0, 1.0))


def _rows() -> list[dict[str, object]]:
    rows = []
    # fcfs short e2e: run0 [10, 20, 30] (p50 20), run1 [20, 40, 60] (p50 40); sjf halves them.
    for run, scale in ((0, 1.0), (1, 2.0)):
        for condition, factor in (("fcfs", 1.0), ("sjf", 0.5)):
            for base in (10.0, 20.0, 30.0):
                rows.append(
                    {
                        "mode": "burst",
                        "rho": "",
                        "run": run,
                        "condition": condition,
                        "cls": "short",
                        "ok": True,
                        "e2e_s": base * scale * factor,
                        "ttft_s": 1.0,
                    }
                )
            rows.append(
                {
                    "mode": "burst",
                    "rho": "",
                    "run": run,
                    "condition": condition,
                    "cls": "long",
                    "ok": False,
                    "e2e_s": None,
                    "ttft_s": None,
                }
            )
    return rows


def test_summarize_means_per_run_percentiles_and_counts_failures() -> None:
    cells = {(c.condition, c.cls): c for c in summarize(_rows())}
    fcfs = cells[("fcfs", "short")]
    assert (fcfs.runs, fcfs.n, fcfs.failed) == (2, 6, 0)
    assert fcfs.stats["e2e_p50"][0] == pytest.approx(30.0)  # mean of 20 and 40
    assert fcfs.stats["e2e_p50"][1] == pytest.approx(math.sqrt(200))  # sample std of 20, 40
    assert cells[("sjf", "long")].failed == 2 and cells[("sjf", "long")].n == 0


def test_paired_reductions_per_run() -> None:
    red = paired_reductions(_rows(), metric="e2e", q=50, cls="short")
    mean, std, runs = red[("burst", None, "sjf")]
    assert (mean, std, runs) == (pytest.approx(0.5), pytest.approx(0.0), 2)
    assert red[("burst", None, "fcfs")][0] == pytest.approx(0.0)


def _prompts() -> list[BenchPrompt]:
    out = []
    for i, tokens in enumerate([10, 50, 150, 650, 700, 790]):
        out.append(BenchPrompt(f"c{i}:0", tokens, class_of(tokens), 5, "x", text=f"prompt {i}"))
    return out


def test_forced_length_is_monotone_ceiling() -> None:
    assert forced_length(700, 0.25) == 175
    assert forced_length(701, 0.25) == 176
    assert forced_length(1, 0.01) == 1
    lengths = [forced_length(n, 0.3) for n in range(1, 800)]
    assert lengths == sorted(lengths)


def test_burst_composition_keeps_true_class() -> None:
    specs = burst(_prompts(), n_short=5, n_long=4, length_scale=0.1, seed=3)
    assert sum(s.cls == "short" for s in specs) == 5 and sum(s.cls == "long" for s in specs) == 4
    assert all(s.offset_s == 0.0 for s in specs)
    assert all(s.n_predict == forced_length(s.answer_tokens, 0.1) for s in specs)
    assert [s.index for s in specs] == list(range(9))
    assert burst(_prompts(), n_short=5, n_long=4, length_scale=0.1, seed=3) == specs  # seeded
