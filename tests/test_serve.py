"""`clairvoyant serve`'s flags: --predictor names the ONNX predictor file (--model, its former name,
still works and warns: `calibrate --model` names the LLM); every flag's help states a real default."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from clairvoyant.cli import build_parser, main
from clairvoyant.config import CLI_FLAGS


def serve_args(*argv: str) -> dict[str, object]:
    args = build_parser().parse_args(["serve", *argv])
    return {name: getattr(args, name) for name in CLI_FLAGS}


def test_predictor_names_the_onnx_file_without_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_args("--predictor", "m.onnx")["model_path"] == Path("m.onnx")
    assert capsys.readouterr().err == ""


def test_model_is_a_deprecated_alias_that_warns(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_args("--model", "m.onnx")["model_path"] == Path("m.onnx")
    err = capsys.readouterr().err
    assert "--model is deprecated; use --predictor" in err
    assert serve_args()["model_path"] is None and capsys.readouterr().err == ""  # no flag, no warning


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_the_deprecated_flag_still_reaches_the_predictor(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "serve", "--model", str(tmp_path / "nope.onnx")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2  # start-up stopped at the file the alias named
    assert "--model is deprecated; use --predictor" in result.stderr
    assert "nope.onnx" in result.stderr and "not found" in result.stderr


def test_calibrate_model_is_still_the_llms_name(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["calibrate", "--model", "llama3.2:1b"])
    assert args.model == "llama3.2:1b" and capsys.readouterr().err == ""


def test_every_flags_help_states_a_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "Undefined" not in text
    assert text.count("(default ") >= len(CLI_FLAGS)
    assert "--backend URL A backend's base URL; repeat the flag for a pool" in text
    assert "(default none; CLAIRVOYANT_BACKENDS)" in text
    assert "--predictor" in text and "--model MODEL_PATH deprecated: --predictor" in text


def test_backend_repeats_for_a_pool() -> None:
    assert serve_args("--backend", "http://a:1", "--backend", "http://b:2")["backends"] == ["http://a:1", "http://b:2"]
