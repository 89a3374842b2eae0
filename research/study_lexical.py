"""Step-1 lexical candidates: XGBoost regressor / pairwise ranker / bucketed ranker on rich_v2 or paper19,
natural ShareGPT distribution (English, leak-free group split), scored on AlpacaEval dev (4 models) and the
held-out natural mix. Appends markdown rows to research/results.log.

    PYTHONPATH=src nice -n 10 python research/study_lexical.py [names...]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import xgboost as xgb

from common import Data, heldout_rows, load, report

BUCKET_W = -np.log(1 - 0.2)


def query_groups(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random permutation of n rows cut into query groups of ``size`` (the last may be smaller)."""
    order = np.random.default_rng(seed).permutation(n)
    sizes = [size] * (n // size) + ([n % size] if n % size else [])
    return order, np.asarray(sizes)


def fit_predict(kind: str, x: np.ndarray, y: np.ndarray, evals: list[np.ndarray], *, depth: int, rounds: int,
                lr: float, group: int = 32, seed: int = 42, min_child_weight: float = 1.0, subsample: float = 1.0,
                colsample: float = 1.0) -> list[np.ndarray]:
    common = dict(n_estimators=rounds, max_depth=depth, learning_rate=lr, tree_method="hist", n_jobs=2,
                  random_state=seed, min_child_weight=min_child_weight, subsample=subsample,
                  colsample_bytree=colsample)
    if kind == "reg":
        model = xgb.XGBRegressor(objective="reg:squarederror", **common)
        model.fit(x, y)
        return [model.predict(e) for e in evals]
    order, sizes = query_groups(len(y), group, seed)
    label = y[order]
    if kind == "bucket":
        label = np.floor(label / BUCKET_W)
    model = xgb.XGBRanker(objective="rank:pairwise", lambdarank_pair_method="mean", lambdarank_num_pair_per_sample=8,
                          **common)
    model.fit(x[order], label, group=sizes)
    return [model.predict(e) for e in evals]


def run(d: Data, name: str, kind: str, feats: str, turns: str, **kw: object) -> dict:
    x_all = d.x_rich if feats == "rich_v2" else d.x_p19
    ax = d.ax_rich if feats == "rich_v2" else d.ax_p19
    m = d.train & d.english
    if turns == "first":
        m &= d.first
    tr = np.flatnonzero(m)
    h, hf = heldout_rows(d), heldout_rows(d, first_only=True)
    t0 = time.perf_counter()
    sa, sh, shf = fit_predict(kind, x_all[tr], d.log_tokens[tr], [ax, x_all[h], x_all[hf]], **kw)  # type: ignore[arg-type]
    return report(name, sa, sh, shf, d, f"{kind} {feats} {turns} rows={len(tr)} {kw} fit {time.perf_counter() - t0:.0f}s")


CANDIDATES = {
    "reg_d3_100_all": ("reg", "rich_v2", "all", dict(depth=3, rounds=100, lr=0.1)),
    "reg_d3_100_first": ("reg", "rich_v2", "first", dict(depth=3, rounds=100, lr=0.1)),
    "reg_d4_200_all": ("reg", "rich_v2", "all", dict(depth=4, rounds=200, lr=0.05)),
    "reg_d4_200_first": ("reg", "rich_v2", "first", dict(depth=4, rounds=200, lr=0.05)),
    "reg_d6_300_all": ("reg", "rich_v2", "all", dict(depth=6, rounds=300, lr=0.05)),
    "reg_d6_300_first": ("reg", "rich_v2", "first", dict(depth=6, rounds=300, lr=0.05)),
    "reg_d2_100_first": ("reg", "rich_v2", "first", dict(depth=2, rounds=100, lr=0.1)),
    "reg_d3_100_first_mcw20": ("reg", "rich_v2", "first", dict(depth=3, rounds=100, lr=0.1, min_child_weight=20)),
    "rank_d3_100_all": ("rank", "rich_v2", "all", dict(depth=3, rounds=100, lr=0.1)),
    "rank_d3_100_first": ("rank", "rich_v2", "first", dict(depth=3, rounds=100, lr=0.1)),
    "bucket_d3_100_all": ("bucket", "rich_v2", "all", dict(depth=3, rounds=100, lr=0.1)),
    "bucket_d3_100_first": ("bucket", "rich_v2", "first", dict(depth=3, rounds=100, lr=0.1)),
    "reg_p19_d3_100_first": ("reg", "paper19", "first", dict(depth=3, rounds=100, lr=0.1)),
    "reg_p19_d3_100_all": ("reg", "paper19", "all", dict(depth=3, rounds=100, lr=0.1)),
}


if __name__ == "__main__":
    data = load()
    for cand in sys.argv[1:] or list(CANDIDATES):
        kind, feats, turns, kw = CANDIDATES[cand]
        run(data, cand, kind, feats, turns, **kw)
