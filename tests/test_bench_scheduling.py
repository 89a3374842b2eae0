"""benchmarks/bench_scheduling.py: Poisson arrivals at a target utilisation, the service model they
are computed from, and sjf's share of the oracle's reduction (the runs themselves go by hand)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from bench_scheduling import ServiceModel, parser, poisson, share_of_oracle, with_poisson_arrivals  # noqa: E402

from clairvoyant.tools.bench.prompt_set import BenchPrompt, class_of  # noqa: E402


def _prompts() -> list[BenchPrompt]:
    return [
        BenchPrompt(f"c{i}:0", tokens, class_of(tokens), 5, "x", text=f"prompt {i}")
        for i, tokens in enumerate([10, 50, 150, 650, 700, 790])
    ]


def test_service_model_fits_a_line_and_needs_two_lengths() -> None:
    service = ServiceModel.fit([(10, 1.5), (20, 2.5), (30, 3.5)])
    assert service.per_token_s == pytest.approx(0.1) and service.overhead_s == pytest.approx(0.5)
    assert service.predict(40) == pytest.approx(4.5)
    for samples in ([(10, 1.0)], [(10, 1.0), (10, 2.0)], []):
        with pytest.raises(ValueError, match="two distinct lengths"):
            ServiceModel.fit(samples)


def test_poisson_rate_targets_rho() -> None:
    service = ServiceModel.fit([(10, 1.0), (20, 2.0), (30, 3.0)])
    assert service.per_token_s == pytest.approx(0.1) and service.overhead_s == pytest.approx(0.0, abs=1e-9)
    specs, rate = poisson(_prompts(), n_short=50, n_long=50, length_scale=0.1, rho=0.5, service=service, seed=0)
    assert rate == pytest.approx(0.5 / service.mean(specs))
    offsets = [s.offset_s for s in specs]
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    many = with_poisson_arrivals(specs * 20, rate_per_s=2.0, seed=1)
    assert many[-1].offset_s / (len(many) - 1) == pytest.approx(0.5, rel=0.15)
    with pytest.raises(ValueError):
        with_poisson_arrivals(specs, rate_per_s=0.0)


def _rows(short_e2e: dict[str, list[float]]) -> list[dict[str, Any]]:
    """One burst run per list entry: one Short request per condition and run."""
    return [
        dict(mode="burst", rho="", run=run, condition=condition, cls="short", ok=True, e2e_s=e2e, ttft_s=e2e)
        for condition, values in short_e2e.items()
        for run, e2e in enumerate(values)
    ]


def test_share_of_oracle_is_sjfs_paired_reduction_over_the_oracles() -> None:
    # fcfs 10 s; sjf cuts 40% and 60% (mean 50%); the oracle 80% both runs: sjf reaches 62%.
    lines = share_of_oracle(_rows({"fcfs": [10.0, 10.0], "sjf": [6.0, 4.0], "oracle": [2.0, 2.0]}))
    assert lines == [
        "burst: sjf reaches 62% of the oracle's Short P50 reduction (sjf +50%, oracle +80% against fcfs, "
        "mean of 2 paired runs)"
    ]
    assert share_of_oracle(_rows({"fcfs": [10.0], "sjf": [5.0]})) == []  # no oracle run: nothing to compare
    assert share_of_oracle(_rows({"fcfs": [10.0], "sjf": [5.0], "oracle": [12.0]})) == []  # the oracle cut nothing


def test_results_go_to_a_temporary_directory_by_default() -> None:
    out = parser().parse_args([]).out
    assert out.name == "scheduling" and not out.is_relative_to(BENCHMARKS.parent)
