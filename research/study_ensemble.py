"""Step-1 d follow-up: does the fine-tuned encoder add to the shipped lexical model? Rank-average (z-scored)
blends of the two scores on AlpacaEval dev and the ShareGPT held-out first turns.

    PYTHONPATH=src nice -n 10 python research/study_ensemble.py /tmp/rcache/ft_scores.npz
"""

from __future__ import annotations

import sys
from pathlib import Path

import json

import numpy as np

from clairvoyant.prediction.features import Prompt
from clairvoyant.tools.training.evaluate import load_alpaca_eval
from clairvoyant.tools.training.scoring import ModelScorer
from common import CACHE, alpaca_taus, load, tau


def z(v: np.ndarray) -> np.ndarray:
    return (v - v.mean()) / v.std()


def main() -> None:
    d = load()
    ft = np.load(sys.argv[1])
    scorer = ModelScorer(Path(__file__).resolve().parents[1] / "model" / "predictor.onnx")
    alpaca = load_alpaca_eval(Path("/work/shared/data/alpaca_eval_dev.jsonl"))
    lex_a = scorer.score_prompts(alpaca.prompts)
    # held-out first turns, as single-message prompts (ShareGPT first turns rarely carry a system prompt)
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    rows = ft["heldout_rows"]
    lex_h = scorer.score_prompts([Prompt(texts[i], context_chars=len(texts[i])) for i in rows])
    for w in (0.0, 0.3, 0.5, 0.7, 1.0):
        sa = w * z(ft["alpaca"]) + (1 - w) * z(lex_a)
        sh = w * z(ft["heldout"]) + (1 - w) * z(lex_h)
        per, mean = alpaca_taus(sa, d)
        print(f"| encoder weight {w} | " + " | ".join(f"{t:.3f}" for t in per) + f" | **{mean:.3f}** | "
              f"{tau(sh, d.tokens[rows]):.3f} (first turns) |", flush=True)


if __name__ == "__main__":
    main()
