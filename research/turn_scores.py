"""Issue 8, brief TURN, idea 1 step 2: the shipped models' scores on the rows the turn-aware blend is fitted and checked on.

Rows (indices into load_pairs(), the order of /tmp/rcache/sharegpt.npz):
- the training-side later turns the shipped encoder never saw (turn_unseen_rows.py: unseen_later, ~19k),
- 2,000 seen later turns of each kind (pass-2 batches 0..399, and pass 1's draw): the check that the replay is right
  (seen rows must fit the encoder better than unseen ones, and the unseen ones about as well as held-out rows),
- every held-out row of the natural split (evaluate's 10,642 English rows; held-out AlpacaEval is scored in
  turn_study.py).
Scores, exactly as served: the encoder (model/encoder.card.json, prediction/encoder.py, one prompt per run) on the
Prompt's instruction, and the lexical prior = model/predictor.onnx raw score through its card's calibration. For
training rows that prior is IN-SAMPLE (the lexical model was trained on every training row): turn_oof_lexical.py
gives out-of-fold priors for them.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/turn_scores.py --rows /tmp/turn/unseen_rows.npz \
        --out /tmp/turn/scores.npz
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from clairvoyant.prediction.encoder import EncoderModel
from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split, load_pairs
from clairvoyant.tools.training.scoring import ModelScorer

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--check-rows", type=int, default=2000)
    args = parser.parse_args()
    r = np.load(args.rows)
    pairs = load_pairs()
    split = build_natural_split(pairs, NaturalConfig())
    key_index = {p.key: i for i, p in enumerate(pairs)}
    held = np.array([key_index[p.key] for p in split.test], dtype=np.int64)
    train_keys = {p.key for p in split.train}
    rng = np.random.default_rng(0)
    check_p2 = np.sort(rng.choice(r["seen_later_p2"], size=args.check_rows, replace=False))
    check_p1 = np.sort(rng.choice(r["seen_later_p1"], size=args.check_rows, replace=False))
    unseen = r["unseen_later"]
    for part in (unseen, check_p2, check_p1):  # the research cache's training side is the split's training side
        assert all(pairs[i].key in train_keys for i in part)
    rows = np.concatenate([unseen, check_p2, check_p1, held])
    kind = np.concatenate([np.full(len(unseen), 0), np.full(len(check_p2), 1), np.full(len(check_p1), 2),
                           np.full(len(held), 3)]).astype(np.int8)  # 0 unseen later, 1/2 seen later, 3 held-out
    prompts = [pairs[i].prompt for i in rows]
    scorer = ModelScorer(ROOT / "model" / "predictor.onnx")
    raw = scorer.score_prompts(prompts)
    prior = scorer.predicted_log_tokens(raw)
    encoder = EncoderModel(ROOT / "model" / "encoder.card.json")
    started = time.perf_counter()
    enc = encoder.log_tokens_many([p.instruction for p in prompts])
    print(f"encoded {len(rows)} rows in {time.perf_counter() - started:.0f} s", flush=True)
    tokens = np.load("/tmp/rcache/sharegpt.npz")["tokens"][rows].astype(np.int64)
    assert np.array_equal(tokens[kind == 3], split.test_lengths)  # the cache's labels are the split's
    np.savez(args.out, rows=rows, kind=kind, raw=raw, prior=prior, enc=enc, tokens=tokens,
             turn=np.array([pairs[i].turn for i in rows]), instruction_chars=np.array([len(p.instruction) for p in prompts]),
             total_chars=np.array([p.total_chars for p in prompts]), system_chars=np.array([p.system_chars for p in prompts]),
             turns=np.array([p.turns for p in prompts]))
    print("saved", args.out)


if __name__ == "__main__":
    main()
