"""`clairvoyant calibrate`: the commands of docs/operations.md, as written, against a real llama.cpp server (OpenAI
dialect) and against respx-mocked Ollama (its native API cannot run here); the advice it prints
must be valid settings that follow from the measured time."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import respx

from clairvoyant.cli import main
from clairvoyant.config import ENV_PREFIX, Settings, load_settings
from clairvoyant.tools.calibrate import MAX_TOKENS, SHORT_PROMPTS, CalibrationError, measure

if TYPE_CHECKING:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

ROOT = Path(__file__).resolve().parents[1]
SETTING_ENVS = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
DOC_LLAMACPP_URL = "http://127.0.0.1:8081"


def documented_commands() -> list[list[str]]:
    """The `clairvoyant calibrate` lines of docs/operations.md's calibration block, split as a shell would."""
    readme = (ROOT / "docs" / "operations.md").read_text()
    start = readme.index("<!-- calibrate-commands")
    block = readme[readme.index("```sh", start) + 5 : readme.index("```", readme.index("```sh", start) + 5)]
    commands = [shlex.split(line, comments=True) for line in block.strip().splitlines()]
    assert commands and all(c[:2] == ["clairvoyant", "calibrate"] for c in commands)
    return commands


def parse_report(text: str) -> tuple[float, list[dict[str, str]]]:
    """mu_short and the blocks of KEY=VALUE lines (default rule first, then the paper's rule)."""
    mu = float(re.search(r"^mu_short = ([\d.]+) s", text, re.M).group(1))  # type: ignore[union-attr]
    blocks: list[dict[str, str]] = []
    for chunk in text.split("\n\n"):
        pairs = dict(line.split("=", 1) for line in chunk.splitlines() if re.match(r"^[A-Z_]+=", line))
        if pairs:
            blocks.append(pairs)
    return mu, blocks


def check_advice(text: str, upstream: str, slots: str | None, monkeypatch: pytest.MonkeyPatch) -> float:
    mu, (default, paper) = parse_report(text)
    assert mu > 0
    assert set(default) | set(paper) <= SETTING_ENVS  # only real settings
    assert default[f"{ENV_PREFIX}UPSTREAM_URL"] == upstream
    if slots is not None:
        assert default[f"{ENV_PREFIX}SLOTS"] == slots
    assert default[f"{ENV_PREFIX}STARVATION_TIMEOUT_S"] == f"{Settings.model_fields['starvation_timeout_s'].default:g}"
    tau = float(paper[f"{ENV_PREFIX}STARVATION_TIMEOUT_S"])
    # 3 x mu, rounded up to 0.1 s (mu is printed to 0.01 s), never below 0.1 s.
    assert max(0.1, 3 * mu - 0.03) <= tau <= max(0.1, 3 * mu + 0.1 + 0.03)
    assert paper[f"{ENV_PREFIX}STARVATION_SLOWDOWN"] == "0"
    # Each block, set as printed, is accepted by the proxy's own settings loader.
    for block in (default, paper):
        with monkeypatch.context() as m:
            for key, value in block.items():
                if not value.startswith("<"):
                    m.setenv(key, value)
            settings = load_settings()
        assert settings.starvation_timeout_s == float(block[f"{ENV_PREFIX}STARVATION_TIMEOUT_S"])
    return mu


# -- the real llama.cpp server ------------------------------------------------------------------


def test_documented_llamacpp_command_against_the_real_server(
    llama_server: EmbeddedLlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    (command,) = [c for c in documented_commands() if DOC_LLAMACPP_URL in c]
    argv = [llama_server.base_url if a == DOC_LLAMACPP_URL else a for a in command[2:]]
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "calibrate", *argv], capture_output=True, text=True, timeout=600
    )
    wall_s = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert f"backend {llama_server.base_url} (openai), model SmolLM2-135M-Instruct" in result.stdout
    assert "10 Short requests, one at a time" in result.stdout
    mu = check_advice(result.stdout, llama_server.base_url, "1", monkeypatch)  # n_parallel=1: /props says 1 slot
    assert 10 * mu < wall_s  # the 10 measured requests (plus the warm-up) happened within this run
    tokens = int(re.search(r"; (\d+) output tokens on average", result.stdout).group(1))  # type: ignore[union-attr]
    assert 0 < tokens <= MAX_TOKENS


# -- Ollama, mocked ---------------------------------------------------------------------------------


