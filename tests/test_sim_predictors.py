"""Scorers of the simulator (clairvoyant.tools.sim.predictors): oracle, noisy at a target accuracy, real-predictor interface."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from clairvoyant.prediction.features import Prompt
from clairvoyant.tools.sim import (
    NoisyScorer,
    OracleScorer,
    PredictorScorer,
    PromptService,
    make_workload,
    paper_service,
)
from clairvoyant.tools.sim.predictors import pairwise_accuracy
from clairvoyant.tools.sim.workload import load_prompts, score_stream


def test_pairwise_accuracy_by_hand() -> None:
    scores = np.array([1.0, 2.0, 3.0, 1.5, 2.0])
    classes = np.array([0, 0, 2, 2, 2], dtype=np.int8)
    # Short {1, 2} vs Long {3, 1.5, 2}: (1<3)(1<1.5)(1<2)(2<3)(2>1.5)(2=2 -> half) = 4.5 of 6
    assert pairwise_accuracy(scores, classes) == pytest.approx(4.5 / 6)
    assert np.isnan(pairwise_accuracy(scores, np.zeros(5, dtype=np.int8)))


@pytest.mark.parametrize("target", [0.6, 0.75, 0.9, 0.97])
def test_noisy_scorer_hits_its_target_accuracy(target: float) -> None:
    w = make_workload(1, 6000, paper_service(), rate_per_s=0.12)
    achieved = pairwise_accuracy(NoisyScorer(target).scores(w, score_stream(1)), w.class_idx)
    assert achieved == pytest.approx(target, abs=0.015)


def test_noisy_scorer_extremes() -> None:
    w = make_workload(2, 4000, paper_service(), rate_per_s=0.12)
    assert pairwise_accuracy(NoisyScorer(1.0).scores(w, score_stream(2)), w.class_idx) == 1.0
    assert pairwise_accuracy(NoisyScorer(0.0).scores(w, score_stream(2)), w.class_idx) == 0.0
    assert pairwise_accuracy(NoisyScorer(0.5).scores(w, score_stream(2)), w.class_idx) == pytest.approx(0.5, abs=0.02)
    with pytest.raises(ValueError):
        NoisyScorer(1.2)


def test_oracle_ranks_by_true_service_time() -> None:
    w = make_workload(3, 2000, paper_service(), rate_per_s=0.12)
    scores = OracleScorer().scores(w, score_stream(3))
    assert np.array_equal(scores, w.service_s)
    # N(3.5, 0.8) vs N(8.9, 2.0) overlap a little: P(S < L) = Phi(5.4 / sqrt(4.64)) ~ 0.994
    assert pairwise_accuracy(scores, w.class_idx) == pytest.approx(0.994, abs=0.005)


@dataclass
class FakePrediction:
    score: float


class FakePredictor:
    """The predictor interface the simulator relies on: .predict(Prompt) -> object with .score."""

    def __init__(self) -> None:
        self.calls = 0

    def predict(self, prompt: Prompt) -> FakePrediction:
        self.calls += 1
        return FakePrediction(0.9 if "essay" in prompt.instruction else 0.1)


def write_prompts(path: Path) -> Path:
    rows = [
        {"prompt": "What is 2+2?", "output_tokens": 5, "class": "short"},
        {"prompt": "Write a long essay on rivers.", "output_tokens": 900, "class": "long"},
        {"prompt": "Name a colour.", "output_tokens": 3, "class": "short"},
        {"prompt": "Summarise this paragraph briefly.", "output_tokens": 300, "class": "medium"},
        {"prompt": "Write an essay about the sea.", "output_tokens": 1000, "class": "long"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_predictor_scorer_over_prompts(tmp_path: Path) -> None:
    records = load_prompts(write_prompts(tmp_path / "prompts.jsonl"))
    assert [r.class_idx for r in records] == [0, 2, 0, 1, 2]
    service = PromptService(records, c0_s=0.5, c_tok_s=0.01)
    w = make_workload(0, 200, service, rate_per_s=0.1)
    expected = np.array([0.5 + 0.01 * records[i].output_tokens for i in w.item])
    assert np.allclose(w.service_s, expected)
    assert service.mean_service_s() == pytest.approx(0.5 + 0.01 * (5 + 900 + 3 + 300 + 1000) / 5)
    fake = FakePredictor()
    scores = PredictorScorer(fake, records).scores(w, score_stream(0))
    assert fake.calls <= len(records)  # one prediction per distinct prompt
    assert pairwise_accuracy(scores, w.class_idx) == 1.0
    assert set(np.round(scores, 3)) <= {0.1, 0.9}


def test_predictor_scorer_needs_prompts() -> None:
    w = make_workload(0, 10, paper_service(), rate_per_s=0.1)
    with pytest.raises(ValueError, match="prompt-based"):
        PredictorScorer(FakePredictor(), []).scores(w, score_stream(0))


def test_bad_prompt_line_names_the_line_not_the_text(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"prompt": "secret words", "output_tokens": 4, "class": "short"}\n{"prompt": "secret", "class": "huge"}\n'
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2") as info:
        load_prompts(path)
    assert "secret" not in str(info.value)


def test_label_scorer_is_right_the_stated_fraction_and_predicts_class_means() -> None:
    from clairvoyant.tools.sim.predictors import LabelScorer

    w = make_workload(4, 5000, paper_service(), rate_per_s=0.12)
    scorer = LabelScorer(0.8)
    labels = scorer.labels(w, score_stream(4))
    assert np.mean(labels == w.class_idx) == pytest.approx(0.8, abs=0.02)
    beliefs = scorer.beliefs(w, score_stream(4))
    short_mean = w.service_s[w.class_idx == 0].mean()
    assert np.allclose(beliefs.predicted_s[labels == 0], short_mean)
    assert set(np.unique(beliefs.score)) <= {0.0, 1.0}
