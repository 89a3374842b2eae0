"""The floor of the serving stack: a bare FastAPI + httpx streaming pass-through, no scheduling.

Run beside the real proxy by bench_proxy_overhead.py, so the proxy's added latency can be split
into what the stack (uvicorn, FastAPI, httpx) costs on this machine and what Clairvoyant adds.

Routes: POST /v1/chat/completions (streamed through) and GET on any path (buffered).

    python benchmarks/harness/passthrough.py UPSTREAM_URL PORT
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse


def build(upstream: str) -> FastAPI:
    app = FastAPI()
    # A keep-alive pool as large as the throughput benchmark's 64 clients: the floor reuses connections.
    client = httpx.AsyncClient(
        base_url=upstream, timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
    )

    async def send_fresh_if_stale(req: httpx.Request) -> httpx.Response:
        # llama.cpp's server closes some keep-alive connections after a streamed answer without saying
        # so; nothing was answered, so send again on a fresh connection (as Clairvoyant and nginx do).
        for _ in range(2):
            try:
                return await client.send(req, stream=True)
            except httpx.RemoteProtocolError:
                continue
        return await client.send(req, stream=True)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.body()
        req = client.build_request(
            "POST", "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        response = await send_fresh_if_stale(req)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(
            relay(), status_code=response.status_code, media_type=response.headers.get("content-type")
        )

    @app.get("/{path:path}")
    async def get(path: str, request: Request) -> Response:
        """A buffered GET pass-through (/v1/models, /api/tags), the floor of the proxy's pass-through path."""
        response = await client.get(f"/{path}", params=request.query_params)
        return Response(
            response.content, status_code=response.status_code, media_type=response.headers.get("content-type")
        )

    return app


if __name__ == "__main__":
    uvicorn.run(build(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
