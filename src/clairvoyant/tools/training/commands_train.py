"""`clairvoyant train`: ShareGPT -> leak-free split -> XGBoost -> ONNX + calibrated model card.

Examples::

    clairvoyant train                       # the shipped regressor -> model/predictor.onnx
    clairvoyant train --preset paper --out model/paper.onnx   # the paper's 3-class configuration
    clairvoyant train --preset rich_v2_3class --out model/baselines/rich_v2_3class.onnx  # the previous model

The ``shipped`` preset is a regressor of ln(answer tokens) trained on the NATURAL distribution of
ShareGPT pairs (every English pair of the training groups); its raw score is calibrated to ln tokens
by isotonic regression on the training rows. The classifier presets (``paper``, ``rich_v2_3class``)
train on the class-balanced split as before; their score is P(Long), also calibrated to ln tokens.

Heavy imports (xgboost, onnxmltools, the dataset, the tokenizer) happen inside ``run``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from clairvoyant.prediction.length_classes import LONG_FROM_TOKENS, SHORT_BELOW_TOKENS
from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH

__all__ = ["COMMAND", "add_arguments", "run", "train_and_export", "train_regressor_and_export"]

logger = logging.getLogger(__name__)

COMMAND = "clairvoyant train"
LEXICON_COMMAND = "python -m clairvoyant.tools.training.lexicon"  # the rich_v3 lexicon the model reads
# Options that say how fast or how verbosely, not what is made: left out of the card's command.
_NOT_RECIPE = ("threads", "no_progress")

# Why the classifier presets' Long bound is 600 and not the paper's 800: see NOTES below.
DEFAULT_LONG_FROM = LONG_FROM_TOKENS  # the one definition (length_classes)
NOTES = [
    "Class bounds: the packaged ShareGPT answers are capped just under 800 cl100k tokens (ChatGPT's "
    "output limit at the time): of ~57k pairs only 64 reach 800 tokens (8 first turns), so the paper's "
    "Long >= 800 class cannot be populated. Long >= 600 cl100k tokens (~690-750 Llama-2 tokens, the "
    "paper's tokenizer) keeps the paper's intent with >4,000 Long rows. `--long-from 800` reproduces the "
    "starvation.",
    "Rows: every user turn (with its conversation history, as the proxy sees it), not only first turns: "
    "first turns alone hold 723 Long rows (>= 600), too few for 2,000 per class.",
    "Ranking accuracy counts tied (Short, Long) pairs as half correct.",
]
REGRESSOR_NOTES = [
    "Objective: XGBoost reg:squarederror on ln(cl100k tokens of the reference answer), natural "
    "distribution of ShareGPT pairs (no class balancing), every English user turn of the training "
    "conversation groups. The queue key is the raw score (lower = sooner); predicted_tokens = "
    "exp(np.interp(score, calibration.score, calibration.log_tokens)).",
    "Features: rich_v3 = rich_v2 + lexicon_log_tokens, a ridge lexicon of words and word bigrams fit on "
    "the same training split (src/clairvoyant/prediction/lexicons/rich_v3.json). The regressor is trained on "
    "out-of-fold lexicon scores (5 group folds), so it trusts the column only as much as it deserves on "
    "unseen prompts.",
    "Censored answers: the packaged ShareGPT answers pile up at 760-779 cl100k tokens (about half of "
    "them end mid-sentence): a training answer of at least censored_from_tokens tokens was cut, not "
    "finished, and is left out of the fit (weight 0; still in the calibration rows). On AlpacaEval dev "
    "this lifts the served mean tau_b by +0.003 to +0.004 (0.403 to 0.406 by clairvoyant evaluate), on every model "
    "(benchmarks/bench_sharegpt_labels.py).",
    "Chosen by transfer to AlpacaEval dev (406 instructions x 4 open models; evaluation only, never "
    "trained on): see predictor.evaluation.md. The ShareGPT answers are ChatGPT's, "
    "capped near 800 tokens: predicted_tokens is in that model's scale; the online learner rescales it "
    "to the served model.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=("shipped", "paper", "rich_v2_3class"),
        default="shipped",
        help="'shipped' = rich_v3 log-token regressor on the natural mix; 'paper' = paper19, "
        "3-class, 300 trees, depth 6, lr 0.1; 'rich_v2_3class' = the previous shipped model",
    )
    parser.add_argument("--feature-set", help="override the preset's feature set (paper19, rich_v1, rich_v2, rich_v3)")
    parser.add_argument("--n-estimators", type=int, help="boosting rounds (override)")
    parser.add_argument("--max-depth", type=int, help="tree depth (override)")
    parser.add_argument("--learning-rate", type=float, help="learning rate (override)")
    parser.add_argument(
        "--censored-from",
        type=int,
        help="regressor: leave training answers of at least this many tokens out of the fit, as cut "
        "rather than finished (the shipped preset: 760; 0 keeps every row)",
    )
    parser.add_argument("--seed", type=int, default=42, help="seed of the split, the sampling and xgboost")
    parser.add_argument("--per-class", type=int, default=2000, help="classifiers: balanced rows per class (train+test)")
    parser.add_argument("--max-train-rows", type=int, help="regressor: subsample the natural training rows")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--turns", choices=("all", "first"), default="all", help="which user turns make rows")
    parser.add_argument("--short-below", type=int, default=SHORT_BELOW_TOKENS, help="Short: answer tokens below this")
    parser.add_argument("--long-from", type=int, default=DEFAULT_LONG_FROM, help="Long: answer tokens from this")
    parser.add_argument("--no-english-filter", action="store_true", help="keep non-English prompts")
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_PATH, help="ONNX file to write (card beside it)")
    parser.add_argument("--threads", type=int, default=2, help="xgboost threads")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _configs(args: argparse.Namespace) -> tuple[Any, Any]:
    from dataclasses import replace

    from clairvoyant.tools.training.dataset import DataConfig, NaturalConfig
    from clairvoyant.tools.training.labels import ClassBounds
    from clairvoyant.tools.training.train import PRESETS, RegressorConfig

    model_config = PRESETS[args.preset].with_overrides(
        feature_set=args.feature_set,
        n_estimators=args.n_estimators,
        max_depth=args.max_depth,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )
    if isinstance(model_config, RegressorConfig) and args.censored_from is not None:
        model_config = replace(model_config, censored_from_tokens=args.censored_from or None)
    if isinstance(model_config, RegressorConfig):
        return NaturalConfig(
            test_fraction=args.test_fraction,
            turns=args.turns,
            seed=args.seed,
            english_only=not args.no_english_filter,
            max_train_rows=args.max_train_rows,
        ), model_config
    data_config = DataConfig(
        per_class=args.per_class,
        test_fraction=args.test_fraction,
        turns=args.turns,
        bounds=ClassBounds(args.short_below, args.long_from),
        seed=args.seed,
        english_only=not args.no_english_filter,
    )
    return data_config, model_config


def _versions() -> dict[str, str]:
    import onnxmltools
    import onnxruntime

    from clairvoyant.tools.training.train import xgboost_version

    return {
        "xgboost": xgboost_version(),
        "onnxmltools": onnxmltools.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def train_and_export(
    split: Any,
    model_config: Any,
    out: Path,
    *,
    preset: str,
    threads: int = 2,
    progress: bool = False,
    notes: list[str] | None = None,
    command: str = COMMAND,
) -> dict[str, Any]:
    """Classifier: fit on ``split.train`` (balanced), export to ``out``, check parity, write both cards.

    The score is P(Long), calibrated to ln tokens by isotonic regression on the training rows.
    ``command``: the command line the card names as the one that made the model.
    Returns the card. Raises ``export.ParityError`` if ONNX and xgboost disagree by > 1e-5.
    """
    import numpy as np

    from clairvoyant.prediction.features import get_feature_set
    from clairvoyant.tools.training import calibration, export, metrics
    from clairvoyant.tools.training import card as card_md
    from clairvoyant.tools.training.dataset import log_tokens
    from clairvoyant.tools.training.labels import TOKENIZER_NAME, TOKENIZER_PACKAGE
    from clairvoyant.tools.training.train import featurize, fit

    fs = get_feature_set(model_config.feature_set)
    x_train = featurize(fs, [p.prompt for p in split.train], progress=progress)
    x_test = featurize(fs, [p.prompt for p in split.test], progress=progress)
    clf = fit(x_train, split.train_labels, model_config, threads=threads)
    model_bytes = export.to_onnx(clf, fs.size)
    parity = export.check_parity(clf, model_bytes, x_test)
    export.write_model(model_bytes, out)
    probs = export.onnx_probabilities(model_bytes, x_test)
    held_out = metrics.summary(probs, split.test_labels, split.test_lengths)
    p_long_train = export.onnx_probabilities(model_bytes, x_train)[:, 2]
    card: dict[str, Any] = {
        "kind": "classifier",
        "preset": preset,
        "command": command,
        "feature_set": fs.name,
        "feature_names": list(fs.names),
        "tokenizer": f"{TOKENIZER_NAME} ({TOKENIZER_PACKAGE})",
        "calibration": calibration.isotonic_breakpoints(p_long_train, log_tokens(split.train_lengths)),
        "class_bounds": split.config.bounds.as_dict(),
        "data": {
            **split.config.as_dict(),
            "train_rows": len(split.train),
            "test_rows": len(split.test),
            "train_class_counts": np.bincount(split.train_labels, minlength=3).tolist(),
            "test_class_counts": np.bincount(split.test_labels, minlength=3).tolist(),
            "eligible_before_balancing": split.available,
            "split_fingerprint": split.fingerprint(),
        },
        "hyperparameters": model_config.as_dict(),
        "onnx_bytes": len(model_bytes),
        "metrics": {"held_out_" + k: v for k, v in held_out.items()} | {"onnx_xgboost_max_abs_diff": parity},
        "notes": list(notes or [])
        + ["calibration: isotonic regression from P(Long) to ln(answer tokens) on the balanced training rows"],
        "versions": _versions(),
    }
    export.write_card(out, card)
    card_md.write_markdown(out)
    logger.info(
        "wrote %s (ranking accuracy %.4f on %d held-out rows)", out, held_out["ranking_accuracy"], len(split.test)
    )
    return card


def lexicon_column_for_training(fs: Any, x_train: Any, split: Any, *, folds: int = 5) -> dict[str, Any]:
    """Replace ``lexicon_log_tokens`` in ``x_train`` (in place) by out-of-fold lexicon scores.

    Returns what the card records about the lexicon (file, sha256, whether the shipped lexicon was fit
    on exactly this training split).
    """
    import hashlib
    import json

    import numpy as np

    from clairvoyant.prediction.features import LEXICON_DIR, RICH_V3_LEXICON, RICH_V3_LEXICON_SHA256
    from clairvoyant.tools.training.lexicon import LexiconConfig, out_of_fold_scores, terms_of_texts

    column = fs.names.index("lexicon_log_tokens")
    raw = (LEXICON_DIR / RICH_V3_LEXICON).read_bytes()
    meta = json.loads(raw)
    config = LexiconConfig(**{k: meta["config"][k] for k in ("min_rows", "ridge_alpha", "name")})
    oof = out_of_fold_scores(
        terms_of_texts([p.prompt.instruction for p in split.train]),
        split.train_log_tokens,
        [p.group for p in split.train],
        config,
        folds=folds,
    )
    x_train[:, column] = oof.astype(np.float32)
    same_split = meta.get("split_fingerprint") == split.fingerprint()
    if not same_split:
        logger.warning("the shipped lexicon was fit on another training split than this run's")
    return {
        "file": f"src/clairvoyant/prediction/lexicons/{RICH_V3_LEXICON}",
        "command": f"{LEXICON_COMMAND} --out src/clairvoyant/prediction/lexicons/{RICH_V3_LEXICON}",
        "sha256": hashlib.sha256(raw).hexdigest(),
        "pinned_sha256": RICH_V3_LEXICON_SHA256,
        "terms": len(meta["weights"]),
        "config": meta["config"],
        "fit_on_this_training_split": same_split,
        "training_column": f"out-of-fold ({folds} group folds)",
    }


def train_regressor_and_export(
    split: Any,
    model_config: Any,
    out: Path,
    *,
    preset: str,
    threads: int = 2,
    progress: bool = False,
    notes: list[str] | None = None,
    command: str = COMMAND,
) -> dict[str, Any]:
    """Regressor: fit ln tokens on ``split.train`` (natural mix), export, check parity, calibrate, write cards.
    ``command``: the command line the card names as the one that made the model."""
    import numpy as np

    from clairvoyant.prediction.features import get_feature_set
    from clairvoyant.tools.training import calibration, export, metrics
    from clairvoyant.tools.training import card as card_md
    from clairvoyant.tools.training.labels import TOKENIZER_NAME, TOKENIZER_PACKAGE
    from clairvoyant.tools.training.train import featurize, fit_regressor

    fs = get_feature_set(model_config.feature_set)
    x_train = featurize(fs, [p.prompt for p in split.train], progress=progress)
    x_test = featurize(fs, [p.prompt for p in split.test], progress=progress)
    lexicon = lexicon_column_for_training(fs, x_train, split) if "lexicon_log_tokens" in fs.names else None
    y_train = split.train_log_tokens
    weights = model_config.training_weights(split.train_lengths)
    reg = fit_regressor(x_train, y_train, model_config, threads=threads, weights=weights)
    model_bytes = export.regressor_to_onnx(reg, fs.size)
    parity = export.check_regressor_parity(reg, model_bytes, x_test)
    export.write_model(model_bytes, out)
    raw_train = export.onnx_outputs(model_bytes, x_train, export.REGRESSOR_OUTPUT)[:, 0]
    raw_test = export.onnx_outputs(model_bytes, x_test, export.REGRESSOR_OUTPUT)[:, 0]
    calib = calibration.isotonic_breakpoints(raw_train, y_train)
    predicted = calibration.apply(calib, raw_test)
    first = np.array([p.turn == 0 for p in split.test])
    held_out = {
        "kendall_tau_b": metrics.kendall_tau(raw_test, split.test_lengths),
        "kendall_tau_b_first_turns": metrics.kendall_tau(raw_test[first], split.test_lengths[first]),
        "pairwise_accuracy_2x": metrics.pairwise_accuracy(raw_test, split.test_lengths),
        "log_tokens_mae": float(np.mean(np.abs(predicted - split.test_log_tokens))),
        "rows": len(split.test),
    }
    card: dict[str, Any] = {
        "kind": "regressor",
        "output": export.REGRESSOR_OUTPUT,
        "score": "log_tokens",
        "preset": preset,
        "command": command,
        "feature_set": fs.name,
        "feature_names": list(fs.names),
        "tokenizer": f"{TOKENIZER_NAME} ({TOKENIZER_PACKAGE})",
        "calibration": calib,
        "data": {
            **split.config.as_dict(),
            "train_rows": len(split.train),
            "test_rows": len(split.test),
            "train_first_turn_rows": sum(p.turn == 0 for p in split.train),
            "train_censored_rows_left_out": 0 if weights is None else int((weights == 0).sum()),
            "split_fingerprint": split.fingerprint(),
        },
        "hyperparameters": model_config.as_dict(),
        "onnx_bytes": len(model_bytes),
        "metrics": {"held_out_" + k: v for k, v in held_out.items()} | {"onnx_xgboost_max_abs_diff": parity},
        "notes": list(notes or [])
        + [
            "calibration: isotonic regression from the raw score to ln(answer tokens) on the training rows "
            "(plateaus merged to one point each, at most 200 points)"
        ],
        "versions": _versions(),
    }
    if lexicon is not None:
        card["lexicon"] = lexicon
    export.write_card(out, card)
    card_md.write_markdown(out)
    logger.info("wrote %s (held-out Kendall tau_b %.4f on %d rows)", out, held_out["kendall_tau_b"], len(split.test))
    return card


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split, build_split, load_pairs
    from clairvoyant.tools.training.invocation import command_line

    command = command_line("train", add_arguments, args, ignore=_NOT_RECIPE)

    data_config, model_config = _configs(args)
    progress = not args.no_progress
    pairs = load_pairs()
    if isinstance(data_config, NaturalConfig):
        split = build_natural_split(pairs, data_config)
        card = train_regressor_and_export(
            split,
            model_config,
            args.out,
            preset=args.preset,
            threads=args.threads,
            progress=progress,
            notes=REGRESSOR_NOTES,
            command=command,
        )
        m = card["metrics"]
        print(
            f"wrote {args.out}: held-out Kendall tau_b {m['held_out_kendall_tau_b']:.4f} (natural mix, "
            f"{m['held_out_rows']} rows), pairwise accuracy (>= 2x) {m['held_out_pairwise_accuracy_2x']:.4f}, "
            f"ONNX/xgboost max |diff| {m['onnx_xgboost_max_abs_diff']:.2e}"
        )
        return 0
    split = build_split(pairs, data_config, progress=progress)
    card = train_and_export(
        split,
        model_config,
        args.out,
        preset=args.preset,
        threads=args.threads,
        progress=progress,
        notes=NOTES,
        command=command,
    )
    m = card["metrics"]
    print(
        f"wrote {args.out}: held-out ranking accuracy {m['held_out_ranking_accuracy']:.4f}, "
        f"3-class accuracy {m['held_out_three_class_accuracy']:.4f}, Kendall tau_b {m['held_out_kendall_tau_b']:.4f}, "
        f"ONNX/xgboost max |diff| {m['onnx_xgboost_max_abs_diff']:.2e}"
    )
    return 0
