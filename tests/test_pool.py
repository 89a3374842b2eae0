"""A pool of backends through the whole proxy, against respx-mocked backends (faults and Ollama's
native API cannot run here; two real llama.cpp servers are in test_pool_e2e.py)."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
import respx
from polling import wait_until
from proxy_harness import (
    BackgroundPosts,
    MarkerPredictor,
    broken_sse,
    gate_wait,
    metric_value,
    mock_transport,
    queue_snapshot,
    running_proxy,
)

from clairvoyant.config import Settings

A, B = "http://a.test", "http://b.test"


def pool_proxy(router: respx.MockRouter, backends: list[dict[str, Any]], **settings: Any) -> Any:
    for backend in backends:  # the monitors' health checks
        if not any(r.name == f"health-{backend['url']}" for r in router.routes):
            router.get(f"{backend['url']}/health", name=f"health-{backend['url']}").respond(200, json={"status": "ok"})
    return running_proxy(
        Settings(backends=backends, **settings), predictor=MarkerPredictor(), upstream_transport=mock_transport(router)
    )


def down_once_it_refused(router: respx.MockRouter, url: str, refused: respx.Route) -> None:
    """The backend's /health: up at start-up, down once it has refused a request (as a killed one is)."""

    def health(request: httpx.Request) -> httpx.Response:
        if refused.called:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"status": "ok"})

    router.get(f"{url}/health", name=f"health-{url}").mock(side_effect=health)


def chat(text: str, model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def openai_backends(**extra: Any) -> list[dict[str, Any]]:
    return [{"url": A, "kind": "openai", "slots": 1, **extra}, {"url": B, "kind": "openai", "slots": 1, **extra}]


def test_a_refused_backend_is_skipped_and_its_request_served_by_the_other() -> None:
    router = respx.MockRouter(assert_all_called=False)
    refused = router.post(f"{A}/v1/chat/completions").mock(side_effect=httpx.ConnectError("refused"))

    down_once_it_refused(router, A, refused)
    served = router.post(f"{B}/v1/chat/completions").respond(200, json={"served_by": "b"})
    with pool_proxy(router, openai_backends()) as base:
        answers = [httpx.post(f"{base}/v1/chat/completions", json=chat(f"q{i}")) for i in range(3)]
        backends = queue_snapshot(base)["backends"]
        rerouted = metric_value(base, "clairvoyant_backend_requests_total", 'backend="backend-1",outcome="refused"')
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert all(r.json() == {"served_by": "b"} for r in answers)
    assert {r.headers["x-clairvoyant-backend"] for r in answers} == {"backend-2"}
    assert refused.call_count == 1 and served.call_count == 3  # a refused once, then was skipped
    assert [(b["name"], b["healthy"]) for b in backends] == [("backend-1", False), ("backend-2", True)]
    assert rerouted == 1


def test_nothing_is_resent_after_the_first_byte_the_stream_ends_with_an_error() -> None:
    router = respx.MockRouter(assert_all_called=False)

    first = router.post(f"{A}/v1/chat/completions").respond(
        200, headers={"content-type": "text/event-stream"}, content=broken_sse()
    )
    second = router.post(f"{B}/v1/chat/completions").respond(200, json={"served_by": "b"})
    with pool_proxy(router, openai_backends()) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=chat("hi", stream=True))
    events = [line for line in r.text.splitlines() if line]
    assert r.status_code == 200 and r.headers["x-clairvoyant-backend"] == "backend-1"
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "upstream_unavailable"
    assert first.call_count == 1 and second.call_count == 0  # never sent again, anywhere