def ollama_router(models: list[str], delay_s: float = 0.02, eval_count: int = 7) -> tuple[respx.MockRouter, list[dict]]:
    bodies: list[dict] = []

    def chat(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        time.sleep(delay_s)  # a service time that is not zero
        return httpx.Response(
            200,
            json={
                "model": body["model"],
                "message": {"role": "assistant", "content": "Tokyo."},
                "done": True,
                "eval_count": eval_count,
                "eval_duration": 10_000_000,
                "prompt_eval_count": 12,
            },
        )

    router = respx.mock(assert_all_called=False)
    router.get("http://127.0.0.1:11434/api/tags").respond(
        200, json={"models": [{"name": m, "model": m} for m in models]}
    )
    router.get("http://127.0.0.1:11434/api/version").respond(200, json={"version": "0.13.5"})
    router.post("http://127.0.0.1:11434/api/chat").mock(side_effect=chat)
    return router, bodies


def test_documented_ollama_command_against_mocked_ollama(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (command,) = [c for c in documented_commands() if DOC_LLAMACPP_URL not in c]
    router, bodies = ollama_router(["llama3.2:1b", "qwen2.5:0.5b"])
    with router:
        assert main(command[1:]) == 0
    out = capsys.readouterr().out
    assert "backend http://127.0.0.1:11434 (ollama), model llama3.2:1b" in out
    assert len(bodies) == 11  # one warm-up, ten measured
    assert all(b["model"] == "llama3.2:1b" and b["stream"] is False for b in bodies)
    assert all(b["options"]["num_predict"] == MAX_TOKENS for b in bodies)
    assert {b["messages"][0]["content"] for b in bodies} <= set(SHORT_PROMPTS)
    assert "7 output tokens on average" in out  # read from Ollama's eval_count
    mu = check_advice(out, "http://127.0.0.1:11434", None, monkeypatch)
    assert 0.02 <= mu < 1.0
    # Ollama does not say how many parallel slots it runs: the advice asks for OLLAMA_NUM_PARALLEL.
    assert f"{ENV_PREFIX}SLOTS=<the backend's parallel slots, e.g. OLLAMA_NUM_PARALLEL" in out


def test_model_flag_and_json_output(tmp_path: Path) -> None:
    router, bodies = ollama_router(["llama3.2:1b"])
    out = tmp_path / "cal.json"
    with router:
        assert main(["calibrate", "--model", "phi3:mini", "--n", "3", "--warmup", "0", "--json", str(out)]) == 0
    assert [b["model"] for b in bodies] == ["phi3:mini"] * 3
    saved = json.loads(out.read_text())
    assert saved["dialect"] == "ollama" and len(saved["service_s"]) == 3 and saved["output_tokens"] == [7, 7, 7]
    assert saved["advice"]["paper"][f"{ENV_PREFIX}STARVATION_SLOWDOWN"] == "0"


def test_an_openai_server_without_props_gets_the_openai_dialect() -> None:
    with respx.mock(assert_all_called=False) as router:
        router.get("http://gpu:8000/api/tags").respond(404)
        router.get("http://gpu:8000/v1/models").respond(200, json={"object": "list", "data": [{"id": "meta/llama"}]})
        router.get("http://gpu:8000/props").respond(404)
        chat = router.post("http://gpu:8000/v1/chat/completions").respond(
            200,
            json={
                "choices": [{"message": {"role": "assistant", "content": "Yes."}}],
                "usage": {"completion_tokens": 2},
            },
        )
        cal = measure("http://gpu:8000/", n=2, warmup=1)
    assert (cal.dialect, cal.model, cal.slots, cal.output_tokens) == ("openai", "meta/llama", None, (2, 2))
    assert chat.call_count == 3
    assert json.loads(chat.calls[0].request.content)["max_tokens"] == MAX_TOKENS


def test_an_ollama_style_model_list_without_api_version_is_not_taken_for_ollama() -> None:
    """llama.cpp's server lists its models at /api/tags too, but serves chat at /v1/chat/completions."""
    with respx.mock(assert_all_called=False) as router:
        router.get("http://cpp:8081/api/tags").respond(200, json={"models": [{"name": "smol"}]})
        router.get("http://cpp:8081/api/version").respond(404)
        router.get("http://cpp:8081/v1/models").respond(200, json={"data": [{"id": "smol"}], "models": []})
        router.get("http://cpp:8081/props").respond(200, json={"total_slots": 4})
        chat = router.post("http://cpp:8081/v1/chat/completions").respond(200, json={"usage": {"completion_tokens": 3}})
        cal = measure("http://cpp:8081", n=1, warmup=0)
    assert (cal.dialect, cal.model, cal.slots) == ("openai", "smol", 4) and chat.call_count == 1


def test_a_backend_with_no_model_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    router, _ = ollama_router([])
    with router:
        assert main(["calibrate"]) == 2
    assert "lists no model (ollama pull <model> first)" in capsys.readouterr().err


def test_an_unreachable_backend_is_a_clear_error(free_port: int) -> None:
    with pytest.raises(CalibrationError, match=f"cannot reach the backend at http://127.0.0.1:{free_port}"):
        measure(f"http://127.0.0.1:{free_port}", n=1)


def test_a_failing_request_names_the_status() -> None:
    with respx.mock(assert_all_called=False) as router:
        router.get("http://127.0.0.1:11434/api/tags").respond(200, json={"models": [{"name": "m"}]})
        router.get("http://127.0.0.1:11434/api/version").respond(200, json={"version": "0.13.5"})
        router.post("http://127.0.0.1:11434/api/chat").respond(404, json={"error": "model 'm' not found"})
        with pytest.raises(CalibrationError, match=r"answered 404 for model 'm'.*not found"):
            measure("http://127.0.0.1:11434", n=1)


# -- progress: a bar on a terminal, plain lines when piped -----------------------------------------


def test_piped_progress_is_one_plain_line_per_request(capsys: pytest.CaptureFixture[str]) -> None:
    router, _ = ollama_router(["llama3.2:1b"])
    with router:
        assert main(["calibrate", "--n", "3", "--warmup", "0"]) == 0
    err = capsys.readouterr().err  # not a terminal here
    assert err == "".join(f"measuring Short requests: {i}/3\n" for i in (1, 2, 3))


def test_progress_on_a_terminal_is_a_bar(llama_server: EmbeddedLlamaServer) -> None:
    """The real command with its standard error on a pseudo-terminal, against the real llama.cpp."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100, as a terminal has
    with subprocess.Popen(
        [sys.executable, "-m", "clairvoyant", "calibrate", "--backend", llama_server.base_url, "--n", "2"],
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
    ) as process:
        os.close(follower)
        seen = b""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the command closed the terminal (it has ended)
                break
            if not chunk:
                break
            seen += chunk
        os.close(leader)
        stdout = process.stdout.read() if process.stdout else ""
        assert process.wait(30) == 0, seen
    text = seen.decode(errors="replace")
    assert "measuring Short requests:" in text and "2/2" in text
    assert "|" in text and "100%" in text  # tqdm's bar (the test extra installs tqdm)
    assert "mu_short = " in stdout
