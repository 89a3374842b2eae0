"""Which label, loss and features carry what many models agree a prompt needs: a k-fold study.

On a file of instructions each answered by many models (``alpaca_eval_multi.jsonl``: 406 instructions x
200 models, non-commercial, evaluation only), a predictor is fitted on the instructions of k-1 folds
and scored on the instructions of the last one (``GroupKFold``-style: an instruction is in the fit or
in the check, never in both). Its figure is Kendall tau_b between its score on the check fold and
each model's lengths there, averaged over the models, then over the folds.

Labels (ln tokens, fitted on the fit fold's instructions only):

- ``one``: one model's answer (the label a single reference answer gives, as ShareGPT's ChatGPT
  answers do), averaged over several models drawn with a fixed seed;
- ``mean_of_3``: the mean ln length of 3 models drawn per label (what a few near-duplicate prompts give);
- ``mean``, ``median``, ``trimmed``: the mean, median and 20%-trimmed mean of the ln lengths of all models.

Methods: XGBoost with squared error, pseudo-Huber error or a pairwise ranking objective
(``rank:pairwise``, one query: every pair of fit instructions), and a ridge regression; on the
product's own feature rows (``rich_v3``, the serving extractor), on the shipped encoder's pooled
embedding, or on both.

The same instructions as the dev file: a method chosen here is brought to ShareGPT training; no
model trained here is shipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.tools.training import metrics

__all__ = [
    "LABELS",
    "METHODS",
    "MultiModelSet",
    "StudyRow",
    "fit_predict",
    "fold_of",
    "label_values",
    "load_multi",
    "mean_tau_over_models",
    "run_study",
    "scored_the_same_way",
]

LABELS = ("one", "mean_of_3", "mean", "median", "trimmed")
METHODS = ("squared", "pseudo_huber", "pairwise", "ridge")
TRIM_SHARE = 0.2  # the trimmed mean drops this share of the models at each end
ONE_MODEL_DRAWS = 4  # single-model labels are averaged over this many models (seeded)


@dataclass(frozen=True, slots=True)
class MultiModelSet:
    prompts: list[str]
    models: list[str]
    lengths: np.ndarray  # [instructions, models] answer tokens

    @property
    def log_lengths(self) -> np.ndarray:
        return np.log(np.maximum(self.lengths.astype(np.float64), 1.0))


def load_multi(path: Path) -> MultiModelSet:
    """The multi-model file: every line's prompt and its ``output_tokens`` per model (the models of
    the first line; a line missing one raises ValueError)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no rows")
    models = sorted(rows[0]["output_tokens"])
    lengths = np.zeros((len(rows), len(models)), dtype=np.int64)
    for i, row in enumerate(rows):
        missing = set(models) - set(row["output_tokens"])
        if missing:
            raise ValueError(f"{path}: line {i + 1} has no length for {sorted(missing)[:3]}")
        lengths[i] = [int(row["output_tokens"][m]) for m in models]
    return MultiModelSet([r["prompt"] for r in rows], models, lengths)


def fold_of(n_rows: int, folds: int, seed: int) -> np.ndarray:
    """Each instruction's fold (0..folds-1), a seeded permutation cut into near-equal parts."""
    fold = np.empty(n_rows, dtype=np.int64)
    fold[np.random.default_rng(seed).permutation(n_rows)] = np.arange(n_rows) % folds
    return fold


def label_values(log_lengths: np.ndarray, label: str, rng: np.random.Generator) -> list[tuple[np.ndarray, int | None]]:
    """The label column(s) of ``label`` for the fit rows ``log_lengths`` [rows, models], each with the
    model it comes from (None for labels of several models)."""
    from scipy.stats import trim_mean

    n_models = log_lengths.shape[1]
    if label == "one":
        picks = rng.choice(n_models, size=min(ONE_MODEL_DRAWS, n_models), replace=False)
        return [(log_lengths[:, j], int(j)) for j in picks]
    if label == "mean_of_3":
        draws: list[tuple[np.ndarray, int | None]] = []
        for _ in range(ONE_MODEL_DRAWS):
            cols = np.stack([rng.choice(n_models, size=3, replace=False) for _ in range(len(log_lengths))])
            draws.append((np.take_along_axis(log_lengths, cols, axis=1).mean(axis=1), None))
        return draws
    if label == "mean":
        return [(log_lengths.mean(axis=1), None)]
    if label == "median":
        return [(np.median(log_lengths, axis=1), None)]
    if label == "trimmed":
        return [(np.asarray(trim_mean(log_lengths, TRIM_SHARE, axis=1)), None)]
    raise ValueError(f"unknown label {label!r} (one of {LABELS})")


