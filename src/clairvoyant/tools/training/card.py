"""The human-readable model card, rendered from the JSON card (the JSON is the source of truth).

``model/predictor.onnx`` gets ``model/MODEL_CARD.md``; any other ``<stem>.onnx`` gets
``<stem>.card.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clairvoyant.prediction.predictor import card_path_for

__all__ = ["markdown_path_for", "render", "write_markdown"]


def markdown_path_for(model_path: Path) -> Path:
    if model_path.name == "predictor.onnx":
        return model_path.parent / "MODEL_CARD.md"
    return model_path.with_suffix(".card.md")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"
    return str(value)


def _table(rows: dict[str, Any]) -> list[str]:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows.items()]
    return lines


def render(card: dict[str, Any], model_path: Path) -> str:
    data = card.get("data", {})
    bounds = card.get("class_bounds", {})
    if card.get("kind") == "regressor":
        calib = card.get("calibration", {})
        what = [
            "## What it predicts",
            f"The natural log of the answer's length in `{card.get('tokenizer', '?')}` tokens of the dataset's "
            f"reference (ChatGPT) answer (ONNX output `{card.get('output')}`, score `{card.get('score')}`). The "
            "scheduler orders requests by ascending score; `predicted_tokens` = exp(np.interp(score, "
            "calibration.score, calibration.log_tokens)), an isotonic map fit on the training rows "
            f"({len(calib.get('score', []))} points).",
            "",
        ]
    else:
        what = [
            "## What it predicts",
            f"P(Short), P(Medium), P(Long) of the answer length, in `{card.get('tokenizer', '?')}` tokens of the "
            f"dataset's reference (ChatGPT) answer: Short < {bounds.get('short_below')}, "
            f"Medium {bounds.get('short_below')}-{(bounds.get('long_from') or 1) - 1}, Long >= {bounds.get('long_from')}. "
            + (
                "The scheduler orders requests by ascending P(Long); `predicted_tokens` comes from an isotonic map "
                "from P(Long) to ln tokens (the card's `calibration`)."
                if card.get("calibration")
                else "The scheduler orders requests by ascending P(Long)."
            ),
            "",
        ]
    out = [
        f"# Model card: {model_path.name}",
        "",
        f"Made by `{card.get('command', 'clairvoyant train')}` (the model and this card; the evaluation and "
        "latency sections by `clairvoyant evaluate` and `benchmarks/bench_predictor.py`). Generated from `"
        + card_path_for(model_path).name
        + "` (the machine-readable card, checked by `clairvoyant.prediction.predictor` on load): do not edit by hand.",
        "",
        *what,
        "## Identity",
        *_table(
            {
                "preset": card.get("preset"),
                "kind": card.get("kind", "classifier"),
                "feature set": card.get("feature_set"),
                "features": len(card.get("feature_names", [])),
                "onnx sha256": card.get("onnx_sha256"),
                "onnx size (bytes)": card.get("onnx_bytes"),
            }
        ),
        "",
        "Feature names, in column order: " + ", ".join(f"`{n}`" for n in card.get("feature_names", [])),
        "",
        "## Data and split",
        *_table({k: json.dumps(v) if isinstance(v, dict) else v for k, v in data.items()}),
        "",
        "## Hyperparameters",
        *_table(card.get("hyperparameters", {})),
        "",
        "## Measured",
    ]
    lexicon = card.get("lexicon")
    if lexicon:
        out += [
            "### lexicon",
            *_table({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in lexicon.items()}),
            "",
        ]
    for section in ("metrics", "evaluation", "latency"):
        values = card.get(section)
        if values:
            out += [
                f"### {section}",
                *_table({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in values.items()}),
                "",
            ]
    notes = card.get("notes")
    if notes:
        out += ["## Notes", *[f"- {n}" for n in notes], ""]
    out += ["## Versions", *_table(card.get("versions", {})), ""]
    return "\n".join(out)


def write_markdown(model_path: Path) -> Path:
    card = json.loads(card_path_for(model_path).read_text())
    path = markdown_path_for(model_path)
    path.write_text(render(card, model_path))
    return path
