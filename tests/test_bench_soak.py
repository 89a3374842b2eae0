"""benchmarks/bench_soak.py on a tiny count: 300 requests through a real proxy process, every fault
kind at least once, so that the soak's machinery cannot rot. (The soak itself, 50,000 requests
with llama.cpp, runs by hand: docs/performance.md.)"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import bench_soak  # noqa: E402
from harness.soak import FAULT_KINDS, Outcome, Plan, Tally, make_plan, stream_end  # noqa: E402

pytestmark = pytest.mark.e2e


def test_the_plan_has_every_fault_kind_within_its_first_requests() -> None:
    plans = make_plan(60, llama_share=0.0)
    behaviours = Counter(p.behaviour for p in plans)
    for kind in ("leave", "stall", "status:400", "status:404", "status:500", "status:503"):
        assert behaviours[kind] >= 1, kind
    assert {p.path for p in plans} == {"/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"}
    assert make_plan(60, llama_share=0.0) == plans  # seeded


def test_the_tally_counts_lost_and_duplicated_answers() -> None:
    plan = Plan(1, "fake", "/v1/chat/completions", True, "plain", "a", 0, None, "m")
    resent = Plan(2, "fake", "/api/chat", False, "status:503", "a", 0, None, "m")
    tally = Tally()
    tally.add(Outcome(plan, 200, "cut", True))  # a stream that stopped without its end: lost
    tally.add(Outcome(resent, 503, "whole", True))
    assert len(tally.lost) == 1 and tally.statuses == Counter({"200": 1, "503": 1})
    ledger = Counter({"soak-1": 2, "soak-2": 4})  # the 503 one is sent again by design
    assert tally.duplicated(ledger) == 1 and tally.resent_after_503(ledger) == (1, 4)
    assert stream_end("/api/chat", b'{"done":false}\n{"done":true}\n') == "whole"
    assert stream_end("/v1/chat/completions", b'data: {"error":{"message":"x"}}\n\n') == "error_event"
    assert stream_end("/v1/chat/completions", b"data: {}\n\n") == "cut"


def test_a_short_soak_with_every_fault_loses_nothing(tmp_path: Path) -> None:
    result = asyncio.run(
        bench_soak.run_soak(
            300, log_dir=tmp_path, llama_share=0.0, report_every=100, rss_baseline_at=100, backend_kills=1,
            learner_kills=1, out=lambda line: None, encoder=False,  # encoder off: a quicker start
        )
    )  # fmt: skip
    for kind in FAULT_KINDS:
        assert result.faults[kind] >= 1, kind
    assert result.tally.outcomes == 300 and result.lost == 0
    assert result.duplicated == 0 and result.crashed == 0 and result.tally.wrong_id == 0
    assert {"200", "400", "404", "500", "503"} <= set(result.tally.statuses)
    fake = result.proxies[0]
    assert [n for n, _ in fake.samples] == [100, 200, 300]
    assert fake.idle is not None and fake.idle.tasks is not None and fake.samples[0][1].retained
    rows = bench_soak.rows(result)
    assert all(row.ok is not False for row in rows), [r.case for r in rows if r.ok is False]