def test_requests_go_only_to_backends_that_serve_their_model_and_unknown_models_get_404() -> None:
    router = respx.MockRouter(assert_all_called=False)
    router.post(f"{A}/api/chat").respond(200, json={"from": "a", "done": True})
    router.post(f"{B}/api/chat").respond(200, json={"from": "b", "done": True})
    backends = [
        {"url": A, "kind": "ollama", "slots": 1, "models": ["llama3"]},
        {"url": B, "kind": "ollama", "slots": 1, "models": ["qwen2.5:7b"]},
    ]
    router.get(f"{A}/api/ps").respond(200, json={"models": []})
    router.get(f"{B}/api/ps").respond(200, json={"models": [{"name": "qwen2.5:7b"}, {"name": "phi3:mini"}]})
    with pool_proxy(router, backends) as base:
        qwen = httpx.post(f"{base}/api/chat", json=chat("x", model="qwen2.5:7b", stream=False))
        llama = httpx.post(f"{base}/api/chat", json=chat("x", model="llama3:latest", stream=False))
        unknown = httpx.post(f"{base}/api/chat", json=chat("x", model="mistral", stream=False))
        openai_unknown = httpx.post(f"{base}/v1/chat/completions", json=chat("x", model="mistral"))
        loaded = {b["name"]: b["loaded_models"] for b in queue_snapshot(base)["backends"]}
    assert qwen.json()["from"] == "b" and llama.json()["from"] == "a"
    assert unknown.status_code == 404 and "mistral" in unknown.json()["error"]  # Ollama's error shape
    assert openai_unknown.status_code == 404 and openai_unknown.json()["error"]["code"] == "model_not_found"
    # b's from its /api/ps; a's: the model just sent to it, until its next /api/ps
    assert loaded == {"backend-1": ["llama3:latest"], "backend-2": ["qwen2.5:7b", "phi3:mini"]}


def test_model_listings_are_merged_across_the_pool_and_passthrough_follows_the_model() -> None:
    router = respx.MockRouter(assert_all_called=False)
    router.get(f"{A}/api/tags").respond(200, json={"models": [{"name": "llama3:latest"}, {"name": "shared:latest"}]})
    router.get(f"{B}/api/tags").respond(200, json={"models": [{"name": "qwen:latest"}, {"name": "shared"}]})
    router.get(f"{A}/v1/models").respond(200, json={"object": "list", "data": [{"id": "llama3"}]})
    router.get(f"{B}/v1/models").mock(side_effect=httpx.ConnectError("refused"))
    show_a = router.post(f"{A}/api/show").respond(200, json={"from": "a"})
    show_b = router.post(f"{B}/api/show").respond(200, json={"from": "b"})
    backends = [
        {"url": A, "kind": "ollama", "slots": 1, "models": ["llama3", "shared"]},
        {"url": B, "kind": "ollama", "slots": 1, "models": ["qwen", "shared"]},
    ]
    router.get(f"{A}/api/ps").respond(200, json={"models": []})
    router.get(f"{B}/api/ps").respond(200, json={"models": []})
    with pool_proxy(router, backends) as base:
        tags = httpx.get(f"{base}/api/tags").json()
        models = httpx.get(f"{base}/v1/models").json()
        shown = httpx.post(f"{base}/api/show", json={"model": "qwen"}).json()
        shown_old_field = httpx.post(f"{base}/api/show", json={"name": "llama3"}).json()
    assert [m["name"] for m in tags["models"]] == ["llama3:latest", "shared:latest", "qwen:latest"]
    assert models == {"object": "list", "data": [{"id": "llama3"}]}  # b did not answer: left out
    assert shown == {"from": "b"} and shown_old_field == {"from": "a"}
    assert show_a.call_count == 1 and show_b.call_count == 1


def test_a_passthrough_request_fails_over_before_its_first_byte() -> None:
    router = respx.MockRouter(assert_all_called=False)
    refused = router.get(f"{A}/props").mock(side_effect=httpx.ConnectError("refused"))

    down_once_it_refused(router, A, refused)
    router.get(f"{B}/props").respond(200, json={"from": "b"})
    with pool_proxy(router, openai_backends()) as base:
        r = httpx.get(f"{base}/props")
        healthy = [b["healthy"] for b in queue_snapshot(base)["backends"]]
    assert r.json() == {"from": "b"} and refused.call_count == 1
    assert healthy == [False, True]


def test_readyz_is_ready_while_one_backend_is_and_names_each() -> None:
    router = respx.MockRouter(assert_all_called=False)
    router.get(f"{A}/health", name=f"health-{A}").mock(side_effect=httpx.ConnectError("refused"))
    with pool_proxy(router, openai_backends()) as base:
        one_up = httpx.get(f"{base}/readyz")
        router.get(f"{B}/health", name=f"health-{B}").mock(side_effect=httpx.ConnectError("refused"))
        none_up = httpx.get(f"{base}/readyz")
    assert one_up.status_code == 200 and one_up.json()["backends"] == {"backend-1": False, "backend-2": True}
    assert none_up.status_code == 503 and none_up.json()["backends"] == {"backend-1": False, "backend-2": False}
    assert "a.test" not in one_up.text + none_up.text  # no internal address


