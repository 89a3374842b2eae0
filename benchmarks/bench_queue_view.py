"""Time to build /queue's body with N requests waiting: ``queue_view`` and its JSON, per tree.

Each tree runs in its own process (PYTHONPATH=<tree>/src): a dispatcher with one busy slot and
--n waiting requests (sjf, alternating predicted seconds), then the body built --reps times; the
trees take turns for --rounds rounds, so load on a shared machine falls on both alike. A tree from
before ``QueueView`` (``Dispatcher.snapshot()``) is timed as that snapshot's JSON, which is what
its /queue served. Prints each tree's best and median CPU milliseconds and their ratio.

    python benchmarks/bench_queue_view.py [--n 10000] [--limit N] [--baseline-src OTHER/src]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(n: int, limit: int | None, reps: int) -> list[float]:
    """Seconds per body, ``reps`` times, in the tree on this process's PYTHONPATH."""
    import asyncio

    from clairvoyant.clock import MonotonicClock
    from clairvoyant.metrics import Metrics
    from clairvoyant.prediction.predictor import Prediction
    from clairvoyant.scheduling.dispatcher import Dispatcher, Ticket
    from clairvoyant.scheduling.policy import build_queue, make_policy

    try:
        from clairvoyant.scheduling.queue_view import queue_view

        def body(d: Dispatcher) -> bytes:
            return queue_view(d, limit).model_dump_json().encode()
    except ImportError:  # before QueueView: /queue served the snapshot's JSON

        def body(d: Dispatcher) -> bytes:
            snapshot = d.snapshot(limit) if limit is not None else d.snapshot()  # type: ignore[attr-defined]
            return json.dumps(snapshot, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    async def run() -> list[float]:
        policy = make_policy("sjf")
        d = Dispatcher(
            build_queue(policy), policy, slots=1, clock=MonotonicClock(), metrics=Metrics(), max_queue=n + 10
        )  # fmt: skip
        await d.start()
        prediction = Prediction.from_probabilities(0.5, 0.3, 0.2)
        for i in range(n + 1):  # the first takes the slot
            d.submit(Ticket(f"r{i}", "/v1/chat/completions", "openai", None, prediction, 10, predicted_s=1.0 + i % 7))
            if i == 0:
                await asyncio.sleep(0)  # dispatched
        body(d)  # first use: lazy imports, schema caches
        out = []
        for _ in range(reps):
            started = time.process_time()  # CPU seconds: on a shared machine, wall time counts others' turns
            body(d)
            out.append(time.process_time() - started)
        return out

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000, help="requests waiting (default 10,000)")
    parser.add_argument("--limit", type=int, default=None, help="rows listed (default: all, as /queue without ?limit)")
    parser.add_argument("--reps", type=int, default=5, help="bodies per round (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="turns per tree (default 3)")
    parser.add_argument("--baseline-src", type=Path, help="another tree's src/ to time beside this one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.n, args.limit, args.reps)))
        return 0
    trees = {"this tree": ROOT / "src"}
    if args.baseline_src is not None:
        trees["baseline"] = args.baseline_src.resolve()
    argv = [sys.executable, __file__, "--worker", "--n", str(args.n), "--reps", str(args.reps)]
    if args.limit is not None:
        argv += ["--limit", str(args.limit)]
    seconds: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, src in trees.items():
            env = {**os.environ, "PYTHONPATH": str(src)}
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            seconds[name] += json.loads(done.stdout.splitlines()[-1])
    shown = "all" if args.limit is None else str(args.limit)
    print(f"\n/queue body (queue_view + JSON), {args.n:,} waiting, {shown} listed; {args.rounds} x {args.reps} each\n")
    print("| tree | best CPU ms | median CPU ms |")
    print("|---|---:|---:|")
    for name, values in seconds.items():
        print(f"| {name} | {min(values) * 1000:.1f} | {statistics.median(values) * 1000:.1f} |")
    if "baseline" in seconds:
        ratio = statistics.median(seconds["this tree"]) / statistics.median(seconds["baseline"])
        print(f"\nmedian ratio, this tree / baseline: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
