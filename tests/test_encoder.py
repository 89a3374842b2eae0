"""The encoder's second opinion (clairvoyant.prediction.encoder): the shipped files, the card checks,
the blend into a prediction, and the background refiner, all on the real ONNX encoder."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clairvoyant.errors import ModelError
from clairvoyant.prediction.encoder import DEFAULT_ENCODER_CARD, EncoderModel, Refiner
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import OnnxPredictor

ESSAY = "Write a detailed 2000-word essay on the causes and consequences of the fall of the Roman Empire."
SHORT = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def encoder() -> EncoderModel:
    return EncoderModel()


@pytest.fixture(scope="module")
def predictor() -> OnnxPredictor:
    return OnnxPredictor()


def _copy_card(tmp_path: Path, **changes: Any) -> Path:
    card = json.loads(DEFAULT_ENCODER_CARD.read_text())
    for key in ("onnx_file", "tokenizer_file"):
        shutil.copy(DEFAULT_ENCODER_CARD.parent / card[key], tmp_path / card[key])
    card.update(changes)
    path = tmp_path / "encoder.card.json"
    path.write_text(json.dumps(card))
    return path


def test_the_shipped_encoder_orders_an_essay_after_a_one_word_answer(encoder: EncoderModel) -> None:
    essay, short = encoder.log_tokens(ESSAY), encoder.log_tokens(SHORT)
    assert essay > short + 1.0  # e-fold apart at least, in tokens
    assert 0.0 < math.exp(short) < math.exp(essay) < 5000
    many = encoder.log_tokens_many([ESSAY, SHORT, ESSAY])
    assert many.tolist() == [essay, short, essay]  # one at a time: the served values exactly


def test_the_encoder_reads_only_its_word_pieces(encoder: EncoderModel) -> None:
    tail = " Then list every emperor with a one-page biography each." * 200
    clipped = encoder.clip(ESSAY + tail)
    assert len(clipped) == encoder.card.max_word_pieces * 8
    assert encoder.log_tokens(ESSAY + tail) == encoder.log_tokens(clipped)
    assert math.isfinite(encoder.log_tokens("\x00\ud83d lone surrogate"))  # JSON allows it; the tokenizer does not
    assert math.isfinite(encoder.log_tokens(""))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"onnx_sha256": "0" * 64}, "does not match the sha256"),
        ({"blend_weight": 1.5}, "is not in \\[0, 1\\]"),
        ({"max_word_pieces": 2}, "below 8"),
        ({"onnx_file": "missing.onnx"}, "not found"),
    ],
)
def test_a_bad_card_is_refused(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        EncoderModel(_copy_card(tmp_path, **changes))


def test_a_missing_card_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        EncoderModel(tmp_path / "encoder.card.json")


class _ConstantCorrector:
    def __init__(self, log_tokens: float) -> None:
        self.log_tokens = log_tokens
        self.priors: list[float] = []

    def correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        self.priors.append(prior_log_tokens)
        return self.log_tokens


def test_refined_blends_in_log_tokens_then_corrects_then_caps(predictor: OnnxPredictor) -> None:
    lexical = predictor.predict(Prompt(SHORT), model="m")
    prior = lexical.prior_log_tokens
    same = predictor.refined(lexical, 7.0, 0.0)
    assert same.predicted_tokens == pytest.approx(lexical.predicted_tokens)
    assert same.prior_log_tokens == prior
    whole = predictor.refined(lexical, 7.0, 1.0)
    assert whole.predicted_tokens == pytest.approx(math.exp(7.0))
    half = predictor.refined(lexical, 7.0, 0.5)
    assert half.prior_log_tokens == pytest.approx(prior + 0.5 * (7.0 - prior))
    assert half.score > lexical.score  # a longer answer: a later key
    assert half.feature_row == lexical.feature_row and half.model == "m"  # the learner still sees its row
    capped = predictor.refined(predictor.predict(Prompt(SHORT), cap_tokens=20), 7.0, 1.0)
    assert capped.predicted_tokens == 20.0 and capped.cap_tokens == 20
    corrector = _ConstantCorrector(math.log(2.0))
    learned = OnnxPredictor(predictor.model_path, corrector=corrector)
    corrected = learned.refined(lexical, 7.0, 0.5)
    assert corrector.priors[-1] == pytest.approx(half.prior_log_tokens)  # the correction sees the refined prior
    assert corrected.predicted_tokens == pytest.approx(2.0 * half.predicted_tokens)


def test_the_refiner_encodes_only_what_still_waits_and_drops_past_its_bound(encoder: EncoderModel) -> None:
    async def scenario() -> None:
        delivered: list[tuple[str, float]] = []
        outcomes: list[str] = []
        got_one = asyncio.Event()

        def deliver(key: str, value: float, components: bytes) -> None:
            delivered.append((key, value))
            assert len(components) == 4 * encoder.components
            got_one.set()

        gate = threading.Event()

        def blocked() -> bool:
            gate.wait(10.0)  # holds the worker on its first item while the queue fills
            return True

        refiner = Refiner(encoder, deliver, max_pending=1, count=outcomes.append)
        refiner.start(asyncio.get_running_loop())
        assert refiner.want("first", ESSAY, blocked)
        for _ in range(200):  # until the worker has taken "first" off the queue
            if refiner._pending.empty():
                break
            await asyncio.sleep(0.01)
        assert refiner.want("gone", SHORT, lambda: False)  # dispatched before its turn
        assert not refiner.want("over", SHORT, lambda: True)  # the bound: keeps its lexical prediction
        gate.set()
        await asyncio.wait_for(got_one.wait(), 10.0)
        for _ in range(200):  # until the worker has taken "gone" too
            if refiner._pending.empty():
                break
            await asyncio.sleep(0.01)
        assert refiner.want("second", SHORT, lambda: True)
        for _ in range(500):
            if len(delivered) == 2:
                break
            await asyncio.sleep(0.01)
        refiner.stop()
        assert [k for k, _ in delivered] == ["first", "second"]
        assert delivered[0][1] == encoder.log_tokens(ESSAY)
        assert sorted(outcomes) == ["dropped", "skipped"]

    asyncio.run(scenario())
