"""Added latency of the proxy: a 1-token request through Clairvoyant versus straight to the backend.

Starts a real llama.cpp server (xllamacpp + SmolLM2) and `clairvoyant serve` in front of it as a
separate process (the deployed shape), then alternates direct and proxied requests one at a time,
empty queue, same prompt (so the backend answers from its prompt cache). Prints TTFT and total time
for both, side by side, and the paired per-request difference (proxy - direct), which cancels most
of the machine's noise.

    python benchmarks/bench_proxy_overhead.py --n 300
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np
from tqdm import tqdm

from clairvoyant.embedded_backend import EmbeddedLlamaServer

BODY = {
    "messages": [{"role": "user", "content": "Say OK."}],
    "max_tokens": 1,
    "stream": True,
    "temperature": 0,
}


def one_request(client: httpx.Client, url: str) -> tuple[float, float]:
    """(TTFT, total) seconds for one streamed 1-token chat completion."""
    started = time.perf_counter()
    ttft = None
    with client.stream("POST", url, json=BODY) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if ttft is None and line.startswith("data: ") and '"content"' in line:
                ttft = time.perf_counter() - started
    total = time.perf_counter() - started
    return (ttft if ttft is not None else total), total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_proxy(upstream: str, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "clairvoyant", "serve", "--upstream", upstream, "--port", str(port), "--log-level", "warning"],
        env={**os.environ},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("proxy did not start")


def describe(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values) * 1000
    return {"p50_ms": float(np.percentile(arr, 50)), "p90_ms": float(np.percentile(arr, 90)), "p99_ms": float(np.percentile(arr, 99))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="request pairs (default 300)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    with EmbeddedLlamaServer() as backend:
        port = free_port()
        proxy = start_proxy(backend.base_url, port)
        try:
            urls = {
                "direct": f"{backend.base_url}/v1/chat/completions",
                "proxy": f"http://127.0.0.1:{port}/v1/chat/completions",
            }
            samples: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "total": []} for k in urls}
            with httpx.Client(timeout=60) as client:
                for _ in range(args.warmup):
                    for url in urls.values():
                        one_request(client, url)
                for i in tqdm(range(args.n), desc="pairs"):
                    order = ("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")
                    for name in order:
                        ttft, total = one_request(client, urls[name])
                        samples[name]["ttft"].append(ttft)
                        samples[name]["total"].append(total)
        finally:
            proxy.terminate()
            proxy.wait(10)

    result: dict[str, object] = {"n_pairs": args.n}
    print(f"\n1-token streamed chat completion, empty queue, n={args.n} pairs (alternating order)")
    print(f"{'':8} {'TTFT p50':>10} {'TTFT p90':>10} {'total p50':>10} {'total p90':>10} {'total p99':>10}")
    for name in ("direct", "proxy"):
        t, tot = describe(samples[name]["ttft"]), describe(samples[name]["total"])
        result[name] = {"ttft": t, "total": tot}
        print(f"{name:8} {t['p50_ms']:10.2f} {t['p90_ms']:10.2f} {tot['p50_ms']:10.2f} {tot['p90_ms']:10.2f} {tot['p99_ms']:10.2f}")
    for metric in ("ttft", "total"):
        diffs = [p - d for p, d in zip(samples["proxy"][metric], samples["direct"][metric])]
        added = describe(diffs)
        result[f"added_{metric}"] = added
        print(f"added {metric}: median of paired differences {statistics.median(diffs) * 1000:.2f} ms (p90 {added['p90_ms']:.2f} ms)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
