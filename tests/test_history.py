"""The live page's history (proxy/history.py), with time as data: snapshots in, rings and
percentiles out. Each snapshot is what /queue says at ``now_s`` on the dispatcher's clock."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from clairvoyant.proxy import history as history_module
from clairvoyant.proxy.history import History, percentile
from clairvoyant.scheduling.queue_view import QueueView


def finished(
    request_id: str,
    ended_ago_s: float,
    waited_s: float,
    *,
    service_s: float | None = 1.0,
    predicted_class: str = "short",
    tenant: str = "",
    outcome: str = "completed",
    predicted_tokens: float = 50.0,
    output_tokens: int | None = 40,
    model: str = "m",
) -> dict[str, Any]:
    """One entry of the snapshot's ``recent`` list (the fields the history reads)."""
    return {
        "request_id": request_id, "model": model, "tenant": tenant, "predicted_class": predicted_class,
        "predicted_tokens": predicted_tokens, "outcome": outcome, "output_tokens": output_tokens,
        "waited_s": waited_s, "service_s": service_s, "ended_ago_s": ended_ago_s,
    }  # fmt: skip


def snapshot(
    waiting: int = 0,
    in_flight: int = 0,
    recent: list[dict[str, Any]] | None = None,
    tenants: dict[str, Any] | None = None,
) -> QueueView:
    """/queue's view as the history reads it; ``recent`` newest first, like the dispatcher's."""
    return QueueView.model_validate({
        "waiting_count": waiting,
        "in_flight": [{"request_id": f"r{i}"} for i in range(in_flight)],
        "recent": recent or [],
        **({} if tenants is None else {"tenants": tenants}),
    })  # fmt: skip


def use(in_system: int = 0, last_minute: int = 0, tokens: int = 0, **limits: int) -> dict[str, Any]:
    return {"limits": limits, "in_system": in_system, "requests_last_minute": last_minute, "tokens_today": tokens}


def test_the_series_is_one_point_a_sample_and_the_present_last() -> None:
    history = History()
    for now_s, waiting, in_flight in [(100.0, 0, 1), (102.0, 3, 1), (104.0, 5, 2)]:
        history.sample(snapshot(waiting, in_flight), now_s)
    stored = history.view(105.0)["series"]
    live = history.view(105.0, snapshot(7, 0))["series"]
    assert stored == {"ago_s": [5.0, 3.0, 1.0], "waiting": [0, 3, 5], "in_flight": [1, 1, 2]}
    assert live == {"ago_s": [5.0, 3.0, 1.0, 0.0], "waiting": [0, 3, 5, 7], "in_flight": [1, 1, 2, 0]}
    assert history.view(105.0)["covered_s"] == 5.0


def test_only_the_last_15_minutes_are_kept() -> None:
    history = History()  # 900 s window, a sample every 2 s
    for i in range(1000):  # 2,000 s of samples, one finished request each
        now_s = 2.0 * i
        history.sample(snapshot(i, 1, [finished(f"r{i}", 0.5, waited_s=1.0)]), now_s)
    view = history.view(1998.0)
    ages = view["series"]["ago_s"]
    assert max(ages) <= 900 and len(ages) == 451 and view["covered_s"] == 900
    assert view["series"]["waiting"][-1] == 999
    # The waits: 30 s buckets from 15 minutes ago to now, each with its own 15 requests.
    assert len(view["waits"]["ago_s"]) == 31 and max(view["waits"]["ago_s"]) <= 900
    counts = view["waits"]["by_class"]["short"]["count"]
    assert counts[1:-1] == [15] * 29 and counts[0] <= 15  # the oldest bucket, partly within the window
    assert len(view["answers"]) == 200  # the last 200 answers, whatever their age
    assert [a["ago_s"] for a in view["answers"][-2:]] == [2.5, 0.5]


def test_a_finished_request_is_recorded_once_though_several_snapshots_list_it() -> None:
    history = History()
    first = finished("a", ended_ago_s=1.0, waited_s=2.0)
    history.sample(snapshot(recent=[first]), 10.0)
    # 2 s later the same request and a new one; the clock was read 50 ms before the snapshot's own reading
    again = finished("a", ended_ago_s=3.05, waited_s=2.0)
    history.sample(snapshot(recent=[finished("b", 0.5, 4.0), again]), 12.0)
    # A client may reuse an id: another wait is another request.
    still = finished("a", ended_ago_s=4.0, waited_s=2.0)
    history.observe(snapshot(recent=[finished("a", 0.1, 6.0), finished("b", 1.5, 4.0), still]), 13.0)
    view = history.view(13.0)
    assert [(a["ago_s"], a["output_tokens"]) for a in view["answers"]] == [(4.0, 40), (1.5, 40), (0.1, 40)]
    assert sum(view["waits"]["by_class"]["short"]["count"]) == 3


