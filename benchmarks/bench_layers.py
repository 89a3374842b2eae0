"""Where one request's instructions go, per layer (issue 12, deliverable 1): callgrind, one request
at a time, behind the same fixed-answer nginx as bench_instructions.py.

Python code all runs inside the interpreter, so callgrind cannot name the Python module that spent
an instruction; the split is made by difference, from runs that each contain fewer layers:

* ``proxy``: ``clairvoyant serve`` (server + product + client + event loop), per build;
* ``client``: the backend client alone, in a loop of ``Upstream.open`` / read / ``aclose`` on
  uvloop, with the headers and body the proxy forwards, per build (the base build's is aiohttp's);
* ``server``: the proxy's own server (``proxy.server.build_server``: uvicorn + httptools + its
  client limits) with a raw ASGI app that reads the body and answers the fixed JSON: the server and
  ASGI layers with no product and no client.

Product code (routing, parsing, prediction, queue, lease, relay, metrics, learners) is then
``proxy - server - client``. Within every run, the instructions of each shared object are also
counted (self cost by ELF object): the interpreter (all Python code), uvloop (the event loop's C
code) plus ``_asyncio`` (C futures and tasks), httptools, aiohttp's C parser, onnxruntime, libc.

    PYTHONPATH=src python benchmarks/bench_layers.py --build new=src --build base=/tmp/wt-base/src
        [--stream] [--n 200] [--warm 50]

Needs valgrind and nginx. Not a timed test: counts are nearly deterministic (~0.3% between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The headers the proxy forwards for bench_instructions.py's httpx client (less hop-by-hop ones).
FORWARDED = [("accept", "*/*"), ("accept-encoding", "gzip, deflate"), ("user-agent", "python-httpx/0.28.1"),
             ("content-type", "application/json")]  # fmt: skip


def body(stream: bool) -> bytes:
    payload: dict[str, Any] = {"model": "bench", "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1}
    if stream:
        payload["stream"] = True
    return json.dumps(payload).encode()


# --- the runs (each in its own process under callgrind) ---------------------------------------


def run_client(upstream_url: str, stream: bool) -> None:
    """The client alone: waits for a line on stdin between warm-up, counted requests and exit."""
    import uvloop

    from clairvoyant.proxy.upstream import Upstream

    data = body(stream)

    async def requests(upstream: Upstream, n: int) -> None:
        for _ in range(n):
            response = await upstream.open(
                "POST", "/v1/chat/completions", headers=FORWARDED, body=data, close_connection=stream
            )
            try:
                async for _chunk in upstream.iter_body(response):
                    pass
            finally:
                await response.aclose()
            if response.status_code != 200:
                raise RuntimeError(f"status {response.status_code}")

    async def main() -> None:
        upstream = Upstream(upstream_url)
        loop = asyncio.get_running_loop()
        try:
            for _ in range(3):  # warm, counted, then exit
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line.strip():
                    return
                await requests(upstream, int(line))
                print("done", flush=True)
        finally:
            await upstream.aclose()

    uvloop.run(main())


def run_server(port: int) -> None:
    """The proxy's server answering the fixed JSON itself (no product, no client). Builds whose
    ``build_server`` takes an ASGI app (before the proxy's own connection, 2026-11-26) get a raw
    ASGI app; later ones a minimal site that the connection serves directly."""
    import inspect

    from profile_request_path import ANSWER

    from clairvoyant.config import Settings
    from clairvoyant.proxy import server

    answer = ANSWER.encode()
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]}  # fmt: skip

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        if scope["path"] == "/healthz":
            await send({**start, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await send(start)
        await send({"type": "http.response.body", "body": answer})

    class FixedSite:
        """What the proxy's connection serves: every request answered the fixed JSON, as the app does."""

        asgi = staticmethod(app)  # the lifespan
        parking = None
        metrics = None

        def route(self, method: str, path: str) -> int:
            return 0  # connection.NATIVE

        def serve(self, conn: Any, request: Any) -> None:
            body = b"ok" if request.path == "/healthz" else answer
            conn.respond(200, [(b"content-type", b"application/json")], body)

        def upload_lost(self, request: Any) -> None:
            pass

        def too_large(self, request: Any, error: Any) -> None:
            pass

    site: Any = FixedSite() if "connection" in inspect.getsource(server) else app
    settings = Settings(upstream_url="http://127.0.0.1:9", port=port, log_level="warning")
    server.build_server(site, settings, host="127.0.0.1", port=port, log_level="warning").run()


# --- the driver --------------------------------------------------------------------------------


def objects(callgrind_file: str) -> dict[str, int]:
    """Self instructions per ELF object in a callgrind dump (call lines' inclusive costs skipped)."""
    names: dict[str, str] = {}
    totals: dict[str, int] = defaultdict(int)
    current = "?"
    after_call = False
    compressed = re.compile(r"\((\d+)\)(?: (.*))?")

    def name_of(spec: str) -> str:
        m = compressed.match(spec)
        if m is None:
            return spec
        if m[2] is not None:
            names[m[1]] = m[2]
        return names.get(m[1], spec)

    for line in Path(callgrind_file).read_text().splitlines():
        if line.startswith("ob="):
            current = name_of(line[3:])
        elif line.startswith("cob="):
            name_of(line[4:])  # defines a compressed name, if new
        elif line.startswith("calls="):
            after_call = True
        elif line and (line[0].isdigit() or line[0] in "+-*"):
            if after_call:
                after_call = False
                continue
            parts = line.split()
            if len(parts) >= 2:
                totals[current] += int(parts[1])
    return dict(totals)


def category(obj: str) -> str:
    base = os.path.basename(obj)
    if "/uvloop/" in obj:
        return "uvloop"
    if "/httptools/" in obj:
        return "httptools"
    if "/aiohttp/" in obj:
        return "aiohttp C"
    if "onnxruntime" in obj:
        return "onnxruntime"
    if base.startswith("_asyncio"):
        return "_asyncio"
    if base.startswith(("libpython", "python")):
        return "interpreter"
    if base.startswith(("libc.so", "libc-")):
        return "libc"
    return "other"


def callgrind(argv: list[str], out: Path, env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no", *argv],
        env={**os.environ, **env}, text=True, **kw,
    )  # fmt: skip


def last_dump(out: Path) -> str:
    dumps = sorted((f for f in glob.glob(f"{out}.*") if not f.endswith(".log")), key=os.path.getmtime)
    return dumps[0]


def measure_client(pythonpath: str, upstream: str, args: argparse.Namespace, out: Path) -> dict[str, int]:
    argv = [sys.executable, __file__, "--run", "client", "--upstream", upstream] + (["--stream"] if args.stream else [])
    proc = callgrind(argv, out, {"PYTHONPATH": pythonpath}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(f"{args.warm}\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        time.sleep(0.5)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        proc.stdin.write(f"{args.n}\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return objects(last_dump(out))


def measure_http(argv: list[str], port: int, pythonpath: str, args: argparse.Namespace, out: Path) -> dict[str, int]:
    """A server under callgrind, driven one request at a time as bench_instructions.py does."""
    import httpx
    from bench_instructions import drive

    data = body(args.stream)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def request(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(url, content=data, headers={"content-type": "application/json"})

    with open(f"{out}.log", "w") as log:
        proc = callgrind(argv, out, {"PYTHONPATH": pythonpath}, stdout=log, stderr=log)
        try:
            drive(proc, port, request, warm=args.warm, n=args.n)
        finally:
            proc.terminate()
            proc.wait(120)
    return objects(last_dump(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", metavar="NAME=PYTHONPATH")
    parser.add_argument(
        "--stream", action="store_true", help="a streamed request (SSE answer; the client asks to close)"
    )
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--warm", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--run", choices=("client", "server"), help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run == "client":
        run_client(args.upstream, args.stream)
        return 0
    if args.run == "server":
        run_server(args.port)
        return 0

    import servers
    from profile_request_path import ANSWER, SSE

    from clairvoyant.tools.bench.request_path import nginx_fixed_answer_conf

    servers.require_tools("nginx", "valgrind")
    builds = dict(b.split("=", 1) for b in args.build or ["new=src"])
    backend_port = servers.free_port()

    def render(prefix: Path) -> str:
        conf = nginx_fixed_answer_conf(prefix, backend_port, SSE if args.stream else ANSWER)
        return (
            conf.replace("default_type application/json;", "default_type text/event-stream;") if args.stream else conf
        )

    first_path = next(iter(builds.values()))
    with tempfile.TemporaryDirectory(prefix="bench-layers-") as tmp, servers.nginx(render, backend_port):
        upstream = f"http://127.0.0.1:{backend_port}"
        jobs: dict[str, Any] = {}
        for name, path in builds.items():
            port = servers.free_port()
            proxy_argv = [sys.executable, "-m", "clairvoyant.cli", "serve", "--upstream", upstream, "--port", str(port),
                          "--slots", "64", "--max-queue", "10000", "--log-level", "warning"]  # fmt: skip
            jobs[f"proxy {name}"] = (measure_http, proxy_argv, port, path)
            jobs[f"client {name}"] = (measure_client, path)
        server_port = servers.free_port()
        jobs["server"] = (measure_http, [sys.executable, __file__, "--run", "server", "--port", str(server_port)],
                          server_port, first_path)  # fmt: skip

        def run(item: tuple[str, Any]) -> tuple[str, dict[str, int]]:
            label, job = item
            out = Path(tmp) / (label.replace(" ", "-") + ".callgrind")
            if job[0] is measure_client:
                return label, measure_client(job[1], upstream, args, out)
            return label, measure_http(job[1], job[2], job[3], args, out)

        with ThreadPoolExecutor(args.parallel) as pool:
            results = dict(pool.map(run, jobs.items()))

    per_request = {label: {obj: count / args.n for obj, count in objs.items()} for label, objs in results.items()}
    cats = ["interpreter", "uvloop", "_asyncio", "httptools", "aiohttp C", "onnxruntime", "libc", "other"]
    print(f"\ninstructions per request ({'streamed' if args.stream else 'JSON'} answer, one at a time, n={args.n})\n")
    print("| run | total | " + " | ".join(cats) + " |")
    print("|---|---:|" + "---:|" * len(cats))
    summary: dict[str, Any] = {"stream": args.stream, "n": args.n, "runs": {}}
    for label, objs in per_request.items():
        by_cat: dict[str, float] = defaultdict(float)
        for obj, count in objs.items():
            by_cat[category(obj)] += count
        total = sum(objs.values())
        summary["runs"][label] = {"total": total, "by_category": dict(by_cat), "by_object": objs}
        print(f"| {label} | {total:,.0f} | " + " | ".join(f"{by_cat.get(c, 0):,.0f}" for c in cats) + " |")
    server = summary["runs"]["server"]["total"]
    print()
    for name in builds:
        proxy = summary["runs"][f"proxy {name}"]["total"]
        client = summary["runs"][f"client {name}"]["total"]
        product = proxy - server - client
        summary[name] = {"proxy": proxy, "server": server, "client": client, "product": product}
        print(
            f"{name}: proxy {proxy:,.0f} = server {server:,.0f} + client {client:,.0f} + product (the rest) {product:,.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
