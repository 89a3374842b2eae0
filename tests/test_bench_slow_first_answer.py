"""benchmarks/bench_slow_first_answer.py: the requests it sends and how it reads /queue (the runs
themselves go by hand: they need llama.cpp and minutes)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from bench_slow_first_answer import (  # noqa: E402
    BLOCKER_TOKENS,
    FIRST_TOKENS,
    QUICK,
    QUICK_TOKENS,
    inversions,
    plan,
    request_id,
)

from clairvoyant.tools.bench.prompt_set import BenchPrompt, class_of  # noqa: E402


def _prompts() -> list[BenchPrompt]:
    lengths = [10, 20, 40, 60, 80, 100, 120, 150, 180, 190, 620, 650, 700, 790, 900, 1000, 1100, 1200]
    return [
        BenchPrompt(f"c{i}:0", tokens, class_of(tokens), 5, "x", text=f"prompt {i}") for i, tokens in enumerate(lengths)
    ]


def test_the_plan_sends_a_short_first_quick_shorts_a_blocker_then_a_burst_with_no_prompt_twice() -> None:
    predicted = {f"prompt {i}": float(t) for i, t in enumerate([90, 30, 50, 45, 200, 80, 70, 20, 100, 60] + [300] * 8)}
    the_plan = plan(_prompts(), n_short=4, n_long=4, length_scale=0.1, seed=3, predicted_tokens=predicted.__getitem__)
    assert the_plan.first.cls == "short" and the_plan.first.n_predict == FIRST_TOKENS
    assert the_plan.first.text == "prompt 7"  # the Short prompt predicted shortest (20 tokens)
    assert [q.cls for q in the_plan.quick] == ["short"] * QUICK
    assert all(q.n_predict == QUICK_TOKENS for q in the_plan.quick)
    assert all(predicted[q.text] >= 1.5 * 20 for q in the_plan.quick)  # predicted longer than the first
    assert the_plan.blocker.cls == "long" and the_plan.blocker.n_predict == BLOCKER_TOKENS
    assert sorted(s.cls for s in the_plan.burst) == ["long"] * 4 + ["short"] * 4
    sent = [the_plan.first, *the_plan.quick, the_plan.blocker, *the_plan.burst]
    assert len({s.key for s in sent}) == len(sent)
    assert len({request_id(s) for s in sent}) == len(sent)  # /queue names each one apart
    again = plan(_prompts(), n_short=4, n_long=4, length_scale=0.1, seed=3, predicted_tokens=predicted.__getitem__)
    assert again == the_plan  # the same for every condition
    assert (
        plan(_prompts(), n_short=4, n_long=4, length_scale=0.1, seed=3).quick != the_plan.quick
    )  # no predictor: drawn


def test_inversions_count_short_long_pairs_by_predicted_seconds() -> None:
    def waiting(rid: str, tokens: float, seconds: float) -> dict[str, object]:
        return {"request_id": rid, "predicted_tokens": tokens, "predicted_s": seconds}

    queued = {
        "waiting": [
            waiting("short-0", 18, 7.4),  # the reported case: a one-word answer at 7.4 s ...
            waiting("long-1", 450, 0.01),  # ... an essay at 0.01 s
            waiting("short-2", 500, 1.0),  # predicted longer than the essay: the predictor's doing
            waiting("long-3", 600, 9.0),
        ]
    }
    # pairs: (s0, l1) inverted with fewer tokens; (s0, l3) fine; (s2, l1) inverted, more tokens; (s2, l3) fine
    assert inversions(queued) == (4, 2, 1)
    assert inversions({}) == (0, 0, 0)
