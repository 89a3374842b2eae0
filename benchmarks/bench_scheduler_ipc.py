"""What one central scheduler would cost front-end processes: CPU per ticket-grant-end exchange.

A model of the messages, not of the proxy: a "front" process (uvloop, asyncio Protocols, as the
proxy's) runs 64 concurrent requests; each sends a 40-byte ticket over a Unix socket to a
"scheduler" process, waits for its 40-byte grant, then sends a 40-byte end. The scheduler only
answers grants. Each request pauses ``--pause-ms`` first, so that the rate is near the proxy's
(64 / 10 ms = ~6,000 a second; at 0 the messages batch far more than they would at that rate).
The same front runs again without the messages (the pauses alone); the difference is what the
messages cost it. Prints the front's and the scheduler's CPU per request (getrusage), medians over
``--runs``. See docs/benchmarks.md section 27a.

    python benchmarks/bench_scheduler_ipc.py [--requests 30000] [--pause-ms 10] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import statistics
import sys
import time

import uvloop

MESSAGE_BYTES = 40
CLIENTS = 64


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Scheduler(asyncio.Protocol):
    """Answers every ticket ("T") with a grant ("G") of the same key; ends ("E") are read and dropped."""

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        grants = []
        whole = len(buffer) - len(buffer) % MESSAGE_BYTES
        for at in range(0, whole, MESSAGE_BYTES):
            if buffer[at] == ord("T"):
                grants.append(b"G" + buffer[at + 1 : at + MESSAGE_BYTES])
        self.buffer = buffer[whole:]
        if grants:
            self.transport.write(b"".join(grants))

    def connection_lost(self, exc: Exception | None) -> None:
        self.done.set_result(None)


class _Front(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = b""
        self.waiters: dict[bytes, asyncio.Future[None]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        whole = len(buffer) - len(buffer) % MESSAGE_BYTES
        for at in range(0, whole, MESSAGE_BYTES):
            self.waiters.pop(buffer[at + 1 : at + 9]).set_result(None)
        self.buffer = buffer[whole:]


def _run_scheduler(sock: socket.socket, report: socket.socket, requests: int) -> None:
    async def serve() -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await asyncio.get_running_loop().create_unix_connection(lambda: _Scheduler(done), sock=sock)
        await done

    started = _cpu_s()
    uvloop.run(serve())
    report.sendall(f"{(_cpu_s() - started) / requests * 1e6:.3f}".encode())


async def _front(sock: socket.socket | None, requests: int, pause_s: float) -> tuple[float, float]:
    """(CPU us per request, requests/s) of 64 clients sharing ``requests``; no messages if ``sock`` is None."""
    loop = asyncio.get_running_loop()
    front = None
    if sock is not None:
        transport, front = await loop.create_unix_connection(_Front, sock=sock)
    left = requests

    async def client(number: int) -> None:
        nonlocal left
        serial = 0
        padding = b"x" * (MESSAGE_BYTES - 9)
        while left > 0:
            left -= 1
            serial += 1
            await asyncio.sleep(pause_s)
            if front is None:
                continue
            key = number.to_bytes(4, "big") + serial.to_bytes(4, "big")
            granted = front.waiters[key] = loop.create_future()
            front.transport.write(b"T" + key + padding)
            await granted
            front.transport.write(b"E" + key + padding)

    cpu_before, wall_before = _cpu_s(), time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(CLIENTS)))
    cpu_us = (_cpu_s() - cpu_before) / requests * 1e6
    rate = requests / (time.perf_counter() - wall_before)
    if front is not None:
        transport.close()
    return cpu_us, rate


def _one_run(requests: int, pause_s: float) -> tuple[float, float, float, float]:
    """(front CPU us with messages, without, scheduler CPU us, requests/s with messages)."""
    front_end, scheduler_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    report_read, report_write = socket.socketpair()
    child = os.fork()
    if child == 0:
        front_end.close()
        _run_scheduler(scheduler_end, report_write, requests)
        os._exit(0)
    scheduler_end.close()
    with_messages, rate = uvloop.run(_front(front_end, requests, pause_s))
    scheduler_us = float(report_read.recv(64).decode())
    os.waitpid(child, 0)
    without, _ = uvloop.run(_front(None, requests, pause_s))
    return with_messages, without, scheduler_us, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30_000, help="requests per run (default 30,000)")
    parser.add_argument("--pause-ms", type=float, default=10.0, help="each request's pause before it asks, ms")
    parser.add_argument("--runs", type=int, default=3, help="runs, each with and without the messages (default 3)")
    args = parser.parse_args()
    runs = [_one_run(args.requests, args.pause_ms / 1000) for _ in range(args.runs)]
    for i, (with_messages, without, scheduler_us, rate) in enumerate(runs, 1):
        print(
            f"run {i}: {rate:,.0f} requests/s; front {with_messages:.1f} us CPU a request with the messages, "
            f"{without:.1f} without; scheduler {scheduler_us:.1f} us"
        )
    front_cost = statistics.median(w - wo for w, wo, _, _ in runs)
    scheduler_cost = statistics.median(s for _, _, s, _ in runs)
    print(
        f"\nmedian of {args.runs}: the messages cost the front {front_cost:.1f} us of CPU a request and the "
        f"scheduler {scheduler_cost:.1f} us ({front_cost + scheduler_cost:.1f} us together)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
