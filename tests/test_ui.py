"""The live page /ui, in a real headless Chromium (tests/browser.py) against a running proxy.

Chromium comes from Debian's ``chromium`` package (``make test`` installs it). Each test waits for
the page's elements, never for a fixed time. The keyed test keeps a screenshot in
test-artifacts/ui.png; ``python benchmarks/ui_screenshot.py`` makes docs/img/ui.png from the same scene.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import respx
from browser import Browser, Page
from manual_clock import ManualClock
from proxy_harness import (
    BackgroundPosts,
    HeldBackend,
    MarkerPredictor,
    gate_wait,
    mock_transport,
    queue_snapshot,
    running_proxy,
    wait_until,
)
from ui_scenario import KEYS, OPS_KEY, RUN, busy_proxy

from clairvoyant.config import Settings

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
UPSTREAM = "http://upstream.test"

ROW_IDS = "[...document.querySelectorAll('#{table} tbody tr[data-request-id]')].map((tr) => tr.dataset.requestId)"
PAGE_TEXT = "document.body.innerText + '\\n' + document.documentElement.textContent"
# Each request's row on the timeline: its state label (and whether it is cut), and its bars as
# fractions of the bar's width (0 = the left edge, 1 = now).
TIMELINE = """[...document.querySelectorAll('#timeline .row[data-request-id]')].map((row) => {
  const bar = row.querySelector('.bar').getBoundingClientRect();
  const state = row.querySelector('.state');
  const part = (name) => {
    const box = row.querySelector('.' + name)?.getBoundingClientRect();
    return box ? [(box.left - bar.left) / bar.width, box.width / bar.width] : null;
  };
  return {id: row.dataset.requestId, state: state.textContent, cut: state.scrollWidth > state.clientWidth,
          queued: part('queued'), running: part('running')};
})"""
# Each chart: its time axis' labels, and how much it drew.
CHARTS = """Object.fromEntries([...document.querySelectorAll('.charts figure')].map((figure) => [figure.id, {
  time_labels: [...figure.querySelectorAll('g.axis.time text')].map((t) => t.textContent),
  lines: figure.querySelectorAll('path.line').length,
  dots: figure.querySelectorAll('circle').length,
  no_data: figure.querySelector('.no-data')?.textContent || null,
  legend: figure.querySelector('.legend').innerText,
}]))"""


class HoldMarked:
    """A mocked serial backend: answers at once, except requests whose text has "hold", which wait
    for ``gate``. Records the order requests reach it."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.gate = threading.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        text = json.loads(request.content)["messages"][-1]["content"]
        self.order.append(text)
        if "hold" in text:
            await gate_wait(self.gate)
        return httpx.Response(200, json={"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": 7}})


def _rows(page: Page, table: str) -> list[str]:
    return list(page.evaluate(ROW_IDS.format(table=table)))


