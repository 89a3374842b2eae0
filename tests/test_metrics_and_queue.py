"""/metrics and /queue move as requests flow (respx-mocked backend held on a gate)."""

from __future__ import annotations

import json
import threading

import httpx
import respx
from polling import wait_until
from proxy_harness import (
    BackgroundPosts,
    HeldBackend,
    MarkerPredictor,
    metric_value,
    mock_transport,
    queue_snapshot,
    running_proxy,
)

from clairvoyant.config import Settings

UPSTREAM = "http://upstream.test"


def test_metrics_follow_a_held_queue_and_its_release() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    settings = Settings(upstream_url=UPSTREAM, max_queue=3, starvation_timeout_s=42)
    with running_proxy(settings, predictor=MarkerPredictor(), upstream_transport=mock_transport(router)) as base:
        threads = [BackgroundPosts(base, "[long] secret holder text")]
        wait_until(lambda: len(backend.order) == 1, what="holder dispatched")
        assert httpx.post(f"{base}/api/chat", json={"messages": []}).status_code == 400
        threads += [
            BackgroundPosts(base, "[short] secret s1"),
            BackgroundPosts(base, "[short] secret s2"),
            BackgroundPosts(base, "[long] secret l1"),
        ]
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 3, what="3 waiting")

        assert metric_value(base, "clairvoyant_queue_depth", 'predicted_class="short"') == 2
        assert metric_value(base, "clairvoyant_queue_depth", 'predicted_class="long"') == 1
        assert metric_value(base, "clairvoyant_in_flight_requests") == 1
        assert metric_value(base, "clairvoyant_starvation_timeout_seconds") == 42

        # Rejections by reason: queue full, too large (and bad request, above).
        assert (
            httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code
            == 503
        )
        assert httpx.post(f"{base}/v1/chat/completions", content=b"x" * (17 * 1024 * 1024)).status_code == 413
        for reason in ("queue_full", "too_large", "bad_request"):
            assert metric_value(base, "clairvoyant_rejections_total", f'reason="{reason}"') == 1, reason

        snapshot = queue_snapshot(base)
        text = json.dumps(snapshot)
        assert "secret" not in text  # no prompt text
        assert [w["position"] for w in snapshot["waiting"]] == [0, 1, 2]
        assert [w["predicted_class"] for w in snapshot["waiting"]] == ["short", "short", "long"]
        assert all(w["waited_s"] >= 0 and w["endpoint"] == "/v1/chat/completions" for w in snapshot["waiting"])
        assert snapshot["in_flight"][0]["predicted_class"] == "long" and snapshot["in_flight"][0]["slot"] == 0
        assert snapshot["policy"] == "sjf" and snapshot["slots"] == 1

        backend.gate.set()
        for t in threads:
            t.join(10)
        wait_until(lambda: metric_value(base, "clairvoyant_in_flight_requests") == 0, what="all done")
        assert metric_value(base, "clairvoyant_queue_depth", 'predicted_class="short"') == 0
        assert metric_value(base, "clairvoyant_queue_wait_seconds_count", 'predicted_class="short"') == 2
        assert metric_value(base, "clairvoyant_queue_wait_seconds_count", 'predicted_class="long"') == 2
        assert metric_value(base, "clairvoyant_end_to_end_seconds_count", 'predicted_class="short"') == 2
        assert metric_value(base, "clairvoyant_time_to_first_byte_seconds_count", 'predicted_class="long"') == 2
        # 4 served; the one refused by the full queue was refused before its body was read.
        assert metric_value(base, "clairvoyant_predictor_seconds_count") == 4
        assert (
            metric_value(
                base, "clairvoyant_requests_total", 'dialect="openai",endpoint="/v1/chat/completions",status="200"'
            )
            == 4
        )
        assert (
            metric_value(
                base, "clairvoyant_requests_total", 'dialect="openai",endpoint="/v1/chat/completions",status="503"'
            )
            == 1
        )
        assert queue_snapshot(base)["waiting"] == []


def _post_as(base: str, tenant: str, text: str) -> threading.Thread:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    headers = {"X-Clairvoyant-Tenant": tenant}
    thread = threading.Thread(
        target=lambda: httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30), daemon=True
    )
    thread.start()
    return thread


def test_metrics_show_what_the_proxy_retains_and_it_empties_after_the_requests() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    settings = Settings(upstream_url=UPSTREAM, tenants=[{"name": "a"}, {"name": "b"}])
    with running_proxy(settings, predictor=MarkerPredictor(), upstream_transport=mock_transport(router)) as base:
        threads = [_post_as(base, "a", "[long] holder")]
        wait_until(lambda: len(backend.order) == 1, what="holder dispatched")
        threads.append(_post_as(base, "b", "[short] waiter"))
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 1, what="1 waiting")
        assert metric_value(base, "clairvoyant_retained_entries", 'structure="fair_share_tenants"') == 2
        assert metric_value(base, "clairvoyant_retained_entries", 'structure="running"') == 1
        busy_tasks = metric_value(base, "clairvoyant_event_loop_tasks")
        backend.gate.set()
        for thread in threads:
            thread.join(timeout=10)
        wait_until(lambda: not queue_snapshot(base)["in_flight"], what="nothing in flight")
        assert metric_value(base, "clairvoyant_retained_entries", 'structure="fair_share_tenants"') == 0
        assert metric_value(base, "clairvoyant_retained_entries", 'structure="running"') == 0
        assert metric_value(base, "clairvoyant_retained_entries", 'structure="limit_tenants"') == 2
        assert 0 < metric_value(base, "clairvoyant_event_loop_tasks") < busy_tasks


def test_queue_shows_every_models_service_time_fit_after_its_requests_ended() -> None:
    """/queue's ``service_time`` lists each model's fit, the one that orders its requests: not
    only the default model's and those in flight, so an idle proxy still shows what it learned."""
    from clairvoyant.scheduling.service_time import C_DECODE_MIN_S

    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(return_value=httpx.Response(200, json={"ok": True}))
    router.get("/health").respond(200)
    settings = Settings(upstream_url=UPSTREAM)
    with running_proxy(settings, predictor=MarkerPredictor(), upstream_transport=mock_transport(router)) as base:
        # (the first qwen answer followed a model switch, whose load is not service: not learned)
        for model in ("smollm2", "smollm2", "qwen", "qwen"):
            body = {"model": model, "messages": [{"role": "user", "content": "[short] hi"}]}
            assert httpx.post(f"{base}/v1/chat/completions", json=body).status_code == 200
        wait_until(lambda: metric_value(base, "clairvoyant_in_flight_requests") == 0, what="all done")
        wait_until(
            lambda: queue_snapshot(base)["service_time"].get("smollm2", {}).get("observations") == 2,
            what="both smollm2 answers learned",
        )
        fits = queue_snapshot(base)["service_time"]
        assert fits["qwen"]["observations"] == 1
        assert fits["default"]["observations"] == 0  # no request without a model: the defaults
        for fit in fits.values():
            assert fit["c0_s"] >= 0 and fit["c_prompt_s"] >= 0 and fit["c_decode_s"] >= C_DECODE_MIN_S
            assert fit["outlier_factor"] >= 3.0
