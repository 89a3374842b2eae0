"""`clairvoyant evaluate`: how well a model orders real answers (see ``training.evaluate``).

    clairvoyant evaluate --alpaca-eval /work/shared/data/alpaca_eval_dev.jsonl

Writes ``<model>.evaluation.json`` and ``<model>.evaluation.md`` beside the model and copies the
headline figures into its card (and MODEL_CARD.md). The AlpacaEval file is read from its path, never
copied. Heavy imports happen inside ``run``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from clairvoyant.prediction.encoder import DEFAULT_ENCODER_CARD
from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH, help="ONNX model (card beside it)")
    parser.add_argument(
        "--alpaca-eval",
        type=Path,
        metavar="PATH",
        help="AlpacaEval dev JSONL (prompt + output_tokens per model); without it that section is skipped",
    )
    parser.add_argument(
        "--baseline-model",
        type=Path,
        help="the previous shipped model to compare (default: model/baselines/rich_v2_3class.onnx)",
    )
    parser.add_argument(
        "--encoder",
        type=Path,
        default=DEFAULT_ENCODER_CARD,
        help="encoder card to report the model refined by it, as waiting requests are served (default: the shipped one)",
    )
    parser.add_argument("--no-encoder", action="store_true", help="skip the encoder rows")
    parser.add_argument("--no-paper-baseline", action="store_true", help="skip training the paper preset (faster)")
    parser.add_argument("--threads", type=int, default=2, help="xgboost threads for the paper baseline")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from clairvoyant.tools.training.evaluate import BASELINE_MODEL_PATH, evaluate_model, write_report

    if args.alpaca_eval is not None and not args.alpaca_eval.is_file():
        print(f"--alpaca-eval: {args.alpaca_eval} is not a file")
        return 2
    if args.alpaca_eval is None:
        logging.getLogger(__name__).info("no --alpaca-eval PATH: the AlpacaEval transfer section is skipped")
    report = evaluate_model(
        args.model,
        alpaca_eval=args.alpaca_eval,
        baseline_model=args.baseline_model or BASELINE_MODEL_PATH,
        paper_baseline=not args.no_paper_baseline,
        threads=args.threads,
        encoder=None if args.no_encoder or not args.encoder.is_file() else args.encoder,
    )
    json_path, md_path = write_report(args.model, report)
    print(f"wrote {md_path} and {json_path}")
    for name in ("model", "model_with_encoder"):
        m = report["scorers"].get(name)
        if m is None:
            continue
        alpaca = m.get("alpaca_eval")
        print(
            f"{name}: ShareGPT held-out tau_b {m['sharegpt_held_out']['kendall_tau_b']:.4f}"
            + (f", AlpacaEval mean tau_b {alpaca['mean_kendall_tau_b']:.4f}" if alpaca else ", AlpacaEval skipped")
        )
    return 0
