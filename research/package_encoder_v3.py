"""Issue 8, task B: the shipped files of the encoder under --dir (/tmp/rcache/enc3): encoder.onnx (the chosen
variant of export_encoder_v3.py), tokenizer.json (truncation to 128 word pieces, no padding, set IN the file so
Tokenizer.from_file gives the exact preprocessing) and encoder.json (preprocessing, outputs, figures, sha256,
and the blend with the shipped lexical model from study_blend_v3.py).

    python research/package_encoder_v3.py --dir /tmp/rcache/enc3 --variant emb8_fp16 --w 0.6
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

MAX_TOKENS = 128
MAX_CHARS = 4000


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--variant", required=True)
    parser.add_argument("--w", type=float, required=True, help="the blend's encoder weight to ship")
    parser.add_argument("--checkpoint", default="/tmp/rcache/ft3/best_step400.pt")
    args = parser.parse_args()
    variants = json.loads((args.dir / "variants.json").read_text())
    onnx_path = args.dir / "encoder.onnx"
    shutil.copy(args.dir / "variants" / f"{args.variant}.onnx", onnx_path)
    tok = json.loads((args.dir / "tokenizer.json").read_text())
    tok["truncation"] = {"direction": "Right", "max_length": MAX_TOKENS, "strategy": "LongestFirst", "stride": 0}
    tok["padding"] = None
    (args.dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    blend = json.loads((args.dir / "blend_scores.json").read_text())
    row = next(b for b in blend if abs(b["w"] - args.w) < 1e-9)
    card = {
        "name": "minilm-l6-ft3 length regressor",
        "checkpoint": args.checkpoint,
        "base_model": "sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0), fine-tuned on ShareGPT training-side rows only",
        "preprocessing": {
            "text": "Prompt.instruction: the LAST user message's text (chat), or the prompt (completions); "
                    "system prompt and earlier turns are NOT given to the encoder",
            "char_truncation": f"text[:{MAX_CHARS}] (characters) before tokenizing",
            "tokenizer": "tokenizer.json via `tokenizers` (BertNormalizer: lowercases, strips nothing else; "
                         "WordPiece; [CLS] ... [SEP] added); truncation and padding are set in the file",
            "max_length": MAX_TOKENS,
            "max_length_includes_special_tokens": True,
            "batching": "one prompt per run, no padding; attention_mask = ones like input_ids "
                        "(padded batches are also valid: mean pooling uses the mask)",
        },
        "onnx": {
            "inputs": {"input_ids": "int64 [N, T]", "attention_mask": "int64 [N, T]"},
            "outputs": {"log_tokens": "float32 [N]: predicted ln(answer cl100k tokens)",
                        "embedding": "float32 [N, 384]: mean-pooled last hidden state, the head's input"},
            "variant": args.variant,
            "variant_notes": "word-embedding table int8 per row (Gather of int8 + per-row scale), other initializers "
                             "stored float16 behind Cast nodes: runs as is in onnxruntime; "
                             "export_encoder_v3.load_encoder folds the casts at load (fp32 session)"
                             if args.variant == "emb8_fp16" else args.variant,
            "bytes": onnx_path.stat().st_size,
            "sha256": sha256(onnx_path),
            "opset": 17,
        },
        "tokenizer_sha256": sha256(args.dir / "tokenizer.json"),
        "figures": {name: {k: v for k, v in entry.items()} for name, entry in variants.items()},
        "blend_with_lexical": {
            "formula": "blended_ln = a * log_tokens + b * lex + c; lex = the shipped model/predictor.onnx raw output "
                       "(predicted ln tokens BEFORE its isotonic calibration)",
            "lexical_model_sha256": "c8c1e13e42b5b3617af3cd1b0b549e51dce64f2d28ca9c876351efacad51bc2e",
            **row,
        },
    }
    (args.dir / "encoder.json").write_text(json.dumps(card, indent=1))
    print(json.dumps(card["onnx"], indent=1))


if __name__ == "__main__":
    main()
