"""Step-1 follow-up: lexicon variants on top of the shipped recipe (binary terms, 1/sqrt(k), ridge alpha 3,
min 20 rows): + word trigrams; + a second lexicon fit on first turns only; deeper trees on rich_v2 + lexicon.

    PYTHONPATH=src nice -n 10 python research/study_lexicon2.py
"""

from __future__ import annotations

import json

import numpy as np
import xgboost as xgb
from sklearn.model_selection import GroupKFold

from clairvoyant.prediction.features import lexicon_terms, scan_words
from clairvoyant.tools.training.lexicon import LexiconConfig, fit_lexicon, score_terms
from common import CACHE, heldout_rows, load, report


def with_trigrams(words: list[bytes]) -> set[bytes]:
    terms = lexicon_terms(words)
    terms.update(map(b" ".join, zip(words, words[1:], words[2:])))
    return terms


def oof(terms: list, y: np.ndarray, groups: np.ndarray, rows: np.ndarray, config: LexiconConfig) -> np.ndarray:
    out = np.zeros(len(rows))
    for a, b in GroupKFold(5).split(rows, groups=groups[rows]):
        lex = fit_lexicon([terms[rows[i]] for i in a], y[rows[a]], config)
        out[b] = score_terms(lex, [terms[rows[i]] for i in b])
    return out


def main() -> None:
    d = load()
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    atexts = [json.loads(line)["instruction"] for line in (CACHE / "alpaca_texts.jsonl").read_text().splitlines()]
    tr = np.flatnonzero(d.train & d.english)
    h, hf = heldout_rows(d), heldout_rows(d, first_only=True)
    y = d.log_tokens.astype(np.float64)
    config = LexiconConfig()
    for name, fn in (("trigrams", with_trigrams),):
        terms = [fn(scan_words(t)) for t in texts]
        aterms = [fn(scan_words(t)) for t in atexts]
        lex = fit_lexicon([terms[i] for i in tr], y[tr], config)
        sa = score_terms(lex, aterms)
        sh = score_terms(lex, [terms[i] for i in h])
        shf = score_terms(lex, [terms[i] for i in hf])
        report(f"lexicon_{name}_min20", sa, sh, shf, d, f"{len(lex.weights)} terms")
        col = oof(terms, y, d.groups, tr, config)
        reg = xgb.XGBRegressor(n_estimators=150, max_depth=3, learning_rate=0.1, tree_method="hist", n_jobs=2,
                               random_state=42).fit(np.column_stack([d.x_rich[tr], col]), y[tr])
        report(f"rich_v2+lexicon_{name}_150x3", reg.predict(np.column_stack([d.ax_rich, sa])),
               reg.predict(np.column_stack([d.x_rich[h], sh])), reg.predict(np.column_stack([d.x_rich[hf], shf])), d, "")
    # base terms: all-turn lexicon + first-turn lexicon as two columns
    terms = [lexicon_terms(scan_words(t)) for t in texts]
    aterms = [lexicon_terms(scan_words(t)) for t in atexts]
    first_tr = np.flatnonzero(d.train & d.english & d.first)
    lex_all = fit_lexicon([terms[i] for i in tr], y[tr], config)
    lex_first = fit_lexicon([terms[i] for i in first_tr], y[first_tr], LexiconConfig(min_rows=5))
    col_all = oof(terms, y, d.groups, tr, config)
    col_first = np.zeros(len(tr))
    # out-of-fold first-turn lexicon for every training row
    for a, b in GroupKFold(5).split(tr, groups=d.groups[tr]):
        fa = [tr[i] for i in a if d.first[tr[i]]]
        lex = fit_lexicon([terms[i] for i in fa], y[fa], LexiconConfig(min_rows=5))
        col_first[b] = score_terms(lex, [terms[tr[i]] for i in b])

    def cols(rows_terms: list) -> np.ndarray:
        return np.column_stack([score_terms(lex_all, rows_terms), score_terms(lex_first, rows_terms)])

    ca, ch, chf = cols(aterms), cols([terms[i] for i in h]), cols([terms[i] for i in hf])
    report("lexicon_first_turns_only_min5", ca[:, 1], ch[:, 1], chf[:, 1], d, f"{len(lex_first.weights)} terms")
    for depth, rounds, lr in ((3, 150, 0.1), (4, 300, 0.05)):
        reg = xgb.XGBRegressor(n_estimators=rounds, max_depth=depth, learning_rate=lr, tree_method="hist", n_jobs=2,
                               random_state=42).fit(np.column_stack([d.x_rich[tr], col_all, col_first]), y[tr])
        report(f"rich_v2+lexicon_all+first_{rounds}x{depth}", reg.predict(np.column_stack([d.ax_rich, ca])),
               reg.predict(np.column_stack([d.x_rich[h], ch])), reg.predict(np.column_stack([d.x_rich[hf], chf])), d, "")
        reg = xgb.XGBRegressor(n_estimators=rounds, max_depth=depth, learning_rate=lr, tree_method="hist", n_jobs=2,
                               random_state=42).fit(np.column_stack([d.x_rich[tr], col_all]), y[tr])
        report(f"rich_v2+lexicon_{rounds}x{depth}", reg.predict(np.column_stack([d.ax_rich, ca[:, 0]])),
               reg.predict(np.column_stack([d.x_rich[h], ch[:, 0]])), reg.predict(np.column_stack([d.x_rich[hf], chf[:, 0]])), d, "")


if __name__ == "__main__":
    main()
