"""Model switches end to end: two models on one serial backend that pays a load to switch, a burst of
12 + 12 requests, the proxy's default policy against fcfs.

The backend is the real llama.cpp server (``EmbeddedLlamaServer``: SmolLM2, one slot, one thread)
behind ``SwitchingFront`` (benchmarks/harness/switching_front.py), which sleeps ``--switch-s`` (3 s) before
a request whose model is not the one it served last, as Ollama or llama-swap loads a model; the
generation is llama.cpp's. The proxy runs in this process on its real server, streams on, with the
shipped predictor and every setting at its default except the condition's:

    fcfs        policy=fcfs (arrival order; it ignores model_switch_bound_s)
    default     the defaults: policy=sjf, model_switch_bound_s=30
    before      the defaults with the switch rule before weighing (``ModelAffinity`` rule "bound": the
                held model is served until a request for another has been put off the bound, and the
                starvation guard counts that wait), selected in this process for that proxy only
    bound-N     the defaults with model_switch_bound_s=N (bound-0: no grouping, switching counted as free)
    noguard     the defaults with starvation_timeout_s=inf (what the starvation guard costs the order)

The workload: real ShareGPT prompts from the shipped predictor's held-out side
(profiler/data/prompts.jsonl), ``--shorts`` Short and ``--longs`` Long per model (6 + 6: 12 Short and
12 Long in all; classes of the TRUE answer length, prediction/length_classes.py), sent in an order
that alternates models, each answer
forced to ``ceil(true length x --length-scale)`` tokens through the proxy's benchmark-only
``upstream`` field (``bench_upstream_fields``), so the predictor never sees it. All 24 are sent at
once, in a seeded shuffled order that alternates models; each repetition draws other prompts and
another order, and every condition of a repetition sends the same requests (paired). Conditions go
in an order rotated by the repetition.

Each condition runs in a fresh proxy, after a warm-up of four small sequential requests (a, a, b, b):
the proxy learns the usual first-byte delay of each model and one load (from the first byte of the
answer that followed the switch), and the backend holds a known model when the burst comes. More
warm-up is not needed for the grouping: a load counts against switching from 0.5 s
(``FREE_LOAD_S``), and the load assumed until one is measured is 5 s; the learned load only sets
ETAs and what a switch is charged in fair share.

Targets, in every repetition (each a seed of its own):

1. model switches under default <= 25% of fcfs's (the backend's own count; the proxy's
   ``clairvoyant_model_switches_total`` is shown beside it);
2. Short P50 (end to end, client side) under default <= 50% of fcfs's;
3. the mean (end to end, every request) under default no worse than under before (judged on the
   median of the per-repetition ratios). On a busy machine one request's service differs by half
   between conditions, so each order is also replayed at common service seconds (``order_means``:
   the median of each request's measured service, 3 s a switch) and that ratio printed beside it;
4. every request answered (200, whole stream) under every condition;
5. no request waits past its stated bound (default, before and every bound-N with N > 0); the
   longest put-off and the most any went past its allowance are printed.

The stated bound (docs/scheduling.md "Model switches", scheduling/affinity.py): with two models and
one slot, a request whose model the backend does not hold is *put off* from P = max(its arrival, the
backend's last switch); its model is switched to (a request for it is dispatched, finding the other
model held) at most ``model_switch_bound_s`` after P, plus the rest of the request in flight at
P + bound (the backend finishes what it runs, then switches). Per request and per stretch of its wait
during which the backend held the other model: ``put_off_s`` = switch to its model - P, and
``allowed_s`` = the bound plus that in-flight remainder (the bound alone if the switch came within
it); the request's figure is its worst stretch, checked with ``TOLERANCE_S`` for the dispatch step's
event-loop turn and /queue's millisecond rounding. Times are the proxy's own (/queue's finished
requests: arrival, dispatch, end); fcfs and bound-0 state no bound (their put-off is shown, not judged).

    PYTHONPATH=src python benchmarks/bench_model_swaps.py          # fcfs, before, default; 3 repetitions
    PYTHONPATH=src python benchmarks/bench_model_swaps.py --reps 1 --conditions fcfs,default,bound-0,noguard

The forced lengths (``--length-scale`` 0.1: Long answers of about 60-80 tokens, Short of 1-20) make
a model's share of the burst (12 answers) last several times the starvation guard's 1 s + 3.2 x
predicted seconds, so the model served second has waited long past its guard when it is loaded:
the case where the rule before weighing served it in arrival order (the backend's order and the
guard's picks are printed per condition).

Results (every request, the backend's log, the learned loads) go to ``--json`` (default: a file in
the temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
import unittest.mock
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.switching_front import Served, SwitchingFront  # noqa: E402

MODELS = ("model-a", "model-b")
CHAT = "/v1/chat/completions"
TOLERANCE_S = 0.05  # the dispatch step runs one event-loop turn after a slot frees; /queue rounds to 1 ms
WARMUP = (("warm-0", MODELS[0]), ("warm-1", MODELS[0]), ("warm-2", MODELS[1]), ("warm-3", MODELS[1]))
WARMUP_TEXT = "Say hello."
WARMUP_TOKENS = 4
SWITCH_TARGET = 0.25  # default's switches / fcfs's, at most
SHORT_P50_TARGET = 0.50  # default's Short P50 / fcfs's, at most


# --------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SwapRequest:
    """One request of the burst (or the warm-up)."""

    request_id: str  # sent as X-Request-Id; the proxy sends it on to the backend
    model: str
    cls: str  # class of the TRUE answer length
    answer_tokens: int  # the TRUE answer length (cl100k tokens)
    n_predict: int  # the forced length
    text: str


def workload(prompts: Sequence[Any], *, shorts: int, longs: int, length_scale: float, seed: int) -> list[SwapRequest]:
    """``shorts`` + ``longs`` requests per model, distinct prompts, sent in a seeded shuffled order
    that alternates models (a, b, a, b, ...: arrival order switches model at every request)."""
    from clairvoyant.tools.bench.workload import forced_length

    rng = random.Random(seed)
    out: list[SwapRequest] = []
    for cls, per_model in (("short", shorts), ("long", longs)):
        pool = [p for p in prompts if p.cls == cls]
        if len(pool) < per_model * len(MODELS):
            raise ValueError(f"only {len(pool)} {cls} prompts for {per_model} per model")
        chosen = rng.sample(pool, per_model * len(MODELS))
        for i, prompt in enumerate(chosen):
            model = MODELS[i % len(MODELS)]
            n = forced_length(prompt.answer_tokens, length_scale)
            rid = f"{model[-1]}-{cls[0]}{i // len(MODELS)}"
            out.append(SwapRequest(rid, model, cls, prompt.answer_tokens, n, prompt.text))
    by_model = [[r for r in out if r.model == model] for model in MODELS]
    for requests in by_model:
        rng.shuffle(requests)
    return [r for turn in zip(*by_model, strict=True) for r in turn]


def warmup_requests() -> list[SwapRequest]:
    return [SwapRequest(rid, model, "short", 0, WARMUP_TOKENS, WARMUP_TEXT) for rid, model in WARMUP]


@dataclass(slots=True)
class Answer:
    """What the client saw for one request (seconds from its send)."""

    request_id: str
    model: str
    cls: str
    n_predict: int
    status: int | None = None
    e2e_s: float | None = None  # end of the stream
    ttft_s: float | None = None  # first answer text
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.completion_tokens == self.n_predict


async def send(client: httpx.AsyncClient, base_url: str, request: SwapRequest) -> Answer:
    """Stream one chat answer through the proxy, its length forced out of the predictor's sight."""
    from clairvoyant.tools.bench.client import RequestSpec, build_body

    spec = RequestSpec(0, request.request_id, request.cls, request.answer_tokens, request.n_predict, 0, request.text)
    body = build_body(spec, "openai", model=request.model, hide_length=True)
    answer = Answer(request.request_id, request.model, request.cls, request.n_predict)
    sent = time.perf_counter()
    try:
        async with client.stream(
            "POST", base_url + CHAT, json=body, headers={"X-Request-Id": request.request_id}
        ) as response:
            answer.status = response.status_code
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                event = json.loads(line[5:])
                usage = event.get("usage")
                if isinstance(usage, dict):
                    answer.completion_tokens = usage.get("completion_tokens")
                if answer.ttft_s is None and any((c.get("delta") or {}).get("content") for c in event["choices"]):
                    answer.ttft_s = time.perf_counter() - sent
        answer.e2e_s = time.perf_counter() - sent
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    return answer


