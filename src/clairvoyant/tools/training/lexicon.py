"""The rich_v3 word lexicon: ridge regression of log answer tokens on binary term presence.

Terms are the distinct words and word bigrams of the rich_v2 scan window (``features.lexicon_terms``
over ``features.scan_words``), exactly what the serving extractor looks up. A row's design vector is
``1/sqrt(k)`` on its ``k`` known terms (the serving formula), so the fitted ridge weights are the
lexicon's weights as they are. Terms seen in fewer than ``min_rows`` training rows are dropped.

Stacking: the XGBoost model that reads ``lexicon_log_tokens`` must be trained on OUT-OF-FOLD lexicon
scores (``out_of_fold_scores``: a lexicon fit without the row's conversation group), or it learns to
trust a column that is far more accurate on its training rows than on new prompts.

    python -m clairvoyant.tools.training.lexicon --out src/clairvoyant/prediction/lexicons/rich_v3.json  # new name!
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.prediction.features import Lexicon, lexicon_terms, scan_words

__all__ = ["LexiconConfig", "fit_lexicon", "out_of_fold_scores", "score_terms", "terms_of_texts"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LexiconConfig:
    min_rows: int = 20  # a term must occur in this many training rows
    ridge_alpha: float = 3.0
    name: str = "rich_v3"

    def as_dict(self) -> dict[str, Any]:
        return {
            "min_rows": self.min_rows,
            "ridge_alpha": self.ridge_alpha,
            "name": self.name,
            "terms": "distinct words and word bigrams of the rich_v2 scan window",
            "row_vector": "1/sqrt(k) on the k known terms",
            "target": "ln(answer cl100k tokens, at least 1)",
        }


def terms_of_texts(texts: Sequence[str]) -> list[set[bytes]]:
    return [lexicon_terms(scan_words(t)) for t in texts]


def _design(term_sets: Sequence[set[bytes]], vocabulary: dict[bytes, int]) -> Any:
    import scipy.sparse as sp

    indptr, indices = [0], []
    for terms in term_sets:
        indices.extend(vocabulary[t] for t in terms if t in vocabulary)
        indptr.append(len(indices))
    counts = np.diff(indptr)
    data = np.repeat(1.0 / np.sqrt(np.maximum(counts, 1)), counts)
    return sp.csr_matrix(
        (data, np.asarray(indices, dtype=np.int64), np.asarray(indptr)), shape=(len(term_sets), len(vocabulary))
    )


def fit_lexicon(term_sets: Sequence[set[bytes]], log_tokens: np.ndarray, config: LexiconConfig) -> Lexicon:
    """The ridge lexicon of ``term_sets`` (one set per row) -> ``log_tokens``. Deterministic."""
    from collections import Counter

    from sklearn.linear_model import Ridge

    counts: Counter[bytes] = Counter()
    for terms in term_sets:
        counts.update(terms)
    vocabulary = {t: i for i, t in enumerate(sorted(t for t, c in counts.items() if c >= config.min_rows))}
    ridge = Ridge(alpha=config.ridge_alpha).fit(_design(term_sets, vocabulary), np.asarray(log_tokens, np.float64))
    weights = {t: float(ridge.coef_[i]) for t, i in vocabulary.items() if ridge.coef_[i] != 0.0}
    logger.info("lexicon: %d terms from %d rows", len(weights), len(term_sets))
    return Lexicon(config.name, float(ridge.intercept_), weights)


def score_terms(lexicon: Lexicon, term_sets: Sequence[set[bytes]]) -> np.ndarray:
    """The lexicon column for rows given as term sets (same formula as ``Lexicon.score_words``)."""
    import math

    weights = lexicon.weights
    out = np.full(len(term_sets), lexicon.intercept_log_tokens, dtype=np.float64)
    for row, terms in enumerate(term_sets):
        known = terms & weights.keys()
        if known:
            out[row] += math.fsum(weights[t] for t in known) / math.sqrt(len(known))
    return out


def out_of_fold_scores(
    term_sets: Sequence[set[bytes]],
    log_tokens: np.ndarray,
    groups: Sequence[str],
    config: LexiconConfig,
    folds: int = 5,
) -> np.ndarray:
    """Each row's lexicon score from a lexicon fit on the other folds (whole groups per fold)."""
    from sklearn.model_selection import GroupKFold

    y = np.asarray(log_tokens, np.float64)
    out = np.zeros(len(term_sets), dtype=np.float64)
    for fit_rows, score_rows in GroupKFold(folds).split(np.zeros(len(y)), groups=np.asarray(groups)):
        lexicon = fit_lexicon([term_sets[i] for i in fit_rows], y[fit_rows], config)
        out[score_rows] = score_terms(lexicon, [term_sets[i] for i in score_rows])
    return out


def main(argv: list[str] | None = None) -> int:
    """Fit the lexicon on the natural-mix training split (seed 42) and write it (see the module docstring)."""
    import hashlib

    from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split, load_pairs

    parser = argparse.ArgumentParser(prog="python -m clairvoyant.tools.training.lexicon")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="rich_v3")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    data_config = NaturalConfig()
    split = build_natural_split(load_pairs(), data_config)
    config = LexiconConfig(name=args.name)
    lexicon = fit_lexicon(
        terms_of_texts([p.prompt.instruction for p in split.train]), np.log(np.maximum(split.train_lengths, 1)), config
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        lexicon.to_json(
            {
                "config": config.as_dict(),
                "data": data_config.as_dict(),
                "train_rows": len(split.train),
                "split_fingerprint": split.fingerprint(),
            }
        )
    )
    print(f"wrote {args.out}: {len(lexicon.weights)} terms, sha256 {hashlib.sha256(args.out.read_bytes()).hexdigest()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
