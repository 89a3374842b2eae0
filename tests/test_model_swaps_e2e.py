"""Model switches end to end: the proxy (shipped predictor, streams on) in front of the REAL
llama.cpp server behind a front that makes it pay a load when the model changes
(benchmarks/harness/switching_front.py, as Ollama or llama-swap loads a model), and the bound check the
benchmark judges with (benchmarks/bench_model_swaps.py), on explicit times.

The end-to-end scenario: a warm-up (a, a, b) teaches the proxy the usual first byte and one load; a
blocker for model b holds the one slot while 3 + 3 requests arrive alternating a, b, a, b, ... (each
submitted once the previous one is seen waiting in /queue: the arrival order is data, not luck);
then the slot frees and the policy decides. fcfs switches at every arrival; the default policy
serves the model it holds (b) first, then switches once."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxy_harness import running_proxy

from clairvoyant.config import Settings
from clairvoyant.prediction.predictor import OnnxPredictor
from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import bench_model_swaps as bench  # noqa: E402
from harness.switching_front import SwitchingFront  # noqa: E402

SWITCH_S = 1.0  # the front's load: short, to keep the test short; well above the 0.5 s that counts
A, B = bench.MODELS
# One prompt for every request, its answer's length forced: the load is learned as a first byte's
# excess over the model's usual one, which a longer prompt's prefill would shift by tenths of a second.
PROMPT = "What is the capital of France?"
# (request id, model, text, forced tokens): 3 + 3, alternating models
BURST = [(f"{model[-1]}{i}", model, PROMPT, 12 if i % 2 else 4) for i in range(3) for model in (A, B)]


def request(rid: str, model: str, text: str, tokens: int) -> bench.SwapRequest:
    return bench.SwapRequest(rid, model, "short", 0, tokens, text)


WARMUP = [request(f"warm-{i}", model, PROMPT, 2) for i, model in enumerate((A, A, B))]
BLOCKER = request("blocker", B, PROMPT, 80)  # holds the slot 1.5-3 s while the burst arrives


@pytest.fixture(scope="module")
def front(llama_server: EmbeddedLlamaServer) -> Iterator[SwitchingFront]:
    with SwitchingFront(llama_server.base_url, switch_s=SWITCH_S) as switching:
        yield switching


@pytest.fixture(scope="module")
def predictor() -> OnnxPredictor:
    return OnnxPredictor()


@dataclass
class Burst:
    answers: list[bench.Answer]
    snapshot: dict[str, Any]  # /queue after the burst
    switches: int  # the backend's, from the blocker on
    served: list[str]  # request ids in the order the backend served them, from the blocker on


async def _poll(client: httpx.AsyncClient, url: str, rid: str, where: str, deadline_s: float) -> None:
    """Until ``rid`` is in /queue's ``where`` list ("waiting", "in_flight")."""
    while time.monotonic() < deadline_s:
        if any(r["request_id"] == rid for r in (await client.get(f"{url}/queue")).json()[where]):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{rid} never showed {where} in /queue (did the blocker end before the burst was in?)")


async def _burst(url: str) -> list[bench.Answer]:
    """The blocker, then the burst in order, each once the previous one waits; every answer."""
    deadline_s = time.monotonic() + 30
    async with httpx.AsyncClient(timeout=60) as client, httpx.AsyncClient(timeout=60) as watcher:
        tasks = [asyncio.create_task(bench.send(client, url, BLOCKER))]
        await _poll(watcher, url, BLOCKER.request_id, "in_flight", deadline_s)
        for spec in BURST:
            tasks.append(asyncio.create_task(bench.send(client, url, request(*spec))))
            await _poll(watcher, url, spec[0], "waiting", deadline_s)
        return list(await asyncio.gather(*tasks))


def run_burst(front: SwitchingFront, predictor: OnnxPredictor, **settings: Any) -> Burst:
    config = Settings(upstream_url=front.base_url, bench_upstream_fields=True, log_level="warning", **settings)
    with running_proxy(config, predictor=predictor) as url:
        warm = asyncio.run(bench.send_all(url, WARMUP, at_once=False))
        assert all(a.ok for a in warm), warm
        assert front.holds == B
        before = len(front.served)
        answers = asyncio.run(_burst(url))
        snapshot = httpx.get(f"{url}/queue").json()
    served = front.served[before:]
    return Burst(answers[1:], snapshot, sum(s.switched for s in served), [s.request_id for s in served])


def _check_answered_once(burst: Burst) -> None:
    assert [a.request_id for a in burst.answers if a.ok] == [spec[0] for spec in BURST]  # 200, every token
    assert sorted(burst.served) == sorted(["blocker", *(spec[0] for spec in BURST)])  # each reached the backend once


def _put_offs(burst: Burst) -> dict[str, bench.PutOff]:
    records = bench.records_from_queue(burst.snapshot)
    bound_s = burst.snapshot["model_switch"]["bound_s"]
    return bench.put_offs(records, [spec[0] for spec in BURST], bound_s)


def _expected_load_s(prior_s: float, samples: int, sample_s: float) -> float:
    """ServiceTimeModel.observe_load's moving average after ``samples`` loads of ``sample_s``."""
    from clairvoyant.scheduling.service_time import LOAD_WEIGHT

    load_s = prior_s
    for n in range(samples):
        load_s += max(LOAD_WEIGHT, 1.0 / (n + 2)) * (sample_s - load_s)
    return load_s


