"""Instructions per call of single parts of the scheduled request path, under callgrind (issue 12).

bench_instructions.py counts a whole request; Python code all runs inside the interpreter, so
callgrind cannot split it by Python function. This runs one part at a time in a loop, in its own
process under callgrind, twice (0 and ``--n`` calls, same hash seed) and prints the difference per
call: the part's own instructions plus a loop turn and a call (the ``noop`` row, ~0.7-0.9k).
Start-up varies by up to ~10M instructions between processes, so ``--n`` should be >= 20,000.

    PYTHONPATH=src python benchmarks/bench_part_instructions.py [--n 20000] [--part queue_cycle ...]

Parts: the scheduled queue's life of one request (push, pop, repriced, done on the default
FairShareQueue + StarvationGuard + SJF heap), the usage tap on the JSON and the SSE answers of
profile_request_path.py, a labelled Prometheus counter (count_request) and histogram observation,
a Ticket and its Job, the Relay of a scheduled request, an UpstreamRequest. Needs valgrind.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PARTS = ("noop", "queue_cycle", "usage_json", "usage_sse", "counter", "histogram", "ticket_job", "relay", "request")

CHILD = """
import asyncio, sys
sys.path.insert(0, {bench!r})
from profile_request_path import ANSWER, SSE
from clairvoyant.config import Settings
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.dialects import Dialect
from clairvoyant.prediction.usage import UsageTap
from clairvoyant.proxy.responses import Relay, UpstreamRequest
from clairvoyant.scheduling.dispatcher import Ticket
from clairvoyant.scheduling.job_queue import Job
from clairvoyant.scheduling.policy import PolicyParams, build_queue, make_policy

s = Settings()
policy = make_policy(s.policy, PolicyParams(s.boost_gamma_per_s, s.boost_auto_gamma, s.boost_max_s))
queue = build_queue(policy, starvation_timeout_s=s.starvation_timeout_s, starvation_slowdown=s.starvation_slowdown,
                    fair_share=s.fair_share, tenant_weights={{}})
metrics = Metrics()
request = UpstreamRequest("POST", "/v1/chat/completions", "", [], b"{{}}", Dialect.OPENAI)
answer, sse = ANSWER.encode(), SSE.encode()
clock = [0.0]

def noop(): pass
def queue_cycle():
    clock[0] += 1.0
    job = Job(None, clock[0])
    queue.push(job); queue.pop(clock[0]); queue.repriced(job, 1.0); queue.done(job)
def usage_json():
    tap = UsageTap("application/json"); tap.feed(answer); tap.usage(wall_s=0.01, request_model="bench")
def usage_sse():
    tap = UsageTap("text/event-stream"); tap.feed(sse); tap.usage(wall_s=0.01, request_model="bench")
def counter(): metrics.count_request("/v1/chat/completions", "openai", "200")
def histogram(): metrics.ttft_by_class["short"].observe(0.01)
def ticket_job():
    Ticket("r", "/v1/chat/completions", "openai", "m", None, 3, 1.0, cap_tokens=None, priority=0, tenant="")
def relay():
    Relay(None, request, metrics, list, list, on_usage=list, now=list, model="m", retry_unavailable=True,
          failover=list, on_answered=list, on_broken=list)
def request_():
    UpstreamRequest("POST", "/v1/chat/completions", "", [], b"{{}}", Dialect.OPENAI, close_connection=False)

part = {{"request": request_}}.get(sys.argv[1]) or globals()[sys.argv[1]]
async def main():  # a running loop: a Ticket makes its future on it
    for _ in range(int(sys.argv[2])):
        part()
asyncio.run(main())
"""


def _count(part: str, n: int) -> int:
    bench = str(Path(__file__).resolve().parent)
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, "-c", CHILD.format(bench=bench), part, str(n)],
        env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    match = re.search(r"refs:\s+([\d,]+)", out.stderr)
    if match is None:
        raise RuntimeError(f"{part}: no count in valgrind's output")
    return int(match.group(1).replace(",", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--part", action="append", choices=PARTS)
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args()
    parts = args.part or list(PARTS)
    jobs = [(p, n) for p in parts for n in (0, args.n)]
    with ThreadPoolExecutor(args.parallel) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: _count(*job), jobs)))
    for part in parts:
        print(f"{part:12s} {(counts[part, args.n] - counts[part, 0]) / args.n:10,.0f} instructions per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
