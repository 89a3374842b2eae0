"""End to end: the proxy in front of a POOL of two real llama.cpp servers.

Two ``EmbeddedLlamaServer`` (SmolLM2, one slot and one thread each), the proxy in-process on real
its server (``proxy_harness.running_proxy``). Output lengths are forced with ``max_tokens`` +
``ignore_eos``, so each backend's ``llamacpp:tokens_predicted_total`` says exactly what it generated.
A backend is killed with SIGKILL, as a crash would: no goodbye on any connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from polling import until
from proxy_harness import queue_snapshot, running_proxy

from clairvoyant.config import Settings

if TYPE_CHECKING:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

CHAT = "/v1/chat/completions"
BACKEND_HEADER = "x-clairvoyant-backend"
SHORT = 8  # tokens of each queued request
HOLDER = 80  # tokens of the request that keeps the survivor busy through the kill (~2 s)
VICTIM = 400  # tokens of the request killed mid-generation (~10 s: it never finishes on its own)
QUIET: dict[str, Any] = {"log_level": "warning"}


@contextlib.contextmanager
def two_llama_servers() -> Iterator[tuple[EmbeddedLlamaServer, EmbeddedLlamaServer]]:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

    with EmbeddedLlamaServer(n_parallel=1, n_threads=1) as a, EmbeddedLlamaServer(n_parallel=1, n_threads=1) as b:
        yield a, b


def tokens_predicted(server: EmbeddedLlamaServer) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total "):
            return float(line.split()[1])
    raise AssertionError("llamacpp:tokens_predicted_total not in llama.cpp /metrics")


def chat_body(text: str, tokens: int, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def sse_events(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


@dataclass
class Answer:
    """What the client got for one request."""

    status: int
    backend: str | None
    text: str
    stream: bool

    @property
    def completion_tokens(self) -> int | None:
        if not self.stream:
            return int(json.loads(self.text)["usage"]["completion_tokens"]) if self.status == 200 else None
        usage = [json.loads(e).get("usage") for e in sse_events(self.text) if e != "[DONE]"]
        counts = [u["completion_tokens"] for u in usage if u]
        return counts[-1] if counts else None

    @property
    def ended_with_done(self) -> bool:
        events = sse_events(self.text)
        return bool(events) and events[-1] == "[DONE]"


async def ask(
    client: httpx.AsyncClient,
    url: str,
    request_id: str,
    tokens: int,
    *,
    stream: bool,
    first_text: asyncio.Event | None = None,
) -> Answer:
    """One request read to its end; ``first_text`` is set once the first SSE event arrives."""
    body = chat_body(f"Tell me about the number {tokens}.", tokens, stream=stream)
    async with client.stream("POST", f"{url}{CHAT}", json=body, headers={"x-request-id": request_id}) as response:
        parts = []
        async for chunk in response.aiter_text():
            parts.append(chunk)
            if first_text is not None and "data:" in chunk:
                first_text.set()
        return Answer(response.status_code, response.headers.get(BACKEND_HEADER), "".join(parts), stream)


def in_flight(url: str) -> dict[str, dict[str, Any]]:
    return {e["request_id"]: e for e in queue_snapshot(url)["in_flight"]}


# --------------------------------------------------------------------------------------------
# (a) spreading
# --------------------------------------------------------------------------------------------


def test_a_burst_is_spread_over_both_backends_and_each_request_answered_once_in_full(
    require_embedded_backend: None,
) -> None:
    with two_llama_servers() as (a, b):
        names = {"backend-1": a, "backend-2": b}  # the default names: backend-N, N its place in the list
        before = {name: tokens_predicted(server) for name, server in names.items()}
        settings = Settings(backends=[{"url": a.base_url}, {"url": b.base_url}], **QUIET)
        with running_proxy(settings) as url:

            async def burst() -> list[Answer]:
                async with httpx.AsyncClient(timeout=120) as client:
                    return list(
                        await asyncio.gather(
                            *(ask(client, url, f"spread-{i}", SHORT, stream=i % 2 == 0) for i in range(6))
                        )
                    )

            answers = asyncio.run(burst())
        generated = {name: tokens_predicted(server) - before[name] for name, server in names.items()}

    assert [a.status for a in answers] == [200] * 6
    assert [a.completion_tokens for a in answers] == [SHORT] * 6
    assert all(a.ended_with_done for a in answers if a.stream)
    served = Counter(a.backend for a in answers)
    assert set(served) == set(names), served  # both backends answered, under their default names
    # Each backend generated exactly the answers that name it: none was sent twice.
    assert generated == {name: SHORT * served[name] for name in names}, (generated, served)


# --------------------------------------------------------------------------------------------
# (b), (c) SIGKILL one backend with a request in flight on it and four more queued
# --------------------------------------------------------------------------------------------


@dataclass
class AfterKill:
    stream: bool  # was the killed request streamed
    victim: Answer
    holder: Answer
    queued: list[Answer]
    survivor: str  # backend names as configured
    killed: str
    queued_at_kill: int  # waiting requests when the backend died
    survivor_generated: float  # the survivor's tokens_predicted_total delta
    queue: dict[str, Any] = field(default_factory=dict)  # /queue once everything ended
    metrics: list[str] = field(default_factory=list)  # the proxy's clairvoyant_backend_* lines


@pytest.fixture(scope="module", params=[True, False], ids=["streamed-victim", "non-streamed-victim"])
def after_kill(request: pytest.FixtureRequest, require_embedded_backend: None) -> AfterKill:
    """Victim request (VICTIM tokens) on one backend, a holder (HOLDER tokens) on the other, four
    SHORT requests queued; then the victim's backend is SIGKILLed mid-generation."""
    stream: bool = request.param
    with two_llama_servers() as (a, b):
        servers = {"alpha": a, "beta": b}
        settings = Settings(
            backends=[{"url": a.base_url, "name": "alpha"}, {"url": b.base_url, "name": "beta"}],
            backend_wait_s=5,  # bounds the test if a dead backend were waited for instead of skipped
            **QUIET,
        )
        with running_proxy(settings) as url:

            async def scenario() -> AfterKill:
                async with httpx.AsyncClient(timeout=120) as client:
                    first_text = asyncio.Event()
                    victim = asyncio.create_task(
                        ask(client, url, "victim", VICTIM, stream=stream, first_text=first_text if stream else None)
                    )
                    await until(lambda: "victim" in in_flight(url), timeout_s=30, what="the victim in flight")
                    killed = in_flight(url)["victim"]["backend"]
                    survivor = next(name for name in servers if name != killed)
                    before = tokens_predicted(servers[survivor])
                    holder = asyncio.create_task(ask(client, url, "holder", HOLDER, stream=False))
                    await until(lambda: "holder" in in_flight(url), timeout_s=30, what="the holder in flight")
                    assert in_flight(url)["holder"]["backend"] == survivor  # the idle backend got it
                    queued = [
                        asyncio.create_task(ask(client, url, f"queued-{i}", SHORT, stream=i % 2 == 0)) for i in range(4)
                    ]
                    await until(
                        lambda: queue_snapshot(url)["waiting_count"] == 4, timeout_s=30, what="four requests queued"
                    )
                    if stream:
                        await first_text.wait()  # its 200 and first event have reached the client
                    else:
                        await until(
                            lambda: in_flight(url)["victim"]["running_s"] >= 0.5,
                            timeout_s=30,
                            what="the victim generating",
                        )
                    waiting = queue_snapshot(url)["waiting_count"]
                    assert not holder.done(), "the holder ended before the kill; make HOLDER longer"
                    pid = servers[killed].pid
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
                    answers = await asyncio.gather(victim, holder, *queued)
                    await until(lambda: not in_flight(url), timeout_s=30, what="nothing in flight")
                    metrics = [
                        line
                        for line in httpx.get(f"{url}/metrics").text.splitlines()
                        if line.startswith("clairvoyant_backend_")
                    ]
                    return AfterKill(
                        stream=stream,
                        victim=answers[0],
                        holder=answers[1],
                        queued=list(answers[2:]),
                        survivor=survivor,
                        killed=killed,
                        queued_at_kill=waiting,
                        survivor_generated=tokens_predicted(servers[survivor]) - before,
                        queue=queue_snapshot(url),
                        metrics=metrics,
                    )

            return asyncio.run(scenario())


