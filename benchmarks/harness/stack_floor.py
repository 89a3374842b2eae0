"""The floor of the proxy's own stack: Granian embedded as the proxy runs it, a plain ASGI callable
and aiohttp's client, with nothing of Clairvoyant (no checks, prediction, queue or bookkeeping).

Run beside the proxy by bench_proxy_overhead.py and bench_proxy_throughput.py: the proxy's row
minus this one is what Clairvoyant's own work costs; this row minus direct is what the server and
the client cost on this machine.

Every request is relayed to the same path on the backend: a POST's body whole, the answer streamed
back as it arrives.

    python benchmarks/harness/stack_floor.py UPSTREAM_URL PORT
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.server.embed import Server

RESENDS = 2  # llama.cpp closes some idle keep-alive connections unannounced; nothing was read: send again


def build(upstream: str) -> Any:
    session: aiohttp.ClientSession | None = None

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            if session is not None:
                await session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if session is None:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0), auto_decompress=False
            )
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        headers = {"content-type": "application/json"} if body else {}
        for attempt in range(RESENDS + 1):
            try:
                response = await session.request(
                    scope["method"], upstream + scope["path"], data=body or None, headers=headers
                )
                break
            except aiohttp.ServerDisconnectedError:
                if attempt == RESENDS:
                    raise
        async with response:
            head = [(b"content-type", response.headers.get("content-type", "").encode())]
            await send({"type": "http.response.start", "status": response.status, "headers": head})
            while chunk := await response.content.readany():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def serve(upstream: str, port: int) -> None:
    # The proxy's own server settings (src/clairvoyant/proxy/server.py).
    server = Server(
        build(upstream), address="127.0.0.1", port=port, interface=Interfaces.ASGI, http=HTTPModes.http1,
        websockets=False, runtime_threads=1, backlog=1024,
        http1_settings=HTTP1Settings(header_read_timeout=30_000, keep_alive=True), log_enabled=False,
    )  # fmt: skip
    await server.serve()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
