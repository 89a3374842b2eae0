"""clairvoyant.tools.training.label_study: folds, labels and scores of the k-fold label study."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clairvoyant.tools.training import label_study


def _write_multi(path: Path, lengths: np.ndarray) -> None:
    models = [f"m{j}" for j in range(lengths.shape[1])]
    path.write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "output_tokens": dict(zip(models, map(int, row)))}) + "\n"
            for i, row in enumerate(lengths)
        )
    )


def test_folds_put_every_instruction_in_exactly_one_check_fold() -> None:
    fold = label_study.fold_of(23, 5, seed=3)
    assert sorted(np.bincount(fold).tolist()) == [4, 4, 5, 5, 5]
    assert np.array_equal(fold, label_study.fold_of(23, 5, seed=3))
    assert not np.array_equal(fold, label_study.fold_of(23, 5, seed=4))


def test_labels_are_one_model_or_the_stated_consensus() -> None:
    log_lengths = np.log(np.array([[10.0, 20.0, 40.0, 1000.0, 80.0], [5.0, 5.0, 5.0, 5.0, 500.0]]))
    rng = np.random.default_rng(0)
    ones = label_study.label_values(log_lengths, "one", rng)
    assert len(ones) == min(label_study.ONE_MODEL_DRAWS, 5)
    for values, source in ones:
        assert source is not None and np.array_equal(values, log_lengths[:, source])
    [(mean, none)] = label_study.label_values(log_lengths, "mean", rng)
    assert none is None and mean == pytest.approx(log_lengths.mean(axis=1), abs=1e-12)
    [(median, _)] = label_study.label_values(log_lengths, "median", rng)
    assert median == pytest.approx([np.log(40.0), np.log(5.0)], abs=1e-12)
    # 20% trimmed of 5 models: the lowest and the highest are dropped
    [(trimmed, _)] = label_study.label_values(log_lengths, "trimmed", rng)
    assert trimmed == pytest.approx(np.sort(log_lengths, axis=1)[:, 1:4].mean(axis=1), abs=1e-12)
    for values, source in label_study.label_values(log_lengths, "mean_of_3", rng):
        assert (
            source is None and np.all(values >= log_lengths.min(axis=1)) and np.all(values <= log_lengths.max(axis=1))
        )
    with pytest.raises(ValueError, match="unknown label"):
        label_study.label_values(log_lengths, "mode", rng)


def test_mean_tau_skips_the_label_source() -> None:
    lengths = np.array([[1, 3], [2, 2], [3, 1]])
    score = np.array([1.0, 2.0, 3.0])
    assert label_study.mean_tau_over_models(score, lengths) == pytest.approx(0.0, abs=1e-12)
    assert label_study.mean_tau_over_models(score, lengths, skip=1) == pytest.approx(1.0, abs=1e-12)


def test_the_study_ranks_a_learnable_length_above_chance(tmp_path: Path) -> None:
    """Lengths driven by one feature, with per-model noise: every method learns the order on held-out
    instructions, and the consensus label does at least as well as one model's."""
    rng = np.random.default_rng(1)
    need = rng.normal(size=120)
    lengths = np.exp(5.0 + need[:, None] + rng.normal(scale=0.8, size=(120, 12))).round() + 1
    _write_multi(tmp_path / "multi.jsonl", lengths)
    data = label_study.load_multi(tmp_path / "multi.jsonl")
    assert data.lengths.shape == (120, 12) and data.prompts[0] == "p0"
    x = np.column_stack([need, rng.normal(size=(120, 3))])
    rows = label_study.run_study(
        data, {"toy": x}, labels=("one", "mean"), methods=("squared", "ridge"), folds=3, seed=0
    )
    assert {(r.method, r.label) for r in rows} == {(m, lab) for m in ("squared", "ridge") for lab in ("one", "mean")}
    by = {(r.method, r.label): r.mean_tau for r in rows}
    assert all(tau > 0.3 for tau in by.values()), by
    assert by[("ridge", "mean")] >= by[("ridge", "one")] - 0.02
    fixed = label_study.scored_the_same_way(data, {"truth": need, "noise": rng.normal(size=120)}, folds=3, seed=0)
    assert fixed["truth"][0] > 0.4 and abs(fixed["noise"][0]) < 0.15


@pytest.mark.parametrize("method", label_study.METHODS)
def test_every_method_orders_held_out_rows(method: str) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(200, 4))
    y = 5.0 + x[:, 0] + rng.normal(scale=0.3, size=200)
    predicted = label_study.fit_predict(method, x[:150], y[:150], x[150:], seed=0)
    assert predicted.shape == (50,) and np.corrcoef(predicted, y[150:])[0, 1] > 0.7


def test_a_line_without_every_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "multi.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "output_tokens": {"x": 1, "y": 2}})
        + "\n"
        + json.dumps({"prompt": "b", "output_tokens": {"x": 1}})
        + "\n"
    )
    with pytest.raises(ValueError, match="line 2 has no length for"):
        label_study.load_multi(path)