def test_b_the_request_in_flight_on_a_killed_backend_ends_with_the_dialects_error(after_kill: AfterKill) -> None:
    victim = after_kill.victim
    if after_kill.stream:
        assert victim.status == 200  # the stream had started: the status cannot change any more
        last = sse_events(victim.text)[-1]
        assert last != "[DONE]", victim.text[-300:]
        assert "error" in json.loads(last), victim.text[-300:]
    else:
        assert victim.status == 502, victim.text
        assert json.loads(victim.text)["error"]["message"], victim.text


def test_b_queued_requests_are_served_by_the_survivor_once_and_in_full(after_kill: AfterKill) -> None:
    assert after_kill.queued_at_kill == 4
    everyone_else = [after_kill.holder, *after_kill.queued]
    assert [a.status for a in everyone_else] == [200] * 5, [a.text[:200] for a in everyone_else]
    assert [a.backend for a in everyone_else] == [after_kill.survivor] * 5
    assert [a.completion_tokens for a in everyone_else] == [HOLDER] + [SHORT] * 4
    assert all(a.ended_with_done for a in after_kill.queued if a.stream)
    # The survivor generated exactly the holder and the four queued answers: the killed request was
    # not sent to it again, and nothing was generated twice.
    assert after_kill.survivor_generated == HOLDER + 4 * SHORT
    # One finished record per request in the proxy's own history.
    finished = Counter(e["request_id"] for e in after_kill.queue["recent"])
    assert finished == Counter({"victim": 1, "holder": 1, **{f"queued-{i}": 1 for i in range(4)}}), finished


def test_c_queue_shows_both_backends_with_the_killed_one_unhealthy(after_kill: AfterKill) -> None:
    backends = {b["name"]: b for b in after_kill.queue["backends"]}
    assert set(backends) == {"alpha", "beta"}
    assert backends[after_kill.killed]["healthy"] is False
    assert backends[after_kill.survivor]["healthy"] is True
    assert all(b["in_flight"] == 0 for b in backends.values())
    health = {
        name: float(line.rsplit(" ", 1)[1])
        for line in after_kill.metrics
        if line.startswith("clairvoyant_backend_healthy{")
        for name in backends
        if f'backend="{name}"' in line
    }
    assert health == {after_kill.killed: 0.0, after_kill.survivor: 1.0}, after_kill.metrics
