"""One log line per answer on every path, in one format (text or JSON), no prompt text, no httpx
per-call lines. Runs the real `clairvoyant serve` process, as deployed, and reads its stderr."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_backend import FakeBackend
from polling import wait_until
from proxy_harness import answering, metric_value

ROOT = Path(__file__).resolve().parents[1]
SECRET_PROMPT = "PROMPT-TEXT-7f3a never to be logged"
# Waits here end with their event (the proxy answers, or exits); this bound only keeps a hung proxy
# from hanging the suite. A start costs about 2 s of CPU: on a loaded machine, many times that.
HANG_BOUND_S = 120.0


def _serve(backend_url: str, port: int, **env: str) -> subprocess.Popen[str]:
    environment = {
        **os.environ, "CLAIRVOYANT_UPSTREAM_URL": backend_url, "CLAIRVOYANT_PORT": str(port),
        "CLAIRVOYANT_CLIENT_TIMEOUT_S": "0.5", "CLAIRVOYANT_SHUTDOWN_GRACE_S": "0", "PYTHONPATH": str(ROOT / "src"), **env,
    }  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "clairvoyant.cli", "serve"], env=environment, stderr=subprocess.PIPE, text=True
    )


def _started(process: subprocess.Popen[str], base: str) -> None:
    """Return once the proxy answers; fail at once, with its stderr, if its process exits first."""
    wait_until(
        lambda: process.poll() is not None or answering(base), timeout_s=HANG_BOUND_S, what="the proxy to answer"
    )
    if process.poll() is not None:
        assert process.stderr is not None
        raise AssertionError(f"the proxy exited with code {process.returncode}:\n{process.stderr.read()[-4000:]}")


def _exercise(base: str, port: int) -> None:
    """A scheduled answer, a pass-through, a 400, an aborted upload, a 408 for a body that never ends."""
    chat = {"model": "m", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    with httpx.Client(base_url=base, timeout=HANG_BOUND_S) as client:
        assert client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "sched-1"}).status_code == 200
        assert client.get("/api/tags", headers={"X-Request-Id": "pass-1"}).status_code == 200
        bad = client.post("/api/chat", content=b'{"messages": [', headers={"X-Request-Id": "bad-1"})
        assert bad.status_code == 400
    with socket.create_connection(("127.0.0.1", port)) as sock:  # aborted upload
        sock.sendall(b'POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"m')
    with socket.create_connection(("127.0.0.1", port)) as sock:  # a body that never ends: 408
        sock.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"m')
        sock.settimeout(HANG_BOUND_S)
        assert sock.recv(100).startswith(b"HTTP/1.1 408")


def _run(free_port: int, **env: str) -> str:
    with FakeBackend(lambda path, n: "ok") as backend:
        process = _serve(backend.url, free_port, **env)
        base = f"http://127.0.0.1:{free_port}"
        try:
            _started(process, base)
            _exercise(base, free_port)
            # the aborted upload is counted, then logged in the same step: once counted, it is logged
            wait_until(
                lambda: metric_value(base, "clairvoyant_client_disconnects_total", 'stage="upload"') == 1,
                timeout_s=HANG_BOUND_S,
                what="the aborted upload",
            )
        finally:
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=HANG_BOUND_S)
    return stderr


@pytest.mark.e2e  # `clairvoyant serve` as deployed, a real process
def test_json_logs_one_object_a_line_and_one_request_line_per_answer(free_port: int) -> None:
    stderr = _run(free_port, CLAIRVOYANT_LOG_FORMAT="json")
    lines = [line for line in stderr.splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line, the server's included, is one JSON object
    requests: list[dict[str, Any]] = [e for e in entries if e["msg"] == "request"]
    by_outcome = {str(e["outcome"]): e for e in requests}
    assert by_outcome["completed"]["request_id"] == "sched-1" and by_outcome["completed"]["status"] == 200
    assert by_outcome["passthrough_completed"]["request_id"] == "pass-1"
    assert by_outcome["bad_request"]["status"] == 400 and by_outcome["bad_request"]["request_id"] == "bad-1"
    assert by_outcome["client_left_uploading"]["path"] == "/api/chat"
    assert by_outcome["client_timeout"]["status"] == 408
    assert len(requests) == 5
    assert any(e["logger"] == "clairvoyant.proxy.server" for e in entries)  # "serving on ...", in the same format
    assert SECRET_PROMPT.split()[0] not in stderr
    assert "HTTP Request:" not in stderr  # httpx's per-call INFO line is silenced


@pytest.mark.e2e  # `clairvoyant serve` as deployed, a real process
def test_text_logs_carry_the_same_fields(free_port: int) -> None:
    stderr = _run(free_port)
    request_lines = [line for line in stderr.splitlines() if " clairvoyant.requests: request " in line]
    assert len(request_lines) == 5
    assert any(
        "request_id=sched-1" in line and "status=200" in line and "outcome=completed" in line for line in request_lines
    )
    assert SECRET_PROMPT.split()[0] not in stderr and "Traceback" not in stderr


def test_the_text_request_line_is_loggings_own_format_plus_the_fields() -> None:
    # TextFormatter builds request lines directly (timestamp seconds cached): the text must be what
    # logging.Formatter(TEXT_FORMAT) gives, then the fields, for any time, including second edges.
    import logging

    from clairvoyant.logs import TEXT_FORMAT, TextFormatter

    fast, plain = TextFormatter(), logging.Formatter(TEXT_FORMAT)
    logger = logging.getLogger("clairvoyant.requests")
    fields = {"request_id": "cv-1", "tenant": None, "status": 200, "service_ms": "1.5"}
    tail = "request_id=cv-1 tenant=- status=200 service_ms=1.5"
    for created in (1_700_000_000.0, 1_700_000_000.9995, 1_700_000_001.0004, 1_700_000_001.5, 1_000_000_000.25):
        records = [logger.makeRecord(logger.name, logging.INFO, "f", 1, "request", None, None, extra={"fields": fields})
                   for _ in range(2)]  # fmt: skip
        for record in records:
            record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
        assert fast.format(records[0]) == plain.format(records[1]) + " " + tail
    other = logger.makeRecord(logger.name, logging.WARNING, "f", 1, "%s left", ("x",), None)
    assert fast.format(other).endswith(" WARNING clairvoyant.requests: x left")
