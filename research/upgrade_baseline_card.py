"""Bring the previous shipped model's card (model/baselines/rich_v2_3class.card.json) to the schema-2 card
contract: kind classifier, output probabilities, score p_long, and an isotonic calibration from P(Long) to
ln(answer tokens) fit on ITS training rows (the balanced split rebuilt from its card; the fingerprint must match).
The ONNX file is untouched (same sha256).

    PYTHONPATH=src nice -n 10 python research/upgrade_baseline_card.py model/baselines/rich_v2_3class.onnx
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from clairvoyant.prediction.predictor import card_path_for
from clairvoyant.tools.training import calibration, card as card_md, export
from clairvoyant.tools.training.dataset import DataConfig, build_split, load_pairs, log_tokens
from clairvoyant.tools.training.labels import ClassBounds
from clairvoyant.tools.training.scoring import ModelScorer


def main() -> None:
    model_path = Path(sys.argv[1])
    card_path = card_path_for(model_path)
    card = json.loads(card_path.read_text())
    data = card["data"]
    config = DataConfig(per_class=int(data["per_class"]), test_fraction=float(data["test_fraction"]),
                        turns=str(data["turns"]), bounds=ClassBounds(**card["class_bounds"]), seed=int(data["seed"]),
                        english_only=bool(data["english_only"]))
    split = build_split(load_pairs(), config)
    if split.fingerprint() != data["split_fingerprint"]:
        raise SystemExit("the rebuilt split does not match the card's fingerprint")
    scorer = ModelScorer(model_path)
    p_long = scorer.score_prompts([p.prompt for p in split.train])
    calib = calibration.isotonic_breakpoints(p_long, log_tokens(split.train_lengths))
    export.check_calibration(calib)
    rest = {k: v for k, v in card.items() if k not in ("schema", "kind", "output", "score", "classes", "calibration")}
    upgraded = {"schema": 2, "kind": "classifier", "output": "probabilities", "score": "p_long",
                "classes": card["classes"], "calibration": calib, **rest}
    if isinstance(upgraded.get("evaluation"), dict) and upgraded["evaluation"].get("report") == "predictor.evaluation.md":
        upgraded["evaluation"]["report"] = model_path.with_suffix("").name + ".evaluation.md"
    upgraded["notes"] = list(card.get("notes", [])) + [
        "Kept as the previous shipped model (baseline). Card upgraded to schema 2: calibration = isotonic "
        "regression from P(Long) to ln(answer tokens) on its own balanced training rows; the ONNX file is unchanged."]
    card_path.write_text(json.dumps(upgraded, indent=2) + "\n")
    card_md.write_markdown(model_path)
    print(f"upgraded {card_path}: {len(calib['score'])} calibration points")


if __name__ == "__main__":
    main()
