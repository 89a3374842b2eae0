"""End to end: the proxy with the shipped ONNX predictor in front of a REAL llama.cpp server
(xllamacpp + SmolLM2), driven by the official openai client. Output lengths are forced with
max_tokens + ignore_eos so service times are known."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from polling import until, wait_until
from proxy_harness import queue_snapshot, running_proxy

from clairvoyant.config import Settings
from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, prompt_from_body
from clairvoyant.prediction.predictor import BlendWeights, OnnxPredictor
from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

SHORT_PROMPTS = [
    "What is the capital of France?",
    "What year did World War II end?",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
]
LONG_PROMPTS = [
    "Write a detailed 2000-word essay on the causes and consequences of the French Revolution, with sections and examples.",
    "Write a complete Python implementation of a web server with routing, middleware, templates and tests, and explain every part in detail.",
    "Write a long story in ten chapters about a detective in 1920s Paris, with dialogue and a twist ending.",
    "Generate a comprehensive 30-day training plan for a marathon, day by day, with nutrition advice and explanations for each session.",
]


@pytest.fixture(scope="module")
def predictor() -> OnnxPredictor:
    return OnnxPredictor()


@pytest.fixture(scope="module")
def proxy_url(llama_server: EmbeddedLlamaServer, predictor: OnnxPredictor) -> Iterator[str]:
    settings = Settings(upstream_url=llama_server.base_url, starvation_timeout_s=600)
    with running_proxy(settings, predictor=predictor) as url:
        yield url


def backend_metric(server: EmbeddedLlamaServer, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in llama.cpp /metrics")


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


FORCE = {"ignore_eos": True}


def test_non_streaming_chat_round_trip(proxy_url: str) -> None:
    with OpenAI(base_url=f"{proxy_url}/v1", api_key="sk-unused", max_retries=0, timeout=120) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", messages=chat("Name a colour."), max_tokens=6, extra_body=FORCE
        )
        completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 6
    assert completion.choices[0].message.content
    assert raw.headers["x-request-id"]
    assert float(raw.headers["x-clairvoyant-predicted-tokens"]) > 0
    assert "x-clairvoyant-p-long" not in raw.headers  # the shipped model is a regressor: no class probabilities
    assert raw.headers["x-clairvoyant-predicted-class"] in ("short", "medium", "long")


def test_streaming_chat_and_completion_round_trips(proxy_url: str) -> None:
    with OpenAI(base_url=f"{proxy_url}/v1", api_key="sk-unused", max_retries=0, timeout=120) as client:
        stream = client.chat.completions.create(
            model="smollm2",
            messages=chat("Count to five."),
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=FORCE,
        )
        chunks = list(stream)
        text = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5, extra_body=FORCE)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert content
    assert usage and usage[-1].completion_tokens == 12
    assert text.usage is not None and text.usage.completion_tokens == 5
    assert text.choices[0].text


def test_bad_request_is_answered_in_openai_shape_by_the_proxy(proxy_url: str) -> None:
    r = httpx.post(f"{proxy_url}/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_shorts_complete_before_any_long_when_queued_behind_a_long_job(
    proxy_url: str, predictor: OnnxPredictor
) -> None:
    """The paper's n=8 check: a long request holds the slot; 4 Short and 4 Long arrive together."""
    endpoint = SCHEDULED_ENDPOINTS["/v1/chat/completions"]
    score = lambda text: predictor.predict(prompt_from_body(endpoint, {"messages": chat(text)})).score  # noqa: E731
    short_scores = [score(p) for p in SHORT_PROMPTS]
    long_scores = [score(p) for p in LONG_PROMPTS]
    assert max(short_scores) < min(long_scores), (short_scores, long_scores)  # the premise of the test

    async def scenario() -> list[str]:
        finished: list[str] = []
        async with AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="sk-unused", max_retries=0, timeout=300) as client:

            async def run(tag: str, text: str, tokens: int) -> None:
                await client.chat.completions.create(
                    model="smollm2", messages=chat(text), max_tokens=tokens, extra_body=FORCE
                )
                finished.append(tag)

            holder = asyncio.create_task(run("holder", LONG_PROMPTS[0], 200))
            await until(lambda: queue_snapshot(proxy_url)["in_flight"], timeout_s=60, what="the holder sent")
            batch = [run(f"long{i}", p, 24) for i, p in enumerate(LONG_PROMPTS)]
            batch += [run(f"short{i}", p, 4) for i, p in enumerate(SHORT_PROMPTS)]
            tasks = [asyncio.create_task(c) for c in batch]
            await until(
                lambda: len(queue_snapshot(proxy_url)["waiting"]) >= 8 or holder.done(), timeout_s=60, what="8 queued"
            )
            assert not holder.done(), "the holder finished before the batch queued; make it longer"
            await asyncio.gather(holder, *tasks)
        return finished

    finished = asyncio.run(scenario())
    assert finished[0] == "holder"
    assert sorted(finished[1:5]) == ["short0", "short1", "short2", "short3"], finished
    assert sorted(finished[5:]) == ["long0", "long1", "long2", "long3"], finished


