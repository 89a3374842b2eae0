"""Memory per waiting request, end to end: the proxy's RSS growth while N requests wait.

Starts `clairvoyant serve` (slots 1, a large max_queue) in front of a backend that accepts and
never answers, so the first request holds the slot and the rest wait. N clients (raw asyncio
sockets, each its own connection, a small JSON body) are opened; once /metrics shows N - 1 waiting,
the proxy's VmRSS is read and compared with its RSS before, after a warm-up of a few hundred waiting
requests that came and went (so lazy imports and first-use caches are already paid). Prints bytes per waiting
request, total and less its body (each body is held until dispatch).

    python benchmarks/bench_waiting_memory.py [--n 10000] [--sdk] [--refined] [--traced] [--json FILE]
        [--proxy-cmd "python -m clairvoyant.cli serve"]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from harness.proxy_process import free_port
from harness.results import add_json_option, write_json

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = 300  # requests
BATCH_REFINED = 200  # --refined: clients a batch, within the encoder's queue (256 by default)


def _hanging_backend() -> tuple[int, threading.Event]:
    """A backend that reads requests and never answers (GET /health is answered: ready)."""
    stop = threading.Event()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def serve(conn: socket.socket) -> None:
        data = conn.recv(65536)
        if data.startswith(b"GET /health"):
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            conn.close()
            return
        stop.wait()
        conn.close()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server.getsockname()[1], stop


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
HEADERS = b"Host: x\r\nContent-Type: application/json\r\n"
# --sdk: what the OpenAI Python SDK sends (its headers, a Bearer key, a real model name)
SDK_BODY = json.dumps(
    {
        "model": "llama3.2:3b-instruct-q4_K_M",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
).encode()
SDK_HEADERS = (
    b"Host: 127.0.0.1:8080\r\nAccept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\nAccept: application/json\r\n"
    b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python 1.54.4\r\nX-Stainless-Lang: python\r\n"
    b"X-Stainless-Package-Version: 1.54.4\r\nX-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\n"
    b"X-Stainless-Runtime: CPython\r\nX-Stainless-Runtime-Version: 3.11.7\r\n"
    b"Authorization: Bearer sk-local-0123456789abcdef0123456789abcdef\r\nX-Stainless-Async: false\r\n"
    b"x-stainless-retry-count: 0\r\n"
)
CLIENT = {"headers": HEADERS, "body": BODY}  # the request every client sends (--sdk: SDK_HEADERS, SDK_BODY)
TRACED = {"on": False}  # --traced: each client adds its own W3C traceparent header
_TRACE_IDS = itertools.count(1)


def _traceparent(i: int) -> bytes:
    """The header an OpenTelemetry-instrumented client sends: a trace and span id of its own per request."""
    return b"traceparent: 00-%032x-%016x-01\r\n" % (0x5EED0000 + i, 0xA11CE000 + i)


async def _open_clients(port: int, n: int, batch_done: Any = None) -> list[asyncio.StreamWriter]:
    """``n`` clients, 500 at a time (``BATCH_REFINED`` at a time, each batch awaited with
    ``batch_done(sent)`` before the next, when given)."""
    headers, body = CLIENT["headers"], CLIENT["body"]
    request = b"POST /v1/chat/completions HTTP/1.1\r\n%bContent-Length: %d\r\n\r\n%b" % (headers, len(body), body)
    step = 500 if batch_done is None else BATCH_REFINED
    writers: list[asyncio.StreamWriter] = []
    for start in range(0, n, step):
        batch = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(min(step, n - start))))
        for _, writer in batch:
            if TRACED["on"]:
                request = b"POST /v1/chat/completions HTTP/1.1\r\n%b%bContent-Length: %d\r\n\r\n%b" % (
                    headers,
                    _traceparent(next(_TRACE_IDS)),
                    len(body),
                    body,
                )
            writer.write(request)
            writers.append(writer)
        await asyncio.sleep(0.05)
        if batch_done is not None:
            await batch_done(len(writers))
    return writers


def _waiting(base: str) -> int:
    """Requests waiting, from /metrics (not /queue: listing 10,000 entries would itself raise the RSS)."""
    text = httpx.get(f"{base}/metrics", timeout=60).text
    return int(
        sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("clairvoyant_queue_depth{"))
    )


def _encoder_outcomes(base: str) -> dict[str, float]:
    """The encoder's requests by outcome, from /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=60).text.splitlines():
        if line.startswith("clairvoyant_encoder_requests_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


async def _phase(base: str, port: int, n: int, refined: bool = False) -> list[asyncio.StreamWriter]:
    before = await asyncio.to_thread(_encoder_outcomes, base)
    outcomes = before

    async def encoded(sent: int) -> None:
        """Every waiting request sent so far has its second opinion (refined, or counted otherwise)."""
        nonlocal outcomes
        deadline = time.monotonic() + 300
        while True:
            outcomes = await asyncio.to_thread(_encoder_outcomes, base)
            done = sum(outcomes.get(k, 0.0) - before.get(k, 0.0) for k in ("refined", "late", "dropped", "failed"))
            if done >= sent - 1:  # the first holds the slot: never encoded
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the encoder did not finish: {outcomes}")
            await asyncio.sleep(0.2)

    writers = await _open_clients(port, n, encoded if refined else None)
    deadline = time.monotonic() + 300
    while await asyncio.to_thread(_waiting, base) < n - 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the requests did not all queue")
        await asyncio.sleep(0.5)
    if refined:
        got = outcomes.get("refined", 0.0) - before.get("refined", 0.0)
        print(f"refined by the encoder: {got:.0f} of {n - 1} waiting; outcomes {outcomes}", file=sys.stderr)
    return writers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument(
        "--sdk", action="store_true", help="send the OpenAI Python SDK's headers, a Bearer key and a real model name"
    )
    parser.add_argument(
        "--refined", action="store_true", help="measure once the encoder has refined every waiting request"
    )
    parser.add_argument(
        "--traced", action="store_true", help="each client adds its own W3C traceparent header (OpenTelemetry)"
    )
    parser.add_argument("--proxy-cmd", default=f"{sys.executable} -m clairvoyant.cli serve")
    add_json_option(parser, "waiting_memory")
    args = parser.parse_args()
    if args.sdk:
        CLIENT.update(headers=SDK_HEADERS, body=SDK_BODY)
    TRACED["on"] = args.traced
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    backend_port, stop = _hanging_backend()
    port = free_port()
    env = {**os.environ, "CLAIRVOYANT_UPSTREAM_URL": f"http://127.0.0.1:{backend_port}", "CLAIRVOYANT_PORT": str(port),
           "CLAIRVOYANT_MAX_QUEUE": str(2 * args.n), "CLAIRVOYANT_MAX_CONNECTIONS": str(2 * args.n + 100),
           "CLAIRVOYANT_LOG_LEVEL": "warning", "CLAIRVOYANT_SHUTDOWN_GRACE_S": "0",
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    proxy = subprocess.Popen(
        shlex.split(args.proxy_cmd),
        env=env,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.2)

        async def run() -> tuple[int, int]:
            # Warm-up: a few hundred waiting requests, then gone (lazy imports, first-use caches).
            writers = await _phase(base, port, WARM_UP)
            for w in writers:
                w.close()
            while await asyncio.to_thread(_waiting, base) > 0:
                await asyncio.sleep(0.5)
            await asyncio.sleep(2)
            before = _rss_kb(proxy.pid)
            writers = await _phase(base, port, args.n, refined=args.refined)
            after = _rss_kb(proxy.pid)
            for w in writers:
                w.close()
            return before, after

        before_kb, after_kb = asyncio.run(run())
    finally:
        proxy.send_signal(signal.SIGTERM)
        try:
            proxy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proxy.kill()
        stop.set()
    per_request = (after_kb - before_kb) * 1024 / args.n
    besides = per_request - len(CLIENT["body"])
    print(
        f"{args.n} waiting requests{' (all refined)' if args.refined else ''}: proxy RSS {before_kb / 1024:.1f} -> {after_kb / 1024:.1f} MiB; "
        f"{per_request:.0f} bytes per waiting request, {besides:.0f} besides its "
        f"{len(CLIENT['body'])}-byte body{' (OpenAI SDK headers)' if args.sdk else ''}"
    )
    line = 0
    if args.traced:
        # The client's own bytes, like its body: the line forwarded as it came, a bytes object each
        line = sys.getsizeof(_traceparent(0))
        print(f"with a traceparent each: {besides - line:.0f} besides the body and the {line}-byte object of that line")
    figures = {
        "n": args.n, "sdk": args.sdk, "refined": args.refined, "traced": args.traced,
        "rss_before_kib": before_kb, "rss_after_kib": after_kb, "bytes_per_waiting_request": per_request,
        "body_bytes": len(CLIENT["body"]), "traceparent_object_bytes": line,
        "bytes_besides_body": besides - line,  # and, traced, besides the traceparent line's object
    }  # fmt: skip
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
