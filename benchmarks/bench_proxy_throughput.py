"""Throughput of the request path: 64 concurrent clients (wrk) through each proxy to a trivially fast backend.

The backend is nginx answering every request with a fixed chat-completion JSON (`return 200`); it
is wrk'ed directly first, so its row shows it is not the bottleneck. In front of it, each a separate
process on a free port: nginx as a reverse proxy (proxy_buffering off, upstream keepalive), the bare
FastAPI + uvicorn + httpx pass-through (harness/passthrough.py), the floor of the proxy's own stack
(harness/stack_floor.py: Granian, a plain ASGI callable, aiohttp) and the proxy under test
(`clairvoyant serve --slots 64 --max-queue 10000`, or --proxy-cmd). Two paths: the scheduled POST
/v1/chat/completions (Clairvoyant parses, predicts and queues each request) and the pass-through
GET /v1/models. Rounds run every target once per path in a fresh random order; the tables give
the median over rounds of requests/s and of wrk's per-run p50/p99 latency, each server's CPU per
request, and, for the Python servers, the part of it their event loop's thread spent.

    python benchmarks/bench_proxy_throughput.py [--duration 5] [--rounds 3] [--json FILE]
        [--proxy-cmd '{python} -m clairvoyant.cli serve --upstream {upstream} --port {port} --slots {slots} ...']

Needs nginx and wrk (`make bench-tools` installs them). Prints the tables; --json FILE keeps the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import httpx
from harness import servers
from harness.proxy_process import free_port
from harness.request_path import (
    WrkResult,
    main_thread_cpu_seconds,
    nginx_fixed_answer_conf,
    nginx_proxy_conf,
    parse_wrk_output,
    round_orders,
    tree_cpu_seconds,
    wrk_script,
)
from harness.results import write_json

ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    },
    separators=(",", ":"),
)  # fmt: skip
BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1})
PATHS = {
    "POST /v1/chat/completions": ("POST", "/v1/chat/completions", BODY),
    "GET /v1/models": ("GET", "/v1/models", None),
}
BASE_TARGETS: tuple[str, ...] = ("backend", "nginx", "bare", "floor", "proxy")
NGINX_TARGETS = ("backend", "nginx")


def run_wrk(url: str, script: Path, *, connections: int, threads: int, duration_s: int) -> WrkResult:
    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration_s}s", "--timeout", "10s", "-s", str(script), url]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return parse_wrk_output(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every target x path (default 3)")
    parser.add_argument("--connections", type=int, default=64, help="concurrent wrk connections (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (default 2)")
    parser.add_argument("--slots", type=int, default=64, help="the proxy's --slots (default 64)")
    parser.add_argument("--nginx-workers", type=int, default=1, help="worker processes of each nginx (default 1)")
    parser.add_argument("--warmup", type=int, default=1, help="whole seconds of wrk per target and path before timing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round random order")
    servers.add_target_options(parser, "proxy_throughput")
    args = parser.parse_args()
    TARGETS = BASE_TARGETS + (("baseline",) if args.baseline_cmd else ())
    servers.require_tools("nginx", "wrk")

    ports = {name: free_port() for name in TARGETS}
    backend_url = f"http://127.0.0.1:{ports['backend']}"
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-wrk-") as tmp:
        procs = {
            "backend": stack.enter_context(servers.nginx(
                lambda p: nginx_fixed_answer_conf(p, ports["backend"], ANSWER, workers=args.nginx_workers), ports["backend"])),
            "nginx": stack.enter_context(servers.nginx(
                lambda p: nginx_proxy_conf(p, ports["nginx"], backend_url, workers=args.nginx_workers,
                                           keepalive=args.connections), ports["nginx"])),
            "bare": stack.enter_context(servers.running(servers.passthrough_argv(backend_url, ports["bare"]), ports["bare"])),
            "floor": stack.enter_context(servers.running(servers.stack_floor_argv(backend_url, ports["floor"]), ports["floor"])),
            "proxy": stack.enter_context(servers.running(
                servers.proxy_argv(args.proxy_cmd, backend_url, ports["proxy"], args.slots), ports["proxy"],
                env=servers.proxy_env())),
        }  # fmt: skip
        if args.baseline_cmd:
            procs["baseline"] = stack.enter_context(servers.running(
                servers.proxy_argv(args.baseline_cmd, backend_url, ports["baseline"], args.slots), ports["baseline"]))  # fmt: skip
        scripts = {}
        for label, (method, _, body) in PATHS.items():
            scripts[label] = Path(tmp) / f"{method.lower()}.lua"
            scripts[label].write_text(wrk_script(method, body))

        def url(target: str, path: str) -> str:
            return f"http://127.0.0.1:{ports[target]}{path}"

        # Sanity: every target answers both paths with 200 before anything is timed.
        for target in TARGETS:
            for label, (method, path, body) in PATHS.items():
                r = httpx.request(method, url(target, path), content=body,
                                  headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
                if r.status_code != 200:
                    sys.exit(f"{target} answered {label} with {r.status_code}: {r.text[:200]}")
        for target in TARGETS:
            for label, (_, path, _) in PATHS.items():
                run_wrk(url(target, path), scripts[label], connections=args.connections, threads=args.threads,
                        duration_s=args.warmup)  # fmt: skip

        runs: dict[str, dict[str, list[dict[str, float]]]] = {label: {t: [] for t in TARGETS} for label in PATHS}
        cells = [(label, target) for label in PATHS for target in TARGETS]
        order = round_orders([f"{label}|{target}" for label, target in cells], args.rounds, args.seed)
        load_before = os.getloadavg()
        for i, round_order in enumerate(order):
            for cell in round_order:
                label, target = cell.split("|")
                cpu_before = {name: tree_cpu_seconds(p.pid) for name, p in procs.items()}
                loop_before = main_thread_cpu_seconds(procs[target].pid)
                result = run_wrk(url(target, PATHS[label][1]), scripts[label], connections=args.connections,
                                 threads=args.threads, duration_s=args.duration)  # fmt: skip
                cpu = {name: tree_cpu_seconds(p.pid) - cpu_before[name] for name, p in procs.items()}
                loop_cpu = main_thread_cpu_seconds(procs[target].pid) - loop_before
                per_request = max(result.requests, 1)
                runs[label][target].append({
                    "requests_per_s": result.requests_per_s, "p50_ms": result.p50_ms, "p90_ms": result.p90_ms,
                    "p99_ms": result.p99_ms, "max_ms": result.max_ms, "requests": result.requests,
                    "socket_errors": result.socket_errors, "status_errors": result.status_errors,
                    "cpu_ms_per_request": {name: c / per_request * 1000 for name, c in cpu.items()},
                    "main_thread_cpu_ms_per_request": loop_cpu / per_request * 1000,
                })  # fmt: skip
                print(f"round {i + 1} {label:26} {target:8} {result.requests_per_s:9.0f} req/s  "
                      f"p50 {result.p50_ms:6.2f} ms  p99 {result.p99_ms:7.2f} ms"
                      + ("" if result.ok else f"  ERRORS socket={result.socket_errors} status={result.status_errors}"),
                      flush=True)  # fmt: skip
        load_after = os.getloadavg()

    summary: dict[str, object] = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "proxy_argv": servers.proxy_argv(args.proxy_cmd, "UPSTREAM", 0, args.slots),
        "baseline_argv": servers.proxy_argv(args.baseline_cmd, "UPSTREAM", 0, args.slots) if args.baseline_cmd else None,
        "connections": args.connections, "wrk_threads": args.threads, "duration_s": args.duration,
        "rounds": args.rounds, "nginx_workers": args.nginx_workers, "slots": args.slots,
        "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(), "paths": {},
    }  # fmt: skip
    print(f"\n{args.connections} connections, wrk -t{args.threads}, {args.duration:g} s per run, median of {args.rounds} "
        f"rounds (random order); load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")  # fmt: skip
    for label in PATHS:
        print(f"\n{label}\n")
        print("| target | requests/s | p50 ms | p99 ms | errors | server CPU ms/request | of which its event loop |")
        print("|---|---:|---:|---:|---:|---|---:|")
        table = {}
        for target in TARGETS:
            rs = runs[label][target]
            med = {k: statistics.median(r[k] for r in rs) for k in ("requests_per_s", "p50_ms", "p90_ms", "p99_ms")}
            errors = sum(r["socket_errors"] + r["status_errors"] for r in rs)
            # CPU of the process tree that serves this target (plus the fake backend behind it)
            own = statistics.median(r["cpu_ms_per_request"][target] for r in rs)
            behind = statistics.median(r["cpu_ms_per_request"]["backend"] for r in rs)
            cpu_text = f"{own:.3f}" if target == "backend" else f"{own:.3f} (+ backend {behind:.3f})"
            # The Python servers' main thread runs their event loop, which one core bounds; nginx has none.
            loop = statistics.median(r["main_thread_cpu_ms_per_request"] for r in rs)
            loop_text = "-" if target in NGINX_TARGETS else f"{loop:.3f}"
            table[target] = {**med, "errors": errors, "cpu_ms_per_request": own, "backend_cpu_ms_per_request": behind,
                             "main_thread_cpu_ms_per_request": loop, "runs": rs}  # fmt: skip
            print(
                f"| {target} | {med['requests_per_s']:,.0f} | {med['p50_ms']:.2f} | {med['p99_ms']:.2f} | {errors} "
                f"| {cpu_text} | {loop_text} |"
            )
        # The host's speed moves between rounds; a ratio within each round cancels most of it.
        for target in ("proxy", "baseline")[: 1 + bool(args.baseline_cmd)]:
            ratios = [
                mine["requests_per_s"] / yardstick["requests_per_s"]
                for mine, yardstick in zip(runs[label][target], runs[label]["nginx"], strict=True)
            ]
            table[target]["of_nginx"] = statistics.median(ratios)
            print(f"{target} / nginx, median of the per-round ratios: {100 * statistics.median(ratios):.1f}%")
        summary["paths"][label] = table  # type: ignore[index]
    print()
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
