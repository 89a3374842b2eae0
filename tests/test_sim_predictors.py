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


@dataclass
class RowPrediction:
    """A prediction with a feature row (as OnnxPredictor's): what the expected-tokens key reads."""

    score: float
    predicted_tokens: float
    row: tuple[float, ...]

    def features(self) -> np.ndarray:
        return np.array(self.row, dtype=np.float32)


def test_log_spread_learns_a_variance_that_depends_on_the_features() -> None:
    from clairvoyant.tools.sim.predictors import LogSpread

    rng = np.random.default_rng(0)
    n = 20000
    m = rng.uniform(4.0, 6.0, n)
    vague = rng.integers(0, 2, n).astype(np.float64)  # a count feature: 0 or 1
    sd = np.where(vague > 0, 1.2, 0.4)  # ln-token spread: 1.44 and 0.16
    observed = m + sd * rng.standard_normal(n)
    spread = LogSpread.fit(vague[:, None], m, observed, penalty=1.0)
    test_m = np.array([5.0, 5.0])
    v = spread.variance(np.array([[1.0], [0.0]]), test_m)
    assert v == pytest.approx([1.44, 0.16], abs=0.05)
    # a vague prompt predicted 5.0 ln tokens waits behind a precise one predicted 5.5: its mean is larger
    expected = spread.expected_log_tokens(np.array([[1.0], [0.0]]), np.array([5.0, 5.5]))
    assert expected[0] > expected[1]
    assert np.all(spread.variance(np.zeros((3, 1)), np.array([-50.0, 0.0, 50.0])) >= spread.floor)


def test_log_spread_needs_two_observations() -> None:
    from clairvoyant.tools.sim.predictors import LogSpread

    with pytest.raises(ValueError, match="two observations"):
        LogSpread.fit(np.zeros((1, 1)), np.zeros(1), np.zeros(1))


def test_predictor_scorer_orders_by_expected_tokens_with_a_spread(tmp_path: Path) -> None:
    import math

    from clairvoyant.tools.sim.predictors import LogSpread

    records = load_prompts(write_prompts(tmp_path / "prompts.jsonl"))

    class Fixed:
        """Essays: median 400 tokens, a precise row; everything else: median 300, a vague row."""

        def predict(self, prompt: Prompt) -> RowPrediction:
            essay = "essay" in prompt.instruction
            return RowPrediction(0.9 if essay else 0.1, 400.0 if essay else 300.0, (0.0,) if essay else (1.0,))

    # v = 0.1 for a precise row, 1.1 for a vague one (weights on [m, m^2, log1p(row)] by hand)
    spread = LogSpread(np.zeros(3), np.ones(3), np.array([0.0, 0.0, 1.0 / math.log(2.0)]), 0.1)
    service = PromptService(records)
    w = make_workload(0, 100, service, rate_per_s=0.1)
    median = PredictorScorer(Fixed(), records).beliefs(w, score_stream(0))
    expected = PredictorScorer(Fixed(), records, spread=spread).beliefs(w, score_stream(0))
    essay = np.array(["essay" in records[i].prompt.instruction for i in w.item])
    assert median.score[essay].min() > median.score[~essay].max()  # the median key: essays last
    assert expected.score[essay].max() < expected.score[~essay].min()  # the mean key: essays first
    assert expected.predicted_tokens is not None
    assert expected.predicted_tokens[essay] == pytest.approx(400.0 * math.exp(0.05))
    assert expected.predicted_tokens[~essay] == pytest.approx(300.0 * math.exp(0.55))
    assert expected.predicted_s[essay] == pytest.approx(0.3 + 0.02 * 400.0 * math.exp(0.05))


def test_log_spread_round_trips_through_a_dict() -> None:
    from clairvoyant.tools.sim.predictors import LogSpread

    rng = np.random.default_rng(1)
    features, m = rng.uniform(0, 5, (50, 3)), rng.uniform(3, 6, 50)
    spread = LogSpread.fit(features, m, m + rng.standard_normal(50))
    again = LogSpread.from_dict(json.loads(json.dumps(spread.as_dict())))
    assert np.array_equal(again.variance(features, m), spread.variance(features, m))
    with pytest.raises(ValueError, match="equally long"):
        LogSpread.from_dict({**spread.as_dict(), "weights": [1.0]})
