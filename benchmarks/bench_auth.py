"""What API-key checking adds per request: the AccessControl layer around a do-nothing app,
with keys (a valid Bearer key, 20 keys configured) against without keys, interleaved.

    python benchmarks/bench_auth.py [--n 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from clairvoyant.config import Settings
from clairvoyant.proxy.access import AccessControl, hash_key


async def _noop(scope: dict, receive: object, send: object) -> None:
    return None


def _scope(key: str | None) -> dict:
    headers = [(b"host", b"x"), (b"content-type", b"application/json"), (b"user-agent", b"openai/1.0")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers, "state": {}}


async def _time(layer: AccessControl, key: str | None, n: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(n):
        await layer(_scope(key), None, None)  # type: ignore[arg-type]
    return (time.perf_counter_ns() - started) / n / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    keys = [f"cv-key-{i:02d}-abcdefghijklmnopqrstuvwxyz" for i in range(20)]
    with_keys = AccessControl(
        _noop, Settings(api_keys=[{"hash": hash_key(k), "tenant": f"t{i}"} for i, k in enumerate(keys)])
    )
    without = AccessControl(_noop, Settings())
    on, off = [], []
    for _ in range(args.rounds):
        off.append(asyncio.run(_time(without, None, args.n)))
        on.append(asyncio.run(_time(with_keys, keys[7], args.n)))
    print(
        f"per request, median of {args.rounds} rounds x {args.n}: without keys {statistics.median(off):.2f} us, "
        f"with a valid key {statistics.median(on):.2f} us, added {statistics.median(on) - statistics.median(off):.2f} us"
    )


if __name__ == "__main__":
    main()