def test_a_client_that_leaves_while_queued_is_never_sent(proxy_url: str, llama_server: EmbeddedLlamaServer) -> None:
    before = backend_metric(llama_server, "llamacpp:tokens_predicted_total")

    async def scenario() -> None:
        async with AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="sk-unused", max_retries=0, timeout=300) as client:
            holder = asyncio.create_task(
                client.chat.completions.create(
                    model="smollm2", messages=chat("Tell me a story."), max_tokens=120, extra_body=FORCE
                )
            )
            await until(lambda: queue_snapshot(proxy_url)["in_flight"], timeout_s=60, what="the holder sent")
            leaver = asyncio.create_task(
                client.chat.completions.create(
                    model="smollm2", messages=chat("What is 2+2?"), max_tokens=37, extra_body=FORCE
                )
            )
            await until(lambda: queue_snapshot(proxy_url)["waiting"], timeout_s=60, what="the leaver queued")
            leaver.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaver
            await until(lambda: not queue_snapshot(proxy_url)["waiting"], timeout_s=60, what="the leaver withdrawn")
            assert not holder.done(), "the holder finished too early for the test to mean anything"
            await holder
            await client.chat.completions.create(model="smollm2", messages=chat("Hi"), max_tokens=3, extra_body=FORCE)

    asyncio.run(scenario())
    # Exactly the holder's 120 and the follow-up's 3 tokens were generated: the leaver's 37 never were.
    assert backend_metric(llama_server, "llamacpp:tokens_predicted_total") - before == 123


def test_a_client_that_leaves_mid_stream_lets_the_next_request_run(
    proxy_url: str, llama_server: EmbeddedLlamaServer
) -> None:
    before = backend_metric(llama_server, "llamacpp:n_decode_total")
    with httpx.Client(timeout=120) as client:
        with client.stream(
            "POST",
            f"{proxy_url}/v1/chat/completions",
            json={"messages": chat("Write a very long essay."), "max_tokens": 1500, "stream": True, **FORCE},
        ) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leave mid-generation
        started = time.monotonic()
        nxt = client.post(
            f"{proxy_url}/v1/chat/completions",
            json={"messages": chat("Hi"), "max_tokens": 2, **FORCE},
        )
        waited = time.monotonic() - started
    assert nxt.status_code == 200 and nxt.json()["usage"]["completion_tokens"] == 2
    wait_until(lambda: not queue_snapshot(proxy_url)["in_flight"], what="slot free")
    decoded = backend_metric(llama_server, "llamacpp:n_decode_total") - before
    # Aborted (the default): the backend stopped far short of 1,500 tokens before serving the next one.
    assert decoded < 750, (decoded, waited)


