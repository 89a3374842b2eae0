"""Frozen MiniLM-L6 (all-MiniLM-L6-v2) mean-pooled, L2-normalised embeddings of cached prompts.

Research only (torch + transformers in a separate venv, never the serving path):

    nice -n 10 /tmp/encvenv/bin/python research/embed_minilm.py --texts /tmp/rcache/texts.jsonl \
        --out /tmp/rcache/emb_sharegpt.npy --max-tokens 128 [--only-rows /tmp/rcache/rows.npy]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

MODEL_DIR = Path("/tmp/minilm_pkg/model")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--texts", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--only-rows", type=Path, help="npy of row indices to embed (others left zero)")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    texts = [json.loads(line)["instruction"] for line in args.texts.read_text().splitlines()]
    rows = np.load(args.only_rows) if args.only_rows else np.arange(len(texts))
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModel.from_pretrained(MODEL_DIR).eval()
    out = np.zeros((len(texts), 384), dtype=np.float32)
    # sort by length so batches pad little
    order = sorted(rows.tolist(), key=lambda i: len(texts[i]))
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(order), args.batch):
            idx = order[b : b + args.batch]
            enc = tok([texts[i][:4000] for i in idx], padding=True, truncation=True, max_length=args.max_tokens,
                      return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, dim=1)
            out[idx] = pooled.numpy()
            if b % (args.batch * 20) == 0:
                print(f"{b}/{len(order)} {time.perf_counter() - start:.0f}s", flush=True)
    np.save(args.out, out)
    print(f"done {len(order)} rows in {time.perf_counter() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
