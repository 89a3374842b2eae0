"""The live page /ui, loaded in a real headless Chromium against a running proxy with a held queue.

Chromium comes from Debian's ``chromium`` package (``make test`` installs it). The page is rendered
with --dump-dom after its scripts ran (virtual time), and its rows are compared with /queue. A
screenshot is kept in test-artifacts/ui.png.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
import respx
from proxy_harness import (
    BackgroundPosts,
    HeldBackend,
    MarkerPredictor,
    mock_transport,
    queue_snapshot,
    running_proxy,
    wait_until,
)

from clairvoyant.config import Settings

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
UPSTREAM = "http://upstream.test"


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "Debian's chromium is not installed (make test installs it: apt-get install chromium)"
        if os.environ.get("CLAIRVOYANT_REQUIRE_BACKEND") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def _chromium_run(url: str, *args: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        command = [
            _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--virtual-time-budget=4000", *args, url,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_page_shows_the_held_queue_in_dispatch_order() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    settings = Settings(upstream_url=UPSTREAM, starvation_timeout_s=600, fair_share=False)
    with running_proxy(settings, predictor=MarkerPredictor(), upstream_transport=mock_transport(router)) as base:
        holder = BackgroundPosts(base, "[long] holder")
        wait_until(lambda: backend.order == ["[long] holder"], what="the holder at the backend")
        waiting = BackgroundPosts(base, "[p=0.9] late", "[short] quick", "[p=0.5] middle")
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 3, what="three waiting")
        queue = queue_snapshot(base)
        head = httpx.get(f"{base}/queue", params={"limit": 2}).json()
        page = httpx.get(f"{base}/ui/")
        redirect = httpx.get(f"{base}/ui")
        dom = _chromium_run(f"{base}/ui/", "--dump-dom")
        ARTIFACTS.mkdir(exist_ok=True)
        _chromium_run(f"{base}/ui/", f"--screenshot={ARTIFACTS / 'ui.png'}", "--window-size=1280,720")
        backend.gate.set()
        holder.join(timeout=30)
        waiting.join(timeout=30)

    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert head["waiting_count"] == 3 and [w["request_id"] for w in head["waiting"]] == [
        w["request_id"] for w in queue["waiting"][:2]
    ]  # the page's bounded view: the head of the queue, and the whole count
    assert redirect.status_code in (307, 308) or redirect.url.path == "/ui/"
    expected = [row["request_id"] for row in queue["waiting"]]
    waiting_table = dom.split('id="waiting"', 1)[1].split("</table>", 1)[0]
    shown = re.findall(r'<tr data-request-id="([^"]+)"', waiting_table)
    assert shown == expected  # every waiting request, in dispatch order
    slots_table = dom.split('id="slots"', 1)[1].split("</table>", 1)[0]
    assert re.findall(r'<tr data-request-id="([^"]+)"', slots_table) == [queue["in_flight"][0]["request_id"]]
    assert "holder" not in dom and "quick" not in dom  # no prompt text, ever
    assert (ARTIFACTS / "ui.png").stat().st_size > 10_000


def test_with_a_pool_the_page_shows_each_backend_and_where_each_request_runs() -> None:
    backend = HeldBackend()
    router = respx.MockRouter(assert_all_called=False)
    a, b = "http://a.test", "http://b.test"
    router.post(f"{a}/v1/chat/completions").mock(side_effect=backend)
    router.get(f"{a}/health").respond(200, json={"status": "ok"})
    router.get(f"{b}/health").mock(side_effect=httpx.ConnectError("refused"))  # b is down
    settings = Settings(
        backends=[{"url": a, "kind": "openai", "slots": 1}, {"url": b, "kind": "openai", "slots": 1}],
        starvation_timeout_s=600,
    )
    with running_proxy(settings, predictor=MarkerPredictor(), upstream_transport=mock_transport(router)) as base:
        holder = BackgroundPosts(base, "[long] holder")
        wait_until(lambda: backend.order == ["[long] holder"], what="the holder at backend a")
        wait_until(lambda: not queue_snapshot(base)["backends"][1]["healthy"], what="b seen down")
        dom = _chromium_run(f"{base}/ui/", "--dump-dom")
        backend.gate.set()
        holder.join(timeout=30)
    summary = dom.split('id="summary">', 1)[1].split("</span>", 1)[0]
    assert "backend-1 1/1" in summary and "backend-2 down" in summary
    slots_table = dom.split('id="slots"', 1)[1].split("</table>", 1)[0]
    assert "backend-1 #0" in slots_table
