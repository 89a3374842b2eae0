"""`clairvoyant backend`'s generation speed by thread count, on this machine as it is (other work
included): the evidence for its default (the cores it may use, less one).

    python benchmarks/bench_backend_threads.py [--threads 2 1] [--rounds 2] [--max-tokens 96]

For each round and each thread count, it starts the embedded llama.cpp server (SmolLM2-135M), asks
for one answer of ``--max-tokens`` tokens at temperature 0, and prints llama.cpp's own
``timings.predicted_per_second`` with the load average. Alternated round by round, so a change of
the machine's load falls on both counts alike. Not a timed test: the figures depend on the machine
and its neighbours.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx

from clairvoyant.tools.backend import default_threads
from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

PROMPT = "Write a short story about a cat."


def tokens_per_s(threads: int, max_tokens: int) -> float:
    server = EmbeddedLlamaServer(n_threads=threads, n_parallel=1)
    server.start()
    try:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                "temperature": 0}  # fmt: skip
        answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600).json()
        return float(answer["timings"]["predicted_per_second"])
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    print(
        f"cores allowed: {len(os.sched_getaffinity(0))}; clairvoyant backend's default: {default_threads()} thread(s)"
    )
    for round_ in range(args.rounds):
        for threads in args.threads:
            speed = tokens_per_s(threads, args.max_tokens)
            load = os.getloadavg()[0]
            print(f"round {round_ + 1}: {threads} thread(s): {speed:6.1f} tokens/s (load average {load:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
