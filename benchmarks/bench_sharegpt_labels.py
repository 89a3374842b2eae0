"""ShareGPT training variants of the lexical model, scored on the transfer check as served.

    python benchmarks/bench_sharegpt_labels.py --alpaca-eval alpaca_eval_dev.jsonl [--censored-from 760]
        [--variants squared first_x3 censored_dropped censored_aft pairwise] [--json FILE]

Each variant fits the shipped preset's XGBoost (150 rounds, depth 3, learning rate 0.1, rich_v3 with
out-of-fold lexicon scores, the natural split of ``clairvoyant train``) on the ShareGPT training side
and is scored as ``clairvoyant evaluate`` scores it: Kendall tau_b of the lexical score, and of the
served blend (the calibrated lexical prior refined by the shipped encoder and its kNN, the encoder
card's weights) against each AlpacaEval dev model's lengths, and on the ShareGPT held-out rows.

Variants:
- ``squared``: today's recipe (reg:squarederror on ln tokens);
- ``first_x3``: first user turns weighted 3x (the check's instructions are all first turns);
- ``censored_dropped``: answers of at least ``--censored-from`` tokens left out of the fit (the packaged
  answers pile up at 760-779 cl100k tokens, where half end mid-sentence: cut, not finished);
- ``censored_aft``: the same answers as right-censored (``survival:aft``, normal errors, scale 1):
  their length is at least what was kept;
- ``pairwise``: ``rank:pairwise`` over all training rows as one query.

The dev file is evaluation data (non-commercial licence): passed by path, never trained on.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness.results import add_json_option, write_json  # noqa: E402

from clairvoyant.prediction.predictor import BlendWeights  # noqa: E402

VARIANTS = ("squared", "first_x3", "censored_dropped", "censored_aft", "pairwise")


def _fit(variant: str, x: np.ndarray, y: np.ndarray, first: np.ndarray, censored: np.ndarray) -> Any:
    """A function from feature rows to the variant's raw score."""
    import xgboost

    params: dict[str, Any] = {"max_depth": 3, "learning_rate": 0.1, "tree_method": "hist", "seed": 42, "nthread": 2}
    data = xgboost.DMatrix(x, label=y)
    if variant == "first_x3":
        data.set_weight(np.where(first, 3.0, 1.0))
    elif variant == "censored_dropped":
        data.set_weight(np.where(censored, 0.0, 1.0))
    if variant == "censored_aft":
        # survival:aft reads times: the bounds are tokens, its margin is ln tokens
        data.set_float_info("label_lower_bound", np.exp(y))
        data.set_float_info("label_upper_bound", np.where(censored, np.inf, np.exp(y)))
        params |= {"objective": "survival:aft", "aft_loss_distribution": "normal", "aft_loss_distribution_scale": 1.0}
    elif variant == "pairwise":
        data.set_group([len(y)])
        params |= {"objective": "rank:pairwise"}
    else:
        params |= {"objective": "reg:squarederror"}
    booster = xgboost.train(params, data, num_boost_round=150)
    return lambda rows: booster.predict(xgboost.DMatrix(rows), output_margin=True).astype(np.float64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alpaca-eval", type=Path, required=True, help="alpaca_eval_dev.jsonl")
    parser.add_argument("--censored-from", type=int, default=760, help="answer tokens from which a length is a cut")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    add_json_option(parser, "sharegpt_labels")
    args = parser.parse_args(argv)

    from clairvoyant.prediction.encoder import EncoderModel
    from clairvoyant.prediction.features import get_feature_set
    from clairvoyant.tools.training import calibration, metrics
    from clairvoyant.tools.training.commands_train import lexicon_column_for_training
    from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split, load_pairs
    from clairvoyant.tools.training.evaluate import load_alpaca_eval
    from clairvoyant.tools.training.train import featurize

    started = time.monotonic()
    split = build_natural_split(load_pairs(), NaturalConfig())
    fs = get_feature_set("rich_v3")
    x_train = featurize(fs, [p.prompt for p in split.train])
    x_test = featurize(fs, [p.prompt for p in split.test])
    lexicon_column_for_training(fs, x_train, split)
    y = split.train_log_tokens
    first = np.array([p.turn == 0 for p in split.train])
    censored = split.train_lengths >= args.censored_from
    dev = load_alpaca_eval(args.alpaca_eval)
    x_dev = featurize(fs, dev.prompts)
    encoder = EncoderModel()
    weights = encoder.blend_weights
    enc, knn = encoder.opinions_many([p.instruction for p in dev.prompts])
    print(
        f"ShareGPT: {len(split.train)} training rows ({int(censored.sum())} at >= {args.censored_from} tokens), "
        f"{len(split.test)} held out; AlpacaEval dev: {len(dev.prompts)} x {len(dev.models)} "
        f"({time.monotonic() - started:.0f} s to load)"
    )

    def dev_taus(score: np.ndarray) -> list[float]:
        return [metrics.kendall_tau(score, dev.lengths[:, j]) for j in range(len(dev.models))]

    rows: dict[str, dict[str, Any]] = {}
    print(
        "\n| variant | dev lexical mean tau_b | dev served mean tau_b | "
        + " | ".join(f"{m} served" for m in dev.models)
        + " | ShareGPT held-out tau_b |\n|---|---|---|"
        + "---|" * len(dev.models)
        + "---|"
    )
    for variant in args.variants:
        score = _fit(variant, x_train, y, first, censored)
        raw_train, raw_dev = score(x_train), score(x_dev)
        prior = calibration.apply(calibration.isotonic_breakpoints(raw_train, y), raw_dev)
        # every dev prompt is a single turn: the blend's weight for a request without history
        served = BlendWeights.blend(prior, enc, weights.first, knn, weights.knn)
        lexical, per_model = dev_taus(raw_dev), dev_taus(served)
        held_out = metrics.kendall_tau(score(x_test), split.test_lengths)
        rows[variant] = {
            "dev_lexical_mean": float(np.mean(lexical)),
            "dev_served_mean": float(np.mean(per_model)),
            "dev_served_per_model": dict(zip(dev.models, per_model)),
            "sharegpt_held_out": held_out,
        }
        print(
            f"| {variant} | {np.mean(lexical):.4f} | {np.mean(per_model):.4f} | "
            + " | ".join(f"{t:.4f}" for t in per_model)
            + f" | {held_out:.4f} |",
            flush=True,
        )
    print(f"\n({time.monotonic() - started:.0f} s)")
    write_json(args.json, {"censored_from": args.censored_from, "variants": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
