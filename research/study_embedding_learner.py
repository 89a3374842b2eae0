"""Issue 8, task D (offline): is an online learner on the encoder's 384-d embedding worth building?

Protocol (as benchmarks/bench_replay_learning.py): per AlpacaEval model, the 406 prompts in a seeded random order
(seeds 0-4); the figure is Kendall tau_b of the second half's scores against that model's real lengths, learner
minus the static prior. Prior = the blend (study_blend_v3.py, weight --w, in ln tokens). Learners, fitted on
residuals r = ln(true tokens) - prior, prediction = prior + f(x):
  batch     ridge fitted once on the first half, scores the whole second half (no updates)
  online    ridge refitted every --refit lines on every line seen so far (each line scored before its own
            length is learned), second half scored as it arrives: what a serving learner would see
Features: emb (the 384-d embedding, centred on the rows seen) or emb+prior. Ridge penalty: GCV over a grid
(sklearn RidgeCV, efficient leave-one-out) or a fixed alpha.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/study_embedding_learner.py \
        /tmp/rcache/enc3/scores_emb8_fp16.npz /tmp/rcache/enc3/blend_scores.npz --w 0.6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from sklearn.linear_model import Ridge, RidgeCV

from common import load, tau

ALPHAS = np.logspace(-1, 4, 16)


def fit_predict(x_fit: np.ndarray, r_fit: np.ndarray, x_new: np.ndarray, alpha: float | None) -> np.ndarray:
    mu = x_fit.mean(0)
    model = RidgeCV(alphas=ALPHAS) if alpha is None else Ridge(alpha=alpha)
    model.fit(x_fit - mu, r_fit)
    return model.predict(x_new - mu)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scores", type=Path)
    parser.add_argument("blend", type=Path)
    parser.add_argument("--w", type=float, required=True)
    parser.add_argument("--refit", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    d = load()
    enc = np.load(args.scores)
    bl = np.load(args.blend)
    mu_e, sd_e, mu_l, sd_l = bl["stats"]
    table = json.loads(args.blend.with_suffix(".json").read_text())
    row = next(t for t in table if abs(t["w"] - args.w) < 1e-9)
    prior = row["a"] * bl["enc_a"] + row["b"] * bl["lex_a"] + row["c"]
    emb = enc["alpaca_emb"].astype(np.float64)
    n = len(prior)
    half = n // 2
    results: dict = {}
    configs = [("batch", "emb", None), ("batch", "emb+prior", None), ("batch", "emb", 10.0), ("batch", "emb", 100.0),
               ("online", "emb", None), ("online", "emb+prior", None)]
    for m, model_name in enumerate(d.a_models):
        y = np.log(np.maximum(d.a_lengths[:, m], 1)).astype(np.float64)
        per: dict = {"static": []}
        for seed in args.seeds:
            order = np.random.default_rng(seed).permutation(n)
            second = order[half:]
            per["static"].append(tau(prior[second], d.a_lengths[second, m]))
            for mode, feats, alpha in configs:
                key = f"{mode} {feats} alpha={'GCV' if alpha is None else alpha}"
                x = emb if feats == "emb" else np.column_stack([emb, prior * 10.0])
                r = y - prior
                if mode == "batch":
                    first = order[:half]
                    score = prior[second] + fit_predict(x[first], r[first], x[second], alpha)
                else:
                    score = np.empty(n - half)
                    for k0 in range(half, n, args.refit):
                        seen, new = order[:k0], order[k0 : k0 + args.refit]
                        score[k0 - half : k0 - half + len(new)] = prior[new] + fit_predict(x[seen], r[seen], x[new], alpha)
                per.setdefault(key, []).append(tau(score, d.a_lengths[second, m]))
        results[model_name] = per
    keys = list(next(iter(results.values())))
    print(f"prior: blend w={args.w} ({row['a']:.4f}*enc + {row['b']:.4f}*lex + {row['c']:.4f}); seeds {args.seeds}; "
          "second-half tau_b, mean over seeds (gain over static, min..max over seeds)")
    print("| learner | " + " | ".join(results) + " | mean gain |")
    print("|---|" + "---|" * (len(results) + 1))
    for key in keys:
        cells, gains = [], []
        for model_name, per in results.items():
            v, s = np.array(per[key]), np.array(per["static"])
            g = v - s
            gains.append(g.mean())
            cells.append(f"{v.mean():.3f}" if key == "static" else f"{v.mean():.3f} ({g.mean():+.3f}, {g.min():+.3f}..{g.max():+.3f})")
        print(f"| {key} | " + " | ".join(cells) + f" | {np.mean(gains):+.3f} |", flush=True)
    args.scores.with_name("learner_study.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
