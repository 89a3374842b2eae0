"""Step-1 extra candidate: bag of words (the serving tokenizer's words) -> ridge on log tokens, alone and as a
stacked feature for the rich_v2 regressor. Tells whether a learned word lexicon (cheap at serving time: a dict
lookup per word) carries transfer that rich_v2's curated word groups miss.

    PYTHONPATH=src nice -n 10 python research/study_bow.py
"""

from __future__ import annotations

import json
import time

import numpy as np
import xgboost as xgb
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import Ridge
from sklearn.model_selection import GroupKFold

from clairvoyant.prediction.features import words_of
from common import CACHE, heldout_rows, load, report


def window(text: str) -> str:
    return text[:500] + " " + text[-100:] if len(text) > 600 else text


GRID = ((2, 5, 10.0), (2, 3, 10.0), (2, 5, 30.0))
STACK = (2, 10.0)


def main() -> None:
    d = load()
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    atexts = [json.loads(line)["instruction"] for line in (CACHE / "alpaca_texts.jsonl").read_text().splitlines()]
    for turns in ("all",):
        m = d.train & d.english
        if turns == "first":
            m &= d.first
        tr = np.flatnonzero(m)
        h, hf = heldout_rows(d), heldout_rows(d, first_only=True)
        for ngram, min_df, alpha in GRID:
            t0 = time.perf_counter()
            vec = TfidfVectorizer(analyzer=lambda t: (lambda w: w + [a + " " + b for a, b in zip(w, w[1:])] if ngram == 2 else w)(words_of(window(t))),
                                  min_df=min_df, sublinear_tf=True)
            xt = vec.fit_transform([texts[i] for i in tr])
            y = d.log_tokens[tr]
            ridge = Ridge(alpha=alpha).fit(xt, y)
            sa = ridge.predict(vec.transform(atexts))
            sh = ridge.predict(vec.transform([texts[i] for i in h]))
            shf = ridge.predict(vec.transform([texts[i] for i in hf]))
            report(f"bow{ngram}_ridge_a{alpha}_{turns}", sa, sh, shf, d,
                   f"vocab {len(vec.vocabulary_)} {time.perf_counter() - t0:.0f}s")
            if (ngram, alpha) == STACK:
                # stacked: out-of-fold ridge score as an extra column for the rich_v2 regressor
                oof = np.zeros(len(tr), dtype=np.float32)
                for a, b in GroupKFold(5).split(tr, groups=d.groups[tr]):
                    v = TfidfVectorizer(analyzer=vec.analyzer, min_df=min_df, sublinear_tf=True)
                    r = Ridge(alpha=alpha).fit(v.fit_transform([texts[tr[i]] for i in a]), y[a])
                    oof[b] = r.predict(v.transform([texts[tr[i]] for i in b]))
                x = np.column_stack([d.x_rich[tr], oof])
                reg = xgb.XGBRegressor(n_estimators=300, max_depth=6, learning_rate=0.05, tree_method="hist", n_jobs=2,
                                       random_state=42).fit(x, y)
                pa = reg.predict(np.column_stack([d.ax_rich, sa]))
                ph = reg.predict(np.column_stack([d.x_rich[h], sh]))
                phf = reg.predict(np.column_stack([d.x_rich[hf], shf]))
                report(f"rich_v2+bow_ridge_stack_d6_{turns}", pa, ph, phf, d, "xgb 300x6 on rich_v2 + OOF ridge score")


if __name__ == "__main__":
    main()
