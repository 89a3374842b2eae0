"""Issue 8, brief KNN, step 1: the shipped encoder's pooled embedding of every natural-split row and AlpacaEval prompt.

Exactly as served: model/encoder.card.json through prediction/encoder.py (EncoderModel.word_pieces: the Prompt's
instruction, head + tail word pieces), one prompt per run on one onnxruntime thread, no padding; the graph's
`embedding` output (mean pooled, 384-d, fp32) and its `log_tokens` output (the served encoder score) in one run.
Rows: the natural split's training side (the kNN memory candidates and the out-of-fold queries), its held-out side
(queries only, never memory) and the 406 AlpacaEval prompts (queries only). Sharded so two processes can share the work.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/knn_embed.py --shard 0 --shards 2 --out /tmp/knn/emb0.npz
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from clairvoyant.prediction.encoder import EncoderModel
from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split, load_pairs
from clairvoyant.tools.training.evaluate import load_alpaca_eval

ROOT = Path(__file__).resolve().parents[1]
ALPACA = Path("/work/shared/data/alpaca_eval_dev.jsonl")


def all_texts() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(row index into load_pairs() or -1 for AlpacaEval, part 0 train / 1 held-out / 2 AlpacaEval, instruction)."""
    pairs = load_pairs()
    split = build_natural_split(pairs, NaturalConfig())
    key_index = {p.key: i for i, p in enumerate(pairs)}
    train = [key_index[p.key] for p in split.train]
    held = [key_index[p.key] for p in split.test]
    alpaca = load_alpaca_eval(ALPACA)
    rows = np.array(train + held + [-1] * len(alpaca.prompts), dtype=np.int64)
    part = np.array([0] * len(train) + [1] * len(held) + [2] * len(alpaca.prompts), dtype=np.int8)
    texts = [pairs[i].prompt.instruction for i in train + held] + [p.instruction for p in alpaca.prompts]
    return rows, part, texts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows, part, texts = all_texts()
    mine = np.arange(args.shard, len(texts), args.shards)
    encoder = EncoderModel(ROOT / "model" / "encoder.card.json")
    session = encoder._session  # the served session: one thread, the shipped graph
    emb = np.zeros((len(mine), 384), np.float32)
    enc = np.zeros(len(mine), np.float64)
    started = time.perf_counter()
    for j, i in enumerate(mine):
        ids = np.asarray([encoder.word_pieces(texts[i])], dtype=np.int64)
        out = session.run(["log_tokens", "embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        enc[j] = float(np.asarray(out[0]).reshape(-1)[0])
        emb[j] = np.asarray(out[1], np.float32).reshape(-1)
        if j % 2000 == 0:
            print(f"{j}/{len(mine)} {time.perf_counter() - started:.0f} s", flush=True)
    np.savez(args.out, index=mine, rows=rows[mine], part=part[mine], emb=emb, enc=enc)
    print(f"saved {args.out}: {len(mine)} rows in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
