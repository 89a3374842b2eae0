"""Usage extraction (clairvoyant.prediction.usage): what the backend really produced, read from the relayed
answer without buffering it.

- Real llama.cpp (the `llama_server` fixture): every scheduled endpoint, streamed and not, with the
  output length forced by max_tokens + ignore_eos; the raw bytes are fed to the tap in several
  chunkings, and the same answers go through the proxy, whose /metrics must count them.
- Ollama (cannot run here): the recorded-format bodies in tests/fixtures/ollama/, fed to the tap
  directly and served through the proxy by respx.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from hypothesis import given, settings
from hypothesis import strategies as st
from proxy_harness import MarkerPredictor, metric_value, mock_transport, running_proxy

from clairvoyant.config import Settings
from clairvoyant.prediction.usage import TAIL_BYTES, Usage, UsageTap
from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

FIXTURES = Path(__file__).parent / "fixtures" / "ollama"
NDJSON = "application/x-ndjson"
JSON = "application/json; charset=utf-8"
SSE = "text/event-stream"


def chunkings(body: bytes, seed: int = 0) -> Iterator[list[bytes]]:
    """The same body split the ways a network may split it: whole, byte by byte, random cuts."""
    yield [body]
    yield [body[i : i + 1] for i in range(len(body))]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(body)), min(40, len(body) - 1))) if len(body) > 1 else []
    yield [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]


def tap_all(content_type: str, chunks: list[bytes], request_model: str | None = "requested") -> Usage:
    tap = UsageTap(content_type)
    for chunk in chunks:
        tap.feed(chunk)
    return tap.usage(wall_s=1.25, request_model=request_model)


# --- Ollama: recorded-format bodies ---------------------------------------------------------------

OLLAMA_CASES = {
    # file: (content type, output tokens, prompt tokens, generation s, prompt s, model, stream events)
    "chat_stream.ndjson": (NDJSON, 41, 31, 1.937, 0.148, "llama3.2:3b", 41),
    "chat_stream_cold.ndjson": (NDJSON, 41, 31, 1.937, 0.148, "llama3.2:3b", 41),
    "chat_thinking_stream.ndjson": (NDJSON, 15, 12, 0.64, 0.05, "qwen3:4b", 15),
    # The final object's `context` is longer than the tail: its `model` is cut off, the request's is used.
    "generate_stream.ndjson": (NDJSON, 57, 2943, 3.498, 1.65, "requested", 57),
    "chat.json": (JSON, 4000, 18, 98.412, 0.091, "requested", 0),
    "generate.json": (JSON, 12, 40, 0.701, 0.12, "qwen2.5:7b", 0),
}


@pytest.mark.parametrize("name", sorted(OLLAMA_CASES))
def test_ollama_final_counts_are_read_from_the_tail_in_any_chunking(name: str) -> None:
    content_type, output, prompt, generation_s, prompt_s, model, events = OLLAMA_CASES[name]
    body = (FIXTURES / name).read_bytes()
    for chunks in chunkings(body):
        usage = tap_all(content_type, chunks)
        assert usage.source == "ollama_eval_count"
        assert usage.observed
        assert (usage.output_tokens, usage.prompt_tokens, usage.model, usage.stream_events) == (
            output,
            prompt,
            model,
            events,
        )
        assert usage.generation_s == pytest.approx(generation_s) and usage.prompt_s == pytest.approx(prompt_s)
        assert usage.wall_s == 1.25
        assert usage.seconds_per_output_token == pytest.approx(generation_s / output)


# file: Ollama's load_duration in seconds (milliseconds when the model was loaded already)
OLLAMA_LOADS = {
    "chat_stream.ndjson": 0.021834583,
    "chat_stream_cold.ndjson": 4.213456789,
    "chat_thinking_stream.ndjson": 0.001045291,
    "generate_stream.ndjson": 0.001045291,
    "chat.json": 0.020125,
    "generate.json": 0.001045291,
}


@pytest.mark.parametrize("name", sorted(OLLAMA_LOADS))
def test_ollama_load_duration_is_read_in_seconds_in_any_chunking(name: str) -> None:
    """What the service-time model learns a (backend, model)'s load cost from, and takes out of the
    service seconds of the answer that paid it."""
    content_type = NDJSON if name.endswith(".ndjson") else JSON
    for chunks in chunkings((FIXTURES / name).read_bytes()):
        assert tap_all(content_type, chunks).load_s == pytest.approx(OLLAMA_LOADS[name], abs=1e-12)


def test_a_cold_answer_differs_from_a_warm_one_only_by_its_load() -> None:
    warm = tap_all(NDJSON, [(FIXTURES / "chat_stream.ndjson").read_bytes()])
    cold = tap_all(NDJSON, [(FIXTURES / "chat_stream_cold.ndjson").read_bytes()])
    assert (cold.output_tokens, cold.prompt_tokens, cold.generation_s) == (
        warm.output_tokens,
        warm.prompt_tokens,
        warm.generation_s,
    )
    assert cold.load_s is not None and warm.load_s is not None and cold.load_s - warm.load_s > 4.0


def test_backends_that_do_not_load_on_demand_report_no_load() -> None:
    body = b'{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":5,"completion_tokens":1}}'
    assert tap_all(JSON, [body]).load_s is None
    # A load_duration in generated text is not Ollama's: only its final object's key counts.
    text = b'{"choices":[{"message":{"content":"\\"load_duration\\": 9"}}],"usage":{"completion_tokens":1}}'
    assert tap_all(JSON, [text]).load_s is None


def test_the_fixture_bodies_are_what_they_claim() -> None:
    """The premise of the cases above: counts consistent with the token objects, tails longer than the tap's."""
    lines = [json.loads(x) for x in (FIXTURES / "chat_stream.ndjson").read_text().splitlines()]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == sum(1 for x in lines if x["message"]["content"])
    final = json.loads((FIXTURES / "generate_stream.ndjson").read_text().splitlines()[-1])
    assert len(json.dumps(final["context"])) > TAIL_BYTES
    assert len((FIXTURES / "chat.json").read_bytes()) > TAIL_BYTES


