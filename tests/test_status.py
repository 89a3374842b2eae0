"""`clairvoyant status` against the real proxy with a held queue (a backend that waits on a gate),
keys required for the status pages; and its table against /queue objects older and newer than this
proxy's."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from manual_clock import ManualClock
from polling import wait_until
from proxy_harness import LOOPBACK, HeldBackend, MarkerPredictor, mock_transport, running_proxy

from clairvoyant.cli import main
from clairvoyant.config import Settings
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.learner import ModelQuality
from clairvoyant.proxy.access import hash_key
from clairvoyant.tools.status import KEY_ENV, read_metrics
from clairvoyant.tools.status_table import NOT_ENOUGH_DATA, render, seconds

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = "http://upstream.test"
OPS = "cv-ops-status-key-0123456789"
TEAM = "cv-team-a-key-9876543210"
KEYS = [{"hash": hash_key(OPS), "tenant": "ops"}, {"hash": hash_key(TEAM), "tenant": "team-a", "weight": 2.0}]
ARRIVALS = [(TEAM, "[long] l1"), (OPS, "[short] s1"), (TEAM, "[p=0.4] m1"), (OPS, "[short] s2")]


class KeyedPost(threading.Thread):
    """One chat request POSTed with a client key, from a background thread."""

    def __init__(self, base: str, key: str, text: str) -> None:
        super().__init__(daemon=True)
        self.base, self.key, self.text = base, key, text
        self.start()

    def run(self) -> None:
        httpx.post(
            f"{self.base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": self.text}]},
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=30,
        )


def queue(base: str) -> dict[str, Any]:
    response = LOOPBACK.get(f"{base}/queue", headers={"X-Api-Key": OPS})
    assert response.status_code == 200
    return response.json()


@contextmanager
def held_queue() -> Iterator[str]:
    """A proxy whose one slot is held, with ARRIVALS waiting (sent one after another, so the arrival
    order is known and differs from the dispatch order). Its clock stands still: /queue's times
    (waited, ETAs) are the same at every read."""
    backend = HeldBackend()
    router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
    router.get("/health").respond(200)
    router.post("/v1/chat/completions").mock(side_effect=backend)
    settings = Settings(upstream_url=UPSTREAM, api_keys=KEYS, status_requires_key=True, max_queue=10)
    with running_proxy(
        settings, predictor=MarkerPredictor(), upstream_transport=mock_transport(router), clock=ManualClock(1000.0)
    ) as base:
        posts = [KeyedPost(base, OPS, "[long] holder")]
        wait_until(lambda: len(backend.order) == 1, what="the holder dispatched")
        for waiting, (key, text) in enumerate(ARRIVALS, 1):
            posts.append(KeyedPost(base, key, text))
            wait_until(lambda n=waiting: queue(base)["waiting_count"] == n, what=f"{text} waiting")
        try:
            yield base
        finally:
            backend.gate.set()
            for post in posts:
                post.join(10)


def run_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clairvoyant", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ.get("PATH", ""), **(env or {})},
    )


def test_the_table_prints_every_waiting_request_in_dispatch_order(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, OPS)  # the key from the environment
    with held_queue() as base:
        assert main(["status", "--url", base]) == 0
        out = capsys.readouterr().out
        assert main(["status", "--url", base, "--limit", "2"]) == 0
        limited = capsys.readouterr().out
        snapshot = queue(base)
    waiting = snapshot["waiting"]
    # The queue's dispatch order (sjf within fair share between the tenants) is not the arrival order.
    assert [w["predicted_class"] for w in waiting] != ["long", "short", "medium", "short"]
    lines = out.splitlines()
    rows = [next(i for i, line in enumerate(lines) if w["request_id"] in line) for w in waiting]
    assert rows == sorted(rows) and rows == list(range(rows[0], rows[0] + 4))
    for w, row in zip(waiting, rows):
        cells = lines[row].split()
        assert cells[0] == str(w["position"]) and cells[1] == w["request_id"] and cells[2] == w["tenant"]
        assert w["predicted_class"] in cells
        assert lines[row].rstrip().endswith(seconds(w["eta_s"]))  # the ETA is the last column
    assert "waiting (4, in dispatch order" in out
    # The running request, its backend and slot; the backends with their slots.
    (running,) = snapshot["in_flight"]
    running_line = next(line for line in lines if running["request_id"] in line)
    assert running_line.split()[:2] == ["backend-1", "0"] and "ops" in running_line
    assert "1/1" in next(line for line in lines if line.startswith("  backend-1"))
    # Tenants: requests counted per tenant (waiting, running).
    tenants = lines.index("tenants")
    assert lines[tenants + 2].split()[:3] == ["ops", "2", "1"] and lines[tenants + 3].split()[:3] == [
        "team-a",
        "2",
        "0",
    ]
    # --limit lists the first rows only; the tenants still count every waiting request.
    assert [w["request_id"] in limited for w in waiting] == [True, True, False, False]
    assert "waiting (2 of 4, in dispatch order" in limited and "\ntenants\n" + out.split("\ntenants\n")[1] in limited
    # No request has completed: the learner's quality is not known yet, and says so.
    assert NOT_ENOUGH_DATA in out and not re.search(r"\bnan\b", out, re.I)


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_json_waiting_rows_are_queues_and_the_key_can_come_from_the_environment() -> None:
    with held_queue() as base:
        result = run_cli("status", "--url", base, "--json", env={KEY_ENV: OPS})
        snapshot = queue(base)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert len(snapshot["waiting"]) == 4 and status["waiting"] == snapshot["waiting"]
    # /queue's whole object, unchanged, plus what status adds from /metrics.
    assert {k: v for k, v in status.items() if k != "from_metrics"} == snapshot
    assert status["from_metrics"]["prediction_quality"] == [] and isinstance(status["from_metrics"]["learner_up"], bool)


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_a_missing_or_wrong_key_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with held_queue() as base:
        missing = run_cli("status", "--url", base, env={})
        wrong = run_cli("status", "--url", base, "--key", "not-a-key", env={})
        assert main(["status", "--url", base, "--key", TEAM, "--json"]) == 0  # the flag, any valid key
        assert main(["status", "--url", base, "--key", "not-a-key", "--watch"]) == 2  # no retrying a refused key
    for result in (missing, wrong):
        assert result.returncode == 2 and result.stdout == ""
        assert "401" in result.stderr and KEY_ENV in result.stderr and "--key" in result.stderr
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["waiting"]) == 4  # --key TEAM; then "not-a-key" ended --watch at once
    assert "401" in captured.err and "trying again" not in captured.err


def test_an_unreachable_proxy_is_a_clear_error(free_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--url", f"http://127.0.0.1:{free_port}"]) == 2
    assert f"cannot reach the proxy at http://127.0.0.1:{free_port}" in capsys.readouterr().err


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_watch_refreshes_until_stopped() -> None:
    with held_queue() as base:
        snapshot = queue(base)
        for argv in (["--json"], []):
            with subprocess.Popen(
                [sys.executable, "-m", "clairvoyant", "status", "--url", base, "--watch", "--interval", "0.05", *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={"PYTHONPATH": str(ROOT / "src"), KEY_ENV: OPS},
            ) as process:
                watchdog = threading.Timer(60, process.kill)  # a hung command fails the test, not the run
                watchdog.start()
                try:
                    assert process.stdout is not None and process.stderr is not None
                    if argv:  # JSON Lines: one object per refresh
                        frames = [json.loads(process.stdout.readline()) for _ in range(3)]
                        assert all(f["waiting"] == snapshot["waiting"] for f in frames)
                    else:  # piped: frames follow one another, no screen clearing
                        text = ""
                        while text.count("clairvoyant at ") < 3:
                            line = process.stdout.readline()
                            assert line, process.stderr.read()
                            text += line
                        assert "\x1b" not in text and text.count("waiting (4, in dispatch order") >= 2
                    assert process.poll() is None  # still watching
                finally:
                    watchdog.cancel()
                    process.terminate()
                    process.wait(10)


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_watch_reports_an_unreachable_proxy_and_keeps_trying(free_port: int) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "clairvoyant", "status", "--url", f"http://127.0.0.1:{free_port}", "--watch"]
        + ["--interval", "0.05", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(ROOT / "src")},
    ) as process:
        watchdog = threading.Timer(60, process.kill)
        watchdog.start()
        try:
            assert process.stderr is not None
            lines = [process.stderr.readline() for _ in range(2)]
            assert all("cannot reach the proxy" in line and "trying again in 0.05 s" in line for line in lines)
            assert process.poll() is None
        finally:
            watchdog.cancel()
            process.terminate()
            process.wait(10)
        assert process.stdout is not None and process.stdout.read() == ""  # stdout stays JSON only


# -- the table, from /queue objects of other proxies --------------------------------------------------


def test_quality_from_the_proxys_own_metrics_never_prints_nan() -> None:
    metrics = Metrics()
    metrics.prediction.set_quality(
        {
            "llama3.2:1b": ModelQuality("llama3.2:1b", observations=1, kendall_tau_b=math.nan, mean_abs_log_error=0.7),
            "qwen2.5:0.5b": ModelQuality("qwen2.5:0.5b", observations=40, kendall_tau_b=0.61, mean_abs_log_error=0.42),
            "empty": ModelQuality("empty", observations=0, kendall_tau_b=math.nan, mean_abs_log_error=math.nan),
        }
    )
    metrics.learner.publish(True, 3, 0)
    read = read_metrics(metrics.render().decode())
    assert read["learner_up"] is True and read["learner_refits"] == 3
    by_model = {row["model"]: row for row in read["prediction_quality"]}
    assert by_model["qwen2.5:0.5b"] == {
        "model": "qwen2.5:0.5b",
        "kendall_tau": 0.61,
        "abs_log_token_error": 0.42,
        "window_requests": 40,
    }
    assert by_model["llama3.2:1b"]["kendall_tau"] is None and by_model["empty"]["abs_log_token_error"] is None
    json.dumps(read, allow_nan=False)  # valid JSON: undefined values are null
    text = render({"from_metrics": read}, url="http://x")
    lines = text.splitlines()
    assert next(line for line in lines if "qwen2.5:0.5b" in line).split() == ["qwen2.5:0.5b", "40", "0.610", "0.42"]
    assert next(line for line in lines if "llama3.2:1b" in line).split()[2:5] == ["not", "enough", "data"]
    assert "learner running, 3 refits" in text and not re.search(r"\bnan\b", text, re.I)


def test_an_older_proxys_sparse_object_prints_dashes() -> None:
    text = render({"waiting": [{"request_id": "r1"}, {}], "backends": [{}]}, url="http://old")
    assert "r1" in text and "waiting (2, in dispatch order)" in text
    assert render({}, url="http://empty").count("none") >= 3


def test_a_newer_proxys_fields_are_shown() -> None:
    status = {
        "waiting_count": 3,
        "waiting": [{"request_id": "r1", "tenant": "ops", "eta_s": 75.0}],
        "backends": [{"name": "gpu", "loaded_models": ["llama3"], "load_costs_s": {"qwen": 12.5}}],
        "tenants": [{"tenant": "ops", "weight": 2.0, "max_waiting": 40}, {"tenant": "idle", "max_waiting": 5}],
        "shed_load": True,
        "models": [{"name": "llama3", "load_s": 4.2}],
    }
    text = render(status, url="http://new")
    lines = text.splitlines()
    assert "waiting (1 of 3, in dispatch order)" in text and "1m15s" in text
    backend = next(line for line in lines if line.startswith("  gpu"))
    assert "llama3" in backend and "qwen=12.5" in backend and "load_costs_s" in text
    tenants = lines.index("tenants")
    assert lines[tenants + 1].split() == ["tenant", "waiting", "(shown)", "running", "max_waiting", "weight"]
    assert lines[tenants + 2].split() == ["idle", "0", "0", "5", "-"]
    assert lines[tenants + 3].split() == ["ops", "1", "0", "40", "2"]
    assert "shed_load: yes" in text and "load_s" in text and "4.2" in text


def test_a_sparse_or_mistyped_cluster_part_prints_dashes_not_defaults() -> None:
    sparse = render({"cluster": {}}, url="http://new").splitlines()
    assert "cluster -: answered by replica -, mode -; lease -" in sparse
    assert "waiting in the cluster: none" in sparse and "running in the cluster: none" in sparse
    mistyped = render(
        {"cluster": {"name": "c", "mode": ["x"], "lease_s": "long", "replicas": "r0", "waiting": [{"replica": "r2"}]}},
        url="http://new",
    )
    assert "cluster c: answered by replica -, mode x; lease -" in mistyped and "replicas: none reported" in mistyped
    (row,) = _section(mistyped.splitlines(), "waiting in the cluster (1, in dispatch order)")[1:]
    assert row.split()[:3] == ["0", "-", "r2"]


# -- with replicas: the whole cluster -----------------------------------------------------------------


def _section(lines: list[str], title: str) -> list[str]:
    """A section's lines after its title, up to the blank line that ends it."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start + 1 : end]


