"""Step-1: a serving-cheap word lexicon. Binary presence of the window's words and word bigrams (the serving
tokenizer's words, rich_v2's 600-character window), scaled by 1/sqrt(number of known terms), -> ridge on log
tokens. Serving computes it as a dict lookup per distinct term. Compared with the TF-IDF version of
study_bow.py; stacked (out-of-fold) with rich_v2 into the XGBoost regressor.

    PYTHONPATH=src nice -n 10 python research/study_lexicon.py
"""

from __future__ import annotations

import json

import numpy as np
import scipy.sparse as sp
import xgboost as xgb
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import Ridge
from sklearn.model_selection import GroupKFold

from clairvoyant.prediction.features import words_of
from common import CACHE, heldout_rows, load, report


def terms(text: str) -> list[str]:
    w = words_of(text[:500] + " " + text[-100:] if len(text) > 600 else text)
    return w + [a + " " + b for a, b in zip(w, w[1:])]


def design(vec: CountVectorizer, texts: list[str], norm: str) -> sp.csr_matrix:
    x = vec.transform(texts).astype(np.float32)
    if norm == "sqrt":
        n = np.asarray(x.sum(1)).ravel()
        x = sp.diags(1 / np.sqrt(np.maximum(n, 1))) @ x
    return sp.csr_matrix(x)


def fit(texts: list[str], y: np.ndarray, min_df: int, alpha: float, norm: str) -> tuple[CountVectorizer, Ridge]:
    vec = CountVectorizer(analyzer=terms, binary=True, min_df=min_df).fit(texts)
    return vec, Ridge(alpha=alpha).fit(design(vec, texts, norm), y)


def main() -> None:
    d = load()
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    atexts = [json.loads(line)["instruction"] for line in (CACHE / "alpaca_texts.jsonl").read_text().splitlines()]
    tr = np.flatnonzero(d.train & d.english)
    h, hf = heldout_rows(d), heldout_rows(d, first_only=True)
    y = d.log_tokens[tr]
    trt = [texts[i] for i in tr]
    for min_df, alpha, norm in ((5, 3.0, "sqrt"), (5, 10.0, "sqrt"), (5, 1.0, "sqrt"), (10, 3.0, "sqrt"), (20, 3.0, "sqrt")):
        vec, r = fit(trt, y, min_df, alpha, norm)
        sa = r.predict(design(vec, atexts, norm))
        sh = r.predict(design(vec, [texts[i] for i in h], norm))
        shf = r.predict(design(vec, [texts[i] for i in hf], norm))
        report(f"lexicon_df{min_df}_a{alpha}_{norm}", sa, sh, shf, d, f"terms {len(vec.vocabulary_)}")
        if (min_df, alpha) == (5, 3.0):
            oof = np.zeros(len(tr), dtype=np.float32)
            for a, b in GroupKFold(5).split(tr, groups=d.groups[tr]):
                v, rr = fit([trt[i] for i in a], y[a], min_df, alpha, norm)
                oof[b] = rr.predict(design(v, [trt[i] for i in b], norm))
            np.save(CACHE / "lexicon_oof.npy", oof)
            np.savez(CACHE / "lexicon_scores.npz", alpaca=sa, heldout=sh, heldout_first=shf)
            for depth, rounds, lr in ((6, 300, 0.05), (4, 200, 0.05), (3, 150, 0.1)):
                reg = xgb.XGBRegressor(n_estimators=rounds, max_depth=depth, learning_rate=lr, tree_method="hist",
                                       n_jobs=2, random_state=42).fit(np.column_stack([d.x_rich[tr], oof]), y)
                report(f"rich_v2+lexicon_d{depth}_{rounds}", reg.predict(np.column_stack([d.ax_rich, sa])),
                       reg.predict(np.column_stack([d.x_rich[h], sh])),
                       reg.predict(np.column_stack([d.x_rich[hf], shf])), d, f"xgb {rounds}x{depth} lr {lr}")


if __name__ == "__main__":
    main()
