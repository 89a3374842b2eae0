"""The README's "Try it" commands, run as a newcomer types them in a clone: they end in an answer
from a real llama.cpp server, scheduled by the proxy. Only the ports change (free ones instead of
8080 and 8081), so that the test never meets another server."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def try_it_commands() -> str:
    text = README.read_text()
    block = text[text.index("<!-- try-it:start -->") : text.index("<!-- try-it:end -->")]
    body = re.search(r"```sh\n(.*?)```", block, re.DOTALL)
    assert body is not None, "the README's try-it block has no sh code"
    return body.group(1)


def test_the_try_it_block_is_short_and_uses_the_documented_ports() -> None:
    commands = try_it_commands()
    assert "make install-demo" in commands and "clairvoyant backend --port 8081" in commands
    assert "http://127.0.0.1:8080/v1/chat/completions" in commands
    # the two processes it leaves running: how to stop them, and how to give the backend fewer threads
    after = README.read_text().split("<!-- try-it:end -->")[1].split("\n## ")[0]
    assert commands.count(" &\n") == 2 and "`kill %1 %2`" in after and "`--threads`" in after


@pytest.mark.e2e
def test_the_readmes_try_it_commands_get_a_scheduled_answer(require_embedded_backend: None, tmp_path: Path) -> None:
    backend_port, proxy_port = _free_port(), _free_port()
    script = try_it_commands().replace("8081", str(backend_port)).replace("8080", str(proxy_port))
    env = {**os.environ, "CLAIRVOYANT_PORT": str(proxy_port), "CLAIRVOYANT_ENCODER": "false"}
    # Files, not pipes: the backend and the proxy the commands start keep running (and writing).
    with (tmp_path / "out").open("w") as out_file, (tmp_path / "err").open("w") as err_file:
        process = subprocess.Popen(
            ["bash", "-e", "-c", script], cwd=ROOT, env=env, stdout=out_file, stderr=err_file,
            start_new_session=True,
        )  # fmt: skip
        try:
            process.wait(timeout=240)
            recent = httpx.get(f"http://127.0.0.1:{proxy_port}/queue", timeout=10).json()["recent"]
        finally:
            os.killpg(process.pid, signal.SIGTERM)  # the backend and the proxy the commands left running
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert process.returncode == 0, err[-3000:]
    assert '"choices"' in out and '"content"' in out  # the model's answer
    assert [(r["endpoint"], r["outcome"]) for r in recent] == [("/v1/chat/completions", "completed")]
