"""Issue 8, brief TURN, idea 1 step 1: which training-side later turns the SHIPPED encoder never saw.

The shipped encoder is the step-400 checkpoint of pass 2 (finetune_minilm_continue.py, /tmp/rcache/ft3). This script
replays pass 2's row construction exactly (same seeds, same tokenizer, same length-bucketed batching; it asserts the
replay of pass 1's draw as pass 2 itself did, and that the batch count is the one pass 2 logged: 1,139) and writes:

- unseen_later: later turns (turn > 0) in batches 400.. of pass 2 (never drawn by pass 1, never reached by step 400)
- seen_later_p2: later turns in batches 0..399 of pass 2 (seen once by the shipped checkpoint)
- seen_later_p1: later turns pass 1 drew (seen by ft2, hence by the shipped checkpoint)
- first: every English training-side first turn (seen twice)

Row indices are into /tmp/rcache/sharegpt.npz, which is load_pairs() order (study_blend_v3.py checks this).
torch is not imported: only the tokenizer (transformers) is needed for the batch lengths.

    nice -n 10 /tmp/encvenv/bin/python research/turn_unseen_rows.py --out /tmp/turn/unseen_rows.npz
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

CACHE = Path("/tmp/rcache")
MODEL_DIR = Path("/tmp/minilm_pkg/model")  # finetune_minilm.MODEL_DIR (not imported: it imports torch)
SHIPPED_STEP = 400
BATCH = 32
MAX_TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    s = np.load(CACHE / "sharegpt.npz")
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    log_tokens = np.log(np.maximum(s["tokens"], 1)).astype(np.float32)
    # --- verbatim replay of finetune_minilm_continue.py main() up to make_batches(rows, lengths)
    rng = np.random.default_rng(42)
    train = ~s["test"] & s["english"]
    first = np.flatnonzero(train & (s["turn"] == 0))
    later_all = np.flatnonzero(train & (s["turn"] > 0))
    seen_later = rng.choice(later_all, size=min(len(later_all), len(first)), replace=False)
    ft2_rows = np.concatenate([first, seen_later])
    earlier = json.loads((CACHE / "ft2" / "trajectory.json").read_text())
    assert earlier["rows"] == len(ft2_rows), (earlier["rows"], len(ft2_rows))
    mean = float(earlier["mean"])
    assert abs(mean - float(log_tokens[ft2_rows].mean())) < 1e-4  # the replayed draw is ft2's
    rng.choice(np.flatnonzero(s["test"] & s["english"] & (s["turn"] == 0)), size=600, replace=False)  # held draw
    unseen_later = np.setdiff1d(later_all, seen_later)
    rng2 = np.random.default_rng(7)
    rows = rng2.permutation(np.concatenate([unseen_later, first]))
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    lengths = np.array([len(ids) for ids in tok([texts[i][:4000] for i in rows], truncation=True,
                                                 max_length=MAX_TOKENS)["input_ids"]])
    chunk = BATCH * 50
    batches = []
    for c in range(0, len(rows), chunk):
        part = np.arange(c, min(c + chunk, len(rows)))
        part = part[np.argsort(lengths[part], kind="stable")]
        batches += [rows[part[b : b + BATCH]] for b in range(0, len(part), BATCH)]
    batches = [batches[k] for k in rng2.permutation(len(batches))]
    # --- end of the replay
    p3 = json.loads((CACHE / "ft3" / "trajectory.json").read_text())
    assert p3["rows"] == len(rows) and p3["unseen_later"] == len(unseen_later), p3
    assert p3["best_step"] == SHIPPED_STEP, p3["best_step"]
    assert len(batches) == 1139, len(batches)  # "1139 batches in the first pass" (/tmp/rcache/ft3.log)
    seen_p2 = np.concatenate(batches[:SHIPPED_STEP])
    after = np.concatenate(batches[SHIPPED_STEP:])
    later_set = set(unseen_later.tolist())
    unseen = np.array(sorted(i for i in after.tolist() if i in later_set), dtype=np.int64)
    seen_later_p2 = np.array(sorted(i for i in seen_p2.tolist() if i in later_set), dtype=np.int64)
    assert len(seen_p2) == SHIPPED_STEP * BATCH
    assert not set(unseen.tolist()) & set(seen_later_p2.tolist()) and not set(unseen.tolist()) & set(seen_later.tolist())
    np.savez(args.out, unseen_later=unseen, seen_later_p2=seen_later_p2, seen_later_p1=np.sort(seen_later),
             first=first)
    print(json.dumps({"pass2_rows": len(rows), "batches": len(batches), "unseen_later": len(unseen),
                      "seen_later_p2": len(seen_later_p2), "seen_later_p1": len(seen_later), "first": len(first)}))


if __name__ == "__main__":
    main()
