"""Step-1 encoder candidates: frozen MiniLM-L6 mean-pooled embeddings (research/embed_minilm.py) -> ridge /
XGBoost / small MLP on log tokens, alone and with rich_v2. Rows without an embedding are skipped.

    PYTHONPATH=src nice -n 10 python research/study_encoder.py EMB_SHAREGPT.npy [all|first]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import xgboost as xgb
from sklearn.linear_model import Ridge
from sklearn.neural_network import MLPRegressor

from common import CACHE, heldout_rows, load, report


def main() -> None:
    d = load()
    emb = np.load(sys.argv[1])
    turns = sys.argv[2] if len(sys.argv) > 2 else "first"
    aemb = np.load(CACHE / "emb_alpaca.npy")
    has = np.abs(emb).sum(1) > 0
    m = d.train & d.english & has
    if turns == "first":
        m &= d.first
    tr = np.flatnonzero(m)
    h = np.array([i for i in heldout_rows(d) if has[i]])
    hf = heldout_rows(d, first_only=True)
    y = d.log_tokens[tr]
    tag = f"{turns} rows={len(tr)} heldout rows={len(h)}"
    for alpha in (1.0, 3.0, 10.0):
        r = Ridge(alpha=alpha).fit(emb[tr], y)
        report(f"minilm_ridge_a{alpha}_{turns}", r.predict(aemb), r.predict(emb[h]) if len(h) > 1000 else np.zeros(0),
               r.predict(emb[hf]), d, tag) if len(h) == len(heldout_rows(d)) else None
        if len(h) != len(heldout_rows(d)):
            from common import alpaca_taus, tau
            per, mean = alpaca_taus(r.predict(aemb), d)
            print(f"| minilm_ridge_a{alpha}_{turns} | " + " | ".join(f"{t:.3f}" for t in per)
                  + f" | **{mean:.3f}** | n/a | {tau(r.predict(emb[hf]), d.tokens[hf]):.3f} | {tag} |", flush=True)
    t0 = time.perf_counter()
    mlp = MLPRegressor(hidden_layer_sizes=(256,), alpha=1e-3, early_stopping=True, max_iter=200, random_state=42)
    mlp.fit(emb[tr], y)
    from common import alpaca_taus, tau
    per, mean = alpaca_taus(mlp.predict(aemb), d)
    line = (f"| minilm_mlp256_{turns} | " + " | ".join(f"{t:.3f}" for t in per) + f" | **{mean:.3f}** | "
            f"{tau(mlp.predict(emb[h]), d.tokens[h]) if len(h) else float('nan'):.3f} | "
            f"{tau(mlp.predict(emb[hf]), d.tokens[hf]):.3f} | {tag} {time.perf_counter() - t0:.0f}s |")
    print(line, flush=True)
    for name, xa, xt, xh, xhf in (
        ("minilm_xgb_d4", aemb, emb[tr], emb[h], emb[hf]),
        ("minilm+rich_v2_xgb_d4", np.column_stack([aemb, d.ax_rich]), np.column_stack([emb[tr], d.x_rich[tr]]),
         np.column_stack([emb[h], d.x_rich[h]]), np.column_stack([emb[hf], d.x_rich[hf]])),
    ):
        t0 = time.perf_counter()
        reg = xgb.XGBRegressor(n_estimators=400, max_depth=4, learning_rate=0.05, subsample=0.8, colsample_bytree=0.5,
                               tree_method="hist", n_jobs=2, random_state=42).fit(xt, y)
        per, mean = alpaca_taus(reg.predict(xa), d)
        print(f"| {name}_{turns} | " + " | ".join(f"{t:.3f}" for t in per) + f" | **{mean:.3f}** | "
              f"{tau(reg.predict(xh), d.tokens[h]) if len(h) else float('nan'):.3f} | {tau(reg.predict(xhf), d.tokens[hf]):.3f} | "
              f"{tag} {time.perf_counter() - t0:.0f}s |", flush=True)


if __name__ == "__main__":
    main()
