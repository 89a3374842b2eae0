"""Scores of a fine-tuned MiniLM regressor (research/finetune_minilm.py) on AlpacaEval dev and on ShareGPT
held-out rows (first turns, or all English held-out rows with --all), saved for study_ensemble.py.

    nice -n 10 /tmp/encvenv/bin/python research/score_finetuned.py --state /tmp/rcache/ft/model.pt --out /tmp/rcache/ft_scores.npz
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from finetune_minilm import CACHE, MODEL_DIR, Regressor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--all", action="store_true", help="every English held-out row, not only first turns")
    args = parser.parse_args()
    torch.set_num_threads(2)
    s = np.load(CACHE / "sharegpt.npz")
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    atexts = [json.loads(line)["instruction"] for line in (CACHE / "alpaca_texts.jsonl").read_text().splitlines()]
    held = s["test"] & s["english"]
    if not args.all:
        held &= s["turn"] == 0
    rows = np.flatnonzero(held)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = Regressor()
    model.load_state_dict(torch.load(args.state, map_location="cpu"))
    model.eval()

    def score(batch: list[str]) -> np.ndarray:
        order = np.argsort([len(t) for t in batch])
        out = np.zeros(len(batch), dtype=np.float32)
        with torch.inference_mode():
            for b in range(0, len(batch), 64):
                idx = order[b : b + 64]
                enc = tok([batch[i][:4000] for i in idx], padding=True, truncation=True, max_length=128, return_tensors="pt")
                out[idx] = model(**enc).numpy()
        return out

    np.savez(args.out, alpaca=score(atexts), heldout_rows=rows, heldout=score([texts[i] for i in rows]))
    print("saved", args.out)


if __name__ == "__main__":
    main()
