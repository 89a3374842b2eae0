"""clairvoyant.prediction.predictor and the ONNX export: parity, card checks, the shipped model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from clairvoyant.errors import ModelError
from clairvoyant.prediction.features import Prompt, get_feature_set
from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH, OnnxPredictor, Prediction, card_path_for

# The previous shipped model (balanced 3-class, P(Long)): the class-model reference.
BASELINE_PATH = DEFAULT_MODEL_PATH.parent / "baselines" / "rich_v2_3class.onnx"


@pytest.fixture
def schema1_model(tmp_path: Path) -> Path:
    """The baseline class model with its card as schema 1 wrote it (no kind, output, score or calibration)."""
    dst = tmp_path / "schema1.onnx"
    shutil.copy(BASELINE_PATH, dst)
    card = json.loads(card_path_for(BASELINE_PATH).read_text())
    for key in ("kind", "output", "score", "calibration"):
        card.pop(key, None)
    card_path_for(dst).write_text(json.dumps({**card, "schema": 1}))
    return dst


xgboost = pytest.importorskip("xgboost")
pytest.importorskip("onnxmltools")

WORDS = "write essay code python hi thanks what why list explain table continue story brief detailed".split()


def synthetic_prompts(n: int, seed: int = 0) -> tuple[list[Prompt], np.ndarray]:
    rng = np.random.default_rng(seed)
    prompts, labels = [], []
    for _ in range(n):
        k = int(rng.integers(1, 40))
        text = " ".join(rng.choice(WORDS, size=k))
        prompts.append(
            Prompt(text, context_chars=len(text) + int(rng.integers(0, 3000)), turns=int(rng.integers(1, 6)))
        )
        labels.append(0 if k < 10 else (2 if ("essay" in text or "code" in text) and k > 20 else 1))
    return prompts, np.array(labels)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, np.ndarray]:
    """A 10-round depth-3 rich_v1 model trained here in well under a second, with its card."""
    from clairvoyant.tools.training import export
    from clairvoyant.tools.training.train import ModelConfig, featurize, fit

    fs = get_feature_set("rich_v1")
    prompts, y = synthetic_prompts(600)
    x = featurize(fs, prompts)
    clf = fit(x, y, ModelConfig("rich_v1", 10, 3, 0.3, 42), threads=1)
    path = tmp_path_factory.mktemp("model") / "small.onnx"
    export.write_model(export.to_onnx(clf, fs.size), path)
    from clairvoyant.tools.training import calibration

    p_long = export.onnx_probabilities(path.read_bytes(), x)[:, 2]
    lengths = np.where(y == 0, 50.0, np.where(y == 1, 400.0, 900.0))
    export.write_card(path, {
        "feature_set": fs.name, "feature_names": list(fs.names),
        "calibration": calibration.isotonic_breakpoints(p_long, np.log(lengths)),
    })  # fmt: skip
    held_out, _ = synthetic_prompts(200, seed=1)
    return path, clf, featurize(fs, held_out)


def test_onnx_matches_xgboost_within_1e_5(small_model) -> None:
    from clairvoyant.tools.training.export import check_parity

    path, clf, x_held_out = small_model
    expected = clf.predict_proba(x_held_out)
    got = OnnxPredictor(path).predict_features(x_held_out)
    assert got.shape == (200, 3)
    assert np.max(np.abs(got - expected)) <= 1e-5
    assert check_parity(clf, path.read_bytes(), x_held_out) <= 1e-5


def test_parity_check_fails_loudly_for_a_different_model(small_model) -> None:
    from clairvoyant.tools.training import export
    from clairvoyant.tools.training.train import ModelConfig, fit

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
        assert sum(s.probabilities) == pytest.approx(1.0, abs=1e-5)
        assert s.probabilities == pytest.approx(b.probabilities, abs=1e-6)
        ref = clf.predict_proba(predictor.feature_set.extract(p)[None, :])[0]
        assert s.probabilities[2] == pytest.approx(float(ref[2]), abs=1e-5)
        assert s.score == s.probabilities[2]
    # The reused input buffer really is re-filled: different prompts, different answers.
    assert single[0].score != single[1].score
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
    assert (card["schema"], card["kind"], card["score"]) == (2, "regressor", "log_tokens")
    for key in ("tokenizer", "data", "hyperparameters", "metrics", "calibration"):
        assert key in card
    hi = predictor.predict(Prompt("hi"))
    essay = predictor.predict(Prompt("Write a detailed 2000-word essay on the history of the Roman Empire."))
    assert essay.score > hi.score and essay.predicted_tokens > 2 * hi.predicted_tokens
    assert hi.predicted_class == "short" and hi.probabilities is None


# --------------------------------------------------------------------------------------------
# Schema-2 cards, calibration, caps

import math  # noqa: E402

from clairvoyant.prediction.length_classes import LONG_FROM_TOKENS, SHORT_BELOW_TOKENS  # noqa: E402
from clairvoyant.prediction.predictor import STAND_IN_P_LONG_CALIBRATION, Calibration  # noqa: E402

ESSAY = "Write a detailed 2000-word essay on the history of the Roman Empire."


@pytest.fixture(scope="module")
def regressor_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A small XGBoost regressor on log tokens exported like R's schema-2 models, with its card."""
    from onnxmltools import convert_xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType

    from clairvoyant.tools.training import export

    fs = get_feature_set("rich_v1")
    prompts, labels = synthetic_prompts(600)
    x = fs.extract_many(prompts)
    y = np.log(np.array([30.0, 300.0, 1200.0])[labels]) + np.random.default_rng(3).normal(0, 0.1, len(labels))
    reg = xgboost.XGBRegressor(n_estimators=10, max_depth=3, learning_rate=0.3, n_jobs=1, random_state=0)
    reg.fit(x, y)
    onnx_model = convert_xgboost(reg, initial_types=[("input", FloatTensorType([None, fs.size]))], target_opset=15)
    path = tmp_path_factory.mktemp("regressor") / "reg.onnx"
    export.write_model(onnx_model.SerializeToString(), path)
    card = {
        "schema": 2,
        "kind": "regressor",
        "output": onnx_model.graph.output[0].name,
        "score": "log_tokens",
        "calibration": {"method": "isotonic", "score": [2.0, 4.0, 6.0, 8.0], "log_tokens": [2.5, 4.0, 6.5, 7.0]},
        "feature_set": fs.name,
        "feature_names": list(fs.names),
        "onnx_sha256": export.sha256_of(path),
    }
    card_path_for(path).write_text(json.dumps(card))
    return path, reg


