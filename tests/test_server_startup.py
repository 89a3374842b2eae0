"""proxy/server.py as deployed (`clairvoyant serve`, a real process): start-up says what is true,
refuses what cannot work, and SIGHUP reloads the keys from the config file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fake_backend import FakeBackend
from polling import wait_until

from clairvoyant.proxy.access import hash_key

pytestmark = pytest.mark.e2e  # `clairvoyant serve` as deployed, a real process

ROOT = Path(__file__).resolve().parents[1]


def serve(*argv: str, **env: str) -> subprocess.Popen[str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CLAIRVOYANT_ENCODER": "false", **env}
    return subprocess.Popen(
        [sys.executable, "-m", "clairvoyant", "serve", *argv], env=environment, stderr=subprocess.PIPE, text=True
    )


class Lines:
    """A process's stderr, read as it comes (a thread), for waiting on a line."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert process.stderr is not None
        self.stream = process.stderr
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.stream.readline, "")), daemon=True)
        self.reader.start()

    def close(self) -> None:
        """Once the process has ended: the rest of its output, and the pipe closed."""
        self.reader.join(10)
        self.stream.close()

    def having(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]


@contextmanager
def running(*argv: str, **env: str) -> Iterator[tuple[subprocess.Popen[str], Lines]]:
    process = serve(*argv, **env)
    lines = Lines(process)
    try:
        wait_until(lambda: lines.having("serving on") or process.poll() is not None, timeout_s=60, what="start-up")
        yield process, lines
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        lines.close()


def test_a_taken_port_is_a_clear_error_and_exit_2_before_any_ready_line(free_port: int) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port))
        taken.listen()
        result = subprocess.run(
            [sys.executable, "-m", "clairvoyant", "serve", "--port", str(free_port), "--upstream", "http://127.0.0.1:9"],
            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "CLAIRVOYANT_ENCODER": "false"},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{free_port}: Address already in use" in result.stderr
    assert "clairvoyant ready" not in result.stderr and "Stack backtrace" not in result.stderr


def test_an_upstream_with_an_api_path_is_refused_naming_the_fix(free_port: int) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "serve", "--port", str(free_port), "--upstream", "http://127.0.0.1:8081/v1"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "give the server's base URL, 'http://127.0.0.1:8081'" in result.stderr


def test_listening_beyond_loopback_without_keys_is_one_warning(free_port: int) -> None:
    with FakeBackend(lambda path, n: "ok") as backend:
        with running("--host", "0.0.0.0", "--port", str(free_port), "--upstream", backend.url) as (_, lines):
            assert lines.having("serving on")
    warnings = lines.having("WARNING")
    assert len(warnings) == 1 and "with no API keys" in warnings[0] and "0.0.0.0" in warnings[0]
    # the order docs/operations.md gives, "Install and run"
    said = ("INFO clairvoyant.proxy.serve: predictor ", "clairvoyant ready: ", "authentication off: no api_keys",
            "with no API keys", "serving on http://0.0.0.0")  # fmt: skip
    first = [next(i for i, line in enumerate(lines.lines) if text in line) for text in said]
    assert first == sorted(first), [lines.lines[i] for i in first]


def test_https_in_front_of_a_plain_http_port_is_named(free_port: int) -> None:
    with FakeBackend(lambda path, n: "ok") as backend:
        https = backend.url.replace("http://", "https://")
        with running("--port", str(free_port), "--upstream", https, CLAIRVOYANT_CONNECT_TIMEOUT_S="1") as (_, lines):
            wait_until(lambda: lines.having("use http://"), timeout_s=30, what="the scheme's hint")
    assert "ERROR" in lines.having("use http://")[0]


def test_sighup_reloads_the_keys_from_the_config_file_and_keeps_serving(free_port: int, tmp_path: Path) -> None:
    config = tmp_path / "clairvoyant.toml"

    def write_key(key: str) -> None:
        config.write_text(f'status_requires_key = true\n\n[[api_keys]]\nhash = "{hash_key(key)}"\ntenant = "ops"\n')

    write_key("cv-old-key")
    with FakeBackend(lambda path, n: "ok") as backend:
        argv = ("--config", str(config), "--port", str(free_port), "--upstream", backend.url)
        with running(*argv) as (process, lines):
            base = f"http://127.0.0.1:{free_port}"

            def status(key: str) -> int:
                return httpx.get(f"{base}/queue", headers={"Authorization": f"Bearer {key}"}).status_code

            assert lines.having("authentication on: 1 API key(s)")
            assert (status("cv-old-key"), status("cv-new-key")) == (200, 401)
            write_key("cv-new-key")
            process.send_signal(signal.SIGHUP)
            wait_until(lambda: status("cv-new-key") == 200, timeout_s=10, what="the new key")
            assert status("cv-old-key") == 401
            assert process.poll() is None  # still serving
            assert lines.having("reloaded 1 API key(s)")