def test_with_replicas_the_table_shows_the_clusters_queue_each_request_with_its_replica(
    redis_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster_scene import WAITING, held_cluster

    with held_cluster(redis_server.url) as scene:
        assert main(["status", "--url", scene.bases["r1"]]) == 0
        out = capsys.readouterr().out
    lines = out.splitlines()
    replica_of = {label: replica for label, replica, _ in WAITING}
    assert f"cluster {scene.cluster}: answered by replica r1, mode shared; lease 1.0 s" in out
    # Both replicas' health, this one marked.
    replicas = _section(lines, f"cluster {scene.cluster}")
    assert replicas[0].split() == ["replica", "state", "last", "heartbeat"]
    health = {row.split()[0]: row for row in replicas[1:]}
    assert set(health) == {"r0", "r1"} and "(this one)" in health["r1"] and "(this one)" not in health["r0"]
    assert all(re.search(r"\blive\s+\d+\.\d s ago$", row) for row in health.values())
    # The slot, held by r0's request.
    running = _section(lines, "running in the cluster (1 slot held)")
    assert running[1].split()[1:4] == ["0", scene.holder_id, "r0"]
    # The whole queue in dispatch order (not the arrival order), each request with its replica;
    # the class only where this replica (r1) holds the request.
    waiting = _section(lines, "waiting in the cluster (3, in dispatch order)")
    assert waiting[0].split()[:3] == ["#", "request", "replica"]
    rows = [re.split(r"\s{2,}", row.strip()) for row in waiting[1:]]  # cells: two spaces or more apart
    assert [row[1] for row in rows] == [scene.ids[label] for label in scene.dispatch_order]
    assert [row[2] for row in rows] == [replica_of[label] for label in scene.dispatch_order]
    assert [row[0] for row in rows] == ["0", "1", "2"] and {row[3] for row in rows} == {"(no key)"}
    classes = {row[1]: row[6] for row in rows}
    assert (
        classes[scene.ids["w3"]] == "medium" and classes[scene.ids["w1"]] == "long" and classes[scene.ids["w2"]] == "-"
    )
    assert "tenants (this replica's requests)" in out
    assert "\ncluster:" not in out  # laid out, not dumped among the newer fields


def test_with_redis_gone_the_table_says_the_replica_is_degraded(
    own_redis_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster_scene import replicas
    from fake_backend import FakeBackend

    with (
        FakeBackend(lambda path, n: ("stream", 2, 0.01)) as backend,
        replicas(own_redis_server.url, backend.url) as scene,
    ):
        assert main(["status", "--url", scene.bases["r0"]]) == 0
        shared = capsys.readouterr().out
        own_redis_server.stop()
        wait_until(lambda: queue(scene.bases["r0"])["cluster"]["mode"] == "local", 10.0, "r0 degraded")
        assert main(["status", "--url", scene.bases["r0"]]) == 0
        degraded = capsys.readouterr().out
    assert "mode shared" in shared and "DEGRADED" not in shared
    assert "answered by replica r0, mode local (DEGRADED: Redis unreachable" in degraded
    assert "the shared state could not be read" in degraded and "replicas: none reported" in degraded