def test_a_stream_cut_before_its_final_object_falls_back_to_counted_events() -> None:
    body = (FIXTURES / "chat_stream.ndjson").read_bytes()
    without_final = body[: body.rstrip(b"\n").rfind(b"\n") + 1]
    usage = tap_all(NDJSON, [without_final])
    assert (usage.source, usage.output_tokens, usage.stream_events) == ("stream_events", 41, 41)
    assert usage.model == "llama3.2:3b" and usage.generation_s is None


def _ended_after(content_type: str, chunks: list[bytes]) -> list[bool]:
    tap = UsageTap(content_type)
    seen = []
    for chunk in chunks:
        tap.feed(chunk)
        seen.append(tap.ended)
    return seen


SSE_TRICK = (
    b'data: {"choices":[{"delta":{"content":"data: [DONE]\\n\\n \\"done\\": true [DONE]"}}]}\n\n'
    b'data: {"choices":[{"delta":{}}],"usage":{"completion_tokens":2}}\n\n'
)


@pytest.mark.parametrize("name", ["chat_stream.ndjson", "chat_thinking_stream.ndjson", "generate_stream.ndjson"])
def test_an_ollama_stream_ends_with_its_done_object_in_any_chunking(name: str) -> None:
    body = (FIXTURES / name).read_bytes()
    final_at = body.rstrip(b"\n").rfind(b"\n") + 1  # where the final object's line begins
    for chunks in chunkings(body):
        seen = _ended_after(NDJSON, chunks)
        ends = [sum(map(len, chunks[: i + 1])) for i in range(len(chunks))]  # bytes fed after each chunk
        # Ended exactly once the final object's line is whole (its newline fed), never before.
        assert seen == [fed > body.index(b"\n", final_at) for fed in ends], name


def test_an_sse_stream_ends_with_its_done_event_and_not_with_text_that_spells_it() -> None:
    body = SSE_TRICK + b"data: [DONE]\n\n"
    for chunks in chunkings(body):
        seen = _ended_after(SSE, chunks)
        ends = [sum(map(len, chunks[: i + 1])) for i in range(len(chunks))]
        assert seen == [fed > body.index(b"data: [DONE]\n") + len(b"data: [DONE]") for fed in ends]
    assert _ended_after(SSE, [SSE_TRICK]) == [False]  # the text spells the end; the stream has not ended
    assert _ended_after(NDJSON, [b'{"response":"\\"done\\": true","done":false}\n']) == [False]
    assert _ended_after(JSON, [b'{"done":true}\n']) == [False]  # a plain body ends with its bytes, not an event


