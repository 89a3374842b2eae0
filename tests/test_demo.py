"""clairvoyant.tools.demo: arguments and the side-by-side table (the full demo is timed by hand, see docs/benchmarks.md)."""

from __future__ import annotations

import argparse

from clairvoyant.tools import demo


def test_defaults_fit_the_three_minute_budget() -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.n_short, args.n_long, args.threads) == (8, 8, 1)
    # A Long request (600-799 true tokens) is forced to at most 200 tokens: ~4 s at ~50 tokens/s.
    assert 799 * args.length_scale <= 200


def test_table_shows_both_policies_and_the_change() -> None:
    rows = []
    for condition, short, long in (("fcfs", [10.0, 20.0, 30.0], [40.0, 50.0]), ("sjf", [1.0, 2.0, 3.0], [44.0, 60.0])):
        rows += [{"condition": condition, "cls": "short", "ok": True, "e2e_s": v} for v in short]
        rows += [{"condition": condition, "cls": "long", "ok": True, "e2e_s": v} for v in long]
    table = demo._table(rows)
    lines = {line.split("(s)")[0].strip(): line.split() for line in table.splitlines() if "(s)" in line}
    assert lines["Short P50"][-3:] == ["20.00", "2.00", "-90%"]
    assert lines["Long P50"][-3:] == ["45.00", "52.00", "+16%"]
    assert set(lines) == {"Short P50", "Short P95", "Long P50", "Long P95"}


def test_order_table_lists_the_predicted_order_beside_the_truth() -> None:
    from clairvoyant.tools.bench.client import RequestSpec

    specs = [
        RequestSpec(index=i, key=f"k{i}:0", cls=c, answer_tokens=t, n_predict=t // 4, prompt_chars=3, text="x")
        for i, (c, t) in enumerate([("long", 700), ("short", 30), ("short", 90)])
    ]
    table = demo.order_table(specs, [500.0, 40.0, 20.0], {2: 0, 1: 1, 0: 2})
    rows = [line.split() for line in table.splitlines()[1:]]
    # predicted order: request 2 (20), 1 (40), 0 (500); true ranks 2, 1, 3; finished 1st, 2nd, 3rd
    assert [r[1:] for r in rows] == [
        ["20", "90", "2", "short", "1"],
        ["40", "30", "1", "short", "2"],
        ["500", "700", "3", "long", "3"],
    ]
