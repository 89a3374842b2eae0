"""Issue 8, brief TURN, idea 1: a turn-aware blend, fitted on training rows the shipped encoder never saw.

refined prior = lexical prior + w x (encoder ln tokens - lexical prior), with w = w_first for a request WITHOUT
conversation history and w = w_later for one WITH it. "History" is the lexical feature row's history_chars > 0
(context chars - instruction chars - system chars: earlier messages the encoder cannot read), the column the
predictor itself computes; the same rule serves (OnnxPredictor.refined) and evaluates (`clairvoyant evaluate`).

Inputs: turn_scores.py (/tmp/turn/scores.npz: shipped encoder + shipped lexical prior on the unseen training later
turns, 2 x 2,000 seen later turns, the 10,642 held-out rows) and turn_oof_lexical.py (/tmp/turn/oof.npz: out-of-fold
lexical priors for every training row). Sections:
 1. replay check: the encoder fits its claimed-unseen rows like held-out rows, its seen rows better;
 2. in-sample vs out-of-fold lexical prior on the fitting rows;
 3. w_later fitted on the unseen later turns only (tau_b grid and the closed-form ln-token MSE optimum), with the
    in-sample and with the out-of-fold prior;
 4. the (w_first, w_later) grid on the held-out split (all turns, first turns, later turns) and AlpacaEval
    (mean, per model; all AlpacaEval prompts are single-turn, so only w_first moves it); bootstrap over prompts.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/turn_study.py --scores /tmp/turn/scores.npz \
        --oof /tmp/turn/oof.npz --json /tmp/turn/study.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau

from clairvoyant.prediction.encoder import EncoderModel
from clairvoyant.tools.training.dataset import load_pairs
from clairvoyant.tools.training.evaluate import load_alpaca_eval
from clairvoyant.tools.training.scoring import ModelScorer

ROOT = Path(__file__).resolve().parents[1]
ALPACA = Path("/work/shared/data/alpaca_eval_dev.jsonl")
GRID = tuple(round(0.05 * i, 2) for i in range(21))


def tau(score: np.ndarray, tokens: np.ndarray) -> float:
    return float(kendalltau(score, tokens, variant="b").statistic)


def blend(prior: np.ndarray, enc: np.ndarray, w: np.ndarray | float) -> np.ndarray:
    return prior + w * (enc - prior)


def mse_weight(prior: np.ndarray, enc: np.ndarray, y: np.ndarray) -> float:
    """argmin_w mean((prior + w (enc - prior) - y)^2), closed form."""
    d = enc - prior
    return float(np.dot(d, y - prior) / np.dot(d, d))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scores", type=Path, required=True)
    parser.add_argument("--oof", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--bootstrap", type=int, default=2000)
    args = parser.parse_args()
    s = np.load(args.scores)
    o = np.load(args.oof)
    out: dict = {}
    kind, prior, enc, tokens = s["kind"], s["prior"], s["enc"], s["tokens"].astype(np.float64)
    y = np.log(np.maximum(tokens, 1))
    # the serving rule's column: history_chars of the lexical feature row
    pairs = load_pairs()
    scorer = ModelScorer(ROOT / "model" / "predictor.onnx")
    col = scorer.feature_set.names.index("history_chars")
    history = scorer.features([pairs[i].prompt for i in s["rows"]])[:, col].astype(np.float64)
    later = history > 0
    held = kind == 3
    first_turn = s["turn"] == 0

    # 1. replay check
    print("## 1. replay check: the shipped encoder on later turns (ln-token MSE, tau_b)")
    check = {}
    for name, mask in (("unseen (pass-2 batches 400..)", kind == 0), ("seen, pass-2 batches 0..399", kind == 1),
                       ("seen, pass-1 draw", kind == 2), ("held-out later turns", held & ~first_turn)):
        m = {"rows": int(mask.sum()), "enc_mse": float(np.mean((enc[mask] - y[mask]) ** 2)),
             "enc_tau": tau(enc[mask], tokens[mask])}
        check[name] = m
        print(f"| {name} | {m['rows']} | {m['enc_mse']:.3f} | {m['enc_tau']:.3f} |")
    out["replay_check"] = check
    assert later[kind == 0].all(), "every unseen later turn has history"
    print(f"rule vs turn index on held-out: turn 0 with history {int((held & first_turn & later).sum())}, "
          f"turn > 0 without history {int((held & ~first_turn & ~later).sum())}")

    # 2. in-sample vs out-of-fold lexical prior on the fitting rows
    oof_of = dict(zip(o["rows"].tolist(), range(len(o["rows"]))))
    fit = kind == 0
    oof_prior = np.array([o["oof_prior"][oof_of[i]] for i in s["rows"][fit]])
    yf, tf, ef, pf = y[fit], tokens[fit], enc[fit], prior[fit]
    print("## 2. lexical prior on the fitting rows (ln-token MSE, tau_b); held-out later turns for reference")
    lex = {"in_sample": {"mse": float(np.mean((pf - yf) ** 2)), "tau": tau(pf, tf)},
           "out_of_fold": {"mse": float(np.mean((oof_prior - yf) ** 2)), "tau": tau(oof_prior, tf)},
           "held_out_later": {"mse": float(np.mean((prior[held & later] - y[held & later]) ** 2)),
                              "tau": tau(prior[held & later], tokens[held & later])}}
    for k, v in lex.items():
        print(f"| {k} | {v['mse']:.3f} | {v['tau']:.3f} |")
    out["lexical_prior"] = lex

    # 3. fit w_later on the unseen later turns
    print("## 3. w_later fitted on the unseen later turns")
    fits = {}
    for name, p in (("in_sample", pf), ("out_of_fold", oof_prior)):
        taus = {w: tau(blend(p, ef, w), tf) for w in GRID}
        mses = {w: float(np.mean((blend(p, ef, w) - yf) ** 2)) for w in GRID}
        w_tau = max(taus, key=lambda w: taus[w])
        w_mse = mse_weight(p, ef, yf)
        fits[name] = {"tau_by_w": taus, "mse_by_w": mses, "w_best_tau": w_tau, "w_min_mse": w_mse}
        print(f"{name}: tau-best w {w_tau} ({taus[w_tau]:.4f}); MSE-optimal w {w_mse:.3f}; "
              + " ".join(f"{w}:{taus[w]:.3f}/{mses[w]:.3f}" for w in GRID[::2]))
        # bootstrap over the fitting rows' conversation-free resampling (rows): spread of the two estimates
        rng = np.random.default_rng(0)
        ws_mse, ws_tau = [], []
        for _ in range(200):
            b = rng.integers(0, len(yf), len(yf))
            ws_mse.append(mse_weight(p[b], ef[b], yf[b]))
            sub = GRID[4:17]
            ws_tau.append(max(sub, key=lambda w: tau(blend(p[b][:4000], ef[b][:4000], w), tf[b][:4000])))
        fits[name]["w_min_mse_bootstrap_p5_p95"] = [float(np.percentile(ws_mse, 5)), float(np.percentile(ws_mse, 95))]
        fits[name]["w_best_tau_bootstrap4000_p5_p95"] = [float(np.percentile(ws_tau, 5)),
                                                          float(np.percentile(ws_tau, 95))]
        print(f"  bootstrap (200): MSE-optimal w p5..p95 {fits[name]['w_min_mse_bootstrap_p5_p95']}; "
              f"tau-best w on 4,000-row resamples p5..p95 {fits[name]['w_best_tau_bootstrap4000_p5_p95']}")
    out["w_later_fit"] = fits

    # 4. held-out and AlpacaEval grid
    alpaca = load_alpaca_eval(ALPACA)
    a_raw = scorer.score_prompts(alpaca.prompts)
    a_prior = scorer.predicted_log_tokens(a_raw)
    a_hist = scorer.features(alpaca.prompts)[:, col]
    assert (a_hist == 0).all(), "AlpacaEval prompts are single-turn"
    encoder = EncoderModel(ROOT / "model" / "encoder.card.json")
    a_enc = encoder.log_tokens_many([p.instruction for p in alpaca.prompts])
    np.savez(args.json.with_suffix(".alpaca.npz"), prior=a_prior, enc=a_enc, raw=a_raw, lengths=alpaca.lengths)

    def alpaca_taus(score: np.ndarray) -> list[float]:
        return [tau(score, alpaca.lengths[:, j]) for j in range(len(alpaca.models))]

    hp, he, ht, hl, hf = prior[held], enc[held], tokens[held], later[held], first_turn[held]
    print("## 4. grid: w_first x w_later -> held-out all / first turns / later turns | AlpacaEval per model, mean")
    print(f"models: {alpaca.models}")
    grid = []
    w_laters = sorted({0.0, 0.2, 0.3, 0.4, 0.45, 0.5, 0.6, round(fits['out_of_fold']['w_best_tau'], 2),
                       round(fits['out_of_fold']['w_min_mse'], 2)})
    for w_first in (0.5, 0.6, 0.7):
        a = alpaca_taus(blend(a_prior, a_enc, w_first))
        for w_later in w_laters:
            w = np.where(hl, w_later, w_first)
            sc = blend(hp, he, w)
            row = {"w_first": w_first, "w_later": w_later, "held_all": tau(sc, ht), "held_first": tau(sc[hf], ht[hf]),
                   "held_later": tau(sc[hl], ht[hl]), "held_no_history": tau(sc[~hl], ht[~hl]),
                   "alpaca": a, "alpaca_mean": float(np.mean(a))}
            grid.append(row)
            print(f"| {w_first} | {w_later} | {row['held_all']:.4f} | {row['held_first']:.4f} | {row['held_later']:.4f} | "
                  + " | ".join(f"{t:.3f}" for t in a) + f" | **{row['alpaca_mean']:.4f}** |")
    out["grid"] = grid
    # bootstrap of the AlpacaEval mean over its prompts, for the single-weight blends
    rng = np.random.default_rng(0)
    n = len(alpaca.prompts)
    boots = {}
    for w_first in (0.6, 0.7):
        sc = blend(a_prior, a_enc, w_first)
        vals = []
        for _ in range(args.bootstrap):
            b = rng.integers(0, n, n)
            vals.append(np.mean([tau(sc[b], alpaca.lengths[b, j]) for j in range(len(alpaca.models))]))
        boots[str(w_first)] = {"mean": float(np.mean(alpaca_taus(sc))), "p5": float(np.percentile(vals, 5)),
                               "p95": float(np.percentile(vals, 95)), "sd": float(np.std(vals))}
        print(f"AlpacaEval bootstrap ({args.bootstrap} resamples of the 406 prompts), w_first {w_first}: {boots[str(w_first)]}")
    out["alpaca_bootstrap"] = boots
    args.json.write_text(json.dumps(out, indent=1))
    print("saved", args.json)


if __name__ == "__main__":
    main()
