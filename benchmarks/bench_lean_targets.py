"""Issue 12's four targets in one sitting: the four benchmarks back to back, then one table, figure against target.

    python benchmarks/bench_lean_targets.py [--rounds 5] [--n 300] [--requests 4000] [--memory-n 10000]
        [--memory-runs 3] [--no-doc] [--issue-build /tmp/wt-issue/src]

This host's speed moves by up to 2-5x within minutes (docs/benchmarks.md, sections 26-28), so four
figures taken hours apart can each meet their target in a fast minute and say nothing about the
build. This runs them one after the other, each as its own process, and reads their JSON:

1. ``bench_proxy_throughput.py --rounds R``: scheduled POSTs/s through ``clairvoyant serve`` (64
   wrk clients, 64 slots, the fixed-answer nginx backend); target >= 5,000, p99 stated.
2. ``bench_proxy_overhead.py --n N``: added TTFB p50 over direct, one-token stream to llama.cpp,
   empty queue; target <= 1.0 ms.
3. ``bench_predictor.py --requests M --no-card --load-nice 0 10``: ``predict`` p50 <= 29 us and
   p99 <= 100 us, idle and under a llama.cpp load at nice 0 and nice 10 (each phase must meet both).
4. ``bench_waiting_memory.py --n K`` and ``--sdk``, ``--memory-runs`` times each (default 3): bytes
   per waiting request besides its body; target < 1,024, judged on the median. Each run is the RSS
   growth of a fresh process, and single runs of one build spread by about +-40 bytes
   (docs/benchmarks.md 29c); every run's figure is printed.

Beside each figure it prints the host's yardstick from the same run: nginx's requests/s as a proxy
(the issue's run had 62,000) and the proxy's share of it (5,000 of 62,000 is 8.1%), nginx's added
TTFB, and the floor under the predictor (a one-node ONNX Runtime call; ~2.6-3.2 us on a quiet host).
The table goes into docs/benchmarks.md (section 6i) unless ``--no-doc``; the sub-benchmarks write
their own result files and blocks as they always do. Needs nginx and wrk (apt-get install nginx wrk).

``--issue-build SRC`` also judges the targets as the issue set them, relative to the build it
measured (``git worktree add /tmp/wt-issue 89bb859``, then ``--issue-build /tmp/wt-issue/src``): that
build runs as the throughput run's baseline, and ``bench_predictor_builds.py`` times both builds'
predictors side by side. A second table gives this build's throughput as a multiple of that build's
(median of the per-round ratios; the issue's 5,000 was 8.9 times its 560) and its predictor p50 as a
share of that build's, per phase (the issue's 29 us was 0.55 of its 53, the top of its "42-53 us").
On a host slower or faster than the issue's, these ratios say what the absolute figures cannot
(docs/benchmarks.md 30c).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import servers  # noqa: E402  (benchmarks/servers.py, beside this script)

SCHEDULED = "POST /v1/chat/completions"

THROUGHPUT_MIN = 5_000.0  # scheduled requests/s
TTFB_MAX_MS = 1.0  # added over direct, p50
PREDICT_P50_MAX_US = 29.0
PREDICT_P99_MAX_US = 100.0
MEMORY_MAX_BYTES = 1_024.0  # per waiting request, besides its body
ISSUE_NGINX = 62_000.0  # nginx's requests/s in the run issue 12 measured (its 5,000 is 8.1% of it)
ISSUE_BUILD_RPS = 560.0  # the scheduled requests/s of the build issue 12 measured, in its run
ISSUE_BUILD_P50_US = 53.0  # that build's predictor p50, the top of the issue's "42-53 us"
THROUGHPUT_RATIO_MIN = THROUGHPUT_MIN / ISSUE_BUILD_RPS  # 8.9x that build, side by side
PREDICT_P50_RATIO_MAX = PREDICT_P50_MAX_US / ISSUE_BUILD_P50_US  # 0.55 of that build's p50


# The issue's build as bench_proxy_throughput.py's baseline (its flags as that build reads them)
ISSUE_BUILD_SERVE = (
    "{python} -m clairvoyant.cli serve --upstream {upstream} --port {port} --slots {slots} --max-queue 10000 "
    "--log-level warning"
)


def _run(script: str, *options: str) -> None:
    argv = [sys.executable, f"benchmarks/{script}", *options]  # run from the checkout (cwd below)
    print(f"\n$ {' '.join(argv[1:])}", flush=True)
    done = subprocess.run(argv, cwd=servers.ROOT, env={**os.environ, **servers.proxy_env()})
    if done.returncode != 0:
        sys.exit(f"{script} failed with exit status {done.returncode}")


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def verdict_rows(throughput: dict[str, Any], overhead: dict[str, Any], predictor: dict[str, Any],
                 memory: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, str, bool]]:  # fmt: skip
    """(target, figure, the host's yardstick in the same run, met) per target, from the four benchmarks'
    JSON results (``memory``: each variant's runs; the median is judged)."""
    rows: list[tuple[str, str, str, bool]] = []
    post = throughput["paths"][SCHEDULED]
    proxy, nginx = post["proxy"], post["nginx"]
    rows.append((
        ">= 5,000 scheduled requests/s (64 clients, 64 slots)",
        f"{proxy['requests_per_s']:,.0f} requests/s, p99 {proxy['p99_ms']:.0f} ms, "
        f"{proxy['cpu_ms_per_request']:.3f} ms CPU a request",
        f"nginx {nginx['requests_per_s']:,.0f} requests/s (issue's run: {ISSUE_NGINX:,.0f}); "
        f"proxy {100 * proxy['of_nginx']:.1f}% of nginx (issue's 5,000: {100 * THROUGHPUT_MIN / ISSUE_NGINX:.1f}%)",
        proxy["requests_per_s"] >= THROUGHPUT_MIN,
    ))  # fmt: skip
    added = overhead["added_proxy"]["ttfb"]
    rows.append((
        "added TTFB p50 <= 1.0 ms",
        f"+{added['p50_ms']:.2f} ms (p90 +{added['p90_ms']:.2f})",
        f"nginx +{overhead['added_nginx']['ttfb']['p50_ms']:.2f}, bare +{overhead['added_bare']['ttfb']['p50_ms']:.2f}",
        added["p50_ms"] <= TTFB_MAX_MS,
    ))  # fmt: skip
    for phase, results in predictor["phases"].items():
        r = results[0]
        p50, p99 = r["predict"]["p50_us"], r["predict"]["p99_us"]
        floor = r["floor_identity_run"]
        rows.append((
            f"predictor p50 <= 29 us, p99 <= 100 us: {phase}",
            f"p50 {p50:.1f} us, p99 {p99:.1f} us",
            f"floor p50 {floor['p50_us']:.1f} us, p99 {floor['p99_us']:.1f} us",
            p50 <= PREDICT_P50_MAX_US and p99 <= PREDICT_P99_MAX_US,
        ))  # fmt: skip
    for label, runs in memory.items():
        figures = [m["bytes_besides_body"] for m in runs]
        median = statistics.median(figures)
        rows.append((
            f"< 1 KB a waiting request besides its body: {label}",
            f"median {median:.0f} B of {len(runs)} runs ({', '.join(f'{b:.0f}' for b in figures)}; "
            f"body {runs[0]['body_bytes']} B, {runs[0]['n']:,} waiting)",
            "",
            median < MEMORY_MAX_BYTES,
        ))  # fmt: skip
    return rows


def issue_ratio_rows(throughput: dict[str, Any], builds: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(target, figure, the issue's build in the same run, met) for the targets as ratios to the build
    issue 12 measured: ``throughput`` from a ``bench_proxy_throughput.py`` run with that build as its
    baseline, ``builds`` from ``bench_predictor_builds.py`` with it as the baseline."""
    post = throughput["paths"][SCHEDULED]
    proxy, baseline = post["proxy"], post["baseline"]
    ratios = [a["requests_per_s"] / b["requests_per_s"] for a, b in zip(proxy["runs"], baseline["runs"], strict=True)]
    ratio = statistics.median(ratios)
    rows = [(
        f"throughput >= {THROUGHPUT_RATIO_MIN:.1f}x the issue's build (5,000 / its {ISSUE_BUILD_RPS:,.0f})",
        f"{ratio:.1f}x, median of {len(ratios)} rounds ({min(ratios):.1f}-{max(ratios):.1f}x)",
        f"that build {baseline['requests_per_s']:,.0f} requests/s, this one {proxy['requests_per_s']:,.0f}",
        ratio >= THROUGHPUT_RATIO_MIN,
    )]  # fmt: skip
    for phase, r in builds["phases"].items():
        rows.append((
            f"predictor p50 <= {PREDICT_P50_RATIO_MAX:.2f} of the issue's build's (29 / its {ISSUE_BUILD_P50_US:.0f} us): "
            f"{phase}",
            f"{r['ratio_p50']:.2f} (p99: {r['ratio_p99']:.2f})",
            f"that build p50 {r['baseline']['p50_us']:.1f} us, this one {r['this']['p50_us']:.1f}",
            r["ratio_p50"] <= PREDICT_P50_RATIO_MAX,
        ))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="bench_proxy_throughput.py --rounds (default 5)")
    parser.add_argument("--n", type=int, default=300, help="bench_proxy_overhead.py --n (default 300)")
    parser.add_argument("--requests", type=int, default=4_000, help="bench_predictor.py --requests (default 4000)")
    parser.add_argument("--memory-n", type=int, default=10_000, help="bench_waiting_memory.py --n (default 10000)")
    parser.add_argument("--memory-runs", type=int, default=3, help="runs of each memory variant (default 3)")
    servers.add_doc_options(parser)  # passed on to the runs that write blocks of their own
    parser.add_argument(
        "--issue-build", type=Path, help="the src of the build issue 12 measured (89bb859): also judge the ratios"
    )
    args = parser.parse_args()
    servers.require_tools("nginx", "wrk")
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    doc = ["--no-doc"] if args.no_doc else ["--doc", str(args.doc)]
    with tempfile.TemporaryDirectory(prefix="bench-lean-") as tmp:
        out = {name: Path(tmp) / f"{name}.json" for name in ("throughput", "overhead", "predictor")}
        baseline: list[str] = []
        if args.issue_build is not None:
            baseline = ["--baseline-cmd", f"env PYTHONPATH={args.issue_build} {ISSUE_BUILD_SERVE}"]
        _run("bench_proxy_throughput.py", "--rounds", str(args.rounds), "--json", str(out["throughput"]), *doc,
             *baseline)  # fmt: skip
        _run("bench_proxy_overhead.py", "--n", str(args.n), "--json", str(out["overhead"]), *doc)
        _run("bench_predictor.py", "--requests", str(args.requests), "--no-card", "--load-nice", "0", "10",
             "--json", str(out["predictor"]))  # fmt: skip
        memory: dict[str, list[dict[str, Any]]] = {"plain client": [], "OpenAI SDK headers and key": []}
        for run in range(args.memory_runs):
            for label, flags in zip(memory, ([], ["--sdk"]), strict=True):
                path = Path(tmp) / f"memory-{len(flags)}-{run}.json"
                _run("bench_waiting_memory.py", "--n", str(args.memory_n), *flags, "--json", str(path))
                memory[label].append(json.loads(path.read_text()))
        if args.issue_build is not None:
            out["builds"] = Path(tmp) / "builds.json"
            _run("bench_predictor_builds.py", "--baseline-src", str(args.issue_build), "--requests", "12000",
                 "--json", str(out["builds"]))  # fmt: skip
        results = {name: json.loads(path.read_text()) for name, path in out.items()}
    ended = datetime.now(UTC).strftime("%H:%M")
    rows = verdict_rows(results["throughput"], results["overhead"], results["predictor"], memory)
    say = servers.Report()
    say(f"\nIssue 12's targets, {started}-{ended} UTC, checkout {servers.checkout()}: "
        f"{sum(ok for *_, ok in rows)} of {len(rows)} rows met\n")  # fmt: skip
    say("| target | figure | the host in the same run | met |")
    say("|---|---|---|---|")
    for target, figure, yardstick, ok in rows:
        say(f"| {target} | {figure} | {yardstick} | {_met(ok)} |")
    if "builds" in results:
        ratio_rows = issue_ratio_rows(results["throughput"], results["builds"])
        say(f"\nAs ratios to the build issue 12 measured ({args.issue_build}), in the same runs: "
            f"{sum(ok for *_, ok in ratio_rows)} of {len(ratio_rows)} rows met\n")  # fmt: skip
        say("| target | figure | the issue's build in the same run | met |")
        say("|---|---|---|---|")
        for target, figure, yardstick, ok in ratio_rows:
            say(f"| {target} | {figure} | {yardstick} | {_met(ok)} |")
    command = " ".join([Path(sys.executable).name, *sys.argv])
    servers.write_doc(args, "bench_lean_targets", say, command, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