def test_without_keys_the_page_shows_the_queue_at_once_and_the_current_burst_at_full_width() -> None:
    backend = HoldMarked()
    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    router.get("/health").respond(200)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    clock = ManualClock(1000.0)
    settings = Settings(upstream_url=UPSTREAM, starvation_timeout_s=6000, fair_share=False)
    with running_proxy(
        settings, predictor=MarkerPredictor(), upstream_transport=mock_transport(router), clock=clock
    ) as base:
        earlier = BackgroundPosts(base, "[short] earlier one", "[long] earlier two")
        earlier.join(timeout=30)
        clock.advance(600)  # ten minutes later, a burst
        holder = BackgroundPosts(base, "[long] holder")
        wait_until(lambda: "[long] holder" in backend.order, what="the holder at the backend")
        waiting = BackgroundPosts(base, "[p=0.9] late", "[short] quick", "[p=0.5] middle")
        wait_until(lambda: queue_snapshot(base)["waiting_count"] == 3, what="three waiting")
        clock.advance(5)
        queue = queue_snapshot(base)
        head = httpx.get(f"{base}/queue", params={"limit": 2}).json()
        page_file = httpx.get(f"{base}/ui/")
        redirect = httpx.get(f"{base}/ui")
        with Browser() as browser:
            page = browser.open(f"{base}/ui/")
            page.wait_for(f"{ROW_IDS.format(table='waiting')}.length === 3", what="three waiting rows")
            page.wait_for("document.querySelectorAll('#timeline .row[data-request-id]').length === 4", what="timeline")
            login_hidden = page.evaluate("document.getElementById('login').hidden")
            waiting_rows, slot_rows = _rows(page, "waiting"), _rows(page, "slots")
            timeline = page.evaluate(TIMELINE)
            text = page.evaluate(PAGE_TEXT)
            errors = browser.errors
        backend.gate.set()
        for posts in (holder, waiting):
            posts.join(timeout=30)

    assert page_file.status_code == 200 and "text/html" in page_file.headers["content-type"]
    assert redirect.status_code in (307, 308) or redirect.url.path == "/ui/"
    assert head["waiting_count"] == 3 and [w["request_id"] for w in head["waiting"]] == [
        w["request_id"] for w in queue["waiting"][:2]
    ]  # the page's bounded view: the head of the queue, and the whole count
    assert login_hidden  # no key asked for: keys are off
    assert waiting_rows == [row["request_id"] for row in queue["waiting"]]  # every waiting request, in dispatch order
    assert slot_rows == [queue["in_flight"][0]["request_id"]]
    # The timeline: the burst only (the earlier requests ended 10 minutes ago), across the whole width.
    holder_id = queue["in_flight"][0]["request_id"]
    assert [row["id"] for row in timeline] == [holder_id, *waiting_rows]
    by_id = {row["id"]: row for row in timeline}
    assert by_id[holder_id]["state"] == "running" and by_id[holder_id]["running"][1] > 0.95
    for request_id in waiting_rows:
        left, width = by_id[request_id]["queued"]
        assert by_id[request_id]["state"] == "queued" and left < 0.02 and width > 0.95
    assert not any(row["cut"] for row in timeline)  # state labels are whole
    assert "holder" not in text and "quick" not in text and "earlier" not in text  # no prompt text, ever
    assert "NaN" not in text and "undefined" not in text and errors == []


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
        with Browser() as browser:
            page = browser.open(f"{base}/ui/")
            summary = page.wait_for(
                "document.getElementById('summary').textContent.includes('backend-2 down')"
                " && document.getElementById('summary').textContent",
                what="the pool in the summary",
            )
            slots = page.evaluate("document.querySelector('#slots tbody').innerText")
            backends = page.evaluate(
                "[...document.querySelectorAll('#backends tbody tr')].map((tr) => [...tr.cells].map((c) => c.textContent))"
            )
            cluster = page.evaluate(
                "[document.getElementById('cluster').hidden, document.getElementById('cluster-state').textContent]"
            )
            titles = page.evaluate(
                "[...document.querySelectorAll('#live h2')].map((h) => h.innerText)"
                ".filter((t) => t.startsWith('Running') || t.startsWith('Waiting'))"
            )
        backend.gate.set()
        holder.join(timeout=30)
    assert "backend-1 1/1" in summary and "backend-2 down" in summary
    assert "backend-1 #0" in slots
    assert [row[:3] for row in backends] == [["backend-1", "up", "1/1"], ["backend-2", "down", "0/1"]]
    assert cluster == [True, ""]  # one process: no cluster section, nothing in the header
    assert titles == ["Running what each backend slot is doing", "Waiting in dispatch order: the top row goes next"]


def _no_data(page: Page) -> dict[str, Any]:
    return dict(
        page.evaluate(
            """({live_hidden: document.getElementById('live').hidden,
                 rows: document.querySelectorAll('tr[data-request-id], #timeline .row').length,
                 charts: document.querySelectorAll('svg.chart-svg').length,
                 summary: document.getElementById('summary').textContent,
                 error: document.getElementById('login-error').textContent})"""
        )
    )


