"""Issue 8, brief KNN: two checks of the pre-registered pick (all/k16/cosine, v 0.15; /tmp/knn/pick.json), no new fit.

1. Paired bootstrap over held-out conversation groups (200 resamples), pick minus the shipped refined prior, on the
   first turns and on the later turns separately (knn_study.py gives it for all turns).
2. Serving fidelity of a smaller memory file: the same setting with the memory rows rounded to fp16, or int8 with a
   per-row scale (dequantised), on the held-out split and AlpacaEval.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/knn_extra.py
"""

from __future__ import annotations

import json

import numpy as np
from knn_study import KNN, W_FIRST, W_LATER, Setup, blend, knn_score, neighbours, tau


def main() -> None:
    su = Setup()
    pick = json.loads((KNN / "pick.json").read_text())["pick"]
    e, m = su.e, su.m
    held, al = e["part"] == 1, e["part"] == 2
    h_tok = m["tokens"][su.n_train :]
    h_first = m["turn"][su.n_train :] == 0
    h_ref = blend(m["prior"][su.n_train :], e["enc"][held], np.where(m["history"][su.n_train :] > 0, W_LATER, W_FIRST))
    a = np.load("/tmp/turn/study.alpaca.npz")
    a_ref = blend(a["prior"], e["enc"][al], W_FIRST)
    L = a["lengths"]
    mask = {"all": np.ones(su.n_train, bool)}
    out: dict = {}
    base_h, base_a = None, None
    for storage in ("fp32", "fp16", "int8"):
        mem = su.mem_unit.astype(np.float32)
        if storage == "fp16":
            mem = mem.astype(np.float16).astype(np.float32)
        elif storage == "int8":
            scale = np.abs(mem).max(axis=1, keepdims=True) / 127.0
            mem = (np.round(mem / scale) * scale).astype(np.float32)
        hi, hs = neighbours(e["unit"][held], mem, None, su.mem_group, mask)["all"]
        ai, as_ = neighbours(e["unit"][al], mem, None, su.mem_group, mask)["all"]
        hk = knn_score(hi, hs, su.mem_y, pick["k"], pick["weighting"])
        ak = knn_score(ai, as_, su.mem_y, pick["k"], pick["weighting"])
        if base_h is None:
            base_h, base_a = hk, ak
        h_new, a_new = blend(h_ref, hk, pick["v"]), blend(a_ref, ak, pick["v"])
        f = {"held_all": tau(h_new, h_tok), "held_first": tau(h_new[h_first], h_tok[h_first]),
             "held_later": tau(h_new[~h_first], h_tok[~h_first]),
             "alpaca_mean": float(np.mean([tau(a_new, L[:, j]) for j in range(L.shape[1])])),
             "max_abs_knn_diff_vs_fp32": float(max(np.abs(hk - base_h).max(), np.abs(ak - base_a).max()))}
        out[storage] = f
        print(storage, json.dumps(f), flush=True)
        if storage == "fp32":
            groups = m["group"][su.n_train :]
            rng = np.random.default_rng(0)
            for name, sel in (("first turns", h_first), ("later turns", ~h_first)):
                idx = np.flatnonzero(sel)
                ug, inv = np.unique(groups[idx], return_inverse=True)
                members = [idx[inv == g] for g in range(len(ug))]
                d = []
                for _ in range(200):
                    b = np.concatenate([members[g] for g in rng.integers(0, len(ug), len(ug))])
                    d.append(tau(h_new[b], h_tok[b]) - tau(h_ref[b], h_tok[b]))
                delta = tau(h_new[idx], h_tok[idx]) - tau(h_ref[idx], h_tok[idx])
                out[f"held_{name}"] = {"delta": delta, "p5_p95": [float(np.percentile(d, 5)), float(np.percentile(d, 95))],
                                       "share_pos": float(np.mean(np.array(d) > 0)), "rows": int(len(idx))}
                print(f"held-out {name}: {json.dumps(out[f'held_{name}'])}", flush=True)
    (KNN / "extra.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
