"""clairvoyant.tools.bench end to end: the runner, the client and the report against real servers."""

from __future__ import annotations

import asyncio
import csv
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from httpx_transport import HttpxTransport

from clairvoyant.config import Settings
from clairvoyant.tools.bench.client import RequestSpec, send
from clairvoyant.tools.bench.prompt_set import BenchPrompt
from clairvoyant.tools.bench.report import write_outputs
from clairvoyant.tools.bench.runner import CONDITIONS, BenchConfig, proxy_server, run_cells
from clairvoyant.tools.bench.workload import burst

if TYPE_CHECKING:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer


def _prompts() -> list[BenchPrompt]:
    texts = {"short": "What is 2 + 2?", "long": "Write a long essay about the history of Rome."}
    return [
        BenchPrompt(f"{cls}{i}:0", tokens, cls, len(texts[cls]), "-", text=texts[cls])
        for i, (cls, tokens) in enumerate([("short", 20), ("short", 40), ("long", 700), ("long", 650)])
    ]


def test_burst_through_every_condition_writes_the_right_rows(llama_server: EmbeddedLlamaServer, tmp_path: Path) -> None:
    specs = burst(_prompts(), n_short=1, n_long=1, length_scale=0.01, seed=0)  # 1 and 7 forced tokens
    config = BenchConfig(backend_url=llama_server.base_url)
    rows = run_cells(config, [("burst", None, 0, specs), ("burst", None, 1, specs)], progress=False)

    assert len(rows) == 2 * len(CONDITIONS) * 2
    assert all(r["ok"] for r in rows), [r["error"] for r in rows if not r["ok"]]
    # llama.cpp honoured n_predict + ignore_eos: the exact forced length, never max_tokens.
    assert all(r["completion_tokens"] == r["n_predict"] for r in rows)
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in rows)
    # Conditions rotate: run 1 starts with the second condition.
    first = {r["run"]: r["condition"] for r in rows if r["position"] == 0}
    assert first == {0: CONDITIONS[0], 1: CONDITIONS[1]}

    paths = write_outputs(rows, tmp_path, meta={"test": True}, plots=False)
    with paths["requests.csv"].open() as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
    with paths["summary.csv"].open() as fh:
        cells = list(csv.DictReader(fh))
    assert {(c["condition"], c["class"]) for c in cells} == {(c, k) for c in CONDITIONS for k in ("short", "long")}
    assert all(c["runs"] == "2" for c in cells)
    assert {c["n"] for c in cells} == {"2"}
    summary = json.loads(paths["summary.json"].read_text())
    assert summary["meta"] == {"test": True} and len(summary["cells"]) == len(cells)
    assert {r["condition"] for r in summary["reductions_vs_fcfs"]} == {"direct", "sjf", "oracle"}
    assert "#### Burst" in paths["summary.md"].read_text()


def test_oracle_field_and_true_length_never_reach_the_backend() -> None:
    seen: list[dict] = []

    def backend(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))

        async def sse() -> AsyncIterator[bytes]:
            yield b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=sse(), headers={"content-type": "text/event-stream"})

    spec = RequestSpec(index=0, key="k:0", cls="long", answer_tokens=777, n_predict=78, prompt_chars=5, text="hello")
    settings = Settings(upstream_url="http://backend.invalid", policy="sjf", allow_oracle=True)

    async def go(url: str) -> None:
        async with httpx.AsyncClient() as client:
            result = await send(client, url, spec, dialect="openai", model="m", oracle=True, origin=time.perf_counter())
        assert result.ok and result.ttft_s is not None

    with proxy_server(settings, upstream_transport=HttpxTransport(httpx.MockTransport(backend))) as url:
        asyncio.run(go(url))
    [body] = seen
    assert "clairvoyant" not in body and "max_tokens" not in body
    assert body["n_predict"] == 78 and body["ignore_eos"] is True
    assert "777" not in json.dumps(body)


def test_a_hidden_forced_length_reaches_the_backend_but_not_the_predictor() -> None:
    """The forced length (n_predict) would be a cap the predictor obeys: the benchmark hides it."""
    from clairvoyant.tools.bench.client import build_body

    seen: list[dict] = []

    def backend(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))

        async def answer() -> AsyncIterator[bytes]:
            yield b'{"choices": [{"message": {"content": "hi"}}]}'

        return httpx.Response(200, content=answer(), headers={"content-type": "application/json"})

    spec = RequestSpec(
        index=0,
        key="k:0",
        cls="short",
        answer_tokens=20,
        n_predict=3,
        prompt_chars=5,
        text="Write a detailed 2000-word essay on the history of the Roman Empire.",
    )
    settings = Settings(upstream_url="http://backend.invalid", policy="sjf", bench_upstream_fields=True)
    with proxy_server(settings, upstream_transport=HttpxTransport(httpx.MockTransport(backend))) as url:
        predicted = {}
        for hide in (False, True):
            body = build_body(spec, "openai", model="m", hide_length=hide) | {"stream": False}
            r = httpx.post(f"{url}/v1/chat/completions", json=body)
            assert r.status_code == 200
            predicted[hide] = float(r.headers["x-clairvoyant-predicted-tokens"])
    assert predicted[False] == 3.0  # seen as the client's cap
    assert predicted[True] > 100  # hidden: the predictor's own view of an essay
    for body in seen:  # either way the backend gets the forced length, and nothing of the proxy's
        assert body["n_predict"] == 3 and body["ignore_eos"] is True and "clairvoyant" not in body