def test_a_plain_body_without_counts_is_no_observation() -> None:
    for content_type, body in [
        (JSON, b'{"model":"m","response":"ok","done":true}'),
        (JSON, (FIXTURES / "chat.json").read_bytes()[:-200]),  # broken off before its counts
        ("text/html", b"<html>502 bad gateway</html>"),
        (JSON, b""),
    ]:
        usage = tap_all(content_type, [body])
        assert usage.source == "none" and usage.output_tokens is None and not usage.observed


def test_counts_in_generated_text_are_not_mistaken_for_the_backends() -> None:
    """Generated text that spells a count key is escaped inside its JSON string: never read as a key."""
    trick = json.dumps(
        {
            "model": "m",
            "response": 'say "eval_count": 999999, "usage": {"completion_tokens": 7}',
            "done": True,
            "eval_count": 3,
            "eval_duration": 3_000_000,
        }
    )
    usage = tap_all(JSON, [trick.encode()])
    assert (usage.output_tokens, usage.source) == (3, "ollama_eval_count")
    only_trick = json.dumps({"model": "m", "response": '"eval_count": 999999', "done": True})
    assert tap_all(JSON, [only_trick.encode()]).output_tokens is None


@settings(max_examples=200, deadline=None)
@given(content_type=st.sampled_from([SSE, NDJSON, JSON, ""]), chunks=st.lists(st.binary(max_size=300), max_size=20))
def test_the_tap_never_raises_and_stays_bounded(content_type: str, chunks: list[bytes]) -> None:
    tap = UsageTap(content_type, tail_bytes=256)
    for chunk in chunks:
        tap.feed(chunk)
        assert len(tap._tail) <= 2 * 256 + len(chunk)  # noqa: SLF001 - the bound is the contract
    usage = tap.usage(wall_s=0.0)
    assert usage.output_tokens is None or usage.output_tokens >= 0


# --- real llama.cpp: raw answers ------------------------------------------------------------------

FORCE = {"ignore_eos": True}
CHAT = [{"role": "user", "content": "Name three colours."}]
# (path, body, expected source, expects a backend-reported generation time)
LLAMACPP_CASES = {
    "chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 7, **FORCE}, "openai_usage"),
    "chat_stream": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 9, "stream": True, **FORCE},
        "llamacpp_timings",
    ),
    "chat_stream_usage": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, **FORCE},
        "openai_usage",
    ),
    "completion": ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, **FORCE}, "openai_usage"),
    "completion_stream": (
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 5, "stream": True, **FORCE},
        "openai_usage",
    ),
}


def forced_tokens(body: dict[str, Any]) -> int:
    return int(body["max_tokens"])


