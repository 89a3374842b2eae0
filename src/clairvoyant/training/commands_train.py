"""`clairvoyant train`: ShareGPT -> balanced leak-free split -> XGBoost -> ONNX + model card.

Examples::

    clairvoyant train                       # the shipped model -> model/predictor.onnx
    clairvoyant train --preset paper --out model/paper.onnx   # the paper's configuration
    clairvoyant train --preset paper --turns first --long-from 800 --out /tmp/literal.onnx

Heavy imports (xgboost, onnxmltools, the dataset, the tokenizer) happen inside ``run``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from clairvoyant.predictor import DEFAULT_MODEL_PATH

__all__ = ["add_arguments", "run", "train_and_export"]

logger = logging.getLogger(__name__)

# Why the shipped Long bound is 600 and not the paper's 800: see NOTES below and MODEL_CARD.md.
DEFAULT_LONG_FROM = 600
NOTES = [
    "Class bounds: the packaged ShareGPT answers are capped just under 800 cl100k tokens (ChatGPT's "
    "output limit at the time): of ~57k pairs only 64 reach 800 tokens (8 first turns), so the paper's "
    "Long >= 800 class cannot be populated. Long >= 600 cl100k tokens (~690-750 Llama-2 tokens, the "
    "paper's tokenizer) keeps the paper's intent with >4,000 Long rows. `--long-from 800` reproduces the "
    "starvation.",
    "Rows: every user turn (with its conversation history, as the proxy sees it), not only first turns: "
    "first turns alone hold 723 Long rows (>= 600), too few for 2,000 per class.",
    "Ranking accuracy counts tied (Short, Long) pairs as half correct.",
    "Configuration (preset 'shipped'): rich_v2 features (paper19 + conversation, structure, requested "
    "quantities, word groups and lead word, on a 600-character scan window), 50 rounds x 3 classes of depth-3 "
    "trees, learning rate 0.2, seed 42. Chosen by 5-fold group cross-validation on the training split only; "
    "as accurate as 300x6 and ~6x cheaper per request. The paper preset (paper19, 300x6, lr 0.1) is compared "
    "on the same held-out split in the evaluation report.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=("shipped", "paper"), default="shipped",
                        help="model configuration: 'paper' = paper19, 300 trees, depth 6, lr 0.1, seed 42")
    parser.add_argument("--feature-set", help="override the preset's feature set (paper19, rich_v1, rich_v2)")
    parser.add_argument("--n-estimators", type=int, help="boosting rounds (override)")
    parser.add_argument("--max-depth", type=int, help="tree depth (override)")
    parser.add_argument("--learning-rate", type=float, help="learning rate (override)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split, the sampling and xgboost")
    parser.add_argument("--per-class", type=int, default=2000, help="balanced rows per class (train+test)")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--turns", choices=("all", "first"), default="all", help="which user turns make rows")
    parser.add_argument("--short-below", type=int, default=200, help="Short: answer tokens below this")
    parser.add_argument("--long-from", type=int, default=DEFAULT_LONG_FROM, help="Long: answer tokens from this")
    parser.add_argument("--no-english-filter", action="store_true", help="keep non-English prompts")
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_PATH, help="ONNX file to write (card beside it)")
    parser.add_argument("--threads", type=int, default=2, help="xgboost threads")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _configs(args: argparse.Namespace) -> tuple[Any, Any]:
    from clairvoyant.training.dataset import DataConfig
    from clairvoyant.training.labels import ClassBounds
    from clairvoyant.training.train import PRESETS

    model_config = PRESETS[args.preset].with_overrides(
        feature_set=args.feature_set, n_estimators=args.n_estimators, max_depth=args.max_depth,
        learning_rate=args.learning_rate, seed=args.seed,
    )
    data_config = DataConfig(
        per_class=args.per_class, test_fraction=args.test_fraction, turns=args.turns,
        bounds=ClassBounds(args.short_below, args.long_from), seed=args.seed,
        english_only=not args.no_english_filter,
    )
    return data_config, model_config


def train_and_export(split: Any, model_config: Any, out: Path, *, preset: str, threads: int = 2,
                     progress: bool = False, notes: list[str] | None = None) -> dict[str, Any]:
    """Fit on ``split.train``, export to ``out``, check parity on ``split.test``, write both cards.

    Returns the card. Raises ``export.ParityError`` if ONNX and xgboost disagree by > 1e-5.
    """
    import numpy as np
    import onnxmltools
    import onnxruntime

    from clairvoyant.features import get_feature_set
    from clairvoyant.training import card as card_md
    from clairvoyant.training import export, metrics
    from clairvoyant.training.labels import TOKENIZER_NAME, TOKENIZER_PACKAGE
    from clairvoyant.training.train import featurize, fit, xgboost_version

    fs = get_feature_set(model_config.feature_set)
    x_train = featurize(fs, [p.prompt for p in split.train], progress=progress)
    x_test = featurize(fs, [p.prompt for p in split.test], progress=progress)
    clf = fit(x_train, split.train_labels, model_config, threads=threads)
    model_bytes = export.to_onnx(clf, fs.size)
    parity = export.check_parity(clf, model_bytes, x_test)
    export.write_model(model_bytes, out)
    probs = export.onnx_probabilities(model_bytes, x_test)
    held_out = metrics.summary(probs, split.test_labels, split.test_lengths)
    card: dict[str, Any] = {
        "preset": preset,
        "feature_set": fs.name,
        "feature_names": list(fs.names),
        "tokenizer": f"{TOKENIZER_NAME} ({TOKENIZER_PACKAGE})",
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
        "metrics": {
            "held_out_" + k: v for k, v in held_out.items()
        } | {"onnx_xgboost_max_abs_diff": parity},
        "notes": list(notes or []),
        "versions": {
            "xgboost": xgboost_version(),
            "onnxmltools": onnxmltools.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
    }
    export.write_card(out, card)
    card_md.write_markdown(out)
    logger.info("wrote %s (ranking accuracy %.4f on %d held-out rows)", out, held_out["ranking_accuracy"], len(split.test))
    return card


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from clairvoyant.training.dataset import build_split, load_pairs

    data_config, model_config = _configs(args)
    progress = not args.no_progress
    pairs = load_pairs()
    split = build_split(pairs, data_config, progress=progress)
    card = train_and_export(split, model_config, args.out, preset=args.preset, threads=args.threads,
                            progress=progress, notes=NOTES)
    m = card["metrics"]
    print(
        f"wrote {args.out}: held-out ranking accuracy {m['held_out_ranking_accuracy']:.4f}, "
        f"3-class accuracy {m['held_out_three_class_accuracy']:.4f}, Kendall tau_b {m['held_out_kendall_tau_b']:.4f}, "
        f"ONNX/xgboost max |diff| {m['onnx_xgboost_max_abs_diff']:.2e}"
    )
    return 0