def test_vllm_backends_get_the_computed_priority_and_each_backend_its_own_key() -> None:
    router = respx.MockRouter(assert_all_called=False)
    seen: list[tuple[str, dict[str, Any], str | None]] = []

    def backend(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, json.loads(request.content), request.headers.get("authorization")))
        return httpx.Response(200, json={"ok": True})

    router.post(f"{A}/v1/chat/completions").mock(side_effect=backend)
    router.post(f"{B}/v1/chat/completions").mock(side_effect=backend)
    backends = [
        {"url": A, "kind": "vllm", "slots": 1, "models": ["m"], "api_key": "key-a"},
        {"url": B, "kind": "openai", "slots": 1, "models": ["n"]},
    ]
    with pool_proxy(router, backends, vllm_priority=True) as base:
        answers = [
            httpx.post(f"{base}/v1/chat/completions", json=chat(text, model=model, **extra))
            for text, model, extra in (("[short]", "m", {"priority": 2}), ("[long]", "m", {}), ("[short]", "n", {}))
        ]
    (_, short, auth_a), (_, long, _), (host_b, to_b, auth_b) = seen
    tokens = [float(r.headers["x-clairvoyant-predicted-tokens"]) for r in answers]
    # vLLM's priority: the client's class, then the predicted tokens (lower = sooner)
    assert short["priority"] == 2 * 100_000 + round(tokens[0])
    assert long["priority"] == round(tokens[1]) and tokens[1] > tokens[0]
    assert host_b == "b.test" and "priority" not in to_b  # not a vLLM backend: nothing added
    assert auth_a == "Bearer key-a" and auth_b is None  # each backend's own key, the client's none


def test_a_single_vllm_backend_gets_the_priority_of_a_request_sent_with_a_free_slot() -> None:
    # A free slot lets a request go before its prediction, except where the backend reads it.
    router = respx.MockRouter(assert_all_called=False)
    seen: list[dict[str, Any]] = []

    def backend(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"ok": True})

    router.post(f"{A}/v1/chat/completions").mock(side_effect=backend)
    with pool_proxy(router, [{"url": A, "kind": "vllm", "slots": 1}], vllm_priority=True) as base:
        answer = httpx.post(f"{base}/v1/chat/completions", json=chat("[long]"))
    tokens = float(answer.headers["x-clairvoyant-predicted-tokens"])
    assert tokens > 0 and seen[0]["priority"] == round(tokens)


def test_kinds_and_llamacpp_slots_are_asked_of_each_backend_at_start_up() -> None:
    router = respx.MockRouter(assert_all_called=False)
    router.get(f"{A}/props").respond(200, json={"total_slots": 4, "default_generation_settings": {}})
    router.get(f"{B}/props").respond(404)
    router.get(f"{B}/api/version").respond(200, json={"version": "0.13.5"})
    router.get(f"{B}/api/ps").respond(200, json={"models": []})
    with pool_proxy(router, [{"url": A}, {"url": B}]) as base:
        backends = queue_snapshot(base)["backends"]
    assert [(b["kind"], b["slots"]) for b in backends] == [("llamacpp", 4), ("ollama", 1)]


def test_a_llamacpp_backend_down_at_start_up_gets_its_slots_once_it_answers() -> None:
    # b (configured as llama.cpp, slots unset) does not answer /props at start-up, so the proxy
    # starts it with `slots` (1); its first health check that passes asks again and finds 3.
    router = respx.MockRouter(assert_all_called=False)
    router.get(f"{A}/props").respond(200, json={"total_slots": 2, "default_generation_settings": {}})
    b_props = router.get(f"{B}/props")
    b_props.side_effect = [httpx.ConnectError("refused"), httpx.Response(200, json={"total_slots": 3})]
    with pool_proxy(router, [{"url": A}, {"url": B, "kind": "llamacpp"}]) as base:
        wait_until(lambda: queue_snapshot(base)["backends"][1]["slots"] == 3, what="b resized")
        snapshot = queue_snapshot(base)
        assert metric_value(base, "clairvoyant_backend_slots", 'backend="backend-2"') == 3
    assert [(b["kind"], b["slots"]) for b in snapshot["backends"]] == [("llamacpp", 2), ("llamacpp", 3)]
    assert snapshot["slots"] == 5 and b_props.call_count == 2  # asked once more, then known