def test_calibration_matches_np_interp_both_ways_and_extends_strictly() -> None:
    cal = Calibration((0.0, 0.3, 1.0), (1.0, 5.0, 6.0), "isotonic")
    for x in np.linspace(-1, 2, 61):
        assert cal.log_tokens_of(float(x)) == pytest.approx(np.interp(x, cal.score, cal.log_tokens))
        assert cal.score_of(float(x) * 5) == pytest.approx(np.interp(x * 5, cal.log_tokens, cal.score))
    assert cal.log_tokens_of(math.nan) == 1.0
    beyond = [cal.score_of_extended(v) for v in (-3.0, 0.0, 0.99, 6.01, 9.0, 20.0)]
    assert all(b > a for a, b in zip(beyond, beyond[1:]))  # strictly ordered past both ends
    assert cal.score_of_extended(5.5) == cal.score_of(5.5)
    for bad in (((0.0, 0.0), (1.0, 2.0)), ((0.0, 1.0), (2.0, 1.0)), ((0.0,), (1.0,)), ((0.0, math.inf), (1.0, 2.0))):
        with pytest.raises(ValueError):
            Calibration(bad[0], bad[1], "isotonic")


def test_schema2_regressor_card_predicts_calibrated_tokens(regressor_model) -> None:
    path, reg = regressor_model
    predictor = OnnxPredictor(path)
    assert predictor.output.kind == "regressor" and not predictor.calibration.stand_in
    prompts = [Prompt("hi"), Prompt("write essay code " * 12), Prompt("")]
    single = [predictor.predict(p) for p in prompts]
    bulk = predictor.predict_many(prompts)
    for s, b, p in zip(single, bulk, prompts):
        raw = float(reg.predict(predictor.feature_set.extract(p)[None, :])[0])
        assert s.score == pytest.approx(raw, abs=1e-5)  # the key is the raw score
        expected_log = np.interp(s.score, predictor.calibration.score, predictor.calibration.log_tokens)
        assert s.predicted_tokens == pytest.approx(math.exp(expected_log), rel=1e-6)
        assert s.probabilities is None
        assert "p_long" not in s.as_dict() and s.as_dict()["predicted_tokens"] == s.predicted_tokens
        assert (b.score, b.predicted_tokens) == pytest.approx((s.score, s.predicted_tokens), rel=1e-6)
        assert s.feature_row == b.feature_row == predictor.feature_set.extract(p).tobytes()
    assert single[1].predicted_tokens > single[0].predicted_tokens


