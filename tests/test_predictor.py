"""clairvoyant.predictor and the ONNX export: parity, card checks, the shipped model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from clairvoyant.errors import ModelError
from clairvoyant.features import Prompt, get_feature_set
from clairvoyant.predictor import DEFAULT_MODEL_PATH, OnnxPredictor, Prediction, card_path_for

xgboost = pytest.importorskip("xgboost")
pytest.importorskip("onnxmltools")

WORDS = "write essay code python hi thanks what why list explain table continue story brief detailed".split()


def synthetic_prompts(n: int, seed: int = 0) -> tuple[list[Prompt], np.ndarray]:
    rng = np.random.default_rng(seed)
    prompts, labels = [], []
    for _ in range(n):
        k = int(rng.integers(1, 40))
        text = " ".join(rng.choice(WORDS, size=k))
        prompts.append(Prompt(text, context_chars=len(text) + int(rng.integers(0, 3000)), turns=int(rng.integers(1, 6))))
        labels.append(0 if k < 10 else (2 if ("essay" in text or "code" in text) and k > 20 else 1))
    return prompts, np.array(labels)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, np.ndarray]:
    """A 10-round depth-3 rich_v1 model trained here in well under a second, with its card."""
    from clairvoyant.training import export
    from clairvoyant.training.train import ModelConfig, featurize, fit

    fs = get_feature_set("rich_v1")
    prompts, y = synthetic_prompts(600)
    x = featurize(fs, prompts)
    clf = fit(x, y, ModelConfig("rich_v1", 10, 3, 0.3, 42), threads=1)
    path = tmp_path_factory.mktemp("model") / "small.onnx"
    export.write_model(export.to_onnx(clf, fs.size), path)
    export.write_card(path, {"feature_set": fs.name, "feature_names": list(fs.names)})
    held_out, _ = synthetic_prompts(200, seed=1)
    return path, clf, featurize(fs, held_out)


def test_onnx_matches_xgboost_within_1e_5(small_model) -> None:
    from clairvoyant.training.export import check_parity

    path, clf, x_held_out = small_model
    expected = clf.predict_proba(x_held_out)
    got = OnnxPredictor(path).predict_features(x_held_out)
    assert got.shape == (200, 3)
    assert np.max(np.abs(got - expected)) <= 1e-5
    assert check_parity(clf, path.read_bytes(), x_held_out) <= 1e-5


def test_parity_check_fails_loudly_for_a_different_model(small_model) -> None:
    from clairvoyant.training import export
    from clairvoyant.training.train import ModelConfig, fit

    path, _, x = small_model
    prompts, y = synthetic_prompts(300, seed=5)
    other = fit(get_feature_set("rich_v1").extract_many(prompts), y, ModelConfig("rich_v1", 3, 2, 0.5, 1), threads=1)
    with pytest.raises(export.ParityError):
        export.check_parity(other, path.read_bytes(), x)


def test_predict_matches_bulk_and_probabilities_sum_to_one(small_model) -> None:
    path, clf, _ = small_model
    predictor = OnnxPredictor(path)
    prompts = [Prompt("hi"), Prompt("write a detailed essay " * 10), Prompt(""), Prompt("\ud800" * 5)]
    single = [predictor.predict(p) for p in prompts]
    bulk = predictor.predict_many(prompts)
    for s, b, p in zip(single, bulk, prompts):
        assert isinstance(s, Prediction)
        assert s.p_short + s.p_medium + s.p_long == pytest.approx(1.0, abs=1e-5)
        assert (s.p_short, s.p_medium, s.p_long) == pytest.approx((b.p_short, b.p_medium, b.p_long), abs=1e-6)
        ref = clf.predict_proba(predictor.feature_set.extract(p)[None, :])[0]
        assert s.p_long == pytest.approx(float(ref[2]), abs=1e-5)
        assert s.score == s.p_long
    # The reused input buffer really is re-filled: different prompts, different answers.
    assert single[0].p_long != single[1].p_long
    assert predictor.feature_set_name == "rich_v1"
    assert predictor.predict_many([]) == []


def _copy(model: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "m.onnx"
    shutil.copy(model, dst)
    shutil.copy(card_path_for(model), card_path_for(dst))
    return dst


def _edit_card(path: Path, **changes: object) -> None:
    card_path = card_path_for(path)
    card = json.loads(card_path.read_text())
    for key, value in changes.items():
        if value is None:
            card.pop(key, None)
        else:
            card[key] = value
    card_path.write_text(json.dumps(card))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"feature_set": "paper19"}, "lists features"),  # a 48-column card claiming paper19
        ({"feature_set": "rich_v0"}, "does not have"),
        ({"feature_names": list(get_feature_set("rich_v1").names)[::-1]}, "lists features"),
        ({"classes": ["long", "medium", "short"]}, "classes"),
        ({"onnx_sha256": "0" * 64}, "sha256"),
        ({"onnx_sha256": None}, "onnx_sha256"),
    ],
)
def test_mismatched_card_is_refused(small_model, tmp_path: Path, changes: dict, message: str) -> None:
    path = _copy(small_model[0], tmp_path)
    _edit_card(path, **changes)
    with pytest.raises(ModelError, match=message):
        OnnxPredictor(path)


def test_missing_or_broken_card_and_missing_or_corrupt_model_are_refused(small_model, tmp_path: Path) -> None:
    path = _copy(small_model[0], tmp_path)
    card_path_for(path).unlink()
    with pytest.raises(ModelError, match="not found"):
        OnnxPredictor(path)
    path = _copy(small_model[0], tmp_path)
    card_path_for(path).write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        OnnxPredictor(path)
    with pytest.raises(ModelError, match="not found"):
        OnnxPredictor(tmp_path / "nope.onnx")
    path = _copy(small_model[0], tmp_path)
    path.write_bytes(b"not an onnx model")
    _edit_card(path, onnx_sha256=__import__("hashlib").sha256(b"not an onnx model").hexdigest())
    with pytest.raises(ModelError, match="cannot load"):
        OnnxPredictor(path)


def test_the_shipped_model_loads_by_default_and_ranks_the_obvious_cases() -> None:
    assert DEFAULT_MODEL_PATH.name == "predictor.onnx"
    predictor = OnnxPredictor()
    card = predictor.card
    assert card["feature_set"] == predictor.feature_set_name
    assert card["class_bounds"]["short_below"] == 200
    for key in ("tokenizer", "data", "hyperparameters", "metrics"):
        assert key in card
    hi = predictor.predict(Prompt("hi"))
    essay = predictor.predict(Prompt("Write a detailed 2000-word essay on the history of the Roman Empire."))
    assert essay.p_long > hi.p_long
    assert hi.predicted_class == "short"