def mean_tau_over_models(score: np.ndarray, lengths: np.ndarray, skip: int | None = None) -> float:
    """Mean Kendall tau_b of ``score`` against each column of ``lengths`` (but column ``skip``)."""
    taus = [metrics.kendall_tau(score, lengths[:, j]) for j in range(lengths.shape[1]) if j != skip]
    return float(np.mean(taus))


def fit_predict(method: str, x_fit: np.ndarray, y_fit: np.ndarray, x_check: np.ndarray, seed: int) -> np.ndarray:
    if method == "ridge":
        from sklearn.linear_model import RidgeCV
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        model = make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-1, 4, 11)))
        return np.asarray(model.fit(x_fit, y_fit).predict(x_check), dtype=np.float64)
    import xgboost

    params: dict[str, Any] = {
        "n_estimators": 100,
        "max_depth": 2,
        "learning_rate": 0.1,
        "subsample": 0.8,
        "colsample_bytree": 0.5,
        "tree_method": "hist",
        "random_state": seed,
        "n_jobs": 1,  # a few hundred rows: threads would only wait on each other
    }
    if method == "pairwise":
        ranker = xgboost.XGBRanker(objective="rank:pairwise", lambdarank_pair_method="mean", **params)
        ranker.fit(x_fit, y_fit, qid=np.zeros(len(y_fit), dtype=np.int64))
        return np.asarray(ranker.predict(x_check), dtype=np.float64)
    objective = {"squared": "reg:squarederror", "pseudo_huber": "reg:pseudohubererror"}[method]
    # pseudo-Huber's bounded gradient moves a far start slowly: start at the labels' median
    extra = {"huber_slope": 1.0, "base_score": float(np.median(y_fit))} if method == "pseudo_huber" else {}
    reg = xgboost.XGBRegressor(objective=objective, **extra, **params)
    return np.asarray(reg.fit(x_fit, y_fit).predict(x_check), dtype=np.float64)


@dataclass(frozen=True, slots=True)
class StudyRow:
    features: str
    method: str
    label: str
    mean_tau: float  # over folds of the mean over models
    fold_sd: float  # sd of the folds' figures


def run_study(
    data: MultiModelSet,
    feature_sets: dict[str, np.ndarray],
    *,
    labels: Sequence[str] = LABELS,
    methods: Sequence[str] = METHODS,
    folds: int = 5,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[StudyRow]:
    """Every (features, method, label) by ``folds``-fold over instructions. A single-model label is
    scored against the other models only."""
    fold = fold_of(len(data.prompts), folds, seed)
    log_lengths = data.log_lengths
    rows: list[StudyRow] = []
    for feature_name, x in feature_sets.items():
        x = np.ascontiguousarray(x, dtype=np.float32)
        for method in methods:
            for label in labels:
                per_fold = []
                for f in range(folds):
                    fit, check = fold != f, fold == f
                    rng = np.random.default_rng([seed, f])
                    taus = [
                        mean_tau_over_models(
                            fit_predict(method, x[fit], y, x[check], seed), data.lengths[check], skip=source
                        )
                        for y, source in label_values(log_lengths[fit], label, rng)
                    ]
                    per_fold.append(float(np.mean(taus)))
                rows.append(StudyRow(feature_name, method, label, float(np.mean(per_fold)), float(np.std(per_fold))))
                if progress is not None:
                    progress(f"{feature_name} {method} {label}: {rows[-1].mean_tau:.4f}")
    return rows


def scored_the_same_way(
    data: MultiModelSet, scores: dict[str, np.ndarray], *, folds: int = 5, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """Fixed scorers (trained elsewhere) on the same check folds: (mean over folds, sd)."""
    fold = fold_of(len(data.prompts), folds, seed)
    out = {}
    for name, score in scores.items():
        per_fold = [mean_tau_over_models(score[fold == f], data.lengths[fold == f]) for f in range(folds)]
        out[name] = (float(np.mean(per_fold)), float(np.std(per_fold)))
    return out


def consensus_ceiling(data: MultiModelSet, *, others: int, draws: int = 20, seed: int = 0) -> float:
    """Mean tau_b of the mean ln length of ``others`` other models against each model (all rows):
    how well a consensus of that many models ranks a model it does not include."""
    rng = np.random.default_rng(seed)
    log_lengths = data.log_lengths
    n_models = log_lengths.shape[1]
    taus = []
    for _ in range(draws):
        target = int(rng.integers(n_models))
        pool = np.delete(np.arange(n_models), target)
        chosen = rng.choice(pool, size=others, replace=False)
        taus.append(metrics.kendall_tau(log_lengths[:, chosen].mean(axis=1), data.lengths[:, target]))
    return float(np.mean(taus))
