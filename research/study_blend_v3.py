"""Issue 8, task C: blend of the exported encoder's log_tokens (eval_encoder_variants.py --dump) with the shipped
lexical model's score (model/predictor.onnx, raw output = predicted ln tokens before calibration).

blend_w = w * (enc - mu_e) / sd_e + (1 - w) * (lex - mu_l) / sd_l, with mu/sd FIXED constants: the mean and std of
each score over the English ShareGPT held-out rows (all turns). The ranking depends only on w (and the two sds);
for a server-side formula in ln tokens, blended_ln = a * enc + b * lex + c, where a, b keep the ratio of the
z-blend and one scale + intercept are fitted by least squares to the held-out rows' true ln tokens.
The encoder sees the turn's user text only; the lexical model sees the whole Prompt (context, turns, system).
Rows: AlpacaEval dev (4 models, single-message prompts) and the 10,642 English ShareGPT held-out rows (all turns)
and their first turns.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/study_blend_v3.py /tmp/rcache/enc3/scores_emb8_fp16.npz
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from clairvoyant.tools.training.dataset import load_pairs
from clairvoyant.tools.training.evaluate import load_alpaca_eval
from clairvoyant.tools.training.scoring import ModelScorer
from common import CACHE, alpaca_taus, load, tau

WEIGHTS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def main() -> None:
    d = load()
    enc = np.load(sys.argv[1])
    out_path = Path(sys.argv[1]).with_name("blend_scores.npz")
    scorer = ModelScorer(Path(__file__).resolve().parents[1] / "model" / "predictor.onnx")
    alpaca = load_alpaca_eval(Path("/work/shared/data/alpaca_eval_dev.jsonl"))
    lex_a = scorer.score_prompts(alpaca.prompts)
    rows = enc["heldout_rows"]
    pairs = load_pairs()
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    assert len(pairs) == len(texts) and all(pairs[i].prompt.instruction == texts[i] for i in rows[:500])
    lex_h = scorer.score_prompts([pairs[i].prompt for i in rows])
    enc_a, enc_h = enc["alpaca"].astype(np.float64), enc["heldout"].astype(np.float64)
    y_h = d.log_tokens[rows].astype(np.float64)
    first = d.first[rows]
    mu_e, sd_e, mu_l, sd_l = enc_h.mean(), enc_h.std(), lex_h.mean(), lex_h.std()
    print(f"held-out rows {len(rows)} (first turns {first.sum()}); enc mean/sd {mu_e:.4f}/{sd_e:.4f}, "
          f"lex mean/sd {mu_l:.4f}/{sd_l:.4f}")
    print("| encoder weight w | Llama3 | Mistral | Qwen | Gemma | **AlpacaEval mean** | ShareGPT held-out all turns | "
          "held-out first turns | blended_ln = a*enc + b*lex + c | held-out MAE (ln) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for w in WEIGHTS:
        za = w * (enc_a - mu_e) / sd_e + (1 - w) * (lex_a - mu_l) / sd_l
        zh = w * (enc_h - mu_e) / sd_e + (1 - w) * (lex_h - mu_l) / sd_l
        per, mean = alpaca_taus(za, d)
        h_all, h_first = tau(zh, d.tokens[rows]), tau(zh[first], d.tokens[rows][first])
        k, c0 = np.polyfit(zh, y_h, 1)  # blended_ln = k * z + c0
        a, b = k * w / sd_e, k * (1 - w) / sd_l
        c = c0 - a * mu_e - b * mu_l
        mae = float(np.abs(a * enc_h + b * lex_h + c - y_h).mean())
        print(f"| {w} | " + " | ".join(f"{t:.3f}" for t in per) + f" | **{mean:.3f}** | {h_all:.3f} | {h_first:.3f} | "
              f"{a:.4f}*enc + {b:.4f}*lex + {c:.4f} | {mae:.3f} |", flush=True)
        table.append({"w": w, "alpaca": per, "alpaca_mean": mean, "heldout_all": h_all, "heldout_first": h_first,
                      "a": a, "b": b, "c": c, "heldout_mae": mae})
    Path(out_path.with_suffix(".json")).write_text(json.dumps(table, indent=1))
    np.savez(out_path, lex_a=lex_a, enc_a=enc_a, lex_h=lex_h, enc_h=enc_h, heldout_rows=rows,
             stats=np.array([mu_e, sd_e, mu_l, sd_l]))
    print("saved", out_path)


if __name__ == "__main__":
    main()
