"""The pool of backends' targets, measured against the REAL proxy process and two real llama.cpp servers.

The proxy runs as deployed: ``python -m clairvoyant serve`` in a child process configured by
CLAIRVOYANT_* variables (one backend: ``CLAIRVOYANT_UPSTREAM_URL``; the pool:
``CLAIRVOYANT_BACKENDS='[{"url": ...}, {"url": ...}]'``). Backends: two ``EmbeddedLlamaServer``
(SmolLM2, ``n_parallel=1``, 1 thread each, so the two fit on two cores), started once and kept warm.

Parts (targets and measured figures are printed as a table and written to ``--json FILE``):

* ``burst``: 16 Short + 16 Long held-out ShareGPT prompts (``profiler/data/prompts.jsonl``), all sent
  at once in a seeded shuffled order, answer lengths forced to ``ceil(0.1 x true length)`` tokens
  (Short: 1-20, Long: 60-80) with ``n_predict`` + ``ignore_eos`` in the proxy's
  ``clairvoyant.upstream`` field (``bench_upstream_fields``, unseen by the predictor); even positions
  streamed, odd ones not. Conditions ``one`` (the proxy in front of backend A, ``slots=1``) and
  ``pool`` (A and B), ``policy=sjf`` and every other setting at its default, a fresh proxy per
  condition and rep, the conditions alternated (rep r: one/pool when r is even, pool/one when odd),
  both fed the identical workload (seed = rep). Targets: median pool wall time <= 60% of the median
  one-backend wall time; median Short P50 (pool) <= median Short P50 (one).
* ``kill``: the pool under a burst of 8 Short + 8 Long (same forcing and mix, seed 100 + trial); once
  3 requests have completed and backend B has a request in flight for >= 0.3 s and at most half its
  expected time (0.3 s + 30 tokens/s; even trials: a streamed one, odd trials: a non-streamed one;
  any one after 15 s), B's process gets SIGKILL. Targets: that
  request ends with the dialect's error (streamed: a final ``data: {"error": ...}`` event after a
  200; non-streamed: a 502 with an OpenAI error body); every other request is answered 200 with its
  full forced length; none is answered by B after the kill; every request gets exactly one answer;
  backend A's ``llamacpp:tokens_predicted_total`` grew by exactly the forced lengths of the requests
  whose ``X-Clairvoyant-Backend`` names A (so nothing was generated twice there); ``/queue`` shows
  B unhealthy and A healthy.

    PYTHONPATH=src python benchmarks/bench_pool.py                          # both parts, ~4 min
    PYTHONPATH=src python benchmarks/bench_pool.py --parts burst --reps 1 --conditions one   # before the pool exists
    ... --proxy-src /path/to/other/src                                      # the same probe against another tree

Timing figures are noisy on a shared 2-core machine; the load average is recorded with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from harness import proxy_process
from harness.proxy_process import ProxyProcess
from harness.results import add_json_option, write_json
from harness.verdicts import Row, percentile, print_table, sse_outcome

from clairvoyant.tools.bench.client import RequestSpec
from clairvoyant.tools.bench.runner import wait_idle
from clairvoyant.tools.bench.workload import burst

CHAT = "/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct"
LENGTH_SCALE = 0.1
WALL_RATIO_TARGET = 0.60
BACKEND_HEADER = "x-clairvoyant-backend"


# --------------------------------------------------------------------------------------------
# One request, streamed or not, with what the client saw
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Answer:
    request_id: str
    index: int
    cls: str
    n_predict: int
    stream: bool
    sent_s: float  # after the workload start
    status: int | None = None
    backend: str | None = None  # X-Clairvoyant-Backend
    outcome: str = "none"  # ok | error_event | http_error | cut | transport_error
    completion_tokens: int | None = None
    e2e_s: float | None = None  # from the send to the end of the answer (any outcome)
    done_s: float | None = None  # end of the answer, after the workload start
    error: str | None = None  # the error body / event / exception, shortened
    predicted_tokens: float | None = None  # X-Clairvoyant-Predicted-Tokens
    queue_wait_s: float | None = None  # X-Clairvoyant-Queue-Wait-Ms / 1000

    @property
    def complete(self) -> bool:
        """200 and exactly the forced number of tokens."""
        return self.outcome == "ok" and self.completion_tokens == self.n_predict


def request_body(spec: RequestSpec, *, stream: bool) -> dict[str, Any]:
    """Chat body; the forced length travels in the proxy's field (needs ``bench_upstream_fields``)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": spec.text}],
        "stream": stream,
        "temperature": 0.0,
        "seed": 0,
        "clairvoyant": {"upstream": {"n_predict": spec.n_predict, "ignore_eos": True}},
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def usage_tokens_from_sse(text: str) -> int | None:
    tokens = None
    for line in text.splitlines():
        if not line.startswith("data:") or line[5:].strip() in ("", "[DONE]"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        usage = event.get("usage") if isinstance(event, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            tokens = usage["completion_tokens"]
    return tokens


def last_sse_event(text: str) -> str:
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    return events[-1] if events else ""


async def send(
    client: httpx.AsyncClient, base_url: str, spec: RequestSpec, *, stream: bool, request_id: str, origin: float
) -> Answer:
    """Send one request and read its answer to the end; never raises for HTTP or transport errors."""
    sent = time.perf_counter()
    answer = Answer(request_id, spec.index, spec.cls, spec.n_predict, stream, sent - origin)
    try:
        async with client.stream(
            "POST", base_url + CHAT, json=request_body(spec, stream=stream), headers={"x-request-id": request_id}
        ) as response:
            answer.status = response.status_code
            answer.backend = response.headers.get(BACKEND_HEADER)
            predicted = response.headers.get("x-clairvoyant-predicted-tokens")
            wait_ms = response.headers.get("x-clairvoyant-queue-wait-ms")
            answer.predicted_tokens = float(predicted) if predicted else None
            answer.queue_wait_s = float(wait_ms) / 1000 if wait_ms else None
            raw = (await response.aread()).decode("utf-8", "replace")
        if answer.status != 200:
            answer.outcome, answer.error = "http_error", raw[:300]
        elif stream:
            end = sse_outcome(raw)
            answer.completion_tokens = usage_tokens_from_sse(raw)
            answer.outcome = {"done": "ok", "error": "error_event", "cut": "cut"}[end]
            if end != "done":
                answer.error = last_sse_event(raw)[:300]
        else:
            data = json.loads(raw)
            answer.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
            answer.outcome = "ok"
    except (httpx.HTTPError, ValueError) as exc:
        answer.outcome, answer.error = "transport_error", f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    answer.e2e_s, answer.done_s = end - sent, end - origin
    return answer


def new_client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0))


