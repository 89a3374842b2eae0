"""The live page's scene, for its test and for the screenshot in docs/img/ui.png: a proxy with keys
(status pages behind them), three tenants with limits, and the shipped predictor, after a
30-request run against a fast fake backend, with a queue held at the end.

    with busy_proxy() as scene:
        ...  # scene.base is the proxy's URL; the operator's key is OPS_KEY
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import respx
from proxy_harness import mock_transport, queue_snapshot, running_proxy, wait_until

from clairvoyant.config import Settings
from clairvoyant.proxy.access import hash_key

UPSTREAM = "http://upstream.test"
OPS_KEY = "cv-operator-key-for-the-live-page"  # the operator's: it reads the page
KEYS = {
    "alice": "cv-alice-key-for-the-live-page",
    "bob": "cv-bob-key-for-the-live-page",
    "carol": "cv-carol-key-for-the-live-page",
}
LIMITS = {
    "alice": {"max_concurrent": 8, "requests_per_minute": 60},
    "bob": {"tokens_per_day": 20_000},
    "carol": {},
}
# (prompt, the answer's output tokens): the backend answers each with that many
PROMPTS = [
    ("What is the capital of France? One word.", 3),
    ("Write a haiku about autumn rain.", 22),
    ("Translate 'good morning' into Spanish.", 6),
    ("Explain in detail how a hash table handles collisions, with code examples in Python.", 780),
    ("Summarize the plot of Hamlet in two sentences.", 60),
    ("Write a long, detailed essay on the causes of the First World War.", 1400),
    ("List five prime numbers.", 14),
    ("Describe step by step how to bake sourdough bread, with timings.", 520),
    ("Is 17 prime? Answer yes or no.", 2),
    ("Write a short story about a lighthouse keeper, about 300 words.", 410),
]
RUN = 30  # requests in the run, in bursts of 10
TOKENS_PER_S = 1500  # the fake backend's pace: a burst of 10 keeps a queue for about 2 s
MODELS = ("llama3.2:1b", "qwen2.5:0.5b")


@dataclass
class Scene:
    base: str
    gate: threading.Event  # set: the held requests are answered
    posts: list[threading.Thread] = field(default_factory=list)


def _backend(gate: threading.Event) -> respx.MockRouter:
    """Answers each prompt with its tokens after a few milliseconds (one at a time per slot),
    and holds the ones marked "[hold]" until ``gate`` is set."""
    tokens = dict(PROMPTS)

    async def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        text = body["messages"][-1]["content"]
        if "[hold]" in text:
            while not gate.is_set():
                await asyncio.sleep(0.01)
        output = tokens.get(text.removeprefix("[hold] "), 50)
        await asyncio.sleep(0.005 + output / TOKENS_PER_S)
        return httpx.Response(
            200,
            json={
                "model": body.get("model"),
                "choices": [{"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 20, "completion_tokens": output},
            },
        )

    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    router.get("/health").respond(200)
    router.post("/v1/chat/completions").mock(side_effect=answer)
    return router


def _post(base: str, tenant: str, text: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    return httpx.post(
        f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=60
    )


def _stored_samples(base: str, headers: dict[str, str]) -> int:
    """The history's samples so far (its series ends with the present, not stored)."""
    return len(httpx.get(f"{base}/history", headers=headers).json()["series"]["ago_s"]) - 1


def _burst(base: str, requests: list[tuple[str, str, str]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=_post, args=(base, *r), daemon=True) for r in requests]
    for t in threads:
        t.start()
    return threads


@contextmanager
def busy_proxy() -> Iterator[Scene]:
    """The scene, ready: 30 answered requests (one for model "m", which a llama.cpp server would
    echo, so the learner has too little to rank for it), one request held at the backend and four
    waiting behind it. Leaving releases them."""
    gate = threading.Event()
    api_keys = [{"hash": hash_key(key), "tenant": tenant, **LIMITS[tenant]} for tenant, key in KEYS.items()] + [
        {"hash": hash_key(OPS_KEY), "tenant": "ops"}
    ]
    settings = Settings(
        upstream_url=UPSTREAM, api_keys=api_keys, status_requires_key=True, encoder=False, log_level="warning"
    )
    ops = {"Authorization": f"Bearer {OPS_KEY}"}
    with running_proxy(settings, upstream_transport=mock_transport(_backend(gate))) as base:
        scene = Scene(base, gate)
        tenants = ["alice", "bob", "alice", "carol", "bob"]
        run = [
            (tenants[i % 5], PROMPTS[i % len(PROMPTS)][0], "m" if i == 7 else MODELS[1] if i % 4 == 3 else MODELS[0])
            for i in range(RUN)
        ]
        for start in range(0, RUN, 10):
            # Each burst starts after a new sample of the history, so that the charts show them apart.
            samples = _stored_samples(base, ops)
            wait_until(lambda n=samples: _stored_samples(base, ops) > n, timeout_s=30, what="a new sample")
            for t in _burst(base, run[start : start + 10]):
                t.join(timeout=60)
        try:
            scene.posts += _burst(base, [("bob", "[hold] " + PROMPTS[5][0], MODELS[0])])
            wait_until(lambda: len(queue_snapshot(base, ops)["in_flight"]) == 1, timeout_s=30, what="one held")
            waiting = [
                ("alice", PROMPTS[3][0]),
                ("carol", PROMPTS[0][0]),
                ("alice", PROMPTS[1][0]),
                ("bob", PROMPTS[7][0]),
            ]
            scene.posts += _burst(base, [(tenant, "[hold] " + text, MODELS[0]) for tenant, text in waiting])
            wait_until(lambda: queue_snapshot(base, ops)["waiting_count"] == 4, timeout_s=30, what="four waiting")
            yield scene
        finally:
            gate.set()
            for t in scene.posts:
                t.join(timeout=60)
