"""Added latency of the proxy: a 1-token streamed request through each proxy versus straight to the backend.

Starts a real llama.cpp server (xllamacpp + SmolLM2) and, each as a separate process on a free
port in front of it: nginx (Debian `nginx`; proxy_buffering off, upstream keepalive), the bare
FastAPI + uvicorn + httpx pass-through (harness/passthrough.py: the stack the design card names),
the floor of the proxy's own stack (harness/stack_floor.py: Granian, a plain ASGI callable and
aiohttp, nothing of Clairvoyant) and the proxy under test (`clairvoyant serve`, the deployed
shape, or --proxy-cmd). Each round sends one request to every target, one at a time (empty
queue), in a fresh random order (a fixed rotation would put the same target before each one every
time), same prompt (the backend answers from its prompt cache). Prints TTFB (first body byte), TTFT (first text chunk) and total time, the paired
per-round differences against direct (which cancel most of the machine's noise), and each server
process's CPU time per request (/proc/<pid>/stat of its process tree).

    python benchmarks/bench_proxy_overhead.py [--n 300] [--json FILE] [--proxy-cmd '...{upstream} {port}...']

Needs nginx (`make bench-tools` installs it). Prints the tables; --json FILE keeps the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from harness import servers
from harness.proxy_process import free_port
from harness.request_path import (
    nginx_proxy_conf,
    paired_differences,
    predecessor_counts,
    round_orders,
    summarize_ms,
    tree_cpu_seconds,
)
from harness.results import write_json
from tqdm import tqdm

from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

BODY = {
    "messages": [{"role": "user", "content": "Say OK."}],
    "max_tokens": 1,
    "stream": True,
    "temperature": 0,
}
BASE_TARGETS: tuple[str, ...] = ("direct", "nginx", "bare", "floor", "proxy")
METRICS = ("ttfb", "ttft", "total")


def one_request(client: httpx.Client, url: str) -> dict[str, float]:
    """TTFB, TTFT and total seconds of one streamed 1-token chat completion.

    llama.cpp's server sometimes closes a keep-alive connection after a streamed answer without
    saying so; a request that meets such a connection is timed again from scratch."""
    for _ in range(3):
        try:
            return _timed_request(client, url)
        except httpx.RemoteProtocolError:
            continue
    return _timed_request(client, url)


def _timed_request(client: httpx.Client, url: str) -> dict[str, float]:
    started = time.perf_counter()
    ttfb = ttft = None
    seen = b""
    with client.stream("POST", url, json=BODY) as response:
        response.raise_for_status()
        for chunk in response.iter_raw():
            now = time.perf_counter() - started
            if ttfb is None and chunk:
                ttfb = now
            if ttft is None:
                seen += chunk
                if b'"content":"' in seen:  # the first delta carrying text (the role-only delta has none)
                    ttft = now
    total = time.perf_counter() - started
    return {"ttfb": ttfb if ttfb is not None else total, "ttft": ttft if ttft is not None else total, "total": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="rounds of one request to each target (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed rounds first (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round random order")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1: stable on shared cores)")
    servers.add_target_options(parser, "proxy_overhead", slots_note="; slots 1 here")
    args = parser.parse_args()
    TARGETS = BASE_TARGETS + (("baseline",) if args.baseline_cmd else ())
    servers.require_tools("nginx")

    with contextlib.ExitStack() as stack:
        backend = stack.enter_context(EmbeddedLlamaServer(n_threads=args.threads))
        ports = {name: free_port() for name in TARGETS if name != "direct"}
        procs = {
            "direct": backend.pid,
            "nginx": stack.enter_context(servers.nginx(
                lambda p: nginx_proxy_conf(p, ports["nginx"], backend.base_url), ports["nginx"])).pid,
            "bare": stack.enter_context(servers.running(
                servers.passthrough_argv(backend.base_url, ports["bare"]), ports["bare"])).pid,
            "floor": stack.enter_context(servers.running(
                servers.stack_floor_argv(backend.base_url, ports["floor"]), ports["floor"])).pid,
            "proxy": stack.enter_context(servers.running(
                servers.proxy_argv(args.proxy_cmd, backend.base_url, ports["proxy"], 1), ports["proxy"],
                env=servers.proxy_env())).pid,
        }  # fmt: skip
        if args.baseline_cmd:
            procs["baseline"] = stack.enter_context(servers.running(
                servers.proxy_argv(args.baseline_cmd, backend.base_url, ports["baseline"], 1), ports["baseline"])).pid  # fmt: skip
        urls = {"direct": f"{backend.base_url}/v1/chat/completions"}
        urls |= {name: f"http://127.0.0.1:{port}/v1/chat/completions" for name, port in ports.items()}
        samples: dict[str, dict[str, list[float]]] = {m: {t: [] for t in TARGETS} for m in METRICS}
        orders = round_orders(TARGETS, args.n, args.seed)
        with httpx.Client(timeout=60) as client:
            for order in round_orders(TARGETS, args.warmup, args.seed + 1):
                for name in order:
                    one_request(client, urls[name])
            load_before = os.getloadavg()
            cpu_before = {k: tree_cpu_seconds(pid) for k, pid in procs.items() if pid is not None}
            for order in tqdm(orders, desc="rounds"):
                for name in order:
                    timed = one_request(client, urls[name])
                    for metric in METRICS:
                        samples[metric][name].append(timed[metric])
            cpu_after = {k: tree_cpu_seconds(pid) for k, pid in procs.items() if pid is not None}
            load_after = os.getloadavg()
    # the backend serves every target's request; each proxy only its own
    served = {name: args.n * (len(TARGETS) if name == "direct" else 1) for name in cpu_after}
    cpu_ms = {k: (cpu_after[k] - cpu_before[k]) / served[k] * 1000 for k in cpu_after}

    result: dict[str, object] = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "proxy_argv": servers.proxy_argv(args.proxy_cmd, "UPSTREAM", 0, 1),
        "baseline_argv": servers.proxy_argv(args.baseline_cmd, "UPSTREAM", 0, 1) if args.baseline_cmd else None,
        "n_rounds": args.n, "order": "random per round", "seed": args.seed, "llama_threads": args.threads,
        "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(),
        "predecessors": {k: dict(v) for k, v in predecessor_counts(orders).items()},
        "server_cpu_ms_per_request": cpu_ms,
    }  # fmt: skip
    print(f"\n1-token streamed chat completion to llama.cpp, empty queue, n={args.n} rounds (random order per round); "
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}\n")  # fmt: skip
    print("| target | TTFB p50 | TTFB p90 | TTFT p50 | total p50 | total p90 | total p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in TARGETS:
        s = {m: summarize_ms(samples[m][name]) for m in METRICS}
        result[name] = s
        print(f"| {name} | {s['ttfb']['p50_ms']:.2f} | {s['ttfb']['p90_ms']:.2f} | {s['ttft']['p50_ms']:.2f} | "
            f"{s['total']['p50_ms']:.2f} | {s['total']['p90_ms']:.2f} | {s['total']['p99_ms']:.2f} |")  # fmt: skip
    print("\nAdded over direct, paired per round (ms): p50 and p90 of (target - direct)\n")
    print("| target | TTFB p50 | TTFB p90 | TTFT p50 | total p50 | total p90 | server CPU ms/request |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    added = {m: paired_differences(samples[m], "direct") for m in METRICS}
    for name in TARGETS[1:]:
        a = {m: summarize_ms(added[m][name]) for m in METRICS}
        result[f"added_{name}"] = a
        print(f"| {name} | {a['ttfb']['p50_ms']:.2f} | {a['ttfb']['p90_ms']:.2f} | {a['ttft']['p50_ms']:.2f} | "
            f"{a['total']['p50_ms']:.2f} | {a['total']['p90_ms']:.2f} | {cpu_ms[name]:.2f} |")  # fmt: skip
    print(f"\nllama.cpp server (direct) CPU per request it served: {cpu_ms['direct']:.2f} ms")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
