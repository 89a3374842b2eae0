"""`clairvoyant evaluate`: the evaluation report of a model on its held-out split.

Writes ``<model>.evaluation.json`` and ``<model>.evaluation.md`` beside the model and copies the
headline figures into its card (and MODEL_CARD.md). Heavy imports happen inside ``run``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from clairvoyant.predictor import DEFAULT_MODEL_PATH

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH, help="ONNX model (card beside it)")
    parser.add_argument("--ood-rows", type=int, default=3000, help="held-out English rows for the natural-mix slices")
    parser.add_argument("--no-ablation", action="store_true", help="skip the drop-one-group ablation (faster)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from clairvoyant.training.evaluate import evaluate_model, write_report

    report = evaluate_model(args.model, ood_rows=args.ood_rows, ablation=not args.no_ablation)
    json_path, md_path = write_report(args.model, report)
    h = report["held_out"]
    print(
        f"wrote {md_path} and {json_path}: ranking accuracy {h['model']['ranking_accuracy']:.4f} "
        f"(paper preset {h['paper_preset']['ranking_accuracy']:.4f}, prompt-length rule "
        f"{report['baselines']['prompt_length_rule']['ranking_accuracy']:.4f})"
    )
    return 0