async def send_all(base_url: str, requests: Sequence[SwapRequest], *, at_once: bool) -> list[Answer]:
    """All ``requests`` at once (a burst), or one after another (the warm-up)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0)) as client:
        if at_once:
            return list(await asyncio.gather(*(send(client, base_url, r) for r in requests)))
        return [await send(client, base_url, r) for r in requests]


# --------------------------------------------------------------------------------------------
# The bound, from the proxy's own times
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """One finished request as the proxy saw it (its clock's seconds)."""

    request_id: str
    model: str
    arrival_s: float
    dispatched_s: float
    ended_s: float


def records_from_queue(snapshot: dict[str, Any]) -> list[Record]:
    """The completed requests of /queue's ``recent``, in seconds before the snapshot (negative)."""
    out = []
    for r in snapshot["recent"]:
        if r["outcome"] != "completed" or r["service_s"] is None:
            continue
        ended = -r["ended_ago_s"]
        dispatched = ended - r["service_s"]
        out.append(Record(r["request_id"], r["model"], dispatched - r["waited_s"], dispatched, ended))
    return out


@dataclass(slots=True)
class PutOff:
    """A request's longest stretch put off while the backend held another model (see the module)."""

    request_id: str
    wait_s: float | None  # arrival to dispatch (None: the proxy did not complete it: not measured)
    put_off_s: float = 0.0  # P to the switch to its model (0: its model was held whenever it waited)
    allowed_s: float | None = None  # the stated bound for that stretch (None: no bound stated)
    ok: bool | None = True  # within the bound (True also where none is stated); None: not measured


def put_offs(records: Sequence[Record], ids: Sequence[str], bound_s: float) -> dict[str, PutOff]:
    """Each of ``ids``' put-off against the stated bound (``bound_s`` 0: none, figures only), from the
    backend's timeline in ``records`` (every request it ran, warm-up included: one slot, two models)."""
    timeline = sorted(records, key=lambda r: r.dispatched_s)
    # (switch seconds, model held from then): each dispatch that found another model held (or nothing)
    holds: list[tuple[float, str]] = []
    for ran in timeline:
        if not holds or holds[-1][1] != ran.model:
            holds.append((ran.dispatched_s, ran.model))
    by_id = {x.request_id: x for x in records}
    out: dict[str, PutOff] = {}
    for rid in ids:
        r = by_id.get(rid)
        if r is None:  # not answered: counted as such, and no put-off to measure
            out[rid] = PutOff(rid, None, allowed_s=bound_s or None, ok=None)
            continue
        result = out[rid] = PutOff(rid, r.dispatched_s - r.arrival_s, allowed_s=bound_s or None)
        worst = -math.inf
        for i, (switch_s, model) in enumerate(holds):
            until_s = holds[i + 1][0] if i + 1 < len(holds) else math.inf  # the switch to the next model
            if model == r.model or switch_s >= r.dispatched_s or until_s <= r.arrival_s:
                continue  # its own model held, or a stretch outside its wait
            start_s = max(r.arrival_s, switch_s)
            put_off_s = until_s - start_s
            allowed_s = None
            if bound_s:
                due_s = start_s + bound_s
                running = [x for x in timeline if x.dispatched_s <= due_s < x.ended_s]
                allowed_s = max(bound_s, (running[0].ended_s if running else due_s) - start_s)
            margin = put_off_s - (allowed_s if allowed_s is not None else 0.0)
            if margin > worst:
                worst = margin
                result.put_off_s, result.allowed_s = put_off_s, allowed_s
                result.ok = allowed_s is None or put_off_s <= allowed_s + TOLERANCE_S
    return out


# --------------------------------------------------------------------------------------------
# One condition
# --------------------------------------------------------------------------------------------


def settings_for(condition: str, backend_url: str) -> Any:
    from clairvoyant.config import Settings

    overrides: dict[str, Any] = {}
    if condition in ("default", "before"):
        pass  # before: the defaults, its rule selected by ``switch_rule``
    elif condition.startswith("bound-"):
        overrides["model_switch_bound_s"] = float(condition.removeprefix("bound-"))
    elif condition == "fcfs":
        overrides["policy"] = "fcfs"
    elif condition == "noguard":
        overrides["starvation_timeout_s"] = math.inf
    else:
        raise ValueError(f"unknown condition {condition!r}: fcfs, default, before, bound-N or noguard")
    return Settings(
        upstream_url=backend_url, bench_upstream_fields=True, max_queue=1000, log_level="warning", **overrides
    )


def metric(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@dataclass(slots=True)
class ConditionRun:
    condition: str
    bound_s: float  # the stated model switch bound (0: none)
    answers: list[Answer]
    put_offs: dict[str, PutOff]
    switches: int  # the backend's, during the burst
    proxy_switches: float  # clairvoyant_model_switches_total during the burst
    promotions: float  # clairvoyant_starvation_promotions_total during the burst (the guard's picks)
    served: list[Served]  # the backend's log of the burst
    learned_load_s: dict[str, Any]  # /queue's backends[0].load_s after the burst
    wall_s: float
    figures: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def switch_rule(rule: str) -> Iterator[None]:
    """Proxies started inside build their model-affinity queue with ``rule`` (``affinity.SWITCH_RULES``):
    the rule is not a setting, and the proxy runs in this process."""
    from clairvoyant.scheduling import affinity, policy

    def with_rule(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("rule", None)
        return affinity.ModelAffinity(*args[:3], **kwargs, rule=rule)

    with unittest.mock.patch.object(policy, "ModelAffinity", with_rule):
        yield


def run_condition(front: SwitchingFront, condition: str, requests: Sequence[SwapRequest]) -> ConditionRun:
    from clairvoyant.tools.bench.runner import proxy_server

    rule = "bound" if condition == "before" else "weighed"
    with switch_rule(rule), proxy_server(settings_for(condition, front.base_url)) as url:
        warm = asyncio.run(send_all(url, warmup_requests(), at_once=False))
        if not all(a.ok for a in warm):
            raise RuntimeError(f"{condition}: the warm-up failed: {[a for a in warm if not a.ok]}")
        switches_before, served_before = metric(url, "clairvoyant_model_switches_total"), len(front.served)
        promotions_before = metric(url, "clairvoyant_starvation_promotions_total")
        start = time.perf_counter()
        answers = asyncio.run(send_all(url, requests, at_once=True))
        wall_s = time.perf_counter() - start
        snapshot = httpx.get(f"{url}/queue").json()
        proxy_switches = metric(url, "clairvoyant_model_switches_total") - switches_before
        promotions = metric(url, "clairvoyant_starvation_promotions_total") - promotions_before
    served = front.served[served_before:]
    bound_s = float(snapshot["model_switch"]["bound_s"])
    records = records_from_queue(snapshot)
    return ConditionRun(
        condition,
        bound_s,
        answers,
        put_offs(records, [r.request_id for r in requests], bound_s),
        sum(1 for s in served if s.switched),
        proxy_switches,
        promotions,
        served,
        snapshot["backends"][0]["load_s"],
        wall_s,
    )


def figures(run: ConditionRun) -> dict[str, float]:
    from clairvoyant.tools.bench.stats import percentile

    ok = [a for a in run.answers if a.ok and a.e2e_s is not None]
    short = [a.e2e_s for a in ok if a.cls == "short" and a.e2e_s is not None]
    every = [a.e2e_s for a in ok if a.e2e_s is not None]
    return {
        "switches": float(run.switches),
        "proxy_switches": run.proxy_switches,
        "promotions": run.promotions,
        "short_p50_s": percentile(short, 50),
        "short_p95_s": percentile(short, 95),
        "all_p50_s": percentile(every, 50),
        "all_mean_s": statistics.fmean(every) if every else math.nan,
        "all_p99_s": percentile(every, 99),
        "answered": float(len(ok)),
        "sent": float(len(run.answers)),
        "max_put_off_s": max((p.put_off_s for p in run.put_offs.values()), default=0.0),
        "max_past_allowed_s": max(
            (p.put_off_s - p.allowed_s for p in run.put_offs.values() if p.allowed_s is not None), default=math.nan
        ),
        "past_bound": float(sum(1 for p in run.put_offs.values() if p.ok is False)),
        "wall_s": run.wall_s,
    }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def print_requests(run: ConditionRun, requests: Sequence[SwapRequest]) -> None:
    answers = {a.request_id: a for a in run.answers}
    bound = f"bound {run.bound_s:g} s" if run.bound_s else "no bound stated"
    print(f"    each request's put-off ({bound}), in send order:")
    for r in requests:
        a, p = answers[r.request_id], run.put_offs[r.request_id]
        allowed = "-" if p.allowed_s is None else f"{p.allowed_s:5.1f}"
        verdict = "" if p.allowed_s is None else {True: "ok", False: "PAST ITS BOUND", None: "not answered"}[p.ok]
        e2e = "failed" if a.e2e_s is None else f"{a.e2e_s:5.1f}"
        print(
            f"      {r.request_id:7} {r.model} {r.cls:5} n={r.n_predict:3}  e2e {e2e} s  queued {'-' if p.wait_s is None else format(p.wait_s, '5.1f')} s"
            f"  put off {p.put_off_s:5.1f} s / allowed {allowed}  {verdict}"
        )


def print_figures(run: ConditionRun) -> None:
    f = run.figures
    print(
        f"  {run.condition:10} switches {f['switches']:3.0f} (proxy counted {f['proxy_switches']:3.0f})"
        f"  Short P50 {f['short_p50_s']:5.1f} s  P95 {f['short_p95_s']:5.1f} s"
        f"  all P50 {f['all_p50_s']:5.1f} s  mean {f['all_mean_s']:5.1f} s  P99 {f['all_p99_s']:5.1f} s"
        f"  answered {f['answered']:.0f}/{f['sent']:.0f}  max put-off {f['max_put_off_s']:4.1f} s"
        f" (past its allowance by {f['max_past_allowed_s']:+.2f} s)  past bound {f['past_bound']:.0f}  ({f['wall_s']:.0f} s)"
    )
    order = " ".join(s.request_id for s in run.served)
    print(f"    the backend served ({f['promotions']:.0f} picked by the starvation guard): {order}")


def order_means(runs: dict[str, ConditionRun], switch_s: float) -> dict[str, float]:
    """Each condition's order replayed at common service seconds: the mean time to the end of each
    answer of the burst (all sent at 0), each request taking the median of its measured service
    across the conditions, each change of model ``switch_s``, the backend holding the warm-up's last
    model at first. Measured services of one request differ by half between conditions on a busy
    machine; this compares the orders alone."""
    measured: dict[str, list[float]] = {}
    for run in runs.values():
        for served in run.served:
            if served.ended_s is not None:
                measured.setdefault(served.request_id, []).append(served.ended_s - served.started_s - served.load_s)
    service = {rid: statistics.median(values) for rid, values in measured.items()}
    out = {}
    for condition, run in runs.items():
        t, held, ends = 0.0, WARMUP[-1][1], []
        for served in run.served:
            if served.model != held:
                t, held = t + switch_s, served.model
            t += service.get(served.request_id, 0.0)
            ends.append(t)
        out[condition] = statistics.fmean(ends) if ends else math.nan
    return out


def verdicts(reps: list[dict[str, ConditionRun]], switch_s: float) -> dict[str, Any]:
    """Median figures per condition, the ratios against fcfs and before per repetition (paired) and
    PASS/FAIL per target."""
    conditions = list(reps[0])
    medians = {
        c: {k: statistics.median(rep[c].figures[k] for rep in reps) for k in reps[0][c].figures} for c in conditions
    }
    out: dict[str, Any] = {"medians": medians, "targets": {}}
    if "fcfs" in conditions and "default" in conditions:
        switch_ratios = [
            rep["default"].figures["switches"] / rep["fcfs"].figures["switches"]
            if rep["fcfs"].figures["switches"]
            else math.inf
            for rep in reps
        ]
        p50_ratios = [rep["default"].figures["short_p50_s"] / rep["fcfs"].figures["short_p50_s"] for rep in reps]
        out["ratios"] = {"switches": switch_ratios, "short_p50": p50_ratios}
        out["targets"]["switches <= 25% of fcfs, every repetition"] = (
            max(switch_ratios),
            max(switch_ratios) <= SWITCH_TARGET,
        )
        out["targets"]["Short P50 <= 50% of fcfs, every repetition"] = (
            max(p50_ratios),
            max(p50_ratios) <= SHORT_P50_TARGET,
        )
    if "before" in conditions and "default" in conditions:
        mean_ratios = [rep["default"].figures["all_mean_s"] / rep["before"].figures["all_mean_s"] for rep in reps]
        out.setdefault("ratios", {})["mean_vs_before"] = mean_ratios
        replayed = [order_means(rep, switch_s) for rep in reps]
        out["ratios"]["order_mean_vs_before"] = [r["default"] / r["before"] for r in replayed]
        out["targets"]["mean no worse than before (median over repetitions)"] = (
            statistics.median(mean_ratios),
            statistics.median(mean_ratios) <= 1.0,
        )
    answered = all(run.figures["answered"] == run.figures["sent"] for rep in reps for run in rep.values())
    out["targets"]["all answered"] = (
        sum(run.figures["answered"] for rep in reps for run in rep.values()),
        answered,
    )
    judged = [run for rep in reps for run in rep.values() if run.bound_s > 0]
    past = sum(run.figures["past_bound"] for run in judged)
    out["targets"]["none past its bound"] = (past, bool(judged) and past == 0)
    out["max_past_allowed_s"] = max((run.figures["max_past_allowed_s"] for run in judged), default=math.nan)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions (medians over them)")
    parser.add_argument(
        "--conditions", default="fcfs,before,default", help="fcfs, default, before, bound-N, noguard (comma-separated)"
    )
    parser.add_argument("--switch-s", type=float, default=3.0, help="seconds the backend takes to switch models")
    parser.add_argument("--shorts", type=int, default=6, help="Short requests per model")
    parser.add_argument("--longs", type=int, default=6, help="Long requests per model")
    parser.add_argument("--length-scale", type=float, default=0.1, help="forced length = true length x this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no per-request lines")
    parser.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "model_swaps_results.json")
    args = parser.parse_args(argv)
    conditions = tuple(args.conditions.split(","))

    from clairvoyant.tools.bench.prompt_set import load_prompt_set, resolve
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

    prompts = resolve(load_prompt_set(classes=("short", "long")))
    started = time.perf_counter()
    reps: list[dict[str, ConditionRun]] = []
    workloads = []
    with (
        EmbeddedLlamaServer(n_parallel=1, n_threads=1) as llama,
        SwitchingFront(llama.base_url, switch_s=args.switch_s) as front,
    ):
        for rep in range(args.reps):
            requests = workload(
                prompts, shorts=args.shorts, longs=args.longs, length_scale=args.length_scale, seed=args.seed + rep
            )
            workloads.append(requests)
            k = rep % len(conditions)
            order = conditions[k:] + conditions[:k]
            print(f"repetition {rep + 1}/{args.reps} ({', '.join(order)}), seed {args.seed + rep}:")
            runs: dict[str, ConditionRun] = {}
            for condition in order:
                run = run_condition(front, condition, requests)
                run.figures = figures(run)
                runs[condition] = run
                print_figures(run)
                if not args.quiet:
                    print_requests(run, requests)
            reps.append({c: runs[c] for c in conditions})
    result = verdicts(reps, args.switch_s)
    print(f"\nmedians over {args.reps} repetition(s), switch {args.switch_s:g} s, length scale {args.length_scale:g}:")
    for condition, f in result["medians"].items():
        print(
            f"  {condition:10} switches {f['switches']:3.0f}  Short P50 {f['short_p50_s']:5.1f} s  P95 {f['short_p95_s']:5.1f} s"
            f"  all P50 {f['all_p50_s']:5.1f} s  mean {f['all_mean_s']:5.1f} s  P99 {f['all_p99_s']:5.1f} s"
            f"  answered {f['answered']:.0f}/{f['sent']:.0f}  max put-off {f['max_put_off_s']:4.1f} s"
        )
    ratios = result.get("ratios", {})
    if "switches" in ratios:
        print(
            "  per repetition, default / fcfs: switches "
            + ", ".join(f"{x:.2f}" for x in ratios["switches"])
            + "; Short P50 "
            + ", ".join(f"{x:.2f}" for x in ratios["short_p50"])
        )
    if "mean_vs_before" in ratios:
        print(
            "  per repetition, default / before: mean "
            + ", ".join(f"{x:.2f}" for x in ratios["mean_vs_before"])
            + "; the orders at common service seconds (order_means) "
            + ", ".join(f"{x:.2f}" for x in ratios["order_mean_vs_before"])
        )
    print(
        f"  the most any request was put off past its allowance (bound + the request in flight): "
        f"{result['max_past_allowed_s']:+.2f} s"
    )
    print("targets:")
    for name, (value, passed) in result["targets"].items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"  {'PASS' if passed else 'FAIL'}  {name}: {shown}")
    print(f"total {time.perf_counter() - started:.0f} s")
    payload = {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "models": MODELS,
            "tolerance_s": TOLERANCE_S,
        },
        "summary": {k: v for k, v in result.items()},
        "repetitions": [
            {
                "workload": [asdict(r) | {"text": None} for r in workloads[i]],
                "conditions": {
                    c: {
                        "bound_s": run.bound_s,
                        "figures": run.figures,
                        "answers": [asdict(a) for a in run.answers],
                        "put_offs": [asdict(p) for p in run.put_offs.values()],
                        "backend": [asdict(s) for s in run.served],
                        "learned_load_s": run.learned_load_s,
                    }
                    for c, run in rep.items()
                },
            }
            for i, rep in enumerate(reps)
        ],
    }
    args.json.write_text(json.dumps(payload, indent=1))
    print(f"results: {args.json}")
    return 0 if all(passed for _, passed in result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