@pytest.fixture(scope="module")
def llamacpp_answers(llama_server: EmbeddedLlamaServer) -> dict[str, tuple[str, bytes]]:
    """Each case's raw answer from the real server: (content type, body bytes)."""
    answers = {}
    for name, (path, body, _) in LLAMACPP_CASES.items():
        # A fresh connection each: llama.cpp's server silently closes some after a streamed answer.
        with httpx.stream("POST", f"{llama_server.base_url}{path}", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            answers[name] = (r.headers["content-type"], b"".join(r.iter_raw()))
    return answers


@pytest.mark.parametrize("name", sorted(LLAMACPP_CASES))
def test_llamacpp_answers_give_the_forced_length_in_any_chunking(
    name: str, llamacpp_answers: dict[str, tuple[str, bytes]]
) -> None:
    _, body, source = LLAMACPP_CASES[name]
    content_type, raw = llamacpp_answers[name]
    for chunks in chunkings(raw, seed=len(name)):
        usage = tap_all(content_type, chunks)
        assert usage.output_tokens == forced_tokens(body), (name, usage)
        assert usage.source == source
        assert usage.model == "SmolLM2-135M-Instruct"  # the backend's name, not the request's
        assert usage.prompt_tokens is not None and usage.prompt_tokens > 0
        assert usage.generation_s is not None and usage.generation_s > 0  # llama.cpp's timings
        assert usage.prompt_s is not None and usage.prompt_s >= 0
        if body.get("stream"):
            # llama.cpp sends one content event per token: the fallback count agrees with its own.
            assert usage.stream_events == forced_tokens(body)


def test_a_llamacpp_stream_without_its_last_events_is_counted(llamacpp_answers: dict[str, tuple[str, bytes]]) -> None:
    content_type, raw = llamacpp_answers["chat_stream"]
    events = raw.split(b"\n\n")
    # Drop the finish event (with the timings) and [DONE]: what a broken-off stream leaves.
    cut = b"\n\n".join(e for e in events if b"timings" not in e and b"[DONE]" not in e)
    usage = tap_all(content_type, [cut])
    assert (usage.source, usage.output_tokens) == ("stream_events", 9)


# --- through the proxy ----------------------------------------------------------------------------


def usage_count(base: str, source: str) -> float:
    return metric_value(base, "clairvoyant_usage_observations_total", f'source="{source}"')


def test_the_proxy_records_llamacpp_usage_for_streams_and_plain_bodies(llama_server: EmbeddedLlamaServer) -> None:
    settings_ = Settings(upstream_url=llama_server.base_url, online_learning=False)
    with (
        running_proxy(settings_, predictor=MarkerPredictor()) as base,
        httpx.Client(base_url=base, timeout=120) as client,
    ):
        total = 0
        for name, (path, body, _) in LLAMACPP_CASES.items():
            with client.stream("POST", path, json=body) as r:
                assert r.status_code == 200, name
                relayed = b"".join(r.iter_raw())
            assert relayed  # relayed, not swallowed by the tap
            total += forced_tokens(body)
        assert usage_count(base, "openai_usage") == 4
        assert usage_count(base, "llamacpp_timings") == 1
        assert usage_count(base, "none") == 0
        assert metric_value(base, "clairvoyant_observed_output_tokens_count") == len(LLAMACPP_CASES)
        assert metric_value(base, "clairvoyant_observed_output_tokens_sum") == total


def test_the_proxy_records_ollama_final_counts_from_streams_and_bodies() -> None:
    router = respx.MockRouter(base_url="http://ollama.test")
    router.post("/api/chat").respond(
        200, content=(FIXTURES / "chat_stream.ndjson").read_bytes(), headers={"content-type": NDJSON}
    )
    router.post("/api/generate").respond(
        200, content=(FIXTURES / "generate.json").read_bytes(), headers={"content-type": JSON}
    )
    settings_ = Settings(upstream_url="http://ollama.test", online_learning=False)
    with running_proxy(settings_, predictor=MarkerPredictor(), upstream_transport=mock_transport(router)) as base:
        chat = httpx.post(
            f"{base}/api/chat", json={"model": "llama3.2:3b", "messages": [{"role": "user", "content": "hi"}]}
        )
        generate = httpx.post(f"{base}/api/generate", json={"model": "qwen2.5:7b", "prompt": "hi", "stream": False})
        assert chat.content == (FIXTURES / "chat_stream.ndjson").read_bytes()  # relayed byte for byte
        assert generate.json()["eval_count"] == 12
        assert usage_count(base, "ollama_eval_count") == 2
        assert metric_value(base, "clairvoyant_observed_output_tokens_sum") == 41 + 12


def test_the_proxy_records_no_usage_for_failed_answers() -> None:
    router = respx.MockRouter(base_url="http://ollama.test")
    router.post("/api/chat").respond(500, json={"error": "model 'x' not found", "eval_count": 5})
    settings_ = Settings(upstream_url="http://ollama.test", online_learning=False)
    with running_proxy(settings_, predictor=MarkerPredictor(), upstream_transport=mock_transport(router)) as base:
        r = httpx.post(f"{base}/api/chat", json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500
        assert sum(usage_count(base, s) for s in ("ollama_eval_count", "none", "stream_events")) == 0
