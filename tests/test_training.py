"""clairvoyant.tools.training: record decoding, pairs, the leak-free split, metrics, train -> export -> card."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("xgboost")
pytest.importorskip("quicktok")

from lexicon_reference import lexicon_score

from clairvoyant.prediction.features import Prompt  # noqa: E402
from clairvoyant.tools.training import metrics  # noqa: E402
from clairvoyant.tools.training.dataset import (  # noqa: E402
    DataConfig,
    Pair,
    build_split,
    is_english,
    iter_records,
    merge_chunks,
    pairs_from_conversations,
)
from clairvoyant.tools.training.labels import PAPER_BOUNDS, ClassBounds, count_tokens  # noqa: E402

# ---------------------------------------------------------------------------- decoding


def test_iter_records_recovers_every_complete_record_of_a_truncated_array() -> None:
    raw = '[{"id": "a_0", "conversations": []},\n {"id": "b_0", "conversations": [{"from": "human", "value": "x"}]}, {"id": "c_0", "conv'
    assert [r["id"] for r in iter_records(raw)] == ["a_0", "b_0"]
    assert list(iter_records("")) == []
    assert [r["id"] for r in iter_records('[{"id": "z"}]')] == ["z"]


def test_chunks_are_merged_in_order_and_pairs_cross_chunk_boundaries() -> None:
    records = [
        {"id": "c1_1", "conversations": [{"from": "gpt", "value": "answer two"}]},
        {
            "id": "c1_0",
            "conversations": [
                {"from": "system", "value": "sys"},
                {"from": "human", "value": "question one"},
                {"from": "gpt", "value": "answer one"},
                {"from": "human", "value": "question two"},
            ],
        },
        {
            "id": "c2_0",
            "conversations": [{"from": "human", "value": "question one"}, {"from": "gpt", "value": "answer one"}],
        },
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
    first_only = build_split(
        pairs, DataConfig(per_class=60, turns="first", bounds=ClassBounds(200, 800), english_only=False)
    )
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
    from clairvoyant.prediction.features import get_feature_set
    from clairvoyant.tools.training.evaluate import fit_length_rule, keyword_scores

    lengths = np.array([1, 2, 3, 50, 60, 70])
    labels = np.array([2, 2, 2, 0, 0, 0])  # here long prompts get short answers
    threshold, direction = fit_length_rule(lengths, labels)
    assert direction == -1 and 3 < threshold <= 50
    fs = get_feature_set("paper19")
    x = fs.extract_many([Prompt("Write code"), Prompt("hello there"), Prompt("Explain it")])
    assert keyword_scores(x, fs.names).tolist() == [1.0, 0.0, 1.0]


# ---------------------------------------------------------------------------- train -> export -> card


def test_train_and_export_writes_a_model_its_card_and_markdown(tmp_path: Path) -> None:
    from clairvoyant.prediction.predictor import OnnxPredictor
    from clairvoyant.tools.training.commands_train import train_and_export
    from clairvoyant.tools.training.train import PRESETS, ModelConfig

    split = build_split(
        _synthetic_pairs(400), DataConfig(per_class=100, bounds=ClassBounds(200, 800), english_only=False)
    )
    out = tmp_path / "predictor.onnx"
    card = train_and_export(
        split, ModelConfig("rich_v1", 5, 2, 0.3, 42), out, preset="test", threads=1, command="clairvoyant train -x"
    )
    assert card["metrics"]["onnx_xgboost_max_abs_diff"] <= 1e-5
    stored = json.loads((tmp_path / "predictor.card.json").read_text())
    assert (
        stored["command"] == "clairvoyant train -x"
        and "Made by `clairvoyant train -x`" in (tmp_path / "MODEL_CARD.md").read_text()
    )
    assert stored["onnx_sha256"] == __import__("hashlib").sha256(out.read_bytes()).hexdigest()
    assert stored["data"]["split_fingerprint"] == split.fingerprint()
    assert stored["hyperparameters"]["n_estimators"] == 5
    assert "predictor.onnx" in (tmp_path / "MODEL_CARD.md").read_text()
    assert OnnxPredictor(out).feature_set_name == "rich_v1"
    assert PRESETS["paper"] == ModelConfig("paper19", 300, 6, 0.1, 42)


def test_training_is_deterministic_for_a_seed() -> None:
    from clairvoyant.tools.training.train import ModelConfig, featurize, fit

    split = build_split(
        _synthetic_pairs(200), DataConfig(per_class=60, bounds=ClassBounds(200, 800), english_only=False)
    )
    x = featurize("paper19", [p.prompt for p in split.train])
    a = fit(x, split.train_labels, ModelConfig("paper19", 5, 3, 0.3, 42), threads=2).predict_proba(x)
    b = fit(x, split.train_labels, ModelConfig("paper19", 5, 3, 0.3, 42), threads=2).predict_proba(x)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="classes"):
        fit(x, np.zeros(len(x), dtype=np.int64), ModelConfig("paper19", 5, 3, 0.3, 42))


def test_paper_preset_flag_reaches_the_model_config() -> None:
    import argparse

    from clairvoyant.tools.training import commands_train

    parser = argparse.ArgumentParser()
    commands_train.add_arguments(parser)
    data, model = commands_train._configs(parser.parse_args(["--preset", "paper"]))
    assert (model.feature_set, model.n_estimators, model.max_depth, model.learning_rate, model.seed) == (
        "paper19",
        300,
        6,
        0.1,
        42,
    )
    assert (data.per_class, data.test_fraction) == (2000, 0.2)
    natural, shipped = commands_train._configs(parser.parse_args(["--max-depth", "4"]))
    assert shipped.feature_set == "rich_v3" and shipped.max_depth == 4
    assert type(shipped).__name__ == "RegressorConfig" and type(natural).__name__ == "NaturalConfig"
    _, previous = commands_train._configs(parser.parse_args(["--preset", "rich_v2_3class"]))
    assert (previous.feature_set, previous.n_estimators, previous.max_depth) == ("rich_v2", 50, 3)


def test_each_shipped_lexical_card_names_the_command_that_writes_its_model_there() -> None:
    """Parsed by ``clairvoyant train``, the card's command writes the card's model file with the
    card's preset, and names itself again; the lexicon section names the lexicon's command."""
    import argparse
    import shlex

    from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH, card_path_for
    from clairvoyant.tools.training import commands_train
    from clairvoyant.tools.training.card import markdown_path_for
    from clairvoyant.tools.training.invocation import command_line

    root = Path(__file__).parents[1]
    for model in (DEFAULT_MODEL_PATH, root / "model" / "baselines" / "rich_v2_3class.onnx"):
        card = json.loads(card_path_for(model).read_text())
        words = shlex.split(card["command"])
        assert words[:2] == ["clairvoyant", "train"]
        parser = argparse.ArgumentParser()
        commands_train.add_arguments(parser)
        args = parser.parse_args(words[2:])
        assert args.preset == card["preset"]
        assert (root / args.out if not args.out.is_absolute() else args.out).resolve() == model.resolve()
        assert command_line("train", commands_train.add_arguments, args, ignore=("threads",)) == card["command"]
        assert f"Made by `{card['command']}`" in markdown_path_for(model).read_text()
    lexicon = json.loads(card_path_for(DEFAULT_MODEL_PATH).read_text())["lexicon"]
    assert lexicon["command"].endswith(f"--out {lexicon['file']}") and (root / lexicon["file"]).is_file()


# ---------------------------------------------------------------------------- natural split, regressor, calibration


def test_pairwise_accuracy_matches_brute_force_and_skips_close_pairs() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 1000, 300)
    scores = np.log(lengths) + rng.normal(0, 1.0, 300)
    scores[:20] = 0.5  # some ties
    brute_right, brute_pairs = 0.0, 0
    for i in range(300):
        for j in range(300):
            if np.log(lengths[i]) - np.log(lengths[j]) >= np.log(2) - 1e-12:
                brute_pairs += 1
                brute_right += 1.0 if scores[i] > scores[j] else (0.5 if scores[i] == scores[j] else 0.0)
    assert metrics.pairwise_accuracy(scores, lengths, chunk_rows=37) == pytest.approx(brute_right / brute_pairs)
    assert metrics.pairwise_accuracy(np.log(lengths), lengths) == 1.0
    assert metrics.pairwise_accuracy(-np.log(lengths), lengths) == 0.0
    assert np.isnan(metrics.pairwise_accuracy(np.array([1.0, 2.0]), np.array([100, 150])))  # no pair 2x apart


def test_isotonic_calibration_keeps_the_card_contract() -> None:
    from clairvoyant.tools.training import calibration
    from clairvoyant.tools.training.export import check_calibration

    rng = np.random.default_rng(2)
    score = rng.normal(0, 1, 5000)
    truth = 5.0 + 0.8 * score + rng.normal(0, 0.5, 5000)
    calib = calibration.isotonic_breakpoints(score, truth)
    check_calibration(calib)  # strictly increasing, 2..200 points
    assert calib["method"] == "isotonic" and 2 <= len(calib["score"]) <= 200
    mapped = calibration.apply(calib, np.array([-1.0, 0.0, 1.0, 99.0]))
    assert mapped[0] < mapped[1] < mapped[2] <= mapped[3]
    assert mapped[1] == pytest.approx(5.0, abs=0.1) and mapped[2] == pytest.approx(5.8, abs=0.15)
    assert mapped[3] == calib["log_tokens"][-1]  # clamped at the ends
    flat = calibration.isotonic_breakpoints(np.ones(10), np.full(10, 3.0))  # one plateau: still a valid map
    check_calibration(flat)
    assert calibration.apply(flat, np.array([1.0]))[0] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_calibration({"method": "isotonic", "score": [0.0, 0.0], "log_tokens": [1.0, 2.0]})


def _natural_pairs(n_conversations: int) -> list[Pair]:
    """Prompts whose words decide their answer length (so a model can learn the order)."""
    rng = np.random.default_rng(5)
    pairs = []
    for c in range(n_conversations):
        group = f"g{c // 2}"
        for turn in range(2):
            kind = int(rng.integers(0, 3))
            text = ["say hi briefly", "explain this topic", "write a long detailed essay"][kind] + f" number {c}"
            n_words = int(rng.integers(1, 6) * [3, 40, 300][kind])
            pairs.append(
                Pair(f"c{c}", turn, group, Prompt(text, context_chars=len(text), turns=1 + 2 * turn), "word " * n_words)
            )
    return pairs


def test_natural_split_is_unbalanced_leak_free_and_deterministic() -> None:
    from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split

    pairs = _natural_pairs(300)
    split = build_natural_split(pairs, NaturalConfig(english_only=False, seed=3))
    assert len(split.train) + len(split.test) == len(pairs)  # nothing dropped, nothing balanced
    assert not {p.group for p in split.train} & {p.group for p in split.test}
    assert 0.1 < len(split.test) / len(pairs) < 0.3
    assert build_natural_split(pairs, NaturalConfig(english_only=False, seed=3)).fingerprint() == split.fingerprint()
    # the balanced split puts every group on the same side (same seed and fraction)
    balanced = build_split(pairs, DataConfig(per_class=40, bounds=ClassBounds(50, 400), seed=3, english_only=False))
    assert not {p.group for p in balanced.train} & {p.group for p in split.test}
    first = build_natural_split(pairs, NaturalConfig(english_only=False, seed=3, turns="first", max_train_rows=50))
    assert {p.turn for p in first.train + first.test} == {0} and len(first.train) == 50
    flags = [p.conv_id != "c0" for p in pairs]
    assert "c0" not in {
        p.conv_id
        for p in (lambda s: s.train + s.test)(build_natural_split(pairs, NaturalConfig(seed=3), english=flags))
    }
    np.testing.assert_allclose(split.train_log_tokens, np.log(np.maximum(split.train_lengths, 1)))


def test_regressor_train_export_card_and_scorer(tmp_path: Path) -> None:
    from clairvoyant.tools.training.commands_train import train_regressor_and_export
    from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split
    from clairvoyant.tools.training.scoring import ModelScorer
    from clairvoyant.tools.training.train import RegressorConfig

    split = build_natural_split(_natural_pairs(300), NaturalConfig(english_only=False))
    out = tmp_path / "predictor.onnx"
    card = train_regressor_and_export(split, RegressorConfig("rich_v2", 20, 2, 0.3, 42), out, preset="test", threads=1)
    stored = json.loads((tmp_path / "predictor.card.json").read_text())
    assert (stored["schema"], stored["kind"], stored["output"], stored["score"]) == (
        2,
        "regressor",
        "variable",
        "log_tokens",
    )
    assert "classes" not in stored
    assert stored["calibration"]["method"] == "isotonic"
    assert np.all(np.diff(stored["calibration"]["score"]) > 0) and np.all(
        np.diff(stored["calibration"]["log_tokens"]) > 0
    )
    assert stored["data"]["split_fingerprint"] == split.fingerprint() and stored["data"]["distribution"].startswith(
        "natural"
    )
    assert stored["command"] == "clairvoyant train"
    assert card["metrics"]["onnx_xgboost_max_abs_diff"] <= 1e-5
    assert card["metrics"]["held_out_kendall_tau_b"] > 0.5  # the words decide the length here
    assert (
        "ln(answer" in (tmp_path / "MODEL_CARD.md").read_text()
        or "natural log" in (tmp_path / "MODEL_CARD.md").read_text()
    )
    scorer = ModelScorer(out)
    raw = scorer.score_prompts(
        [Prompt(t, context_chars=len(t)) for t in ("say hi briefly number 7", "write a long detailed essay number 7")]
    )
    assert raw[0] < raw[1]
    predicted = np.exp(scorer.predicted_log_tokens(raw))  # true lengths: 3-15 and 300-1500 tokens
    assert predicted[0] < 40 and predicted[1] > 200


def test_regressor_parity_check_fails_for_another_model(tmp_path: Path) -> None:
    from clairvoyant.tools.training import export
    from clairvoyant.tools.training.train import RegressorConfig, fit_regressor

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    a = fit_regressor(x, x[:, 0], RegressorConfig("paper19", 10, 2, 0.3), threads=1)
    b = fit_regressor(x, -x[:, 0], RegressorConfig("paper19", 10, 2, 0.3), threads=1)
    model = export.regressor_to_onnx(a, 4)
    assert export.check_regressor_parity(a, model, x) <= 1e-5
    with pytest.raises(export.ParityError):
        export.check_regressor_parity(b, model, x)


def test_classifier_card_is_schema_2_with_a_calibration(tmp_path: Path) -> None:
    from clairvoyant.tools.training.commands_train import train_and_export
    from clairvoyant.tools.training.train import ModelConfig

    split = build_split(_natural_pairs(300), DataConfig(per_class=60, bounds=ClassBounds(50, 400), english_only=False))
    out = tmp_path / "paper.onnx"
    train_and_export(split, ModelConfig("paper19", 5, 2, 0.3, 42), out, preset="paper", threads=1)
    stored = json.loads((tmp_path / "paper.card.json").read_text())
    assert (stored["schema"], stored["kind"], stored["output"], stored["score"]) == (
        2,
        "classifier",
        "probabilities",
        "p_long",
    )
    assert stored["classes"] == ["short", "medium", "long"]
    # P(Long) rises with the answer length here, so the map from P(Long) to ln tokens rises too
    assert stored["calibration"]["log_tokens"][-1] - stored["calibration"]["log_tokens"][0] > 1.0


# ---------------------------------------------------------------------------- the rich_v3 lexicon


def test_lexicon_fit_score_and_round_trip() -> None:
    from clairvoyant.prediction.features import Lexicon, lexicon_terms, scan_words
    from clairvoyant.tools.training.lexicon import (
        LexiconConfig,
        fit_lexicon,
        out_of_fold_scores,
        score_terms,
        terms_of_texts,
    )

    pairs = _natural_pairs(300)
    texts = [p.prompt.instruction for p in pairs]
    y = np.log(np.maximum(count_tokens([p.answer for p in pairs]), 1))
    terms = terms_of_texts(texts)
    assert b"long detailed" in terms[[i for i, t in enumerate(texts) if "essay" in t][0]]  # bigrams too
    lexicon = fit_lexicon(terms, y, LexiconConfig(min_rows=5, ridge_alpha=1.0))
    assert lexicon.weights[b"essay"] > 0 > lexicon.weights[b"hi"]
    assert b"number" in lexicon.weights and b"0" not in lexicon.weights  # "0" occurs in fewer than 5 rows
    row = score_terms(lexicon, terms)
    served = [lexicon_score(lexicon, scan_words(t)) for t in texts]
    np.testing.assert_allclose(row, served, rtol=1e-9)
    assert lexicon_terms([b"a", b"b", b"a"]) == {b"a", b"b", b"a b", b"b a"}
    again = Lexicon.from_json(lexicon.to_json())
    assert again.weights.keys() == lexicon.weights.keys() and again.intercept_log_tokens == lexicon.intercept_log_tokens
    assert lexicon_score(Lexicon("x", 1.5, {}), [b"anything"]) == 1.5
    oof = out_of_fold_scores(terms, y, [p.group for p in pairs], LexiconConfig(min_rows=5, ridge_alpha=1.0), folds=3)
    assert np.corrcoef(oof, y)[0, 1] > 0.8 and not np.allclose(oof, row)


# ---------------------------------------------------------------------------- evaluate


def test_evaluate_reports_transfer_per_model_and_the_baselines(tmp_path: Path) -> None:
    from clairvoyant.tools.training.commands_train import train_and_export, train_regressor_and_export
    from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split
    from clairvoyant.tools.training.evaluate import evaluate_model, write_report
    from clairvoyant.tools.training.train import ModelConfig, RegressorConfig

    pairs = _natural_pairs(300)
    split = build_natural_split(pairs, NaturalConfig(english_only=False))
    model = tmp_path / "predictor.onnx"
    train_regressor_and_export(split, RegressorConfig("rich_v2", 20, 2, 0.3, 42), model, preset="test", threads=1)
    baseline = tmp_path / "baseline.onnx"
    balanced = build_split(pairs, DataConfig(per_class=60, bounds=ClassBounds(50, 400), english_only=False))
    train_and_export(balanced, ModelConfig("rich_v2", 5, 2, 0.3, 42), baseline, preset="old", threads=1)
    alpaca = tmp_path / "alpaca.jsonl"  # a synthetic stand-in with the real file's shape
    rows = [
        ("say hi briefly number 1", 5, 9),
        ("explain this topic number 2", 120, 200),
        ("write a long detailed essay number 3", 900, 700),
        ("say hi briefly number 4", 6, 4),
    ]
    alpaca.write_text(
        "".join(
            json.dumps({"prompt": p, "source": "x", "output_tokens": {"m1": a, "m2": b}}) + "\n" for p, a, b in rows
        )
    )
    report = evaluate_model(
        model, alpaca_eval=alpaca, split=split, baseline_model=baseline, paper_baseline=True, threads=1
    )
    s = report["scorers"]
    assert set(s) == {"model", "prompt_length", "paper_preset", "previous_shipped"}
    assert report["split"]["model_trained_on_this_split"]
    assert set(s["model"]["alpaca_eval"]["per_model"]) == {"m1", "m2"}
    assert s["model"]["alpaca_eval"]["per_model"]["m1"]["pairwise_accuracy_2x"] == 1.0
    assert s["model"]["alpaca_eval"]["mean_kendall_tau_b"] > 0.5
    assert s["model"]["sharegpt_held_out"]["kendall_tau_b"] > 0.5
    assert "log_tokens_mae" in s["model"]["sharegpt_held_out"]
    json_path, md_path = write_report(model, report)
    assert (
        "AlpacaEval mean tau_b" in md_path.read_text()
        and json.loads(json_path.read_text())["model"] == "predictor.onnx"
    )
    card = json.loads((tmp_path / "predictor.card.json").read_text())
    assert card["evaluation"]["model_alpaca_eval_mean_kendall_tau_b"] == s["model"]["alpaca_eval"]["mean_kendall_tau_b"]
    skipped = evaluate_model(model, split=split, baseline_model=None, paper_baseline=False)
    assert "skipped" in skipped["alpaca_eval"] and "alpaca_eval" not in skipped["scorers"]["model"]


def test_the_shipped_preset_leaves_answers_cut_at_the_package_limit_out_of_the_fit() -> None:
    import argparse

    from clairvoyant.tools.training import commands_train
    from clairvoyant.tools.training.train import RegressorConfig, fit_regressor

    parser = argparse.ArgumentParser()
    commands_train.add_arguments(parser)
    assert commands_train._configs(parser.parse_args([]))[1].censored_from_tokens == 760
    assert commands_train._configs(parser.parse_args(["--censored-from", "900"]))[1].censored_from_tokens == 900
    assert commands_train._configs(parser.parse_args(["--censored-from", "0"]))[1].censored_from_tokens is None
    config = RegressorConfig("paper19", 30, 2, 0.3, censored_from_tokens=760)
    assert config.training_weights(np.array([10, 759, 760, 5000])).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert RegressorConfig("paper19", 30, 2, 0.3).training_weights(np.array([10, 5000])) is None
    # rows at the cut carry a wrong label (+3 ln tokens): with weight 0 they do not move the fit
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 19)).astype(np.float32)
    lengths = np.where(rng.random(400) < 0.3, 770, 100)
    y = x[:, 0] + np.where(lengths >= 760, 3.0, 0.0)
    clean = lengths < 760
    weighted = fit_regressor(x, y, config, threads=1, weights=config.training_weights(lengths))
    unweighted = fit_regressor(x, y, config, threads=1)
    assert np.abs(weighted.predict(x[clean]) - x[clean, 0]).mean() < 0.3
    assert np.abs(unweighted.predict(x[clean]) - x[clean, 0]).mean() > 0.6
