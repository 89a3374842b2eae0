"""What sharing observations between replicas costs (scheduling/cluster/observations.py), on a
real redis-server on loopback.

    python benchmarks/bench_shared_observations.py [--requests 1000] [--rate 200] [--json FILE]

- ``hook_us``: the dispatcher's ``on_observed`` call per completed request (``publish_service``:
  the fields made and queued; no I/O on the request path), beside what the dispatcher already
  spends learning the same observation (``ServiceTimeModel.observe``).
- ``loop_cpu_us``: replica A's CPU per completed request at a steady ``--rate``, with sharing (the
  hook, the pipelined XADD, and its own entries read back and skipped) and without (the same paced
  loop learning locally only), side by side in one run (two rounds each, alternated); the
  difference is what sharing adds.
- ``lag_ms``: from ``publish_service`` on A to the observation applied on B, another process (both
  read CLOCK_MONOTONIC, one clock); p50 and p95.
- ``apply_cpu_us``: B's CPU per observation it applied (read, decoded, learned).
- ``catch_up``: a replica starting on a backlog (``catch_up``) applies at most its bound a second.

Needs ``redis-server`` on PATH (``apt-get install -y redis-server``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from typing import Any

from harness.results import add_json_option, write_json

from clairvoyant.scheduling.cluster.observations import LINGER_S, MAX_APPLIED_PER_S, SharedObservations
from clairvoyant.scheduling.cluster.shared import ServiceObservation
from clairvoyant.scheduling.service_time import ServiceTimeModel

__all__ = ["main"]

HOOK_CALLS = 5_000
ROUNDS = 2
CATCH_UP_ENTRIES = 6_000


def _start_redis(folder: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: apt-get install -y redis-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", folder]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    process.kill()
    raise SystemExit("redis-server did not answer PING within 10 s")


def _observations(n: int, seed: int) -> list[ServiceObservation]:
    rng = random.Random(seed)
    made = []
    for _ in range(n):
        prompt_tokens, output_tokens = rng.randint(10, 2000), rng.randint(5, 600)
        service_s = (0.2 + 0.0005 * prompt_tokens + 0.025 * output_tokens) * rng.uniform(0.8, 1.25)
        made.append(ServiceObservation("m", "gpu", prompt_tokens, output_tokens, service_s, service_s))
    return made


# -- replica B, in its own process -----------------------------------------------------------------
def _replica_b(url: str, cluster: str, expected: int, linger_s: float, ready: Any, out: Any) -> None:
    asyncio.run(_run_b(url, cluster, expected, linger_s, ready, out))


async def _run_b(url: str, cluster: str, expected: int, linger_s: float, ready: Any, out: Any) -> None:
    applied_at: list[float] = []

    class TimedModel(ServiceTimeModel):
        def observe(self, model: str | None, prompt_tokens: int, output_tokens: int, duration_s: float) -> None:
            super().observe(model, prompt_tokens, output_tokens, duration_s)
            applied_at.append(time.monotonic())

    b = SharedObservations(url, cluster=cluster, replica="b", service_time=TimedModel(), linger_s=linger_s)
    b.start()
    while b._reader.last_id in (None, b"$"):  # standing at the stream's end
        await asyncio.sleep(0.005)
    ready.set()
    cpu_s = time.process_time()
    deadline = time.monotonic() + 600.0
    while b.counts.applied < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    cpu_s = time.process_time() - cpu_s
    await b.stop()
    out.put((applied_at, cpu_s))


# -- replica A, here ------------------------------------------------------------------------------
async def _paced(
    observations: list[ServiceObservation], rate: float, shared: SharedObservations | None
) -> tuple[float, list[float]]:
    """Learn (and with ``shared``, publish) one observation every 1/rate s; CPU seconds spent, and when each was published."""
    model = ServiceTimeModel() if shared is None else shared.service_time
    published_at: list[float] = []
    cpu_s = time.process_time()
    start_s = time.monotonic()
    for i, seen in enumerate(observations):
        await asyncio.sleep(max(0.0, start_s + i / rate - time.monotonic()))
        model.observe(seen.model, seen.prompt_tokens, seen.output_tokens, seen.service_s)
        if shared is not None:
            published_at.append(time.monotonic())
            shared.publish_service(seen)
    while shared is not None and shared.counts.published < len(observations):  # until the last is written
        await asyncio.sleep(0.001)
    return time.process_time() - cpu_s, published_at


async def _hook_us(url: str, cluster: str) -> dict[str, float]:
    """The request path's cost: ``publish_service`` and ``ServiceTimeModel.observe``, per call."""
    calls = _observations(HOOK_CALLS, seed=3)
    shared = SharedObservations(url, cluster=cluster, replica="hook", service_time=ServiceTimeModel())
    shared.start()
    model = ServiceTimeModel()
    publish_s = observe_s = 0.0
    for chunk in range(0, HOOK_CALLS, 100):  # the publisher flushes between chunks, as between requests
        part = calls[chunk : chunk + 100]
        t0 = time.perf_counter()
        for seen in part:
            shared.publish_service(seen)
        t1 = time.perf_counter()
        for seen in part:
            model.observe(seen.model, seen.prompt_tokens, seen.output_tokens, seen.service_s)
        observe_s += time.perf_counter() - t1
        publish_s += t1 - t0
        await asyncio.sleep(0.002)
    await shared.stop()
    return {"publish_service": publish_s / HOOK_CALLS * 1e6, "service_time_observe": observe_s / HOOK_CALLS * 1e6}