def test_with_keys_the_page_asks_for_one_then_shows_the_data_and_its_charts() -> None:
    with busy_proxy() as scene, Browser(height=1000) as browser:
        base = scene.base
        without = {p: httpx.get(f"{base}{p}").status_code for p in ("/queue", "/queue/x", "/metrics", "/history")}
        files = {p: httpx.get(f"{base}{p}").status_code for p in ("/ui/", "/ui/ui.js", "/ui/charts.js", "/ui/ui.css")}
        tenant_key = httpx.get(f"{base}/history", headers={"X-Api-Key": KEYS["alice"]}).status_code
        page = browser.open(f"{base}/ui/")
        page.wait_for("!document.getElementById('login').hidden", what="the key form")
        locked = _no_data(page)
        page.type_into("#key", "cv-not-a-key")
        page.press_enter()
        page.wait_for("document.getElementById('login-error').textContent", what="the refusal")
        refused = _no_data(page)
        page.type_into("#key", OPS_KEY)
        page.press_enter()
        page.wait_for(f"{ROW_IDS.format(table='waiting')}.length === 4", what="the waiting requests")
        stored = page.evaluate("sessionStorage.getItem('clairvoyant.key')")
        # The learner has one answer for model "m": too few to rank, and the page says so.
        quality = page.wait_for(
            "document.getElementById('quality').textContent.includes('m not enough data')"
            " && document.getElementById('quality').textContent",
            what="the prediction quality in the header",
        )
        page.wait_for(
            f"document.querySelectorAll('#chart-answers circle.dot').length >= {RUN}", what="the answers' chart"
        )
        charts = page.evaluate(CHARTS)
        tenants = page.evaluate(
            "[...document.querySelectorAll('#tenants tbody tr')].map((tr) => [...tr.cells].map((c) => c.textContent))"
        )
        backends = page.evaluate("document.querySelector('#backends tbody').innerText")
        text = page.evaluate(PAGE_TEXT)
        queue = httpx.get(f"{base}/queue", headers={"Authorization": f"Bearer {OPS_KEY}"}).json()
        waiting = _rows(page, "waiting")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(ARTIFACTS / "ui.png")
        errors = browser.errors

    # Without a key: the page's files, and nothing of the data, in the browser or out of it.
    assert without == {"/queue": 401, "/queue/x": 401, "/metrics": 401, "/history": 401}
    assert set(files.values()) == {200} and tenant_key == 200  # any valid key reads the status
    assert locked == {"live_hidden": True, "rows": 0, "charts": 0, "summary": "", "error": ""}
    assert refused["rows"] == 0 and refused["charts"] == 0 and "refused" in refused["error"]
    # With it: the data.
    assert stored == OPS_KEY
    assert waiting == [w["request_id"] for w in queue["waiting"]]
    assert "NaN" not in text and "undefined" not in text and errors == []
    assert "NaN" not in quality and re.search(r"llama3\.2:1b (-?\d\.\d\d|not enough data)", quality)
    clock_label = re.compile(r"^\d\d:\d\d(:\d\d)?$")
    for name in ("chart-queue", "chart-waits", "chart-tenants", "chart-limits"):
        labels = charts[name]["time_labels"]
        assert sum(bool(clock_label.match(label)) for label in labels) >= 2 and "local time" in labels, name
        assert charts[name]["no_data"] is None and charts[name]["lines"] + charts[name]["dots"] > 0, name
    assert "short P95" in charts["chart-waits"]["legend"] and "waiting" in charts["chart-queue"]["legend"]
    assert "m: not enough data yet (1 answer" in charts["chart-answers"]["legend"]
    for tenant in ("alice", "bob", "carol"):
        assert f"{tenant} P95" in charts["chart-tenants"]["legend"]
    assert charts["chart-limits"]["legend"] == "alice"  # the one tenant with a limit on requests
    by_tenant = {row[0]: row for row in tenants}
    assert by_tenant["alice"][2] == "2 of 8" and by_tenant["alice"][3].endswith("of 60")  # 2 waiting now
    assert by_tenant["bob"][4].endswith("of 20000") and by_tenant["carol"][2].endswith("(no limit)")
    assert re.match(r"\d\.\d\d s / \d\.\d\d s \(\d+\)", by_tenant["alice"][1])
    assert "backend-1" in backends and "up" in backends
    assert (ARTIFACTS / "ui.png").stat().st_size > 30_000


