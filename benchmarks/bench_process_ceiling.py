"""What a second core could give the scheduled path: one proxy process against two independent ones.

The proxy's event loop is one thread; under wrk it runs at 100% of one core while the other core is
mostly idle (section 22b of docs/benchmarks.md). This measures the ceiling of spreading the work
over processes, before paying for any coordination between them: in each round,

* ``one``: one `clairvoyant serve --slots 64`, wrk -t2 -c64;
* ``two``: two independent `clairvoyant serve --slots 32` on two ports, each driven by its own
  wrk -t1 -c32 at the same time; their requests/s are summed. No shared queue, no shared slot
  count: this is NOT a design the proxy could ship (the global shortest-first order and the
  per-backend slot count would be lost), only an upper bound for one that keeps them;
* ``nginx``: nginx as a reverse proxy (1 worker), the yardstick of the host's speed in that round.

All in front of the fixed-answer nginx backend of bench_proxy_throughput.py, scheduled POST
/v1/chat/completions, targets in a fresh random order each round; medians over rounds.

    PYTHONPATH=src python benchmarks/bench_process_ceiling.py [--rounds 5] [--duration 5] [--json FILE]

Needs nginx and wrk (apt-get install nginx wrk). Not a timed test.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import servers  # noqa: E402
from bench_proxy_throughput import ANSWER, BODY  # noqa: E402

from clairvoyant.tools.bench.request_path import (  # noqa: E402
    nginx_fixed_answer_conf,
    nginx_proxy_conf,
    parse_wrk_output,
    round_orders,
    tree_cpu_seconds,
    wrk_script,
)

TARGETS = ("one", "two", "nginx")
PATH = "/v1/chat/completions"
RESULTS = Path(__file__).with_name("process_ceiling_results.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every target (default 5)")
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round random order")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS.name})")
    args = parser.parse_args()
    servers.require_tools("nginx", "wrk")

    backend_port, nginx_port, one_port, *two_ports = (servers.free_port() for _ in range(5))
    backend = f"http://127.0.0.1:{backend_port}"
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-ceiling-") as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(wrk_script("POST", BODY))
        stack.enter_context(servers.nginx(lambda p: nginx_fixed_answer_conf(p, backend_port, ANSWER), backend_port))
        stack.enter_context(servers.nginx(lambda p: nginx_proxy_conf(p, nginx_port, backend), nginx_port))

        def proxy(port: int, slots: int) -> subprocess.Popen[bytes]:
            argv = servers.proxy_argv(None, backend, port, slots)
            return stack.enter_context(servers.running(argv, port, env=servers.proxy_env()))

        pids = {"one": [proxy(one_port, 64).pid], "two": [proxy(p, 32).pid for p in two_ports], "nginx": []}
        drives = {  # (port, wrk threads, connections) run at the same time
            "one": [(one_port, 2, 64)],
            "two": [(p, 1, 32) for p in two_ports],
            "nginx": [(nginx_port, 2, 64)],
        }

        def drive(target: str, duration_s: int) -> tuple[float, float, float]:
            """(requests/s summed, the worst p99 ms, the proxy processes' CPU ms per request)."""
            cpu_before = sum(tree_cpu_seconds(pid) for pid in pids[target])
            wrks = [
                subprocess.Popen(
                    [
                        "wrk",
                        f"-t{t}",
                        f"-c{c}",
                        f"-d{duration_s}s",
                        "--timeout",
                        "10s",
                        "-s",
                        str(script),
                        f"http://127.0.0.1:{port}{PATH}",
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for port, t, c in drives[target]
            ]
            results = [parse_wrk_output(w.communicate()[0]) for w in wrks]
            cpu_s = sum(tree_cpu_seconds(pid) for pid in pids[target]) - cpu_before
            if not all(r.ok for r in results):
                sys.exit(f"{target}: wrk saw errors: {results}")
            requests = sum(r.requests for r in results)
            return sum(r.requests_per_s for r in results), max(r.p99_ms for r in results), cpu_s / requests * 1000

        for target in TARGETS:  # warm-up, untimed
            drive(target, 1)
        runs: dict[str, list[tuple[float, float, float]]] = {t: [] for t in TARGETS}
        load_before = os.getloadavg()
        for i, order in enumerate(round_orders(list(TARGETS), args.rounds, args.seed)):
            for target in order:
                rate, p99, cpu = drive(target, args.duration)
                runs[target].append((rate, p99, cpu))
                print(
                    f"round {i + 1} {target:6} {rate:9,.0f} req/s  p99 {p99:7.2f} ms  CPU {cpu:.3f} ms/request",
                    flush=True,
                )
        load_after = os.getloadavg()

    table = {
        t: {
            "requests_per_s": statistics.median(r[0] for r in runs[t]),
            "p99_ms": statistics.median(r[1] for r in runs[t]),
            "cpu_ms_per_request": statistics.median(r[2] for r in runs[t]),
            "runs": [{"requests_per_s": r[0], "p99_ms": r[1], "cpu_ms_per_request": r[2]} for r in runs[t]],
        }
        for t in TARGETS
    }
    print(
        f"\nmedian of {args.rounds} rounds, {args.duration} s each; load average {load_before[0]:.2f} -> {load_after[0]:.2f}\n"
    )
    print("| target | requests/s | p99 ms | proxy CPU ms/request |")
    print("|---|---:|---:|---:|")
    for t in TARGETS:
        row = table[t]
        cpu_text = "" if t == "nginx" else f"{row['cpu_ms_per_request']:.3f}"
        print(f"| {t} | {row['requests_per_s']:,.0f} | {row['p99_ms']:.1f} | {cpu_text} |")
    ratio = statistics.median(b[0] / a[0] for a, b in zip(runs["one"], runs["two"], strict=True))
    print(f"\ntwo / one, median of the per-round ratios: {ratio:.2f}x")
    summary = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "rounds": args.rounds, "duration_s": args.duration, "cpus": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": load_after, "two_over_one": ratio, "targets": table,
    }  # fmt: skip
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