# --------------------------------------------------------------------------------------------
# Backends and proxies
# --------------------------------------------------------------------------------------------


def llama_metric(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"{name} not in {base_url}/metrics")


NAMES = ("A", "B")  # the pool's backend names (X-Clairvoyant-Backend, /queue), in list order


def start_proxy(name: str, urls: Sequence[str], log_dir: Path, **settings: Any) -> ProxyProcess:
    """One backend: ``upstream_url`` as before the pool (``slots=1``). Several: ``CLAIRVOYANT_BACKENDS``
    named A, B (slots from llama.cpp's /props: 1 each)."""
    common: dict[str, Any] = {"bench_upstream_fields": True, "max_queue": 10_000, **settings}
    if len(urls) == 1:
        return ProxyProcess(name, urls[0], log_dir, slots=1, **common).start()
    backends = json.dumps([{"url": url, "name": n} for url, n in zip(urls, NAMES)])
    return ProxyProcess(name, urls[0], log_dir, backends=backends, **common).start()


def queue_snapshot(proxy: ProxyProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{proxy.url}/queue", timeout=10).json())


def tagged(specs: Sequence[RequestSpec]) -> list[tuple[RequestSpec, bool]]:
    """Even positions streamed, odd ones not (positions are already a shuffle of the classes)."""
    return [(spec, i % 2 == 0) for i, spec in enumerate(specs)]


# --------------------------------------------------------------------------------------------
# Part 1: the burst, one backend vs the pool
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class BurstRun:
    condition: str
    rep: int
    position: int  # 0: first of its rep
    wall_s: float
    short_p50_s: float
    long_p50_s: float
    short_p95_s: float
    complete: int
    requests: int
    by_backend: dict[str, int]
    answers: list[Answer]


async def run_burst(proxy: ProxyProcess, specs: Sequence[RequestSpec], label: str) -> list[Answer]:
    async with new_client() as client:
        origin = time.perf_counter()
        return list(
            await asyncio.gather(
                *(
                    send(client, proxy.url, spec, stream=stream, request_id=f"{label}-{spec.index}", origin=origin)
                    for spec, stream in tagged(specs)
                )
            )
        )


def summarize_burst(condition: str, rep: int, position: int, answers: list[Answer]) -> BurstRun:
    shorts = [a.e2e_s for a in answers if a.cls == "short" and a.e2e_s is not None]
    longs = [a.e2e_s for a in answers if a.cls == "long" and a.e2e_s is not None]
    return BurstRun(
        condition=condition,
        rep=rep,
        position=position,
        wall_s=max(a.done_s or 0.0 for a in answers),
        short_p50_s=percentile(shorts, 0.5),
        long_p50_s=percentile(longs, 0.5),
        short_p95_s=percentile(shorts, 0.95),
        complete=sum(a.complete for a in answers),
        requests=len(answers),
        by_backend=dict(Counter(a.backend or "-" for a in answers)),
        answers=answers,
    )


def burst_specs(prompts: Sequence[Any], seed: int, n_short: int, n_long: int) -> list[RequestSpec]:
    return burst(prompts, n_short=n_short, n_long=n_long, length_scale=LENGTH_SCALE, seed=seed)


async def burst_part(
    prompts: Sequence[Any], urls: list[str], log_dir: Path, *, reps: int, conditions: list[str], n: int
) -> tuple[list[Row], list[BurstRun]]:
    runs: list[BurstRun] = []
    for rep in range(reps):
        specs = burst_specs(prompts, rep, n, n)
        order = conditions if rep % 2 == 0 else list(reversed(conditions))
        for position, condition in enumerate(order):
            for url in urls:
                await asyncio.to_thread(wait_idle, url)
            proxy = start_proxy(f"burst-{condition}-{rep}", urls if condition == "pool" else urls[:1], log_dir)
            try:
                answers = await run_burst(proxy, specs, f"{condition}{rep}")
            finally:
                proxy.stop()
            run = summarize_burst(condition, rep, position, answers)
            runs.append(run)
            print(
                f"  rep {rep} {condition:4}: wall {run.wall_s:6.2f} s, Short P50 {run.short_p50_s:5.2f} s, "
                f"Long P50 {run.long_p50_s:5.2f} s, complete {run.complete}/{run.requests}, by backend {run.by_backend}",
                flush=True,
            )
    return burst_rows(runs, conditions), runs


def burst_rows(runs: list[BurstRun], conditions: list[str]) -> list[Row]:
    def med(condition: str, attr: str) -> float:
        values = [getattr(r, attr) for r in runs if r.condition == condition]
        return statistics.median(values) if values else float("nan")

    rows = []
    for condition in conditions:
        mine = [r for r in runs if r.condition == condition]
        complete = sum(r.complete for r in mine)
        total = sum(r.requests for r in mine)
        rows.append(
            Row(
                f"burst {condition}: every request answered in full",
                "200 and the forced token count, every request",
                f"{complete}/{total}; backends {dict(sum((Counter(r.by_backend) for r in mine), Counter()))}",
                complete == total,
                {"complete": complete, "requests": total},
            )
        )
    if "one" in conditions and "pool" in conditions:
        one_wall, pool_wall = med("one", "wall_s"), med("pool", "wall_s")
        ratio = pool_wall / one_wall
        paired = [
            p.wall_s / o.wall_s
            for o in runs
            if o.condition == "one"
            for p in runs
            if p.condition == "pool" and p.rep == o.rep
        ]
        rows.append(
            Row(
                "burst wall time, pool / one backend (medians of reps)",
                f"<= {WALL_RATIO_TARGET:.0%}",
                f"{pool_wall:.2f} s / {one_wall:.2f} s = {ratio:.1%} (per rep: {', '.join(f'{x:.1%}' for x in paired)})",
                ratio <= WALL_RATIO_TARGET,
                {"one_wall_s": one_wall, "pool_wall_s": pool_wall, "ratio": ratio, "paired_ratios": paired},
            )
        )
        one_p50, pool_p50 = med("one", "short_p50_s"), med("pool", "short_p50_s")
        rows.append(
            Row(
                "burst Short P50, pool vs one backend (medians of reps)",
                "pool <= one",
                f"{pool_p50:.2f} s vs {one_p50:.2f} s ({pool_p50 / one_p50 - 1:+.0%})",
                pool_p50 <= one_p50,
                {"one_short_p50_s": one_p50, "pool_short_p50_s": pool_p50},
            )
        )
        rows.append(
            Row(
                "burst Long P50 / Short P95, pool vs one backend (medians)",
                "(stated)",
                f"Long P50 {med('pool', 'long_p50_s'):.2f} vs {med('one', 'long_p50_s'):.2f} s; "
                f"Short P95 {med('pool', 'short_p95_s'):.2f} vs {med('one', 'short_p95_s'):.2f} s",
                None,
                {
                    "one_long_p50_s": med("one", "long_p50_s"),
                    "pool_long_p50_s": med("pool", "long_p50_s"),
                    "one_short_p95_s": med("one", "short_p95_s"),
                    "pool_short_p95_s": med("pool", "short_p95_s"),
                },
            )
        )
    else:
        for condition in conditions:
            rows.append(
                Row(
                    f"burst {condition}: wall, Short P50 (medians of reps)",
                    "(stated)",
                    f"wall {med(condition, 'wall_s'):.2f} s, Short P50 {med(condition, 'short_p50_s'):.2f} s, "
                    f"Long P50 {med(condition, 'long_p50_s'):.2f} s",
                    None,
                    {"wall_s": med(condition, "wall_s"), "short_p50_s": med(condition, "short_p50_s")},
                )
            )
    return rows


# --------------------------------------------------------------------------------------------
# Part 2: SIGKILL one backend of the pool mid-burst
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class KillTrial:
    trial: int
    wanted_stream: bool
    victim_request: str | None  # the request in flight on B when it was killed
    victim_stream: bool | None
    killed_at_s: float | None  # after the workload start
    completed_before_kill: int
    b_tokens_before_kill: float | None  # B's tokens_predicted_total scraped just before the kill
    a_tokens_delta: float
    answers: list[Answer]
    queue_backends: list[dict[str, Any]]
    recent: dict[str, int]  # /queue "recent": finished records per request id (the proxy's own history)
    proxy_metrics: list[str]


async def kill_trial(
    trial: int, prompts: Sequence[Any], a_url: str, log_dir: Path, *, n: int, after: int = 3
) -> KillTrial:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

    wanted_stream = trial % 2 == 0
    victim = EmbeddedLlamaServer(n_threads=1, log_path=log_dir / f"llama-victim-{trial}.log")
    await asyncio.to_thread(victim.start)
    b_url = victim.base_url
    b_name = NAMES[1]
    await asyncio.to_thread(wait_idle, a_url)
    a_before = llama_metric(a_url, "llamacpp:tokens_predicted_total")
    proxy = start_proxy(f"kill-{trial}", [a_url, b_url], log_dir)
    specs = burst_specs(prompts, 100 + trial, n, n)
    streams = {f"kill{trial}-{spec.index}": stream for spec, stream in tagged(specs)}
    lengths = {f"kill{trial}-{spec.index}": spec.n_predict for spec in specs}
    killed_at: float | None = None
    victim_request: str | None = None
    b_tokens: float | None = None
    done_before = 0
    try:
        async with new_client() as client:
            origin = time.perf_counter()
            tasks = [
                asyncio.ensure_future(
                    send(client, proxy.url, spec, stream=stream, request_id=f"kill{trial}-{spec.index}", origin=origin)
                )
                for spec, stream in tagged(specs)
            ]
            deadline = time.perf_counter() + 15
            async with httpx.AsyncClient(timeout=10) as poller:
                while killed_at is None and not all(t.done() for t in tasks):
                    await asyncio.sleep(0.05)
                    done = sum(t.done() for t in tasks)
                    if done < after:
                        continue
                    try:  # before the snapshot: nothing slow between the snapshot and the kill
                        b_tokens = llama_metric(b_url, "llamacpp:tokens_predicted_total")
                    except (httpx.HTTPError, RuntimeError):
                        b_tokens = None
                    snap = (await poller.get(f"{proxy.url}/queue")).json()
                    on_b = [
                        e
                        for e in snap.get("in_flight", [])
                        if e.get("backend") == b_name and e.get("running_s", 0) >= 0.3
                    ]
                    # Mid-generation: at most half its expected time gone (0.3 s + 30 tokens/s), so it
                    # cannot finish between this snapshot and the kill.
                    fits = [
                        e
                        for e in on_b
                        if streams.get(e["request_id"]) == wanted_stream
                        and e["running_s"] <= 0.5 * (0.3 + lengths[e["request_id"]] / 30)
                    ]
                    pick = fits or (on_b if time.perf_counter() > deadline else [])
                    if pick:
                        assert victim.pid is not None
                        os.kill(victim.pid, signal.SIGKILL)
                        killed_at = time.perf_counter() - origin
                        victim_request = pick[0]["request_id"]
                        done_before = sum(t.done() for t in tasks)
            answers = list(await asyncio.gather(*tasks))
        snap = queue_snapshot(proxy)
        metrics = [
            line
            for line in httpx.get(f"{proxy.url}/metrics", timeout=10).text.splitlines()
            if line.startswith("clairvoyant_backend_")
        ]
    finally:
        proxy.stop()
        await asyncio.to_thread(victim.stop)
    await asyncio.to_thread(wait_idle, a_url)
    a_delta = llama_metric(a_url, "llamacpp:tokens_predicted_total") - a_before
    return KillTrial(
        trial=trial,
        wanted_stream=wanted_stream,
        victim_request=victim_request,
        victim_stream=None if victim_request is None else streams[victim_request],
        killed_at_s=killed_at,
        completed_before_kill=done_before,
        b_tokens_before_kill=b_tokens,
        a_tokens_delta=a_delta,
        answers=answers,
        queue_backends=list(snap.get("backends", [])),
        recent=dict(Counter(str(e["request_id"]) for e in snap.get("recent", []))),
        proxy_metrics=metrics,
    )


def judge_kill(k: KillTrial, a_name: str) -> list[Row]:
    """The checks of one kill trial, as rows."""
    name = f"kill {k.trial} ({'streamed' if k.victim_stream else 'non-streamed'} in flight on B)"
    if k.victim_request is None:
        return [Row(name, "B killed with a request in flight", "never killed (no request in flight on B)", False)]
    by_id = {a.request_id: a for a in k.answers}
    victim = by_id[k.victim_request]
    others = [a for a in k.answers if a.request_id != k.victim_request]
    b_name = NAMES[1]
    if victim.complete:
        expected = "(the harness's race: it finished before the kill landed; trial inconclusive)"
        victim_ok = False
    elif victim.stream:
        victim_ok = victim.status == 200 and victim.outcome == "error_event"
        expected = 'a final data: {"error": ...} event after a 200'
    else:
        victim_ok = victim.status == 502 and victim.outcome == "http_error" and '"error"' in (victim.error or "")
        expected = "a 502 with an OpenAI error body"
    complete = [a for a in others if a.complete]
    after_kill_on_b = [
        a for a in others if a.backend != a_name and (a.done_s or 0) > (k.killed_at_s or 0) and a.outcome == "ok"
    ]
    served_by_a = [a for a in k.answers if a.backend == a_name and a.outcome == "ok"]
    a_expected = sum(a.n_predict for a in served_by_a)
    answered_b_before = [a for a in others if a.backend != a_name and a.outcome == "ok"]
    health = {b.get("name"): b.get("healthy") for b in k.queue_backends}
    ids = Counter(a.request_id for a in k.answers)
    outcomes = Counter(f"{a.status} {a.outcome}" for a in k.answers)
    rows = [
        Row(
            f"{name}: the in-flight request",
            expected,
            f"{victim.request_id}: status {victim.status}, {victim.outcome}, {victim.error!r}"[:240],
            victim_ok,
            asdict(victim),
        ),
        Row(
            f"{name}: every other request",
            "200 with its full forced length; none answered by B after the kill",
            f"{len(complete)}/{len(others)} complete; {len(after_kill_on_b)} by B after the kill; "
            f"{len(served_by_a)} by A, {len(answered_b_before)} by B before the kill (at {k.killed_at_s:.2f} s, "
            f"{k.completed_before_kill} done); outcomes {dict(outcomes)}",
            len(complete) == len(others) and not after_kill_on_b,
            {"outcomes": dict(outcomes), "by_a": len(served_by_a), "by_b_before_kill": len(answered_b_before)},
        ),
        Row(
            f"{name}: exactly one answer each, nothing generated twice on A",
            "each request answered once (client) and finished once (/queue recent); A's tokens_predicted_total delta = forced lengths it answered",
            f"{len(ids)} ids, max {max(ids.values())} answer(s) each; /queue recent: {len(k.recent)} ids, "
            f"max {max(k.recent.values(), default=0)} record(s) each; A generated {k.a_tokens_delta:.0f} tokens, "
            f"its answers carry {a_expected}; B had generated {k.b_tokens_before_kill} before the kill, "
            f"its answers carry {sum(a.n_predict for a in answered_b_before)}",
            len(ids) == len(k.answers)
            and max(ids.values()) == 1
            and k.recent == dict.fromkeys(ids, 1)
            and k.a_tokens_delta == a_expected,
            {
                "a_tokens_delta": k.a_tokens_delta,
                "a_expected": a_expected,
                "b_tokens_before_kill": k.b_tokens_before_kill,
            },
        ),
        Row(
            f"{name}: /queue after",
            "both backends listed; B unhealthy, A healthy",
            f"{health}",
            health.get(a_name) is True and health.get(b_name) is False and len(health) == 2,
            {"backends": k.queue_backends, "metrics": k.proxy_metrics},
        ),
    ]
    return rows


async def kill_part(
    prompts: Sequence[Any], a_url: str, log_dir: Path, *, trials: int, n: int
) -> tuple[list[Row], list[KillTrial]]:
    rows: list[Row] = []
    results = []
    for trial in range(trials):
        k = await kill_trial(trial, prompts, a_url, log_dir, n=n)
        results.append(k)
        new = judge_kill(k, NAMES[0])
        rows.extend(new)
        for row in new:
            print(f"  {row.case}: {'PASS' if row.ok else 'FAIL'} {row.measured}", flush=True)
    return rows, results


# --------------------------------------------------------------------------------------------


def load_prompts() -> list[Any]:
    from clairvoyant.tools.bench.prompt_set import load_prompt_set, resolve

    return resolve(load_prompt_set(classes=("short", "long")))


async def run(args: argparse.Namespace, log_dir: Path) -> tuple[list[Row], dict[str, Any]]:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

    prompts = await asyncio.to_thread(load_prompts)
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    with (
        EmbeddedLlamaServer(n_threads=1, log_path=log_dir / "llama-a.log") as a,
        EmbeddedLlamaServer(n_threads=1, log_path=log_dir / "llama-b.log") as b,
    ):
        if "burst" in args.parts:
            print(f"burst: {args.n} Short + {args.n} Long, {args.reps} rep(s) of {', '.join(conditions)}", flush=True)
            new, runs = await burst_part(
                prompts, [a.base_url, b.base_url], log_dir, reps=args.reps, conditions=conditions, n=args.n
            )
            rows.extend(new)
            raw["burst"] = [asdict(r) for r in runs]
        if "kill" in args.parts:
            b.stop()  # the victims are fresh servers; A survives
            print(f"kill: {args.kill_n} Short + {args.kill_n} Long, {args.trials} trial(s)", flush=True)
            new_rows, trials = await kill_part(prompts, a.base_url, log_dir, trials=args.trials, n=args.kill_n)
            rows.extend(new_rows)
            raw["kill"] = [asdict(k) for k in trials]
    return rows, raw


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="burst,kill", help="burst, kill or both (default both)")
    parser.add_argument("--conditions", default="one,pool", help="burst conditions (default one,pool)")
    parser.add_argument("--reps", type=int, default=3, help="burst reps per condition (default 3)")
    parser.add_argument("--n", type=int, default=16, help="burst: Short and Long requests each (default 16)")
    parser.add_argument("--trials", type=int, default=2, help="kill trials (default 2: streamed, non-streamed)")
    parser.add_argument("--kill-n", type=int, default=8, help="kill: Short and Long requests each (default 8)")
    add_json_option(parser, "pool")
    parser.add_argument("--log-dir", type=Path, help="proxy and llama.cpp logs (default a temporary directory)")
    parser.add_argument("--proxy-src", type=Path, default=proxy_process.PROXY_SRC[0], help="src/ the proxy runs from")
    args = parser.parse_args()
    proxy_process.PROXY_SRC[0] = args.proxy_src.resolve()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-pool-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load_before = os.getloadavg()
    rows, raw = asyncio.run(run(args, log_dir))
    print_table(rows)
    took = time.monotonic() - started
    print(
        f"\n{sum(r.ok is True for r in rows)} PASS, {sum(r.ok is False for r in rows)} FAIL in {took:.0f} s; "
        f"logs in {log_dir}"
    )
    result = {
        "command": "PYTHONPATH=src python benchmarks/bench_pool.py " + " ".join(sys.argv[1:]),
        "seconds": took,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "length_scale": LENGTH_SCALE,
        "rows": [r.as_json() for r in rows],
        "raw": raw,
    }
    write_json(args.json, result)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
