"""Instructions per request of `clairvoyant serve` (valgrind's callgrind): A/B of small cuts on a noisy machine.

On 2 shared cores, wall-clock and CPU-time figures move by 20% between runs, so a 2% cut cannot
be seen in them. User-space instructions per request are nearly deterministic (two runs of one
build differ by ~0.3%): each build runs under callgrind behind the same fixed-answer nginx
backend, gets ``--warm`` untimed requests, then its counters are zeroed (``callgrind_control -z``),
``--n`` requests are sent one at a time (the scheduled POST /v1/chat/completions, with
``--stream`` a streamed one with an SSE answer, with ``--get`` the pass-through GET /v1/models), and
the counters are dumped. Kernel work (the
socket system calls) is not counted; cache misses are not either. Python runs ~50x slower under
valgrind: a build takes 2-3 minutes, mostly start-up.

    python benchmarks/bench_instructions.py --build new=src --build base=/tmp/wt-base/src
        [--stream | --get] [--log-level warning] [--n 200] [--warm 50] [--parallel 2]

``--build NAME=PYTHONPATH`` names a source tree (an earlier commit: `git worktree add /tmp/wt-base
<commit>`). Needs valgrind and nginx (apt-get install valgrind nginx). Not a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import servers  # noqa: E402
from profile_request_path import ANSWER, SSE  # noqa: E402

from clairvoyant.tools.bench.request_path import nginx_fixed_answer_conf  # noqa: E402


def _instructions(totals_file: str) -> int:
    for line in Path(totals_file).read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {totals_file}")


def drive(
    proc: subprocess.Popen[Any],
    port: int,
    request: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]],
    *,
    warm: int,
    n: int,
) -> None:
    """Drive a server running under callgrind: once it answers /healthz, ``warm`` untimed requests
    one at a time, its counters zeroed, ``n`` counted requests, its counters dumped."""
    servers.wait_http(f"http://127.0.0.1:{port}/healthz", proc, timeout_s=900)

    async def send(count: int) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            for _ in range(count):
                response = await request(client)
                if response.status_code != 200:
                    raise RuntimeError(f"status {response.status_code}")

    asyncio.run(send(warm))
    time.sleep(1.0)
    subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
    asyncio.run(send(n))
    subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)


def measure(name: str, pythonpath: str, args: argparse.Namespace, upstream: str, out_dir: Path) -> float:
    """Instructions per request of one build."""
    port = servers.free_port()
    out = out_dir / f"{name}.callgrind"
    argv = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
        sys.executable, "-m", "clairvoyant.cli", "serve", "--upstream", upstream, "--port", str(port),
        "--slots", "64", "--max-queue", "10000", "--log-level", args.log_level,
    ]  # fmt: skip
    body = {"model": "bench", "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1}
    if args.stream:
        body["stream"] = True
    with open(out_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": pythonpath}, stdout=log, stderr=log)
        try:
            base = f"http://127.0.0.1:{port}"

            async def request(client: httpx.AsyncClient) -> httpx.Response:
                if args.get:
                    return await client.get(f"{base}/v1/models")
                return await client.post(f"{base}/v1/chat/completions", json=body)

            drive(proc, port, request, warm=args.warm, n=args.n)
        finally:
            proc.terminate()
            proc.wait(120)
    dumps = sorted((f for f in glob.glob(f"{out}.*") if not f.endswith(".log")), key=os.path.getmtime)
    return _instructions(dumps[0]) / args.n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", required=True, metavar="NAME=PYTHONPATH")
    parser.add_argument("--stream", action="store_true", help="a streamed request (SSE answer)")
    parser.add_argument("--get", action="store_true", help="the pass-through GET /v1/models instead")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--warm", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=2, help="builds measured at once (counts do not depend on it)")
    args = parser.parse_args()
    servers.require_tools("nginx", "valgrind")
    builds = dict(b.split("=", 1) for b in args.build)
    backend_port = servers.free_port()

    def render(prefix: Path) -> str:
        conf = nginx_fixed_answer_conf(prefix, backend_port, SSE if args.stream else ANSWER)
        return (
            conf.replace("default_type application/json;", "default_type text/event-stream;") if args.stream else conf
        )

    with tempfile.TemporaryDirectory(prefix="bench-callgrind-") as tmp, servers.nginx(render, backend_port):
        upstream = f"http://127.0.0.1:{backend_port}"
        with ThreadPoolExecutor(args.parallel) as pool:
            counts = dict(zip(builds, pool.map(lambda kv: measure(*kv, args, upstream, Path(tmp)), builds.items())))
    first = next(iter(counts.values()))
    for name, count in counts.items():
        print(
            f"{name:12s} {count:12,.0f} instructions per request  ({(count / first - 1) * 100:+.1f}% vs {next(iter(counts))})"
        )
    print(
        json.dumps(
            {"stream": args.stream, "get": args.get, "log_level": args.log_level, "n": args.n, "per_request": counts}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