def test_a_llamacpp_backend_back_after_a_failure_is_asked_its_slots_again() -> None:
    # a was restarted with another -np: it refused a request, and /props now says 4 slots, not 2.
    router = respx.MockRouter(assert_all_called=False)
    a_props = router.get(f"{A}/props")
    a_props.side_effect = [httpx.Response(200, json={"total_slots": n}) for n in (2, 4)]
    router.get(f"{B}/props").respond(200, json={"total_slots": 1})
    router.post(f"{A}/v1/chat/completions").mock(side_effect=httpx.ConnectError("refused"))
    router.post(f"{B}/v1/chat/completions").respond(200, json={"served_by": "b"})
    with pool_proxy(router, [{"url": A, "kind": "llamacpp"}, {"url": B, "kind": "llamacpp"}]) as base:
        assert [b["slots"] for b in queue_snapshot(base)["backends"]] == [2, 1]
        answer = httpx.post(f"{base}/v1/chat/completions", json=chat("q"))  # refused by a: a is checked now
        wait_until(lambda: queue_snapshot(base)["backends"][0]["slots"] == 4, what="a resized")
        snapshot = queue_snapshot(base)
    assert answer.headers["x-clairvoyant-backend"] == "backend-2"
    assert snapshot["slots"] == 5 and a_props.call_count == 2


def test_a_backend_whose_answer_broke_gets_no_more_requests_until_its_health_check_passes() -> None:
    router = respx.MockRouter(assert_all_called=False)
    break_a, free_b, b_generating = threading.Event(), threading.Event(), threading.Event()

    async def b_answer(request: httpx.Request) -> httpx.Response:
        b_generating.set()  # (respx records a call only once it is answered)
        await gate_wait(free_b)
        return httpx.Response(200, json={"served_by": "b"})

    dies = router.post(f"{A}/v1/chat/completions").respond(
        200, headers={"content-type": "text/event-stream"}, content=broken_sse(break_a)
    )
    down_once_it_refused(router, A, dies)  # a died with that answer: its /health is refused from then on
    served = router.post(f"{B}/v1/chat/completions").mock(side_effect=b_answer)
    with pool_proxy(router, openai_backends()) as base:
        on_a = BackgroundPosts(base, "[long] a")
        wait_until(lambda: dies.called, what="a generating")
        on_b = BackgroundPosts(base, "[long] b")
        wait_until(b_generating.is_set, what="b generating")
        queued = BackgroundPosts(base, "[short] next")
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 1, what="one queued")
        break_a.set()  # a's answer breaks: its slot frees while a request waits
        on_a.join()
        free_b.set()
        on_b.join()
        queued.join()
    assert on_a.responses[0].headers["x-clairvoyant-backend"] == "backend-1" and '"error"' in on_a.responses[0].text
    assert queued.responses[0].headers["x-clairvoyant-backend"] == "backend-2"  # not the suspect a
    assert dies.call_count == 1 and served.call_count == 2


def test_a_client_that_leaves_while_its_request_waits_for_another_backend_is_never_sent() -> None:
    router = respx.MockRouter(assert_all_called=False)
    release_b, b_busy = threading.Event(), threading.Event()
    refused = router.post(f"{A}/v1/chat/completions").mock(side_effect=httpx.ConnectError("refused"))
    bodies_at_b: list[str] = []

    async def b_answer(request: httpx.Request) -> httpx.Response:
        bodies_at_b.append(json.loads(request.content)["messages"][-1]["content"])
        b_busy.set()
        await gate_wait(release_b)
        return httpx.Response(200, json={"served_by": "b"})

    router.post(f"{B}/v1/chat/completions").mock(side_effect=b_answer)
    # a's /health stays up (it refuses only the chat path), so a is chosen again for the next request
    with pool_proxy(router, openai_backends()) as base:
        first = BackgroundPosts(base, "first")
        wait_until(b_busy.is_set, what="the first rerouted to b")
        wait_until(lambda: queue_snapshot(base)["backends"][0]["healthy"], what="a healthy again")
        with pytest.raises(httpx.ReadTimeout):  # refused by a, then waits for the busy b; its client leaves
            httpx.post(f"{base}/v1/chat/completions", json=chat("leaver"), timeout=1.0)
        wait_until(lambda: queue_snapshot(base)["recent"], what="the leaver's record")
        recent = queue_snapshot(base)["recent"]
        release_b.set()
        first.join()
    assert refused.call_count == 2 and bodies_at_b == ["first"]  # the leaver never reached b
    assert recent[0]["outcome"] == "left_queued" and first.responses[0].json() == {"served_by": "b"}
