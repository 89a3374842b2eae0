"""What the tenants' limits cost a request: µs per admit + release, side by side in one run.

Compares the tenant limits at an earlier commit (``--before``: the hand-written windows, read
from git) with the ones in the tree: in the process, on the ``limits`` package's own
``MemoryStorage`` (which the in-process mode does not use: this shows why), and, when
``redis-server`` is installed, on a local Redis (with the admission's p50 alone, the part a
request's first byte waits for). Two tenants: one without limits (most requests: no key, or a header tenant without an
entry) and one with all three limits, set high enough never to refuse. Each request yields to the
event loop once between admit and release, so the storages' background sweeps (a thread, a task)
run and are paid for. Figures are the median round minus the same loop with no limits at all
("none"), wall and CPU (every thread) per request.

- burst: requests back to back (``--requests`` a round, a fresh instance each round, so the
  window holds at most that many admissions).
- paced: ``--rate`` requests a second for ``--seconds``: CPU per request, where a storage's
  timers and sweeps, paid per wall second rather than per request, show.

    PYTHONPATH=src python benchmarks/bench_limits_cost.py [--before 708006c]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from limits.storage import MemoryStorage

from clairvoyant.config import Limits
from clairvoyant.proxy.limits import TenantLimits, _InProcessWindows

HIGH = Limits(max_concurrent=1_000_000, requests_per_minute=1_000_000, tokens_per_day=10**12)
TENANTS = ("unlimited", "limited")


class NoLimits:
    """The harness alone: what every figure is measured against."""

    def admit(self, tenant: str, free_in_s: Callable[[], float]) -> None:
        pass

    def release(self, tenant: str) -> None:
        pass


def on_package_memory_storage() -> TenantLimits:
    """The limits in the tree on the package's own ``MemoryStorage`` (what the in-process mode
    would be without its lazy storage)."""
    made = TenantLimits({"limited": HIGH})
    made._windows = _InProcessWindows(MemoryStorage())
    return made


def load_before(rev: str) -> type[Any]:
    """The ``TenantLimits`` of commit ``rev``, as a module of its own."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{rev}:src/clairvoyant/proxy/limits.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "limits_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("limits_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["limits_before"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.TenantLimits  # type: ignore[no-any-return]


async def one_round(make: Callable[[], Any], tenant: str, requests: int, interval_s: float) -> tuple[float, float]:
    """(wall µs, CPU µs) per admit + release, on a fresh instance."""
    limits = make()
    if hasattr(limits, "start"):
        await limits.start()
    is_async = inspect.iscoroutinefunction(limits.admit)

    def free_in_s() -> float:
        return 1.0

    loop = asyncio.get_running_loop()
    next_s = loop.time()
    wall_s, cpu_s = time.perf_counter(), time.process_time()
    for _ in range(requests):
        if is_async:
            await limits.admit(tenant, free_in_s)
            await asyncio.sleep(0)
            await limits.release(tenant)
        else:
            limits.admit(tenant, free_in_s)
            await asyncio.sleep(0)
            limits.release(tenant)
        if interval_s:
            next_s += interval_s
            await asyncio.sleep(max(0.0, next_s - loop.time()))
    wall_s, cpu_s = time.perf_counter() - wall_s, time.process_time() - cpu_s
    if hasattr(limits, "aclose"):
        await limits.aclose()
    return wall_s / requests * 1e6, cpu_s / requests * 1e6


async def admission_p50_us(make: Callable[[], Any], tenant: str, requests: int) -> float:
    limits = make()
    await limits.start()
    took_us = []
    for _ in range(requests):
        started_s = time.perf_counter()
        await limits.admit(tenant, lambda: 1.0)
        took_us.append((time.perf_counter() - started_s) * 1e6)
        await limits.release(tenant)
    await limits.aclose()
    return statistics.median(took_us)


def report(title: str, makers: dict[str, Callable[[], Any]], rounds: int, requests: int, interval_s: float) -> None:
    async def run() -> dict[tuple[str, str], list[tuple[float, float]]]:
        rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(rounds):  # alternating: drift in the machine's load falls on every one alike
            for name, make in makers.items():
                for tenant in TENANTS:
                    rows.setdefault((name, tenant), []).append(await one_round(make, tenant, requests, interval_s))
        return rows

    rows = asyncio.run(run())
    median = {key: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for key, v in rows.items()}
    print(f"\n{title}: {rounds} rounds of {requests} requests; µs a request above 'none'")
    print(f"{'implementation':<34} {'tenant':<10} {'wall µs':>9} {'CPU µs':>9}")
    for (name, tenant), (wall_us, cpu_us) in median.items():
        if name == "none":
            continue
        base_wall_us, base_cpu_us = median[("none", tenant)]
        print(f"{name:<34} {tenant:<10} {wall_us - base_wall_us:>9.2f} {cpu_us - base_cpu_us:>9.2f}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, f"redis://127.0.0.1:{port}/0"
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="708006c", help="the commit whose limits.py is the baseline")
    parser.add_argument("--requests", type=int, default=5_000, help="burst: requests a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rate", type=float, default=100.0, help="paced: requests a second")
    parser.add_argument("--seconds", type=float, default=2.0, help="paced: seconds a round")
    args = parser.parse_args()
    before = load_before(args.before)
    makers: dict[str, Callable[[], Any]] = {
        "none": NoLimits,
        f"before ({args.before}), in process": lambda: before({"limited": HIGH}),
        "now, in process": lambda: TenantLimits({"limited": HIGH}),
        "now, package's MemoryStorage": on_package_memory_storage,
    }
    print(f"python {sys.version.split()[0]}")
    report("burst", makers, args.rounds, args.requests, 0.0)
    report("paced", makers, 5, int(args.rate * args.seconds), 1 / args.rate)
    if shutil.which("redis-server") is None:
        print("\nredis-server is not installed: no Redis figures")
        return
    server, url = start_redis()
    try:
        on_redis = {
            "none": NoLimits,
            "now, on Redis (loopback)": lambda: TenantLimits({"limited": HIGH}, redis_url=url, cluster="bench"),
        }
        report("burst, Redis", on_redis, 3, max(1, args.requests // 10), 0.0)
        print(f"admission alone (the first byte's wait), p50 of {args.requests // 10}:")
        for tenant in TENANTS:
            admit_us = asyncio.run(admission_p50_us(on_redis["now, on Redis (loopback)"], tenant, args.requests // 10))
            print(f"  on Redis, {tenant}: {admit_us:.0f} µs")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