def test_a_priority_request_overtakes_queued_normal_ones_and_queue_shows_eta(
    llama_server: EmbeddedLlamaServer, predictor: OnnxPredictor
) -> None:
    """fcfs inside a class, so only the priority can explain the overtaking."""
    settings = Settings(upstream_url=llama_server.base_url, policy="fcfs", min_priority=-5, starvation_timeout_s=600)
    with running_proxy(settings, predictor=predictor) as url:

        async def scenario() -> tuple[list[str], dict, dict, dict[str, str]]:
            finished: list[str] = []
            headers: dict[str, str] = {}
            async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-unused", max_retries=0, timeout=300) as client:

                async def run(tag: str, tokens: int, priority: int | None = None) -> None:
                    extra = {**FORCE, **({"priority": priority} if priority is not None else {})}
                    raw = await client.chat.completions.with_raw_response.create(
                        model="smollm2",
                        messages=chat(SHORT_PROMPTS[0]),
                        max_tokens=tokens,
                        extra_body=extra,
                        extra_headers={"x-request-id": f"e2e-{tag}"},
                    )
                    if tag == "urgent":
                        headers.update(raw.headers)
                    finished.append(tag)

                # The holder streams until the test closes it (then the proxy aborts it and frees
                # the slot), so however slowly a loaded machine fills the queue, it is still running.
                holder = await client.chat.completions.create(
                    model="smollm2",
                    messages=chat(SHORT_PROMPTS[0]),
                    max_tokens=1500,
                    extra_body=FORCE,
                    extra_headers={"x-request-id": "e2e-holder"},
                    stream=True,
                )
                await anext(aiter(holder))  # generating
                tasks = []
                for i in range(3):
                    tasks.append(asyncio.create_task(run(f"normal{i}", 4)))
                    await until(lambda n=i + 1: len(queue_snapshot(url)["waiting"]) >= n, 60, f"normal{i} queued")
                tasks.append(asyncio.create_task(run("urgent", 4, priority=-1)))
                await until(lambda: len(queue_snapshot(url)["waiting"]) >= 4, timeout_s=60, what="urgent queued")
                snapshot = queue_snapshot(url)
                one = httpx.get(f"{url}/queue/e2e-normal2").json()
                await holder.close()
                finished.append("holder")
                await asyncio.gather(*tasks)
            return finished, snapshot, one, headers

        finished, snapshot, one, headers = asyncio.run(scenario())
    assert finished[:2] == ["holder", "urgent"], finished
    assert finished[2:] == ["normal0", "normal1", "normal2"], finished
    assert [t["request_id"] for t in snapshot["in_flight"]] == ["e2e-holder"]
    waiting = snapshot["waiting"]
    assert [w["request_id"] for w in waiting] == ["e2e-urgent", "e2e-normal0", "e2e-normal1", "e2e-normal2"]
    assert [w["position"] for w in waiting] == [0, 1, 2, 3]
    assert waiting[0]["priority"] == -1 and all(w["priority"] == 0 for w in waiting[1:])
    etas = [w["eta_s"] for w in waiting]
    assert 0 < etas[0] < etas[1] < etas[2] < etas[3]  # in-flight remainder, then each one's predicted seconds
    # Read a moment after the snapshot: the same place. Its ETA is not compared with the snapshot's:
    # it follows the holder's stream, whose pace moves from token to token on a busy machine.
    assert one == {"request_id": "e2e-normal2", "waiting": True, "position": 3, "eta_s": one["eta_s"]}
    assert one["eta_s"] > 0
    assert headers["x-clairvoyant-queue-position"] == "0"  # it went straight to the front when it arrived


