"""API keys (tenants, priority ranges), the pass-through allowlist, and secrets kept out of logs."""

from __future__ import annotations

import logging
import threading
from typing import Any

import httpx
import pytest
import respx
from polling import wait_until
from proxy_harness import HeldBackend, MarkerPredictor, mock_transport, queue_snapshot, running_proxy

from clairvoyant.config import Settings
from clairvoyant.proxy.access import hash_key

UPSTREAM = "http://upstream.test"
ALICE = "cv-alice-secret-key-0123456789"
BOB = "cv-bob-secret-key-9876543210"
KEYS = [
    {"hash": hash_key(ALICE), "tenant": "alice", "min_priority": 5, "max_priority": 9, "weight": 2.0},
    {"hash": hash_key(BOB), "tenant": "bob"},
]


def proxy(router: respx.MockRouter, **overrides: Any) -> Any:
    settings = Settings(upstream_url=UPSTREAM, **overrides)
    return running_proxy(settings, predictor=MarkerPredictor(), upstream_transport=mock_transport(router))


def chat(text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def test_a_missing_or_wrong_key_is_401_in_each_dialect() -> None:
    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    route = router.post("/v1/chat/completions").respond(200, json={"ok": 1})
    with proxy(router, api_keys=KEYS) as base:
        missing = httpx.post(f"{base}/v1/chat/completions", json=chat())
        wrong = httpx.post(f"{base}/api/chat", json=chat(), headers={"Authorization": "Bearer nope"})
        bearer = httpx.post(f"{base}/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {ALICE}"})
        api_key = httpx.post(f"{base}/v1/chat/completions", json=chat(), headers={"X-Api-Key": BOB})
        health = httpx.get(f"{base}/healthz")
        queue = httpx.get(f"{base}/queue")  # status pages are open unless status_requires_key
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert missing.headers["www-authenticate"] == "Bearer"
    assert wrong.status_code == 401 and isinstance(wrong.json()["error"], str)  # Ollama's shape
    assert bearer.status_code == 200 and api_key.status_code == 200
    assert health.status_code == 200 and queue.status_code == 200
    assert route.call_count == 2  # refused requests never reach the backend


def test_the_key_names_the_tenant_and_bounds_the_priority() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    with proxy(router, api_keys=KEYS, starvation_timeout_s=600) as base, httpx.Client(timeout=30) as client:

        def post(key: str, text: str, priority: int) -> None:
            client.post(
                f"{base}/v1/chat/completions",
                json=chat(text, priority=priority),
                headers={"Authorization": f"Bearer {key}", "X-Clairvoyant-Tenant": "mallory"},
            )

        threads = [threading.Thread(target=post, args=a) for a in [(BOB, "[long] holder", 0)]]
        threads[0].start()
        wait_until(lambda: backend.order == ["[long] holder"])
        for args in [(ALICE, "[short] urgent", 0), (ALICE, "[short] lazy", 10), (BOB, "[short] bob", 3)]:
            threads.append(threading.Thread(target=post, args=args))
            threads[-1].start()
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 3)
        waiting = queue_snapshot(base)["waiting"]
        backend.gate.set()
        for t in threads:
            t.join(timeout=30)
    by_tenant = sorted((w["tenant"], w["priority"]) for w in waiting)
    assert by_tenant == [("alice", 5), ("alice", 9), ("bob", 3)]  # alice's range is 5..9; the header is ignored


def test_the_client_key_is_not_forwarded_but_the_backend_key_is() -> None:
    seen: list[httpx.Headers] = []
    router = respx.MockRouter(base_url=UPSTREAM)

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"ok": 1})

    router.post("/v1/chat/completions").mock(side_effect=record)
    router.get("/api/tags").mock(side_effect=record)
    with proxy(router, api_keys=KEYS, upstream_api_key="backend-secret") as base:
        httpx.post(f"{base}/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {ALICE}"})
        httpx.get(f"{base}/api/tags", headers={"X-Api-Key": BOB})
    assert [h.get("authorization") for h in seen] == ["Bearer backend-secret"] * 2
    assert all("x-api-key" not in h for h in seen)


