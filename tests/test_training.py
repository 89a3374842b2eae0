"""clairvoyant.training: record decoding, pairs, the leak-free split, metrics, train -> export -> card."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("xgboost")
pytest.importorskip("quicktok")

from clairvoyant.features import Prompt  # noqa: E402
from clairvoyant.training import metrics  # noqa: E402
from clairvoyant.training.dataset import (  # noqa: E402
    DataConfig,
    Pair,
    build_split,
    is_english,
    iter_records,
    merge_chunks,
    pairs_from_conversations,
)
from clairvoyant.training.labels import PAPER_BOUNDS, ClassBounds, count_tokens  # noqa: E402

# ---------------------------------------------------------------------------- decoding


def test_iter_records_recovers_every_complete_record_of_a_truncated_array() -> None:
    raw = '[{"id": "a_0", "conversations": []},\n {"id": "b_0", "conversations": [{"from": "human", "value": "x"}]}, {"id": "c_0", "conv'
    assert [r["id"] for r in iter_records(raw)] == ["a_0", "b_0"]
    assert list(iter_records("")) == []
    assert [r["id"] for r in iter_records('[{"id": "z"}]')] == ["z"]


def test_chunks_are_merged_in_order_and_pairs_cross_chunk_boundaries() -> None:
    records = [
        {"id": "c1_1", "conversations": [{"from": "gpt", "value": "answer two"}]},
        {"id": "c1_0", "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "question one"}, {"from": "gpt", "value": "answer one"},
            {"from": "human", "value": "question two"},
        ]},
        {"id": "c2_0", "conversations": [{"from": "human", "value": "question one"}, {"from": "gpt", "value": "answer one"}]},
    ]
    conversations = merge_chunks(records)
    assert [m["role"] for m in conversations["c1"]] == ["system", "user", "assistant", "user", "assistant"]
    pairs = pairs_from_conversations(conversations)
    # c2 duplicates c1's first pair exactly: dropped. The cross-chunk pair is kept.
    assert [(p.conv_id, p.turn, p.answer) for p in pairs] == [("c1", 0, "answer one"), ("c1", 1, "answer two")]
    second = pairs[1].prompt
    assert second == Prompt("question two", context_chars=3 + 12 + 10 + 12, turns=4, system_chars=3)
    assert pairs[0].group == pairs[1].group  # one conversation, one group


def test_is_english() -> None:
    assert is_english("Please write a short story about a dragon who learns to fly over the mountains.")
    assert not is_english("Bitte schreibe eine kurze Geschichte über einen Drachen, der fliegen lernt.")
    assert is_english("```python\nprint(1)\n```")  # nothing to detect: ASCII counts as English
    assert not is_english("你好，请帮我写一个故事")


# ---------------------------------------------------------------------------- labels


def test_labels_use_cl100k_and_the_bounds() -> None:
    assert list(count_tokens(["hello world", ""])) == [2, 0]
    assert list(PAPER_BOUNDS.classify(np.array([0, 199, 200, 799, 800]))) == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError):
        ClassBounds(500, 200)


# ---------------------------------------------------------------------------- the split


def _synthetic_pairs(n_conversations: int) -> list[Pair]:
    rng = np.random.default_rng(3)
    pairs = []
    for c in range(n_conversations):
        group = f"g{c // 2}"  # two conversations per group (e.g. the same opener)
        for turn in range(3):
            n_words = int(rng.choice([5, 300, 900]))
            pairs.append(Pair(f"c{c}", turn, group, Prompt(f"question {c} {turn}"), "word " * n_words))
    return pairs


def test_split_is_balanced_stratified_deterministic_and_leak_free() -> None:
    pairs = _synthetic_pairs(400)
    config = DataConfig(per_class=100, bounds=ClassBounds(200, 800), seed=7, english_only=False)
    split = build_split(pairs, config)
    assert np.bincount(split.train_labels).tolist() == [80, 80, 80]
    assert np.bincount(split.test_labels).tolist() == [20, 20, 20]
    train_groups = {p.group for p in split.train}
    assert not train_groups & {p.group for p in split.test}
    assert not train_groups & {p.group for p in split.test_pool}
    assert not {p.key for p in split.train} & {p.key for p in split.test}
    again = build_split(pairs, config)
    assert again.fingerprint() == split.fingerprint()
    other = build_split(pairs, DataConfig(per_class=100, bounds=ClassBounds(200, 800), seed=8, english_only=False))
    assert other.fingerprint() != split.fingerprint()
    first_only = build_split(pairs, DataConfig(per_class=60, turns="first", bounds=ClassBounds(200, 800), english_only=False))
    assert {p.turn for p in first_only.train + first_only.test} == {0}


# ---------------------------------------------------------------------------- metrics


def test_ranking_accuracy_is_eq2_with_ties_as_half() -> None:
    labels = np.array([0, 0, 1, 2, 2])
    assert metrics.ranking_accuracy(np.array([0.1, 0.2, 0.9, 0.3, 0.4]), labels) == 1.0
    assert metrics.ranking_accuracy(np.array([0.5, 0.6, 0.0, 0.1, 0.2]), labels) == 0.0
    assert metrics.ranking_accuracy(np.array([0.5, 0.5, 0.0, 0.5, 0.5]), labels) == 0.5  # all tied
    # one of four pairs wrong, one tied: (2 + 0.5) / 4
    assert metrics.ranking_accuracy(np.array([0.1, 0.3, 0.0, 0.3, 0.2]), labels) == pytest.approx(0.625)
    assert np.isnan(metrics.ranking_accuracy(np.array([0.1]), np.array([0])))
    rng = np.random.default_rng(0)
    s, y = rng.random(200), rng.integers(0, 3, 200)
    brute = np.mean([(b > a) + 0.5 * (b == a) for a in s[y == 0] for b in s[y == 2]])
    assert metrics.ranking_accuracy(s, y) == pytest.approx(brute)


def test_summary_has_the_headline_metrics() -> None:
    probs = np.array([[0.8, 0.1, 0.1], [0.1, 0.7, 0.2], [0.1, 0.1, 0.8]])
    out = metrics.summary(probs, np.array([0, 1, 2]), np.array([10, 300, 900]))
    assert out["ranking_accuracy"] == 1.0 and out["three_class_accuracy"] == 1.0
    assert out["kendall_tau_b"] == pytest.approx(1.0)


def test_length_rule_and_keyword_baselines() -> None:
    from clairvoyant.features import get_feature_set
    from clairvoyant.training.evaluate import fit_length_rule, keyword_scores

    lengths = np.array([1, 2, 3, 50, 60, 70])
    labels = np.array([2, 2, 2, 0, 0, 0])  # here long prompts get short answers
    threshold, direction = fit_length_rule(lengths, labels)
    assert direction == -1 and 3 < threshold <= 50
    fs = get_feature_set("paper19")
    x = fs.extract_many([Prompt("Write code"), Prompt("hello there"), Prompt("Explain it")])
    assert keyword_scores(x, fs.names).tolist() == [1.0, 0.0, 1.0]


# ---------------------------------------------------------------------------- train -> export -> card


def test_train_and_export_writes_a_model_its_card_and_markdown(tmp_path: Path) -> None:
    from clairvoyant.predictor import OnnxPredictor
    from clairvoyant.training.commands_train import train_and_export
    from clairvoyant.training.train import PRESETS, ModelConfig

    split = build_split(_synthetic_pairs(400), DataConfig(per_class=100, bounds=ClassBounds(200, 800), english_only=False))
    out = tmp_path / "predictor.onnx"
    card = train_and_export(split, ModelConfig("rich_v1", 5, 2, 0.3, 42), out, preset="test", threads=1)
    assert card["metrics"]["onnx_xgboost_max_abs_diff"] <= 1e-5
    stored = json.loads((tmp_path / "predictor.card.json").read_text())
    assert stored["onnx_sha256"] == __import__("hashlib").sha256(out.read_bytes()).hexdigest()
    assert stored["data"]["split_fingerprint"] == split.fingerprint()
    assert stored["hyperparameters"]["n_estimators"] == 5
    assert "predictor.onnx" in (tmp_path / "MODEL_CARD.md").read_text()
    assert OnnxPredictor(out).feature_set_name == "rich_v1"
    assert PRESETS["paper"] == ModelConfig("paper19", 300, 6, 0.1, 42)


def test_training_is_deterministic_for_a_seed() -> None:
    from clairvoyant.training.train import ModelConfig, featurize, fit

    split = build_split(_synthetic_pairs(200), DataConfig(per_class=60, bounds=ClassBounds(200, 800), english_only=False))
    x = featurize("paper19", [p.prompt for p in split.train])
    a = fit(x, split.train_labels, ModelConfig("paper19", 5, 3, 0.3, 42), threads=2).predict_proba(x)
    b = fit(x, split.train_labels, ModelConfig("paper19", 5, 3, 0.3, 42), threads=2).predict_proba(x)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="classes"):
        fit(x, np.zeros(len(x), dtype=np.int64), ModelConfig("paper19", 5, 3, 0.3, 42))


def test_paper_preset_flag_reaches_the_model_config() -> None:
    import argparse

    from clairvoyant.training import commands_train

    parser = argparse.ArgumentParser()
    commands_train.add_arguments(parser)
    data, model = commands_train._configs(parser.parse_args(["--preset", "paper"]))
    assert (model.feature_set, model.n_estimators, model.max_depth, model.learning_rate, model.seed) == (
        "paper19", 300, 6, 0.1, 42)
    assert (data.per_class, data.test_fraction) == (2000, 0.2)
    _, shipped = commands_train._configs(parser.parse_args(["--max-depth", "3"]))
    assert shipped.feature_set == "rich_v2" and shipped.max_depth == 3