def test_default_policy_switches_less_than_fcfs_and_keeps_the_bound(
    front: SwitchingFront, predictor: OnnxPredictor
) -> None:
    fcfs = run_burst(front, predictor, policy="fcfs")
    default = run_burst(front, predictor)

    # fcfs: arrival order, a switch at every request (b held: a, b, a, b, ...)
    assert fcfs.served == ["blocker", *(spec[0] for spec in BURST)]
    assert fcfs.switches == len(BURST)
    # default: b is held, so b's requests first, then one switch to a
    assert default.served[0] == "blocker" and sorted(default.served[1:4]) == ["b0", "b1", "b2"]
    assert default.switches == 1 < fcfs.switches
    for burst in (fcfs, default):
        _check_answered_once(burst)
    put = _put_offs(default)
    assert default.snapshot["model_switch"]["bound_s"] == 30.0
    assert all(p.ok for p in put.values()), put
    assert max(p.put_off_s for p in put.values()) > 0  # a's requests were put off (while b ran)

    # The load, learned from the first byte of each answer that followed a switch: each such answer
    # came SWITCH_S late, so each model's average is the prior moved toward SWITCH_S by its samples.
    # Each sample is that delay less the model's usual first byte (same prompt, same prefill).
    backend = fcfs.snapshot["backends"][0]
    prior_s = fcfs.snapshot["model_switch"]["load_prior_s"]
    for model, samples in ((A, 3), (B, 4)):  # fcfs's switches to each, and the warm-up's switch to b
        learned = backend["load_s"][model]
        assert learned["observations"] == samples
        assert learned["load_s"] == pytest.approx(_expected_load_s(prior_s, samples, SWITCH_S), abs=0.3)
        assert learned["load_s"] < prior_s - 2.0  # (5 s until measured)


def test_no_request_waits_past_a_bound_that_binds(front: SwitchingFront, predictor: OnnxPredictor) -> None:
    # A 1 s bound against the blocker's 1.5-3 s and 1 s loads: a's requests come due while b runs, and
    # b's while a runs, so the backend must switch on the bound, more than once.
    burst = run_burst(front, predictor, model_switch_bound_s=1.0)
    _check_answered_once(burst)
    put = _put_offs(burst)
    assert burst.switches >= 2
    assert any(p.put_off_s > 1.0 for p in put.values())  # the bound was reached: the check has teeth
    assert all(p.ok for p in put.values()), put


# -- the bound check itself, on explicit times -------------------------------------------------------


def record(rid: str, model: str, arrival_s: float, dispatched_s: float, ended_s: float) -> bench.Record:
    return bench.Record(rid, model, arrival_s, dispatched_s, ended_s)


def test_a_switch_at_the_end_of_the_request_in_flight_when_the_bound_runs_out_is_within_it() -> None:
    records = [
        record("a0", "a", 0.0, 0.0, 5.0),
        record("a1", "a", 0.0, 5.0, 12.0),  # in flight when b0's bound runs out (1 + 10 = 11 s)
        record("b0", "b", 1.0, 12.0, 15.0),
    ]
    (got,) = bench.put_offs(records, ["b0"], 10.0).values()
    assert (got.wait_s, got.put_off_s, got.allowed_s, got.ok) == (11.0, 11.0, 11.0, True)


def test_a_request_for_the_held_model_dispatched_after_the_bound_ran_out_is_past_it() -> None:
    records = [
        record("a0", "a", 0.0, 0.0, 5.0),
        record("a1", "a", 0.0, 5.0, 12.0),
        record("a2", "a", 0.0, 12.0, 14.0),  # dispatched after b0 came due: not allowed
        record("b0", "b", 1.0, 14.0, 15.0),
    ]
    got = bench.put_offs(records, ["b0", "a2"], 10.0)
    assert (got["b0"].put_off_s, got["b0"].allowed_s, got["b0"].ok) == (13.0, 11.0, False)
    assert (got["a2"].put_off_s, got["a2"].ok) == (0.0, True)  # its model was held whenever it waited


def test_a_request_whose_model_is_switched_away_is_put_off_from_that_switch() -> None:
    records = [
        record("b0", "b", 0.0, 0.0, 4.0),
        record("a0", "a", 0.0, 5.0, 10.0),  # the switch away from b, at 5 s
        record("a1", "a", 0.0, 10.0, 16.0),  # in flight when b1's bound runs out (5 + 10 = 15 s)
        record("b1", "b", 2.0, 16.0, 17.0),
    ]
    got = bench.put_offs(records, ["b1"], 10.0)["b1"]
    assert (got.put_off_s, got.allowed_s, got.ok) == (11.0, 11.0, True)
    no_bound = bench.put_offs(records, ["b1"], 0.0)["b1"]  # fcfs states none: the figure, no verdict
    assert (no_bound.put_off_s, no_bound.allowed_s, no_bound.ok) == (11.0, None, True)


def test_a_request_the_proxy_did_not_complete_is_not_measured() -> None:
    got = bench.put_offs([record("a0", "a", 0.0, 0.0, 1.0)], ["a0", "lost"], 10.0)
    assert got["lost"].ok is None and got["lost"].wait_s is None
