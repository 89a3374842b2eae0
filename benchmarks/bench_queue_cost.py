"""Dispatch cost and memory of the waiting queue, at depths up to 10,000 requests.

    python benchmarks/bench_queue_cost.py [--depths 100 1000 10000] [--ops 2000] [--json FILE]

For each policy, the queue the proxy builds by default (policy + starvation guard + fair share,
two tenants) is filled to a depth n, then timed in steady state: one dispatch decision (``pop``),
one arrival (``push``) and the dispatched job's end (``done``), so the depth stays n. Heap
policies should grow like log n, the scan queue (hrrn) like n. Memory: ``tracemalloc`` over n
waiting requests, per request, for the queue record alone (``Job`` and its queue entries) and for
the proxy's ticket (its own queue record) with its ``Prediction`` and entries. Not counted: the
proxy's exchange record and parked fd, and the body (bench_waiting_memory.py measures the whole waiting
request end to end).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import random
import time
import tracemalloc
from typing import Any

from harness.results import add_json_option, write_json

from clairvoyant.scheduling.job_queue import Job
from clairvoyant.scheduling.policy import POLICY_NAMES, build_queue, make_policy

__all__ = ["main", "measure_dispatch_us", "measure_memory_bytes"]


def _job(rng: random.Random, i: int, now: float) -> Job[int]:
    pred = rng.lognormvariate(1.5, 1.0)
    return Job(i, now, score=rng.random(), predicted_tokens=pred * 50, predicted_s=pred,
               priority=rng.choice((0, 0, 0, 1)), tenant=rng.choice(("a", "b")))  # fmt: skip


def _queue(name: str, wrapped: bool = True) -> Any:
    if not wrapped:
        return build_queue(make_policy(name))
    return build_queue(make_policy(name), starvation_timeout_s=1.0, starvation_slowdown=3.2, fair_share=True)


def measure_dispatch_us(name: str, depth: int, ops: int, seed: int = 0, wrapped: bool = True) -> float:
    """Median microseconds of one pop + push + done at a steady ``depth``."""
    rng = random.Random(seed)
    queue = _queue(name, wrapped)
    now = 0.0
    for i in range(depth):
        now += 0.001
        queue.push(_job(rng, i, now))
    samples = []
    for i in range(ops):
        now += 0.001
        job = _job(rng, depth + i, now)
        t0 = time.perf_counter()
        got = queue.pop(now)
        queue.push(job)
        if got is not None:
            queue.done(got[0])  # as the dispatcher reports the slot it frees (fair share needs it)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def measure_memory_bytes(depth: int) -> tuple[float, float]:
    """Bytes per waiting request: (queue record and entries, the proxy's ticket, prediction and entries)."""
    rng = random.Random(1)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    queue = _queue("sjf")
    for i in range(depth):
        queue.push(_job(rng, i, float(i)))
    queue_bytes = (tracemalloc.get_traced_memory()[0] - before) / depth
    tracemalloc.stop()

    async def tickets() -> float:
        from clairvoyant.prediction.predictor import Prediction
        from clairvoyant.scheduling.dispatcher import Ticket

        gc.collect()
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        q = _queue("sjf")
        keep = []
        for i in range(depth):
            t = Ticket(
                f"cv-{i:x}",
                "/v1/chat/completions",
                "openai",
                "model",
                Prediction.from_probabilities(0.2, 0.3, 0.5),
                120,
                float(i),
                score=0.5,
                predicted_tokens=300.0,
                predicted_s=6.0,
                tenant="a",
            )
            q.push(t)
            keep.append(t)
        used = (tracemalloc.get_traced_memory()[0] - start) / depth
        tracemalloc.stop()
        return used

    return queue_bytes, asyncio.run(tickets())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--ops", type=int, default=2000, help="timed pop+push+done rounds per point (default 2000)")
    add_json_option(parser, "queue_cost")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {"depths": args.depths, "ops": args.ops, "dispatch_us": {}}
    for wrapped in (False, True):
        what = "the default guard (1 s + 3.2 x S) and fair share, 2 tenants" if wrapped else "the policy's queue alone"
        print(f"\ndispatch decision + arrival + end (pop, push, done), median microseconds, {what}:")
        print(
            "| policy | "
            + " | ".join(f"n={d}" for d in args.depths)
            + f" | growth {args.depths[0]}->{args.depths[-1]} |"
        )
        print("|---|" + "---|" * (len(args.depths) + 1))
        for name in POLICY_NAMES:
            ops = args.ops if name != "hrrn" else max(50, args.ops // 20)
            us = [measure_dispatch_us(name, d, ops, wrapped=wrapped) for d in args.depths]
            figures["dispatch_us"][f"{name}{' +guard +fair' if wrapped else ''}"] = us
            growth = us[-1] / us[0] if us[0] > 0 else math.nan
            print(f"| {name} | " + " | ".join(f"{u:.1f}" for u in us) + f" | {growth:.1f}x |")
    depth = max(args.depths)
    queue_b, proxy_b = measure_memory_bytes(depth)
    print(f"\nmemory per waiting request at n={depth}: queue record and entries {queue_b:.0f} B; "
          f"proxy's ticket (its own queue record), prediction and entries {proxy_b:.0f} B; "
          "request bodies not included")  # fmt: skip
    figures["memory_bytes"] = {"depth": depth, "queue_record": queue_b, "proxy_ticket": proxy_b}
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