async def _catch_up_per_s(url: str, cluster: str, entries: int) -> float:
    """A backlog of ``entries`` in the stream, then a replica that catches up on it: the entries it
    applies a second (its reader's bound is ``MAX_APPLIED_PER_S``)."""
    a = SharedObservations(url, cluster=cluster, replica="a", service_time=ServiceTimeModel())
    a.start()
    backlog = _observations(entries, seed=5)
    for chunk in range(0, entries, 1000):  # (within what may wait to be published)
        for seen in backlog[chunk : chunk + 1000]:
            a.publish_service(seen)
        while a.counts.published < min(chunk + 1000, entries):
            await asyncio.sleep(0.005)
    await a.stop()
    late = SharedObservations(url, cluster=cluster, replica="late", service_time=ServiceTimeModel(), catch_up=True)
    start_s = time.monotonic()
    late.start()
    while late.counts.applied < entries:
        await asyncio.sleep(0.005)
    elapsed_s = time.monotonic() - start_s
    await late.stop()
    return entries / elapsed_s


async def _run(url: str, requests: int, rate: float, linger_s: float, catch_up: int) -> dict[str, Any]:
    hook = await _hook_us(url, "bench-hook")
    catch_up_per_s = await _catch_up_per_s(url, "bench-catch-up", catch_up)
    context = multiprocessing.get_context("spawn")
    cpu: dict[str, list[float]] = {"local": [], "shared": []}
    lags_ms: list[float] = []
    apply_us: list[float] = []
    for round_no in range(ROUNDS):
        observations = _observations(requests, seed=round_no)
        local_cpu_s, _ = await _paced(observations, rate, None)
        cpu["local"].append(local_cpu_s / requests * 1e6)

        cluster = f"bench-{round_no}"
        ready, out = context.Event(), context.Queue()
        child = context.Process(target=_replica_b, args=(url, cluster, requests, linger_s, ready, out))
        child.start()
        a = SharedObservations(url, cluster=cluster, replica="a", service_time=ServiceTimeModel(), linger_s=linger_s)
        a.start()
        while a._reader.last_id in (None, b"$") or not ready.is_set():
            await asyncio.sleep(0.005)
        shared_cpu_s, published_at = await _paced(observations, rate, a)
        await a.stop()
        applied_at, b_cpu_s = await asyncio.to_thread(out.get, True, 600)
        child.join(30)
        cpu["shared"].append(shared_cpu_s / requests * 1e6)
        lags_ms += [(applied - published) * 1e3 for published, applied in zip(published_at, applied_at, strict=True)]
        apply_us.append(b_cpu_s / requests * 1e6)
    quantiles = statistics.quantiles(lags_ms, n=20)
    local_us, shared_us = statistics.mean(cpu["local"]), statistics.mean(cpu["shared"])
    return {
        "requests": requests,
        "rate_per_s": rate,
        "linger_ms": linger_s * 1e3,
        "hook_us": hook,
        "loop_cpu_us": {"local": local_us, "shared": shared_us, "added": shared_us - local_us, "rounds": cpu},
        "lag_ms": {"p50": statistics.median(lags_ms), "p95": quantiles[18], "max": max(lags_ms)},
        "apply_cpu_us": statistics.mean(apply_us),
        "catch_up": {"entries": catch_up, "applied_per_s": catch_up_per_s, "bound_per_s": MAX_APPLIED_PER_S},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="completed requests per round (default 1000)")
    parser.add_argument("--rate", type=float, default=200.0, help="completed requests a second (default 200)")
    parser.add_argument(
        "--catch-up",
        type=int,
        default=CATCH_UP_ENTRIES,
        help=f"backlog a late replica catches up on (default {CATCH_UP_ENTRIES})",
    )
    parser.add_argument(
        "--linger-ms",
        type=float,
        default=LINGER_S * 1e3,
        help=f"publisher's and reader's linger (default {LINGER_S * 1e3:g})",
    )
    add_json_option(parser, "shared_observations")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        process, url = _start_redis(folder)
        try:
            figures = asyncio.run(_run(url, args.requests, args.rate, args.linger_ms / 1e3, args.catch_up))
        finally:
            process.kill()
            process.wait(10)
    hook, cpu, lag = figures["hook_us"], figures["loop_cpu_us"], figures["lag_ms"]
    print(
        f"{args.requests} completed requests a round at {args.rate:g}/s, linger {args.linger_ms:g} ms,"
        " redis-server on loopback, 2 rounds each"
    )
    print(
        f"request path: on_observed (publish_service) {hook['publish_service']:.1f} µs per request"
        f" (ServiceTimeModel.observe beside it: {hook['service_time_observe']:.1f} µs)"
    )
    print(
        f"replica A's CPU per request: {cpu['shared']:.0f} µs shared vs {cpu['local']:.0f} µs local only:"
        f" +{cpu['added']:.0f} µs (XADD pipelined, own entries read back)"
    )
    print(
        f"lag publish on A -> applied on B: p50 {lag['p50']:.2f} ms, p95 {lag['p95']:.2f} ms, max {lag['max']:.1f} ms"
    )
    print(f"replica B's CPU per observation applied: {figures['apply_cpu_us']:.0f} µs")
    catch_up = figures["catch_up"]
    print(
        f"a late replica catching up on {catch_up['entries']} entries: {catch_up['applied_per_s']:.0f} applied/s"
        f" (its bound: {catch_up['bound_per_s']:g}/s)"
    )
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
