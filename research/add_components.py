"""Issue 8: the encoder's `components` output, for the online learner.

The online learner corrects the prior per deployment from a few hundred observations, so it needs
a few columns that say what a prompt is about, not 384. This script embeds a sample of the ShareGPT
TRAINING side (never AlpacaEval) with the exported encoder (onnxruntime only), takes the top
--k principal components of those embeddings, and adds one output to the graph:

    components [N, k] = (embedding - mean) @ V_k^T       (float32; the mean and V_k are initializers)

so the served encoder hands the learner its k columns in the same run. Writes the new graph and a
JSON beside it with the explained variance.

    PYTHONPATH=src python research/add_components.py --onnx /tmp/rcache/enc3/encoder.onnx \
        --tokenizer /tmp/rcache/enc3/tokenizer.json --out /tmp/rcache/enc3/encoder.components.onnx --k 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from tokenizers import Tokenizer

CACHE = Path("/tmp/rcache")


def training_texts(n: int, seed: int) -> list[str]:
    """``n`` English training-side ShareGPT instructions (research/prepare_data.py's cache)."""
    s = np.load(CACHE / "sharegpt.npz")
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    rows = np.flatnonzero(~s["test"] & s["english"])
    pick = np.random.default_rng(seed).choice(rows, size=min(n, len(rows)), replace=False)
    return [texts[i] for i in pick]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--onnx", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--max-word-pieces", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    tok = Tokenizer.from_file(str(args.tokenizer))
    tok.enable_truncation(args.max_word_pieces)
    tok.no_padding()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(args.onnx), options, providers=["CPUExecutionProvider"])
    embeddings = []
    for text in training_texts(args.rows, args.seed):
        e = tok.encode(text.encode("utf-8", "replace").decode("utf-8")[: args.max_word_pieces * 8])
        ids = np.asarray([e.ids], dtype=np.int64)
        mask = np.asarray([e.attention_mask], dtype=np.int64)
        embeddings.append(session.run(["embedding"], {"input_ids": ids, "attention_mask": mask})[0][0])
    x = np.asarray(embeddings, dtype=np.float64)
    mean = x.mean(axis=0)
    _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
    explained = (s**2) / np.sum(s**2)
    basis = vt[: args.k]  # [k, 384]

    model = onnx.load(str(args.onnx))
    graph = model.graph
    graph.initializer.extend(
        [
            numpy_helper.from_array(mean.astype(np.float32), "components_mean"),
            numpy_helper.from_array(basis.T.astype(np.float32), "components_basis"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Sub", ["embedding", "components_mean"], ["components_centred"]),
            helper.make_node("MatMul", ["components_centred", "components_basis"], ["components"]),
        ]
    )
    graph.output.append(helper.make_tensor_value_info("components", onnx.TensorProto.FLOAT, ["batch", args.k]))
    onnx.checker.check_model(model)
    onnx.save(model, str(args.out))
    summary = {
        "k": args.k,
        "rows": len(x),
        "seed": args.seed,
        "data": "English training-side ShareGPT instructions (never AlpacaEval)",
        "explained_variance": float(explained[: args.k].sum()),
    }
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
