"""`clairvoyant predict --jsonl`: bulk scoring with per-line errors, in order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import OnnxPredictor
from clairvoyant.tools.bulk_predict import LineError, prompt_of_line, score_lines

FIXTURE = Path(__file__).parent / "fixtures" / "predictor_bulk.jsonl"
# line number -> expected error fragment, for the fixture's bad lines
BAD = {
    3: "not valid JSON",
    4: "expected a JSON object",
    5: "empty line",
    6: "neither",
    8: "'messages' must be an array",
}


BASELINE_PATH = Path(__file__).parents[1] / "model" / "baselines" / "rich_v2_3class.onnx"  # a class model


def _check(results: list[dict], *, classes: bool = False) -> None:
    assert [r["line"] for r in results] == list(range(1, 10))
    for r in results:
        if r["line"] in BAD:
            assert BAD[r["line"]] in r["error"] and "score" not in r
        elif classes:
            assert set(r) == {"line", "p_short", "p_medium", "p_long", "score", "predicted_tokens", "predicted_class"}
            assert r["score"] == r["p_long"]
            assert r["predicted_tokens"] > 0
            assert r["p_short"] + r["p_medium"] + r["p_long"] == pytest.approx(1.0, abs=1e-5)
        else:  # the shipped regressor: no class probabilities to show
            assert set(r) == {"line", "score", "predicted_tokens", "predicted_class"}
            assert r["predicted_tokens"] > 0
    assert results[1]["score"] > results[0]["score"]  # the essay ranks after "hi"
    assert results[1]["predicted_tokens"] > results[0]["predicted_tokens"]


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_cli_round_trip_via_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "scores.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "predict", "--jsonl", str(FIXTURE), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr  # some lines were errors
    assert "5 of 9 lines could not be scored" in proc.stderr
    assert "Traceback" not in proc.stderr
    _check([json.loads(line) for line in out.read_text().splitlines()])


def test_a_class_model_adds_its_probabilities(tmp_path: Path) -> None:
    from clairvoyant.cli import main

    out = tmp_path / "scores.jsonl"
    assert main(["predict", "--jsonl", str(FIXTURE), "--out", str(out), "--model", str(BASELINE_PATH)]) == 1
    _check([json.loads(line) for line in out.read_text().splitlines()], classes=True)


def test_cli_main_to_stdout_with_explicit_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from clairvoyant.cli import main
    from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH

    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hello"}\n{"messages": [{"role": "user", "content": "Write code"}]}\n')
    assert main(["predict", "--jsonl", str(good), "--model", str(DEFAULT_MODEL_PATH)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(x)["line"] for x in lines] == [1, 2]


def test_cli_reports_a_missing_model_or_input_clearly(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from clairvoyant.cli import main

    assert main(["predict", "--jsonl", str(FIXTURE), "--model", str(tmp_path / "none.onnx")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["predict", "--jsonl", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_score_lines_batches_keep_order_across_batch_boundaries() -> None:
    predictor = OnnxPredictor()
    lines = [json.dumps({"prompt": "x" * i}) if i % 7 else "bad" for i in range(1, 1200)]
    results = list(score_lines(predictor, lines))
    assert [r["line"] for r in results] == list(range(1, 1200))
    assert all(("error" in r) == (r["line"] % 7 == 0) for r in results)
    single = predictor.predict(Prompt("x" * 5))
    assert results[4]["score"] == pytest.approx(single.score, abs=1e-6)
    assert results[4]["predicted_tokens"] == pytest.approx(single.predicted_tokens, rel=1e-5)


def test_prompt_of_line_uses_the_dialect_rules() -> None:
    p = prompt_of_line(
        json.dumps({"messages": [{"role": "system", "content": "abc"}, {"role": "user", "content": "hi"}]})
    )
    assert p == Prompt("hi", context_chars=5, turns=2, system_chars=3)
    assert prompt_of_line('{"prompt": ["a", "b"]}').instruction == "a\nb"
    with pytest.raises(LineError, match="'prompt' must be"):
        prompt_of_line('{"prompt": 5}')
    with pytest.raises(LineError):
        prompt_of_line("[" * 100_000)  # deep nesting: a clear error, not a RecursionError


def test_lines_carry_their_model_and_cap_like_proxy_requests() -> None:
    from clairvoyant.tools.bulk_predict import request_of_line

    essay = "Write a detailed 2000-word essay on the history of the Roman Empire."
    openai = request_of_line(json.dumps({"model": "m1", "prompt": essay, "max_tokens": 5}))
    assert (openai.model, openai.cap_tokens, openai.endpoint.path) == ("m1", 5, "/v1/completions")
    ollama = request_of_line(
        json.dumps({"model": "m2", "prompt": essay, "system": "be brief", "options": {"num_predict": 3}})
    )
    assert (ollama.model, ollama.cap_tokens, ollama.endpoint.path) == ("m2", 3, "/api/generate")
    assert ollama.prompt.system_chars == len("be brief")  # read as Ollama reads /api/generate
    chat = request_of_line(json.dumps({"messages": [{"role": "user", "content": essay}], "options": {}}))
    assert chat.endpoint.path == "/api/chat" and chat.cap_tokens is None and chat.model is None

    results = list(
        score_lines(
            OnnxPredictor(),
            [
                json.dumps({"prompt": essay}),
                json.dumps({"prompt": essay, "max_tokens": 5}),
                json.dumps({"model": "m", "prompt": essay, "options": {"num_predict": 3}}),
            ],
        )
    )
    assert results[0]["predicted_tokens"] > 100
    assert results[1]["predicted_tokens"] == 5.0 and results[1]["score"] < results[0]["score"]
    assert results[2]["predicted_tokens"] == 3.0