def test_schema1_card_is_a_class_model_with_the_named_stand_in_calibration(schema1_model: Path) -> None:
    predictor = OnnxPredictor(schema1_model)
    assert predictor.card["schema"] == 1
    assert predictor.calibration is STAND_IN_P_LONG_CALIBRATION and predictor.calibration.stand_in
    assert "stand-in" in predictor.calibration.method
    pred = predictor.predict(Prompt(ESSAY))
    assert pred.probabilities is not None and pred.score == pred.probabilities[2]
    assert pred.predicted_tokens == pytest.approx(
        math.exp(np.interp(pred.probabilities[2], (0, 0.5, 1), np.log([100, 400, 1000])))
    )
    # one definition of the classes: derived from predicted tokens
    for p in (predictor.predict(Prompt("hi")), pred):
        expected = (
            "short"
            if p.predicted_tokens < SHORT_BELOW_TOKENS
            else ("medium" if p.predicted_tokens < LONG_FROM_TOKENS else "long")
        )
        assert p.predicted_class == expected


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"schema": 3}, "schemas 1 and 2"),
        ({"kind": "ranker"}, "neither"),
        ({"score": "p_long"}, "does not fit"),
        ({"output": "nope"}, "has no 'nope' output"),
        ({"calibration": {"method": "isotonic", "score": [1, 1], "log_tokens": [1, 2]}}, "strictly increasing"),
        ({"calibration": None}, "must be an object"),
    ],
)
def test_bad_schema2_cards_are_refused(regressor_model, tmp_path: Path, changes: dict, message: str) -> None:
    path = _copy(regressor_model[0], tmp_path)
    card = json.loads(card_path_for(path).read_text())
    card.update(changes)
    card_path_for(path).write_text(json.dumps(card))
    with pytest.raises(ModelError, match=message):
        OnnxPredictor(path)


def test_the_cap_bounds_predicted_tokens_and_the_key(schema1_model: Path) -> None:
    """Issue 8 part 4: `max_tokens: 1` on an essay prompt was predicted Long (p_long 0.86)."""
    predictor = OnnxPredictor(schema1_model)
    cal = predictor.calibration
    free = predictor.predict(Prompt(ESSAY))
    hi = predictor.predict(Prompt("hi"))
    assert free.predicted_class == "long"
    capped = predictor.predict(Prompt(ESSAY), cap_tokens=1)
    assert capped.predicted_tokens == 1.0 and capped.predicted_class == "short" and capped.cap_tokens == 1
    assert capped.score == min(free.score, cal.score_of_extended(math.log(1)))
    assert capped.score < hi.score  # the capped essay now goes before "hi"
    # caps below the calibrated range (its first knot is 100 tokens) still order by cap, not tie
    tiny = [predictor.predict(Prompt(ESSAY), cap_tokens=c).score for c in (1, 4, 24, 99)]
    assert all(b > a for a, b in zip(tiny, tiny[1:])) and tiny[-1] < cal.score[0] <= hi.score
    assert capped.probabilities == free.probabilities  # the model's view is unchanged, only the bound
    # a cap between: tokens = the cap, key = the raw score whose calibrated tokens are the cap
    mid = predictor.predict(Prompt(ESSAY), cap_tokens=300)
    assert mid.predicted_tokens == 300.0
    assert mid.score == pytest.approx(float(np.interp(math.log(300), cal.log_tokens, cal.score)))
    assert cal.log_tokens_of(mid.score) == pytest.approx(math.log(300))
    # a cap above the prediction changes nothing; a zero cap predicts nothing
    loose = predictor.predict(Prompt(ESSAY), cap_tokens=100_000)
    assert (loose.score, loose.predicted_tokens) == (free.score, free.predicted_tokens)
    assert predictor.predict(Prompt(ESSAY), cap_tokens=0).predicted_tokens == 0.0
    # bulk scoring applies the same rule
    bulk = predictor.predict_many([Prompt(ESSAY)] * 3, caps_tokens=[1, 300, None])
    assert [b.score for b in bulk] == pytest.approx([capped.score, mid.score, free.score], rel=1e-6)
    assert [b.predicted_tokens for b in bulk] == pytest.approx([1.0, 300.0, free.predicted_tokens], rel=1e-6)


