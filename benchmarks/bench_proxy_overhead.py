"""Added latency of the proxy: a 1-token request through Clairvoyant versus straight to the backend.

Starts a real llama.cpp server (xllamacpp + SmolLM2) and `clairvoyant serve` in front of it as a
separate process (the deployed shape), plus a bare FastAPI + httpx pass-through
(minimal_passthrough.py: the floor of the serving stack on this machine), then rotates direct,
bare and proxied requests one at a time, empty queue, same prompt (so the backend answers from its
prompt cache). Prints TTFT and total time side by side, the paired per-request differences against
direct (which cancel most of the machine's noise), and each server process's CPU time per request.

    python benchmarks/bench_proxy_overhead.py --n 300 [--json FILE]
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
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

BODY = {
    "messages": [{"role": "user", "content": "Say OK."}],
    "max_tokens": 1,
    "stream": True,
    "temperature": 0,
}


def one_request(client: httpx.Client, url: str) -> tuple[float, float]:
    """(TTFT, total) seconds for one streamed 1-token chat completion.

    llama.cpp's server sometimes closes a keep-alive connection after a streamed answer without
    saying so; a request that meets such a connection is timed again from scratch."""
    for _ in range(3):
        try:
            return _timed_request(client, url)
        except httpx.RemoteProtocolError:
            continue
    return _timed_request(client, url)


def _timed_request(client: httpx.Client, url: str) -> tuple[float, float]:
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


def start_server(argv: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, *argv], env={**os.environ})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{argv} did not start")


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def describe(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values) * 1000
    return {"p50_ms": float(np.percentile(arr, 50)), "p90_ms": float(np.percentile(arr, 90)), "p99_ms": float(np.percentile(arr, 99))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="rounds of one request to each target (default 300)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    names = ("direct", "bare", "proxy")
    with EmbeddedLlamaServer() as backend:
        ports = {"bare": free_port(), "proxy": free_port()}
        servers = {
            "bare": start_server(
                [str(Path(__file__).with_name("minimal_passthrough.py")), backend.base_url, str(ports["bare"])],
                ports["bare"],
            ),
            "proxy": start_server(
                ["-m", "clairvoyant", "serve", "--upstream", backend.base_url, "--port", str(ports["proxy"]),
                 "--log-level", "warning"],
                ports["proxy"],
            ),
        }
        try:
            urls = {
                "direct": f"{backend.base_url}/v1/chat/completions",
                "bare": f"http://127.0.0.1:{ports['bare']}/v1/chat/completions",
                "proxy": f"http://127.0.0.1:{ports['proxy']}/v1/chat/completions",
            }
            samples: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "total": []} for k in urls}
            with httpx.Client(timeout=60) as client:
                for _ in range(args.warmup):
                    for url in urls.values():
                        one_request(client, url)
                cpu_before = {k: cpu_seconds(p.pid) for k, p in servers.items()}
                for i in tqdm(range(args.n), desc="rounds"):
                    for name in names[i % 3:] + names[: i % 3]:  # rotate the order
                        ttft, total = one_request(client, urls[name])
                        samples[name]["ttft"].append(ttft)
                        samples[name]["total"].append(total)
                cpu_per_request_ms = {k: (cpu_seconds(p.pid) - cpu_before[k]) / args.n * 1000 for k, p in servers.items()}
        finally:
            for proc in servers.values():
                proc.terminate()
                proc.wait(10)

    result: dict[str, object] = {"n_rounds": args.n, "server_cpu_ms_per_request": cpu_per_request_ms}
    print(f"\n1-token streamed chat completion, empty queue, n={args.n} rounds (rotating order)")
    print(f"{'':8} {'TTFT p50':>10} {'TTFT p90':>10} {'total p50':>10} {'total p90':>10} {'total p99':>10}")
    for name in names:
        t, tot = describe(samples[name]["ttft"]), describe(samples[name]["total"])
        result[name] = {"ttft": t, "total": tot}
        print(f"{name:8} {t['p50_ms']:10.2f} {t['p90_ms']:10.2f} {tot['p50_ms']:10.2f} {tot['p90_ms']:10.2f} {tot['p99_ms']:10.2f}")
    for name in ("bare", "proxy"):
        for metric in ("ttft", "total"):
            diffs = [p - d for p, d in zip(samples[name][metric], samples["direct"][metric])]
            added = describe(diffs)
            result[f"added_{metric}_{name}"] = added
            print(f"{name} adds to {metric}: median of paired differences {statistics.median(diffs) * 1000:.2f} ms (p90 {added['p90_ms']:.2f} ms)")
    print("server CPU per request: " + ", ".join(f"{k} {v:.2f} ms" for k, v in cpu_per_request_ms.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
