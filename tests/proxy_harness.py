"""Helpers for proxy tests. The proxy runs on its real server (Granian) in a background thread
(``clairvoyant.tools.bench.runner.proxy_server``, which the benchmarks use too): streaming and
disconnects need a real server, since httpx.ASGITransport buffers whole bodies."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import respx
from httpx_transport import HttpxTransport
from polling import until, wait_until  # noqa: F401 (wait_until re-exported)

from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import Prediction
from clairvoyant.tools.bench.runner import proxy_server as running_proxy  # noqa: F401 (re-exported)


class MarkerPredictor:
    """Test double for the ONNX predictor: the prompt says what it is ("[short]", "[long]", or
    "[p=0.37]"), so tests decide the order the queue must produce. Everything else is 0.5.
    Scored like a class model (key P(Long)), capped by the request's own cap."""

    def predict(self, prompt: Prompt, *, model: str | None = None, cap_tokens: int | None = None) -> Prediction:
        text = prompt.instruction
        if "[short]" in text:
            probs = (0.9, 0.08, 0.02)
        elif "[long]" in text:
            probs = (0.02, 0.08, 0.9)
        elif "[p=" in text:
            p = float(text.split("[p=", 1)[1].split("]", 1)[0])
            probs = ((1 - p) / 2, (1 - p) / 2, p)
        else:
            probs = (0.25, 0.25, 0.5)
        return Prediction.from_probabilities(*probs, model=model, cap_tokens=cap_tokens)


# The helpers' own requests share one client. httpx.get() builds a client, and with it an SSL
# context from the CA bundle (~50 ms of CPU), on every call, while these helpers poll plain HTTP on
# the loopback many times a test. No keep-alive: a helper's request never holds a connection that a
# test counts or fills.
LOOPBACK = httpx.Client(timeout=30.0, limits=httpx.Limits(max_keepalive_connections=0))


def queue_snapshot(base_url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    return LOOPBACK.get(f"{base_url}/queue", headers=headers).json()


def answering(base_url: str) -> bool:
    """Whether the proxy at ``base_url`` answers /healthz (a process still starting does not)."""
    try:
        return LOOPBACK.get(f"{base_url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


async def gate_wait(gate: threading.Event, timeout_s: float = 60.0) -> None:
    """Await a threading.Event from the server's loop without blocking it (a test opens its gates
    within seconds; ``timeout_s`` only keeps a forgotten one from hanging the suite)."""
    await until(gate.is_set, timeout_s, what="the test to open the gate")


async def broken_sse(gate: threading.Event | None = None) -> AsyncIterator[bytes]:
    """A backend's event stream that sends one event, then (once ``gate`` is set, if given) dies
    with a connection reset."""
    yield b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    if gate is not None:
        await gate_wait(gate)
    raise httpx.ReadError("connection reset")


def mock_transport(router: respx.MockRouter) -> HttpxTransport:
    """The proxy's transport to ``router``'s mocked backends. respx pre-reads plain-bytes
    responses; a real backend's body is unread when headers arrive, so hand the proxy an unread copy."""

    async def handler(request: httpx.Request) -> httpx.Response:
        response = await router.async_handler(request)
        if response.is_stream_consumed:
            return httpx.Response(
                response.status_code, headers=response.headers, stream=httpx.ByteStream(response.content)
            )
        return response

    return HttpxTransport(httpx.MockTransport(handler))


def metric_value(base: str, name: str, labels: str = "") -> float:
    for line in LOOPBACK.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + (("{" + labels + "}") if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name}{{{labels}}} not found")


class HeldBackend:
    """A mocked serial backend that records the order requests reach it and holds the first one
    until released."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.gate = threading.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.order.append(body["messages"][-1]["content"])
        await gate_wait(self.gate)
        return httpx.Response(200, json={"ok": True})


class BackgroundPosts(threading.Thread):
    """Chat requests POSTed to the proxy together, from a background thread (so a test can watch
    the queue while they wait). ``responses`` is filled once the thread is joined."""

    def __init__(self, base: str, *texts: str) -> None:
        super().__init__(daemon=True)
        self.base, self.texts = base, texts
        self.responses: list[httpx.Response] = []
        self.start()

    def run(self) -> None:
        async def post_all() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                return await asyncio.gather(
                    *(
                        client.post(
                            f"{self.base}/v1/chat/completions", json={"messages": [{"role": "user", "content": t}]}
                        )
                        for t in self.texts
                    )
                )

        self.responses = asyncio.run(post_all())
