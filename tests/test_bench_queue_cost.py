"""benchmarks/bench_queue_cost.py on tiny depths: every policy is timed alone and wrapped, and the
memory figures count the queue record inside the proxy's ticket (no timing asserts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import bench_queue_cost  # noqa: E402

from clairvoyant.scheduling.policy import POLICY_NAMES  # noqa: E402


def test_every_policy_is_timed_and_the_ticket_holds_more_than_the_queue_record(tmp_path: Path) -> None:
    out = tmp_path / "queue_cost.json"
    assert bench_queue_cost.main(["--depths", "20", "40", "--ops", "20", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    expected = {*POLICY_NAMES, *(f"{name} +guard +fair" for name in POLICY_NAMES)}
    assert set(figures["dispatch_us"]) == expected
    assert all(len(us) == 2 and min(us) > 0 for us in figures["dispatch_us"].values())
    memory = figures["memory_bytes"]
    assert memory["depth"] == 40
    assert 0 < memory["queue_record"] < memory["proxy_ticket"]
