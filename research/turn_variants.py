"""Issue 8, brief TURN, idea 2: four principled blend variants, none fitted on AlpacaEval, every one reported.

Baseline: the turn-aware blend (turn_study.py), prior + w x (enc - prior), w = W_FIRST (0.6, the shipped single-turn
weight) without history, w = --w-later with it. Every fitted quantity below is fitted on TRAINING rows only: the
unseen later turns (the shipped encoder never saw them; out-of-fold lexical priors) and, for the quantile maps, the
training first turns too (distributions only: a monotone map per score, no labels).

 V1 quantile blend: each score through its training-distribution ECDF to a normal score (probit), blended there
    with the same weights; ranks, not ln tokens, are averaged, so a score's tails weigh less.
 V2 head + tail word pieces: an instruction longer than the encoder's 128 word pieces is read as its first 64 and
    its last 62 pieces (no fit; the encoder itself is unchanged). Shorter instructions are unchanged.
 V3 weight by instruction length: w + s x (ln(1 + instruction chars) - median), s fitted (least squares, jointly
    with w_later) on the unseen later turns, the same s added to W_FIRST for requests without history.
 V4 linear combiner fitted on the unseen later turns: ln tokens ~ 1, prior, enc, ln(1 + instruction chars),
    ln(1 + history chars); applied to every row (a request without history is outside the rows it was fitted on).

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/turn_variants.py --scores /tmp/turn/scores.npz \
        --oof /tmp/turn/oof.npz --alpaca /tmp/turn/study.alpaca.npz --w-later 0.X --json /tmp/turn/variants.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.special import ndtri
from scipy.stats import kendalltau

from clairvoyant.prediction.encoder import EncoderModel
from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split, load_pairs
from clairvoyant.tools.training.evaluate import load_alpaca_eval
from clairvoyant.tools.training.scoring import ModelScorer

ROOT = Path(__file__).resolve().parents[1]
ALPACA = Path("/work/shared/data/alpaca_eval_dev.jsonl")
W_FIRST = 0.6
HEAD, TAIL = 64, 62  # + [CLS] and [SEP] = 128


def tau(score: np.ndarray, tokens: np.ndarray) -> float:
    return float(kendalltau(score, tokens, variant="b").statistic)


def head_tail_scores(encoder: EncoderModel, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The encoder's ln tokens on head + tail word pieces, and which texts were long enough to change."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(encoder.card.tokenizer_path))
    tok.no_truncation()
    tok.no_padding()
    out = np.empty(len(texts))
    long = np.zeros(len(texts), dtype=bool)
    for i, text in enumerate(texts):
        ids = tok.encode(text[:4000].encode("utf-8", "replace").decode("utf-8")).ids  # [CLS] ... [SEP]
        if len(ids) <= encoder.card.max_word_pieces:
            out[i] = encoder.log_tokens(text)
            continue
        long[i] = True
        kept = ids[:1] + ids[1 : 1 + HEAD] + ids[-1 - TAIL : -1] + ids[-1:]
        feed = {"input_ids": np.asarray([kept], np.int64), "attention_mask": np.ones((1, len(kept)), np.int64)}
        out[i] = float(np.asarray(encoder._session.run([encoder.card.output], feed)[0]).reshape(-1)[0])
    return out, long


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scores", type=Path, required=True)
    parser.add_argument("--oof", type=Path, required=True)
    parser.add_argument("--alpaca", type=Path, required=True)
    parser.add_argument("--w-later", type=float, required=True)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    s, o, a = np.load(args.scores), np.load(args.oof), np.load(args.alpaca)
    pairs = load_pairs()
    split = build_natural_split(pairs, NaturalConfig())
    scorer = ModelScorer(ROOT / "model" / "predictor.onnx")
    encoder = EncoderModel(ROOT / "model" / "encoder.card.json")
    col = scorer.feature_set.names.index("history_chars")
    alpaca = load_alpaca_eval(ALPACA)
    lengths = a["lengths"]

    # rows: fit = unseen later turns (OOF prior); held = held-out split; training first turns for the quantile maps
    kind = s["kind"]
    oof_of = dict(zip(o["rows"].tolist(), range(len(o["rows"]))))
    fit = kind == 0
    held = kind == 3
    f_rows = s["rows"][fit]
    f_prior = np.array([o["oof_prior"][oof_of[i]] for i in f_rows])
    f_enc, f_y = s["enc"][fit], np.log(np.maximum(s["tokens"][fit], 1))
    key_index = {p.key: i for i, p in enumerate(pairs)}
    first_train = np.array([key_index[p.key] for p in split.train if p.turn == 0])
    cache = args.json.with_name("first_train_enc.npz")
    if cache.exists() and np.array_equal(np.load(cache)["rows"], first_train):
        ft_enc = np.load(cache)["enc"]
    else:
        ft_enc = encoder.log_tokens_many([pairs[i].prompt.instruction for i in first_train])
        np.savez(cache, rows=first_train, enc=ft_enc)
    ft_prior = np.array([o["oof_prior"][oof_of[i]] for i in first_train])

    h_rows = s["rows"][held]
    h_prior, h_enc, h_tok = s["prior"][held], s["enc"][held], s["tokens"][held]
    h_prompts = [pairs[i].prompt for i in h_rows]
    h_hist = scorer.features(h_prompts)[:, col]
    h_later = h_hist > 0
    h_first = s["turn"][held] == 0
    h_len = np.log1p([len(p.instruction) for p in h_prompts])
    a_prior, a_enc = a["prior"], a["enc"]
    a_len = np.log1p([len(p.instruction) for p in alpaca.prompts])
    f_len = np.log1p([len(pairs[i].prompt.instruction) for i in f_rows])
    f_hist = scorer.features([pairs[i].prompt for i in f_rows])[:, col]
    w_later = args.w_later
    results = []

    def report(name: str, held_score: np.ndarray, alpaca_score: np.ndarray, note: str = "") -> None:
        per = [tau(alpaca_score, lengths[:, j]) for j in range(lengths.shape[1])]
        row = {"variant": name, "held_all": tau(held_score, h_tok), "held_first": tau(held_score[h_first], h_tok[h_first]),
               "held_later": tau(held_score[~h_first], h_tok[~h_first]), "alpaca": per,
               "alpaca_mean": float(np.mean(per)), "note": note}
        results.append(row)
        print(f"| {name} | {row['held_all']:.4f} | {row['held_first']:.4f} | {row['held_later']:.4f} | "
              + " | ".join(f"{t:.3f}" for t in per) + f" | **{row['alpaca_mean']:.4f}** | {note} |", flush=True)

    print("| variant | held-out all | first turns | later turns | " + " | ".join(alpaca.models) + " | AlpacaEval mean | note |")
    wh = np.where(h_later, w_later, W_FIRST)
    report("baseline: turn-aware blend", h_prior + wh * (h_enc - h_prior), a_prior + W_FIRST * (a_enc - a_prior),
           f"w_first {W_FIRST}, w_later {w_later}")

    # V1 quantile blend (ECDFs of the training rows: first turns + unseen later turns)
    e_ref = np.sort(np.concatenate([ft_enc, f_enc]))
    p_ref = np.sort(np.concatenate([ft_prior, f_prior]))

    def probit(ref: np.ndarray, x: np.ndarray) -> np.ndarray:
        q = (np.searchsorted(ref, x, side="left") + np.searchsorted(ref, x, side="right")) / 2
        return ndtri((q + 0.5) / (len(ref) + 1))

    report("V1 quantile (probit) blend", wh * probit(e_ref, h_enc) + (1 - wh) * probit(p_ref, h_prior),
           W_FIRST * probit(e_ref, a_enc) + (1 - W_FIRST) * probit(p_ref, a_prior),
           f"ECDFs of {len(e_ref)} training rows")

    # V2 head + tail word pieces
    a_ht, a_long = head_tail_scores(encoder, [p.instruction for p in alpaca.prompts])
    h_ht, h_long = head_tail_scores(encoder, [p.instruction for p in h_prompts])
    report("V2 head+tail word pieces", h_prior + wh * (h_ht - h_prior), a_prior + W_FIRST * (a_ht - a_prior),
           f"{int(a_long.sum())} AlpacaEval and {int(h_long.sum())} held-out instructions read differently")

    # V3 weight by instruction length: y - p = (w + s (L - L0)) d, least squares in (w, s) on the unseen later turns
    l0 = float(np.median(np.concatenate([f_len, np.log1p([len(pairs[i].prompt.instruction) for i in first_train])])))
    d = f_enc - f_prior
    design = np.stack([d, d * (f_len - l0)], axis=1)
    (w_fit, slope), *_ = np.linalg.lstsq(design, f_y - f_prior, rcond=None)
    wl_h = np.clip(np.where(h_later, w_later, W_FIRST) + slope * (h_len - l0), 0, 1)
    wl_a = np.clip(W_FIRST + slope * (a_len - l0), 0, 1)
    report("V3 weight by instruction length", h_prior + wl_h * (h_enc - h_prior), a_prior + wl_a * (a_enc - a_prior),
           f"slope {slope:+.3f} per ln char (jointly fitted w_later {w_fit:.3f}), median ln chars {l0:.2f}")

    # V4 linear combiner on the unseen later turns
    def feats(prior: np.ndarray, enc: np.ndarray, length: np.ndarray, hist: np.ndarray) -> np.ndarray:
        return np.stack([np.ones_like(prior), prior, enc, length, np.log1p(hist)], axis=1)

    coef, *_ = np.linalg.lstsq(feats(f_prior, f_enc, f_len, f_hist), f_y, rcond=None)
    report("V4 linear combiner", feats(h_prior, h_enc, h_len, h_hist) @ coef,
           feats(a_prior, a_enc, a_len, np.zeros(len(a_len))) @ coef,
           "ln tokens = " + " ".join(f"{c:+.3f}*{n}" for c, n in zip(coef, ("1", "prior", "enc", "lnchars", "lnhist"))))
    args.json.write_text(json.dumps(results, indent=1))
    print("saved", args.json)


if __name__ == "__main__":
    main()