def test_with_replicas_the_page_shows_the_clusters_queue_with_each_requests_replica_and_their_health(
    own_redis_server: Any,
) -> None:
    """Two replicas on a real Redis, the queue held across both; the page of r0 shows the whole
    queue with the replica of each request, and both replicas live; then Redis stops and the page
    says r0 is degraded."""
    from cluster_scene import WAITING, held_cluster

    cells = "[...document.querySelectorAll('#{table} tbody tr')].map((tr) => [...tr.cells].map((c) => c.textContent))"
    with held_cluster(own_redis_server.url) as scene, Browser() as browser:
        page = browser.open(f"{scene.bases['r0']}/ui/")
        page.wait_for(f"{ROW_IDS.format(table='cluster-waiting')}.length === 3", what="the cluster's waiting rows")
        page.wait_for(f"{cells.format(table='replicas')}.length === 2", what="both replicas")
        waiting = page.evaluate(cells.format(table="cluster-waiting"))
        replicas = page.evaluate(cells.format(table="replicas"))
        slots = page.evaluate(cells.format(table="cluster-slots"))
        local_rows = _rows(page, "waiting")
        local_titles = page.evaluate("[...document.querySelectorAll('#live h2')].map((h) => h.innerText)")
        state = page.evaluate("document.getElementById('cluster-state').textContent")
        own_redis_server.stop()
        degraded = page.wait_for(
            "document.getElementById('cluster-state').className === 'degraded'"
            " && [document.getElementById('cluster-state').textContent, document.getElementById('cluster-mode').textContent]",
            what="the page saying r0 is degraded",
        )
        text = page.evaluate(PAGE_TEXT)
        errors = browser.errors
    replica_of = {label: replica for label, replica, _ in WAITING}
    # The whole queue in dispatch order, each request with the replica that holds it.
    assert [row[1] for row in waiting] == [scene.ids[label] for label in scene.dispatch_order]
    assert [row[2] for row in waiting] == [replica_of[label] for label in scene.dispatch_order]
    assert [row[0] for row in waiting] == ["0", "1", "2"]
    # r0's own table lists only its requests; the cluster's lists r1's too.
    assert local_rows == [scene.ids[label] for label in scene.dispatch_order if replica_of[label] == "r0"]
    assert [t for t in local_titles if t.startswith(("Running", "Waiting"))] == [
        "Running on this replica what each backend slot is doing",
        "Waiting on this replica in dispatch order: the top row goes next",
    ]
    assert [row[:2] for row in sorted(replicas)] == [["r0 (this one)", "live"], ["r1", "live"]]
    assert all(re.fullmatch(r"\d+\.\d s ago", row[2]) for row in replicas)
    assert [row[:3] for row in slots] == [["backend-1 #0", scene.holder_id, "r0"]]
    assert state == f"cluster {scene.cluster} · replica r0 · shared · 2/2 replicas live · 3 waiting in the cluster"
    assert degraded[0].startswith(f"cluster {scene.cluster} · replica r0 · degraded")
    assert "cannot reach Redis" in degraded[1] and "could not be read" in degraded[1]
    assert "NaN" not in text and "undefined" not in text and errors == []
