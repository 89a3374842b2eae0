"""benchmarks/bench_shared_observations.py on a few requests: every figure is measured, and B
applied every observation A published (no timing asserts)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import bench_shared_observations  # noqa: E402


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_benchmark_measures_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "shared.json"
    assert (
        bench_shared_observations.main(["--requests", "20", "--rate", "500", "--catch-up", "300", "--json", str(out)])
        == 0
    )
    figures = json.loads(out.read_text())
    assert figures["hook_us"]["publish_service"] > 0 and figures["hook_us"]["service_time_observe"] > 0
    assert len(figures["loop_cpu_us"]["rounds"]["shared"]) == len(figures["loop_cpu_us"]["rounds"]["local"]) == 2
    assert 0 < figures["lag_ms"]["p50"] <= figures["lag_ms"]["p95"] <= figures["lag_ms"]["max"]
    assert figures["apply_cpu_us"] > 0
    assert figures["catch_up"]["entries"] > 0 and figures["catch_up"]["applied_per_s"] > 0
