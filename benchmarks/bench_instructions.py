"""Instructions per request of the proxy and of its stack's floor, counted by valgrind's callgrind.

On 2 shared cores, requests/s and CPU-time figures of one build move by 20% between runs, so a cut
of a few percent cannot be seen in them. User-space instructions per request hardly move: each
target runs under callgrind behind the same fixed-answer nginx, gets --warm untimed requests, has
its counters zeroed (`callgrind_control -z`), serves --n scheduled POST /v1/chat/completions one at
a time, and has its counters dumped. Targets: the floor of the proxy's stack (harness/stack_floor.py:
Granian, a plain ASGI callable, aiohttp), the proxy under test, and --baseline-cmd beside them.

Not counted: the kernel's work (system calls), cache misses, time spent waiting for the
interpreter lock, and child processes (the learner's worker). The online learner's encoder pass
runs after an answer, for at most learner_max_observations_per_s requests a second; the proxies run
with that rate at 0.01, so the count is the request path's own, as at hundreds of requests a second.

    python benchmarks/bench_instructions.py [--n 200] [--warm 50] [--baseline-cmd "..."]

Needs valgrind and nginx (apt-get install valgrind nginx). Python runs ~50x slower under
callgrind: a target takes 1-3 minutes, mostly start-up; two run at once.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
from bench_proxy_throughput import ANSWER, BODY
from harness import servers
from harness.proxy_process import free_port
from harness.request_path import nginx_fixed_answer_conf
from harness.results import write_json

# The learner's encoder pass sampled away (see the module docstring).
LEARNING_SAMPLED_AWAY = {"CLAIRVOYANT_LEARNER_MAX_OBSERVATIONS_PER_S": "0.01"}
CALLGRIND = ["valgrind", "--tool=callgrind", "--dump-instr=no"]


def callgrind_total(dump: Path) -> int:
    """The instructions a callgrind dump counted (its ``summary:`` or ``totals:`` line)."""
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError(f"no instruction total in {dump}")


def without_env_prefix(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``env K=V ... cmd`` as ``cmd`` with those variables: callgrind must run the server itself, not
    ``env`` (it does not follow an exec)."""
    env = dict(env)
    if argv and argv[0] == "env":
        argv = argv[1:]
        while argv and "=" in argv[0]:
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
    return argv, env


def count(argv: list[str], port: int, env: dict[str, str], out: Path, *, warm: int, n: int) -> float:
    """Instructions per request of the server ``argv`` (listening on ``port``) under callgrind."""
    argv, env = without_env_prefix(argv, env)
    proc = subprocess.Popen(
        [*CALLGRIND, f"--callgrind-out-file={out}", *argv], env={**os.environ, **env}, cwd=servers.ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        servers.wait_http(f"http://127.0.0.1:{port}/", proc, timeout_s=900)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with httpx.Client(timeout=300) as client:

            def send(k: int) -> None:
                for _ in range(k):
                    response = client.post(url, content=BODY, headers={"content-type": "application/json"})
                    if response.status_code != 200:
                        raise RuntimeError(f"{argv[0]}: status {response.status_code}")

            send(warm)
            time.sleep(1.0)  # what the warm requests left behind (the learner's pass) ends first
            subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
            send(n)
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:  # counted and dumped already: nothing is lost
            proc.kill()
            proc.wait()
    dumps = sorted((Path(f) for f in glob.glob(f"{out}.*")), key=os.path.getmtime)
    return callgrind_total(dumps[0]) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="counted requests per target (default 200)")
    parser.add_argument("--warm", type=int, default=50, help="untimed requests first (default 50)")
    servers.add_target_options(parser, "instructions")
    args = parser.parse_args()
    servers.require_tools("nginx", "valgrind", "callgrind_control")
    backend_port = free_port()
    with (
        tempfile.TemporaryDirectory(prefix="bench-callgrind-") as tmp,
        servers.nginx(lambda prefix: nginx_fixed_answer_conf(prefix, backend_port, ANSWER), backend_port),
    ):
        upstream = f"http://127.0.0.1:{backend_port}"
        targets: dict[str, tuple[list[str], dict[str, str]]] = {}
        ports = {name: free_port() for name in ("floor", "proxy", "baseline")}
        targets["floor"] = (servers.stack_floor_argv(upstream, ports["floor"]), {})
        proxy_env = {**servers.proxy_env(), **LEARNING_SAMPLED_AWAY}
        targets["proxy"] = (servers.proxy_argv(args.proxy_cmd, upstream, ports["proxy"], 64), proxy_env)
        if args.baseline_cmd:
            baseline = servers.proxy_argv(args.baseline_cmd, upstream, ports["baseline"], 64)
            targets["baseline"] = (baseline, LEARNING_SAMPLED_AWAY)

        def measure(name: str) -> float:
            argv, env = targets[name]
            return count(argv, ports[name], env, Path(tmp) / f"{name}.callgrind", warm=args.warm, n=args.n)

        with ThreadPoolExecutor(2) as pool:
            per_request = dict(zip(targets, pool.map(measure, targets)))
    floor = per_request["floor"]
    print(f"\nInstructions per scheduled request, {args.n} one at a time (callgrind, user space)\n")
    print("| target | instructions/request | x floor | over the floor |")
    print("|---|---:|---:|---:|")
    for name, value in per_request.items():
        print(f"| {name} | {value:,.0f} | {value / floor:.2f} | {value - floor:+,.0f} |")
    write_json(
        args.json,
        {
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "n": args.n,
            "warm": args.warm,
            "targets": {name: argv for name, (argv, _) in targets.items()},
            "instructions_per_request": per_request,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