def test_the_answers_beyond_the_dispatchers_list_are_kept_up_to_200() -> None:
    """The dispatcher lists its last 100 finished requests; sampled often enough, the history has
    the last 200 answers. Requests that left or expired are waits, not answers."""
    history = History()
    ended: list[dict[str, Any]] = []
    for i in range(250):
        now_s = float(i)
        ended.insert(0, finished(f"r{i}", 0.0, 1.0, predicted_tokens=float(i), output_tokens=i))
        ended = ended[:100]  # the dispatcher's list: newest first, 100 at most
        shifted = [{**e, "ended_ago_s": now_s - int(e["request_id"][1:])} for e in ended]
        history.observe(snapshot(recent=shifted), now_s)
    history.observe(snapshot(recent=[finished("gone", 0.0, 30.0, service_s=None, outcome="left_queued")]), 250.0)
    answers = history.view(250.0)["answers"]
    assert [a["output_tokens"] for a in answers] == list(range(50, 250))
    assert answers[-1] == {
        "ago_s": 1.0, "model": "m", "predicted_class": "short", "predicted_tokens": 249.0, "output_tokens": 249,
    }  # fmt: skip


def test_waits_by_class_are_percentiles_of_each_bucket_by_when_the_wait_ended() -> None:
    history = History()  # 30 s buckets
    # 20 short requests whose wait ended in the bucket [0, 30): waits 1..20 s; two long ones
    recent = [finished(f"s{w}", ended_ago_s=20.0, waited_s=float(w), service_s=5.0) for w in range(1, 21)]
    recent += [finished(f"l{w}", 40.0, float(w), predicted_class="long", service_s=1.0) for w in (30, 50)]
    # one that ran long: it ended in [30, 60), but its wait ended in [0, 30)
    recent.append(finished("x", ended_ago_s=1.0, waited_s=100.0, predicted_class="medium", service_s=40.0))
    history.sample(snapshot(recent=recent), 45.0)
    waits = history.view(45.0)["waits"]
    assert waits["ago_s"] == [15.0, 0.0]  # each bucket's end: 30 s (15 s ago), 60 s (the present one)
    assert waits["by_class"]["short"] == {"p50": [10.0, None], "p95": [19.0, None], "count": [20, 0]}
    assert waits["by_class"]["long"] == {"p50": [30.0, None], "p95": [50.0, None], "count": [2, 0]}
    assert waits["by_class"]["medium"]["p95"] == [100.0, None]
    assert percentile([], 0.5) is None and percentile([3.0], 0.95) == 3.0


def test_an_empty_window_is_null_never_nan() -> None:
    history = History()
    assert json.dumps(history.view(0.0), allow_nan=False)  # nothing recorded yet
    history.sample(snapshot(2, 1), 100.0)
    broken = finished("nan", 1.0, waited_s=math.nan, predicted_tokens=math.nan)
    history.sample(snapshot(recent=[broken], tenants={"alice": use(max_concurrent=2)}), 160.0)
    view = history.view(200.0)
    json.dumps(view, allow_nan=False)  # raises on NaN or infinity
    assert view["answers"] == []
    assert set(view["waits"]["by_class"]) == {"short", "medium", "long"}
    for series in view["waits"]["by_class"].values():
        assert set(series["p50"]) == {None} and set(series["p95"]) == {None} and set(series["count"]) == {0}
    alice = view["tenants"]["alice"]
    assert alice["wait_p50_s"] is None and alice["wait_p95_s"] is None and alice["waits_counted"] == 0
    assert alice["series"]["in_system"] == [None, 0]  # not yet known at the first sample


def test_tenants_show_their_use_against_their_limits_and_their_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_module, "MAX_TENANTS", 3)
    history = History()
    tenants = {
        "alice": use(2, 10, 500, max_concurrent=4, requests_per_minute=60),
        "bob": use(1, 3, 90, tokens_per_day=1000),
        "": use(0, 0, 0),
    }
    recent = [finished(f"a{w}", 1.0, float(w), tenant="alice") for w in (1, 2, 3, 4)]
    recent += [finished("b", 1.0, 8.0, tenant="bob")]
    history.sample(snapshot(recent=recent, tenants=tenants), 10.0)
    # Two more tenants than there is room for: summed as one.
    later = {**tenants, "carol": use(1, 1, 5), "dave": use(2, 2, 7)}
    history.sample(snapshot(recent=[finished("c", 0.5, 6.0, tenant="carol")], tenants=later), 12.0)
    view = history.view(12.0, snapshot(tenants={**later, "alice": use(3, 11, 600, max_concurrent=4)}))
    assert list(view["tenants"]) == ["alice", "bob", "", "(other)"]
    alice = view["tenants"]["alice"]
    assert alice["limits"] == {"max_concurrent": 4}  # as the present snapshot says
    assert (alice["in_system"], alice["requests_last_minute"], alice["tokens_today"]) == (3, 11, 600)
    assert alice["series"] == {"in_system": [2, 2, 3], "requests_last_minute": [10, 10, 11]}
    assert (alice["wait_p50_s"], alice["wait_p95_s"], alice["waits_counted"]) == (2.0, 4.0, 4)
    assert alice["waits"]["p95"] == [4.0]
    other = view["tenants"]["(other)"]
    assert other["limits"] == {} and (other["in_system"], other["tokens_today"]) == (3, 12)
    assert other["series"]["in_system"] == [None, 3, 3] and other["wait_p95_s"] == 6.0
    assert view["tenants"]["bob"]["limits"] == {"tokens_per_day": 1000}