def test_admin_paths_are_closed_beyond_localhost_and_open_on_it() -> None:
    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    pull = router.post("/api/pull").respond(200, json={"status": "success"})
    router.delete("/api/delete").respond(200)
    router.get("/api/tags").respond(200, json={"models": []})
    with proxy(router, host="0.0.0.0") as base:
        refused = httpx.post(f"{base}/api/pull", json={"model": "x"})
        deleted = httpx.request("DELETE", f"{base}/api/delete", json={"model": "x"})
        tags = httpx.get(f"{base}/api/tags")
        scheduled_paths_stay_open = httpx.get(f"{base}/healthz")
    assert refused.status_code == 403 and isinstance(refused.json()["error"], str)
    assert deleted.status_code == 403 and tags.status_code == 200 and scheduled_paths_stay_open.status_code == 200
    assert pull.call_count == 0
    with proxy(router) as base:  # loopback: the operator's own machine, everything passes
        assert httpx.post(f"{base}/api/pull", json={"model": "x"}).status_code == 200
    with proxy(router, host="0.0.0.0", passthrough_allow=["POST /api/pull"]) as base:
        assert httpx.post(f"{base}/api/pull", json={"model": "x"}).status_code == 200
        assert httpx.get(f"{base}/api/tags").status_code == 403


def test_status_pages_can_require_a_key() -> None:
    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    with proxy(router, api_keys=KEYS, status_requires_key=True) as base:
        statuses = [httpx.get(f"{base}{p}").status_code for p in ("/queue", "/queue/x", "/metrics", "/history")]
        keyed = [httpx.get(f"{base}{p}", headers={"X-Api-Key": BOB}).status_code for p in ("/queue", "/history")]
        page = [httpx.get(f"{base}{p}").status_code for p in ("/ui/", "/ui/ui.js")]  # the files, not the data
        bare = httpx.get(f"{base}/ui")  # the same page, as docs/configuration.md says: open, by a redirect
        ready = httpx.get(f"{base}/healthz")
    assert statuses == [401, 401, 401, 401] and keyed == [200, 200] and ready.status_code == 200
    assert page == [200, 200]
    assert bare.is_redirect and bare.headers["location"] == "/ui/"


def test_only_the_status_endpoints_themselves_skip_the_allowlist() -> None:
    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    reached = router.route(path__regex=r"^/(queue|metrics|ui|history)").respond(200)
    with proxy(router, host="0.0.0.0", api_keys=KEYS) as base:
        near = [
            httpx.get(f"{base}{p}").status_code for p in ("/queuex", "/queue/a/b", "/metricsx", "/uix", "/historyx")
        ]
        posted = [httpx.post(f"{base}{p}").status_code for p in ("/queue", "/ui/", "/history")]
    assert near == [403] * 5 and posted == [403] * 3 and reached.call_count == 0


def test_no_key_or_backend_secret_is_logged_even_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    router.post("/v1/chat/completions").respond(200, json={"ok": 1})
    with proxy(router, api_keys=KEYS, upstream_api_key="backend-secret-xyz", log_level="debug") as base:
        httpx.post(f"{base}/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {ALICE}"})
        httpx.post(f"{base}/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer wrong-secret-abc"})
    logged = "\n".join(f"{r.getMessage()} {getattr(r, 'fields', '')}" for r in caplog.records)
    assert "request" in logged  # there were request lines to leak into
    for secret in (ALICE, "wrong-secret-abc", "backend-secret-xyz"):
        assert secret not in logged


def test_only_reads_of_the_open_paths_skip_the_allowlist_and_the_key() -> None:
    from clairvoyant.proxy.access import AccessControl, Denied

    settings = Settings(
        host="0.0.0.0", api_keys=[{"hash": "sha256:" + "a" * 64, "tenant": "t"}], passthrough_allow=["GET /v1/models"]
    )
    access = AccessControl(settings)
    assert access.admit("GET", "/healthz", [])[0] is None  # open
    for method in ("POST", "PUT", "DELETE"):
        with pytest.raises(Denied):  # would be relayed to the backend: the allowlist and the key apply
            access.admit(method, "/healthz", [])
