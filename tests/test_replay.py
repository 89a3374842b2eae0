"""`clairvoyant replay`: each line scored before its length is learned, one JSON line out per line in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clairvoyant.prediction.learner import LearnerConfig, OnlineLearner
from clairvoyant.prediction.predictor import OnnxPredictor
from clairvoyant.tools.bulk_predict import score_lines
from clairvoyant.tools.replay import replay_lines

TOPICS = "Rome volcanoes jazz tea bridges whales chess glaciers bees satellites".split()
ASKS = [
    "What is {t}?",
    "Write a detailed essay about {t}.",
    "List 10 facts about {t}.",
    "Explain {t} briefly.",
    "Write a poem about {t}.",
    "Why do people like {t}?",
]


def _lines(n: int, seed: int = 0) -> list[dict]:
    """Requests whose real lengths depend on the kind of question, unlike the prior's guesses."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        ask = int(rng.integers(len(ASKS)))
        tokens = int(np.exp(2.5 + 0.6 * ask + rng.normal(0, 0.2)))
        lines.append({"prompt": ASKS[ask].format(t=TOPICS[i % len(TOPICS)]), "output_tokens": tokens})
    return lines


@pytest.fixture(scope="module")
def predictor() -> OnnxPredictor:
    return OnnxPredictor()


def _replay(predictor: OnnxPredictor, lines: list[dict], learn: bool = True) -> list[dict]:
    learner = (
        OnlineLearner.for_predictor(predictor, LearnerConfig(refit_every=4, min_observations=16)) if learn else None
    )
    return list(replay_lines(predictor, learner, [json.dumps(line) for line in lines]))


def test_a_line_is_scored_before_its_own_length_is_learned(predictor: OnnxPredictor) -> None:
    """Two files that differ only in line K's length: lines 1..K must score identically (line K's
    label cannot reach its own score), and later lines must differ (the label was learned)."""
    lines = _lines(80)
    k = 40  # well past min_observations, so the learner is fitted when line K is scored
    other = [dict(line) for line in lines]
    other[k - 1]["output_tokens"] = 1 if lines[k - 1]["output_tokens"] > 100 else 20_000
    first, second = _replay(predictor, lines), _replay(predictor, other)
    assert [r["score"] for r in first[:k]] == [r["score"] for r in second[:k]]
    assert [r["predicted_tokens"] for r in first[:k]] == [r["predicted_tokens"] for r in second[:k]]
    assert any(a["score"] != b["score"] for a, b in zip(first[k:], second[k:]))
    # and the learner was really active by line K: its scores differ from the static model's
    static = _replay(predictor, lines, learn=False)
    assert first[k - 1]["score"] != static[k - 1]["score"]


def test_learning_improves_the_ranking_of_later_lines(predictor: OnnxPredictor) -> None:
    from clairvoyant.prediction.learner import kendall_tau_b

    lines = _lines(200, seed=3)
    truth = np.array([line["output_tokens"] for line in lines[100:]])
    learned = np.array([r["score"] for r in _replay(predictor, lines)[100:]])
    static = np.array([r["score"] for r in _replay(predictor, lines, learn=False)[100:]])
    assert kendall_tau_b(learned, truth) > kendall_tau_b(static, truth) + 0.1


def test_no_learn_is_the_static_predictor_and_output_has_the_contract_fields(predictor: OnnxPredictor) -> None:
    lines = _lines(30)
    replayed = _replay(predictor, lines, learn=False)
    bulk = list(score_lines(predictor, [json.dumps(line) for line in lines]))
    classes = {"p_short", "p_medium", "p_long"} if predictor.output.kind == "classifier" else set()
    for r, b in zip(replayed, bulk):
        assert set(r) == {"line", "score", "predicted_tokens"} | classes
        assert (r["score"], r["predicted_tokens"], r.get("p_long")) == (
            b["score"],
            b["predicted_tokens"],
            b.get("p_long"),
        )
    assert predictor.corrector is None  # replay detached its learner


def test_caps_models_and_ollama_bodies_are_read_as_the_proxy_reads_them(predictor: OnnxPredictor) -> None:
    essay = "Write a detailed 2000-word essay on the history of the Roman Empire."
    lines = [
        {"prompt": essay, "output_tokens": 900},
        {"prompt": essay, "max_tokens": 7, "output_tokens": 7},
        {"model": "llama3", "prompt": essay, "options": {"num_predict": 5}, "output_tokens": 5},
        {"model": "llama3", "messages": [{"role": "user", "content": essay}], "stream": False, "output_tokens": 800},
    ]
    learner = OnlineLearner.for_predictor(predictor)
    out = list(replay_lines(predictor, learner, [json.dumps(line) for line in lines], model_name="fallback"))
    assert out[1]["predicted_tokens"] == 7.0 and out[2]["predicted_tokens"] == 5.0
    assert out[0]["predicted_tokens"] > 500 and out[3]["predicted_tokens"] == out[0]["predicted_tokens"]
    assert learner.models() == ["fallback", "llama3"]  # --model-name for lines that name none
    assert learner._buckets["fallback"].ring.count == 1  # the capped answer (7 of 7) was censored
    assert learner._buckets["llama3"].ring.count == 1


def test_bad_lines_get_an_error_in_their_place_and_teach_nothing(predictor: OnnxPredictor) -> None:
    raw = [
        '{"prompt": "hi", "output_tokens": 3}',
        "not json",
        '{"prompt": "hi"}',
        '{"prompt": "hi", "output_tokens": -2}',
        '{"output_tokens": 4}',
        "",
        '{"prompt": "hi", "output_tokens": "5"}',
        '{"prompt": "hi", "output_tokens": 4.0}',
    ]
    learner = OnlineLearner.for_predictor(predictor)
    out = list(replay_lines(predictor, learner, raw))
    assert [r["line"] for r in out] == list(range(1, 9))
    assert [("error" in r) for r in out] == [False, True, True, True, True, True, True, False]
    assert "output_tokens" in out[2]["error"] and "neither" in out[4]["error"]
    assert learner.observed_total == 2


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_cli_stdout_is_only_json_lines_and_state_carries_over(tmp_path: Path) -> None:
    data = tmp_path / "replay.jsonl"
    data.write_text("\n".join(json.dumps(line) for line in _lines(60)) + "\nbroken\n")
    state = tmp_path / "learner.npz"

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "clairvoyant", "replay", str(data), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )

    first = run("--state", str(state))
    assert first.returncode == 1 and "1 of 61 lines were errors" in first.stderr
    out = [json.loads(x) for x in first.stdout.splitlines()]  # every stdout line is JSON
    assert len(out) == 61 and out[-1]["line"] == 61 and "error" in out[-1]
    assert state.is_file()
    # the second run starts from what the first learned: its first line is no longer the prior's
    second = [json.loads(x) for x in run("--state", str(state)).stdout.splitlines()]
    static = [json.loads(x) for x in run("--no-learn").stdout.splitlines()]
    assert out[0]["score"] == static[0]["score"]
    assert second[0]["score"] != static[0]["score"]
    # a corrupt state file: one clear line on stderr, and the replay runs from the prior
    state.write_bytes(b"garbage")
    third = run("--state", str(state))
    assert "refused" in third.stderr and "Traceback" not in third.stderr
    assert [json.loads(x).get("score") for x in third.stdout.splitlines()] == [r.get("score") for r in out]
