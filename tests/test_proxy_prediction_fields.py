"""What the proxy shows of a prediction: predicted tokens always; P(Long) only for class models
(response headers and /queue). The request's model and cap reach the predictor."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import respx
from polling import wait_until
from proxy_harness import gate_wait, mock_transport, queue_snapshot, running_proxy

from clairvoyant.config import Settings
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import Prediction

UPSTREAM = "http://upstream.test"


class RegressorDouble:
    """A regressor-like predictor: no class probabilities; 50 tokens, capped by the request."""

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, int | None]] = []

    def predict(self, prompt: Prompt, *, model: str | None = None, cap_tokens: int | None = None) -> Prediction:
        self.calls.append((model, cap_tokens))
        tokens = 50.0 if cap_tokens is None else min(50.0, cap_tokens)
        return Prediction(score=tokens, predicted_tokens=tokens, probabilities=None, model=model, cap_tokens=cap_tokens)


def test_a_regressor_shows_predicted_tokens_and_no_p_long() -> None:
    gate = threading.Event()
    router = respx.MockRouter(base_url=UPSTREAM)

    async def held(request: httpx.Request) -> httpx.Response:
        await gate_wait(gate)
        return httpx.Response(200, json={"ok": True})

    router.post("/v1/chat/completions").mock(side_effect=held)
    predictor = RegressorDouble()
    body: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    with running_proxy(
        Settings(upstream_url=UPSTREAM), predictor=predictor, upstream_transport=mock_transport(router)
    ) as base:
        results: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: results.append(httpx.post(f"{base}/v1/chat/completions", json=body)))
        sender.start()
        wait_until(lambda: queue_snapshot(base)["in_flight"], what="the request in flight")
        in_flight = queue_snapshot(base)["in_flight"][0]
        gate.set()
        sender.join(timeout=10)
    assert predictor.calls == [("m1", 7)]  # the request's model and cap reached the predictor
    assert in_flight["predicted_tokens"] == 7.0 and "p_long" not in in_flight
    r = results[0]
    assert r.status_code == 200
    assert r.headers["x-clairvoyant-predicted-tokens"] == "7"
    assert r.headers["x-clairvoyant-predicted-class"] == "short"
    assert "x-clairvoyant-p-long" not in r.headers


class RecordingPredictor(RegressorDouble):
    """Records when each prompt is predicted, in one list with the backend's receipts."""

    def __init__(self, events: list[tuple[str, str]]) -> None:
        super().__init__()
        self.events = events

    def predict(self, prompt: Prompt, *, model: str | None = None, cap_tokens: int | None = None) -> Prediction:
        self.events.append(("predicted", prompt.instruction))
        return super().predict(prompt, model=model, cap_tokens=cap_tokens)


def test_a_request_finding_a_free_slot_is_sent_before_its_prediction_and_answered_with_it() -> None:
    # Nobody waits, so there is no order to decide: the request goes at once and is predicted while
    # the backend works. One that must wait is predicted before it is queued, so it is never sent
    # unpredicted. Both answers carry their prediction.
    events: list[tuple[str, str]] = []
    gate = threading.Event()
    router = respx.MockRouter(base_url=UPSTREAM)

    async def held(request: httpx.Request) -> httpx.Response:
        events.append(("sent", json.loads(request.content)["messages"][0]["content"]))
        await gate_wait(gate)
        return httpx.Response(200, json={"ok": True})

    router.post("/v1/chat/completions").mock(side_effect=held)
    predictor = RecordingPredictor(events)
    results: dict[str, httpx.Response] = {}

    def send(text: str) -> None:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 7}
        results[text] = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)

    with running_proxy(
        Settings(upstream_url=UPSTREAM, slots=1), predictor=predictor, upstream_transport=mock_transport(router)
    ) as base:
        senders = [threading.Thread(target=send, args=(text,)) for text in ("first", "second")]
        senders[0].start()
        wait_until(lambda: ("predicted", "first") in events, what="the first request predicted")
        in_flight = queue_snapshot(base)["in_flight"][0]
        senders[1].start()
        wait_until(lambda: queue_snapshot(base)["waiting"], what="the second request waiting")
        gate.set()
        for sender in senders:
            sender.join(timeout=10)
    assert events == [("sent", "first"), ("predicted", "first"), ("predicted", "second"), ("sent", "second")]
    assert in_flight["predicted_tokens"] == 7.0  # the running request's prediction, once made
    for text in ("first", "second"):
        assert results[text].status_code == 200
        assert results[text].headers["x-clairvoyant-predicted-tokens"] == "7"
    assert results["first"].headers["x-clairvoyant-queue-position"] == "0"