def test_the_cap_binds_the_shipped_regressor_too() -> None:
    predictor = OnnxPredictor()
    free, hi = predictor.predict(Prompt(ESSAY)), predictor.predict(Prompt("hi"))
    capped = predictor.predict(Prompt(ESSAY), cap_tokens=1)
    assert free.predicted_tokens > 100 and capped.predicted_tokens == 1.0
    assert capped.score < hi.score < free.score  # the capped essay now goes before "hi"
    assert predictor.calibration.log_tokens_of(predictor.predict(Prompt(ESSAY), cap_tokens=50).score) == pytest.approx(
        math.log(50)
    )


class _ConstantCorrector:
    def __init__(self, log_tokens: float) -> None:
        self.log_tokens = log_tokens
        self.seen: list[tuple[str | None, int, float]] = []

    def correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        self.seen.append((model, len(row), prior_log_tokens))
        return self.log_tokens


def test_a_corrector_moves_tokens_and_key_together_and_the_cap_still_binds(regressor_model) -> None:
    path, _ = regressor_model
    corrector = _ConstantCorrector(math.log(2.0))
    static = OnnxPredictor(path)
    learned = OnnxPredictor(path, corrector=corrector)
    prompts = [Prompt("hi"), Prompt("write essay code " * 12), Prompt("why " * 30)]
    before = [static.predict(p) for p in prompts]
    after = [learned.predict(p, model="m") for p in prompts]
    for b, a in zip(before, after):
        assert a.prior_log_tokens == b.prior_log_tokens
        assert a.predicted_tokens == pytest.approx(2.0 * b.predicted_tokens)
        assert a.model == "m"
    assert corrector.seen[0] == ("m", static.feature_set.size, before[0].prior_log_tokens)
    # the key follows the corrected tokens: same order as predicted tokens
    assert np.argsort([a.score for a in after]).tolist() == np.argsort([a.predicted_tokens for a in after]).tolist()
    capped = learned.predict(prompts[1], cap_tokens=5)
    assert capped.predicted_tokens == 5.0 and capped.score <= after[0].score


def test_a_prediction_stays_well_under_one_kilobyte() -> None:
    import sys

    pred = OnnxPredictor().predict(Prompt(ESSAY * 50), model="some-backend-model:7b", cap_tokens=512)
    size = sys.getsizeof(pred) + sum(
        sys.getsizeof(v)
        for v in (
            pred.score,
            pred.predicted_tokens,
            pred.probabilities,
            pred.prior_log_tokens,
            pred.feature_row,
            pred.model,
            pred.cap_tokens,
        )
    )
    size += sum(sys.getsizeof(p) for p in pred.probabilities or ())
    assert size < 700, size
    assert len(pred.feature_row) == 4 * OnnxPredictor().feature_set.size


def test_the_bound_run_calls_the_session_directly_and_scores_like_a_plain_run() -> None:
    import functools

    import onnxruntime as ort

    from clairvoyant.prediction.predictor import _bound_runner

    predictor = OnnxPredictor()
    bound = predictor._bound
    run = bound.run  # what predict runs
    # this onnxruntime has the C session and binding: the per-call capture bookkeeping is skipped
    assert isinstance(run, functools.partial)
    assert run.func is not bound.session.run_with_iobinding
    assert run.args[0] is bound.binding._iobinding
    assert isinstance(run.args[1], ort.RunOptions)  # made once: none would cost default options every call
    again = _bound_runner(bound.session, bound.binding)
    assert again.func == run.func and again.args[0] is run.args[0]
    prompts = [
        Prompt("hi"),
        Prompt("Write a detailed 2000-word essay on Rome."),
        Prompt(""),
        Prompt("def f(): pass\n" * 40),
    ]
    rows = predictor.feature_set.extract_many(prompts)
    plain = bound.session.run([predictor.output.output], {bound.input_name: rows})[0].reshape(-1)
    for prompt, expected in zip(prompts, plain):
        prediction = predictor.predict(prompt)
        assert prediction.score == float(expected)
        np.testing.assert_array_equal(prediction.features(), predictor.feature_set.extract(prompt))


def test_a_predictions_class_at_the_class_bounds() -> None:
    tokens = (0, 199.999, 200, 599.999, 600, 1e9)
    assert [Prediction(0.5, t).predicted_class for t in tokens] == [
        "short",
        "short",
        "medium",
        "medium",
        "long",
        "long",
    ]