def test_waiting_requests_are_refined_by_the_encoder_and_reordered(
    llama_server: EmbeddedLlamaServer, predictor: OnnxPredictor
) -> None:
    """A request that waits gets the encoder's second opinion: /queue shows exactly the blend of the
    lexical prediction and the encoder's, with the weight for its turn (the essay comes after an
    earlier exchange, the fact alone), and the queue order follows it. The answers' lengths are
    forced upstream after prediction, so no cap hides the predictions."""
    from proxy_harness import metric_value

    from clairvoyant.prediction.encoder import EncoderModel

    encoder = EncoderModel()
    settings = Settings(
        upstream_url=llama_server.base_url, starvation_timeout_s=600, bench_upstream_fields=True, online_learning=False
    )
    texts = {"essay": LONG_PROMPTS[0], "fact": SHORT_PROMPTS[1]}
    history = [
        {"role": "user", "content": "I am reading about Roman history this week."},
        {"role": "assistant", "content": "Happy to help with that."},
    ]
    messages = {"essay": history + chat(texts["essay"]), "fact": chat(texts["fact"])}
    assert encoder.blend_weights.first != encoder.blend_weights.later  # else the turn would not show
    with running_proxy(settings, predictor=predictor) as url:

        async def scenario() -> dict:
            async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-unused", max_retries=0, timeout=300) as client:

                async def run(tag: str, turns: list[dict], tokens: int) -> None:
                    await client.chat.completions.create(
                        model="smollm2",
                        messages=turns,
                        extra_body={"clairvoyant": {"upstream": {"max_tokens": tokens, **FORCE}}},
                        extra_headers={"x-request-id": f"enc-{tag}"},
                    )

                holder = asyncio.create_task(run("holder", chat(SHORT_PROMPTS[0]), 200))
                await until(lambda: queue_snapshot(url)["in_flight"], timeout_s=60, what="the holder sent")
                tasks = [asyncio.create_task(run(tag, turns, 2)) for tag, turns in messages.items()]
                await until(
                    lambda: (
                        holder.done()
                        or metric_value(url, "clairvoyant_encoder_requests_total", 'outcome="refined"') >= 2
                    ),
                    timeout_s=20,
                    what="the waiting requests refined",
                )
                assert not holder.done(), "the holder finished before the waiting requests were refined"
                snapshot = queue_snapshot(url)
                await asyncio.gather(holder, *tasks)
            return snapshot

        snapshot = asyncio.run(scenario())
    waiting = {w["request_id"].removeprefix("enc-"): w for w in snapshot["waiting"]}
    assert set(waiting) == set(texts)
    for tag, text in texts.items():
        prompt = prompt_from_body(SCHEDULED_ENDPOINTS["/v1/chat/completions"], {"messages": messages[tag]})
        lexical = predictor.predict(prompt, model="smollm2")
        value, _, knn = encoder.opinion(text)
        assert knn is not None  # the shipped card blends its kNN in
        refined = predictor.refined(lexical, value, encoder.blend_weights, b"", knn)
        weight = encoder.blend_weights.later if tag == "essay" else encoder.blend_weights.first
        prior = lexical.prior_log_tokens
        blend = prior + weight * (value - prior)
        assert refined.prior_log_tokens == pytest.approx(blend + encoder.blend_weights.knn * (knn - blend))
        first, knn_weight = encoder.blend_weights.first, encoder.blend_weights.knn
        single = predictor.refined(lexical, value, BlendWeights(first, first, knn_weight), b"", knn)
        if tag == "essay":  # one weight for every turn would show another number
            assert waiting[tag]["predicted_tokens"] != pytest.approx(round(single.predicted_tokens, 1), abs=0.06)
        without_knn = predictor.refined(lexical, value, encoder.blend_weights)
        assert waiting[tag]["predicted_tokens"] != pytest.approx(round(without_knn.predicted_tokens, 1), abs=0.06)
        assert waiting[tag]["predicted_tokens"] == pytest.approx(round(refined.predicted_tokens, 1), abs=0.06)
        assert waiting[tag]["predicted_tokens"] != pytest.approx(round(lexical.predicted_tokens, 1), abs=0.06)
    assert [w["request_id"] for w in snapshot["waiting"]] == ["enc-fact", "enc-essay"]
