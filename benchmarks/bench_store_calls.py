"""What the shared Redis store costs a request: calls, script time, and release-to-grant latency.

    python benchmarks/bench_store_calls.py [--requests 500] [--depths 0 10 100] [--url redis://...]

Starts a redis-server on a free loopback port (tests/redis_server.py) unless ``--url`` is given.
One replica, one backend of one slot, two tenants. Each step enqueues an entry, releases the
running one and takes the next grant from the replica's list; ``depth`` entries wait at each
release (so the depth stays). Per request it prints:

- script invocations (``EVALSHA``) and round trips (``EVALSHA`` + ``BLPOP``), from Redis's own
  ``INFO commandstats`` over the measured steps;
- p50/p95 of the script's time inside Redis (``SLOWLOG`` with a 0 us threshold logs every call);
- p50/p95 from issuing ``release`` to the next grant's ``BLPOP`` returning in the replica.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer  # noqa: E402 (the tests' server helper)

from clairvoyant.scheduling.cluster.shared import BackendSpec, Entry, Message, MessageKind  # noqa: E402
from clairvoyant.scheduling.cluster.store import RedisSlotStore  # noqa: E402


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def run_depth(url: str, depth: int, requests: int) -> dict[str, float]:
    admin = aioredis.Redis.from_url(url, decode_responses=True)
    store = RedisSlotStore(url, f"bench{depth}", "r0", lease_s=2.0)
    await store.join([BackendSpec("gpu", 1)])
    while (await store.view()).quiet_s > 0:  # a new cluster's quiet period
        await asyncio.sleep(0.05)
    grants: asyncio.Queue[tuple[float, Message]] = asyncio.Queue()

    async def consume() -> None:
        async for msg in store.messages():
            if msg.kind is MessageKind.GRANT:
                grants.put_nowait((time.perf_counter(), msg))

    consumer = asyncio.create_task(consume())
    n = 0

    async def add() -> None:
        nonlocal n
        n += 1
        await store.enqueue(Entry(f"q{n}", tenant=f"t{n % 2}", score=(n * 7919 % 100) / 10, predicted_s=1.0))

    for _ in range(depth):  # one runs, depth - 1 wait; each step adds one: depth wait at each release
        await add()
    _, running = await grants.get()
    await admin.config_set("slowlog-log-slower-than", 0)
    await admin.config_set("slowlog-max-len", 4 * requests + 100)
    await admin.slowlog_reset()
    await admin.config_resetstat()
    latencies_ms: list[float] = []
    for _ in range(requests):
        await add()
        started = time.perf_counter()
        await store.release(running.request_id, 1.0)
        got_at, running = await grants.get()
        latencies_ms.append((got_at - started) * 1000)
    stats = await admin.info("commandstats")
    log = await admin.slowlog_get(4 * requests + 100)
    await admin.config_set("slowlog-log-slower-than", 10000)
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    await store.leave()
    await store.aclose()
    await admin.aclose()
    script_us = [float(e["duration"]) for e in log if bytes(e["command"]).lower().startswith(b"evalsha")]
    evalsha = int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    blpop = int(stats.get("cmdstat_blpop", {}).get("calls", 0))
    return {
        "depth": depth,
        "evalsha_per_request": evalsha / requests,
        "round_trips_per_request": (evalsha + blpop) / requests,
        "script_p50_us": pct(script_us, 50),
        "script_p95_us": pct(script_us, 95),
        "release_to_grant_p50_ms": pct(latencies_ms, 50),
        "release_to_grant_p95_ms": pct(latencies_ms, 95),
    }


async def main(args: argparse.Namespace) -> None:
    if min(args.depths) < 1:
        raise SystemExit("--depths: at least 1 (an entry must wait for the slot a release frees)")
    server = None
    url = args.url
    if url is None:
        server = RedisServer()
        server.start()
        url = server.url
    try:
        print("depth  evalsha/req  round-trips/req  script p50/p95 (us)  release->grant p50/p95 (ms)")
        for depth in args.depths:
            r = await run_depth(url, depth, args.requests)
            print(
                f"{depth:5d}  {r['evalsha_per_request']:11.2f}  {r['round_trips_per_request']:15.2f}  "
                f"{r['script_p50_us']:8.0f} / {r['script_p95_us']:<8.0f}  "
                f"{r['release_to_grant_p50_ms']:10.3f} / {r['release_to_grant_p95_ms']:.3f}"
            )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--url", default=None, help="an existing Redis (default: start redis-server)")
    asyncio.run(main(parser.parse_args()))
