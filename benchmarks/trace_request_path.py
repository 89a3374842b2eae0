"""The modules one scheduled request passes, from the proxy's entry to the backend call, traced.

The app runs in this process (its ASGI callable, its lifespan) in front of the fake backend
(harness/fake_backend.py); after a few untraced requests, one POST /v1/chat/completions is traced
with ``sys.setprofile``. Every Python call in a ``clairvoyant`` module, from ``ProxyApp.__call__``
until the backend call (``Upstream.open``), adds its module to the path unless the path is already
there; a *return* is a step into a module the path had left before. Fewer returns: a request's
state travels whole instead of being fetched back from where it was left.

    python benchmarks/trace_request_path.py [--baseline-src OTHER/src] [--path]

Each tree runs in its own process (PYTHONPATH=<tree>/src); --path prints every step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "/clairvoyant/"
BODY = json.dumps({"model": "fast", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}).encode()


def returns(path: list[str]) -> int:
    """Steps of ``path`` into a module it had left before (consecutive repeats are one step)."""
    seen: set[str] = set()
    count = 0
    for module in path:
        count += module in seen
        seen.add(module)
    return count


async def trace_one() -> list[str]:
    """The path of one traced request through the app in this process's tree."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness.fake_backend import FakeBackend

    from clairvoyant.config import Settings
    from clairvoyant.proxy.app import create_app

    backend = FakeBackend().start()
    app = create_app(Settings(upstream_url=backend.base_url, encoder=False))
    startup: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    started: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await startup.put({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, startup.get, started.put))
    assert (await started.get())["type"] == "lifespan.startup.complete"

    async def one(profile: Callable[[FrameType, str, Any], None] | None) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                (b"content-length", str(len(BODY)).encode()),
            ],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "root_path": "",
        }  # fmt: skip
        read = asyncio.Event()
        answered = asyncio.Event()
        status: list[int] = []

        async def receive() -> dict[str, Any]:
            if not read.is_set():
                read.set()
                return {"type": "http.request", "body": BODY, "more_body": False}
            await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                answered.set()

        call: Callable[..., Awaitable[None]] = app
        sys.setprofile(profile)
        try:
            await call(scope, receive, send)
        finally:
            sys.setprofile(None)
        assert status == [200], status

    for _ in range(5):  # first use: lazy imports, connections, caches
        await one(None)
    path: list[str] = []
    done = False

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal done
        filename = frame.f_code.co_filename
        if done or event != "call" or PACKAGE not in filename:
            return
        module = "clairvoyant." + filename.rsplit(PACKAGE, 1)[1].removesuffix(".py").replace("/", ".")
        if not path or path[-1] != module:
            path.append(module)
        if frame.f_code.co_name == "open" and module == "clairvoyant.proxy.upstream":
            done = True  # the backend call

    await one(profile)
    await startup.put({"type": "lifespan.shutdown"})
    await lifespan
    backend.stop()
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", type=Path, help="another tree's src/ to trace beside this one")
    parser.add_argument("--path", action="store_true", help="print every step of the path")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(trace_one())))
        return 0
    trees = {"this tree": ROOT / "src"}
    if args.baseline_src is not None:
        trees["baseline"] = args.baseline_src.resolve()
    print("| tree | steps | modules | returns to a module left |")
    print("|---|---:|---:|---:|")
    paths = {}
    for name, src in trees.items():
        env = {**os.environ, "PYTHONPATH": str(src)}
        done = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        path = paths[name] = json.loads(done.stdout.splitlines()[-1])
        print(f"| {name} | {len(path)} | {len(set(path))} | {returns(path)} |")
    if args.path:
        for name, path in paths.items():
            print(f"\n{name}:\n  " + "\n  ".join(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
