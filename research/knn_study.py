"""Issue 8, brief KNN: nearest neighbours in the shipped encoder's embedding space, as one more signal.

kNN score of a query = the (weighted) mean ln tokens of its k nearest TRAINING-side ShareGPT instructions by cosine
of the shipped encoder's pooled embedding (research/knn_embed.py: as served, head + tail word pieces). Final score =
refined + v x (kNN - refined), refined = the shipped turn-aware prior (lexical + w x (encoder - lexical), w 0.6 without
history, 0.45 with it), in ln tokens.

PRE-REGISTERED (written and committed before any held-out or AlpacaEval figure of a kNN score was computed):
- memories: "all" = the 43,151 training-side rows (first and later turns); "first" = its 6,710 first turns.
  Never a held-out row, never AlpacaEval.
- k in {16, 32, 64}; weighting in {"uniform", "cosine"} (weights = max(cos, 0)); v in 0..1 step 0.05.
- fitting rows: the 19,280 training-side later turns the shipped encoder never saw (/tmp/turn/scores.npz kind 0,
  research/turn_unseen_rows.py), their lexical prior OUT OF FOLD (/tmp/turn/oof.npz, research/turn_oof_lexical.py),
  their neighbours never from their own conversation group (the split's leakage group).
- pick: the (memory, k, weighting, v) with the best Kendall tau_b of the final score on the fitting rows.
  Diagnostics only (not used to pick): the same grid on the 6,710 training first turns (OOF kNN and OOF lexical prior,
  but the encoder was trained on them twice, so their encoder score is in-sample).
- variant 2 (censored rows dropped): the picked memory without rows whose NEXT user turn in the same conversation asks
  to continue (lower-cased, punctuation stripped, <= 40 characters, and containing "continue", "go on", "keep going"
  or "carry on"); same k and weighting, v refitted on the fitting rows the same way.
- then, once, for every setting: ShareGPT held-out all / first / later turns, AlpacaEval per model and mean, kNN alone
  and blended; the paired bootstrap (AlpacaEval prompts, 1,000; held-out conversation groups, 200) of the pick vs the
  shipped refined prior.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/knn_study.py --phase fit    # writes /tmp/knn/pick.json
    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/knn_study.py --phase eval   # reads it
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau

ROOT = Path(__file__).resolve().parents[1]
KNN = Path("/tmp/knn")
ALPACA = Path("/work/shared/data/alpaca_eval_dev.jsonl")
KS = (16, 32, 64)
WEIGHTINGS = ("uniform", "cosine")
MEMORIES = ("all", "first")
V_GRID = tuple(round(0.05 * i, 2) for i in range(21))
W_FIRST, W_LATER = 0.6, 0.45
CONTINUE = re.compile(r"continue|go on|keep going|carry on")


def tau(score: np.ndarray, tokens: np.ndarray) -> float:
    return float(kendalltau(score, tokens, variant="b").statistic)


def is_continue(text: str) -> bool:
    t = re.sub(r"[^\w\s]", "", text.lower()).strip()
    return len(t) <= 40 and CONTINUE.search(t) is not None


def load_embeddings() -> dict[str, np.ndarray]:
    parts = [np.load(p) for p in sorted(KNN.glob("emb[0-9].npz"))]
    index = np.concatenate([p["index"] for p in parts])
    order = np.argsort(index)
    assert np.array_equal(index[order], np.arange(len(index))), "missing shards"
    out = {k: np.concatenate([p[k] for p in parts])[order] for k in ("rows", "part", "emb", "enc")}
    emb = out["emb"].astype(np.float32)
    out["unit"] = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    return out


def split_rows() -> np.ndarray:
    """load_pairs() indices of the natural split's training rows then its held-out rows (knn_embed.py's order),
    from the session-18 caches (build_natural_split runs langdetect over every pair: minutes)."""
    s = np.load("/tmp/turn/scores.npz")
    return np.concatenate([np.load("/tmp/turn/oof.npz")["rows"], s["rows"][s["kind"] == 3]])


def load_meta(e: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Per train/held-out row: group id, turn, history_chars (the blend rule's column), tokens, censored flag. Cached."""
    path = KNN / "meta.npz"
    if path.is_file():
        meta = dict(np.load(path))
        if e is not None:
            assert np.array_equal(meta["rows"], e["rows"][e["part"] < 2])
        return meta
    from clairvoyant.tools.training.dataset import load_pairs
    from clairvoyant.tools.training.scoring import ModelScorer

    pairs = load_pairs()
    rows = split_rows()
    if e is not None:
        assert np.array_equal(rows, e["rows"][e["part"] < 2])
    by_key = {p.key: p for p in pairs}
    groups = np.unique([pairs[i].group for i in rows], return_inverse=True)[1]
    nxt = [by_key.get(f"{pairs[i].conv_id}:{pairs[i].turn + 1}") for i in rows]
    censored = np.array([n is not None and is_continue(n.prompt.instruction) for n in nxt])
    scorer = ModelScorer(ROOT / "model" / "predictor.onnx")
    col = scorer.feature_set.names.index("history_chars")
    prompts = [pairs[i].prompt for i in rows]
    history = scorer.features(prompts)[:, col].astype(np.float64)
    prior = scorer.predicted_log_tokens(scorer.score_prompts(prompts))  # served lexical prior (in-sample on train)
    tokens = np.load("/tmp/rcache/sharegpt.npz")["tokens"][rows].astype(np.int64)
    meta = {"rows": rows, "group": groups, "turn": np.array([pairs[i].turn for i in rows]), "history": history,
            "tokens": tokens, "censored": censored, "prior": prior}
    np.savez(path, **meta)
    return meta


def neighbours(q: np.ndarray, mem: np.ndarray, q_group: np.ndarray | None, mem_group: np.ndarray,
               masks: dict[str, np.ndarray], kmax: int = max(KS)) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per memory (a column mask over mem): top-kmax memory indices (into mem) and cosines per query, best first;
    memory rows of the query's own group excluded if q_group is given. One mat-mul shared by every memory."""
    res = {name: (np.zeros((len(q), kmax), np.int64), np.zeros((len(q), kmax), np.float32)) for name in masks}
    for c in range(0, len(q), 1000):
        s = q[c : c + 1000] @ mem.T
        if q_group is not None:
            s[q_group[c : c + 1000, None] == mem_group[None, :]] = -np.inf
        for name, mask in masks.items():
            cols = np.flatnonzero(mask)
            sm = s[:, cols]
            top = np.argpartition(-sm, kmax, axis=1)[:, :kmax]
            ts = np.take_along_axis(sm, top, 1)
            o = np.argsort(-ts, axis=1)
            res[name][0][c : c + 1000] = cols[np.take_along_axis(top, o, 1)]
            res[name][1][c : c + 1000] = np.take_along_axis(ts, o, 1)
    return res


def knn_score(idx: np.ndarray, sim: np.ndarray, labels: np.ndarray, k: int, weighting: str) -> np.ndarray:
    y = labels[idx[:, :k]]
    if weighting == "uniform":
        return y.mean(axis=1)
    w = np.maximum(sim[:, :k], 0).astype(np.float64) + 1e-9
    return (w * y).sum(axis=1) / w.sum(axis=1)


def blend(a: np.ndarray, b: np.ndarray, w: np.ndarray | float) -> np.ndarray:
    return a + w * (b - a)


class Setup:
    def __init__(self) -> None:
        e = load_embeddings()
        m = load_meta(e)
        self.e, self.m = e, m
        tr = e["part"] == 0
        self.n_train = int(tr.sum())
        self.mem_unit = e["unit"][tr]
        self.mem_y = np.log(np.maximum(m["tokens"][: self.n_train], 1)).astype(np.float64)
        self.mem_group = m["group"][: self.n_train]
        self.mem_first = m["turn"][: self.n_train] == 0
        self.mem_censored = m["censored"][: self.n_train]
        self.enc = e["enc"]
        pos = {int(r): j for j, r in enumerate(m["rows"][: self.n_train])}
        s = np.load("/tmp/turn/scores.npz")
        o = np.load("/tmp/turn/oof.npz")
        oof_of = dict(zip(o["rows"].tolist(), o["oof_prior"].tolist()))
        unseen = s["rows"][s["kind"] == 0]
        self.fit_idx = np.array([pos[int(r)] for r in unseen])  # positions in the train part
        firsts = np.flatnonzero(self.mem_first)
        self.diag_idx = firsts
        oof = np.array([oof_of[int(r)] for r in m["rows"][: self.n_train]])
        hist = m["history"][: self.n_train]
        w = np.where(hist > 0, W_LATER, W_FIRST)
        self.train_refined_oof = blend(oof, self.enc[: self.n_train], w)
        assert (hist[self.fit_idx] > 0).all()

    def memory_mask(self, memory: str, drop_censored: bool = False) -> np.ndarray:
        mask = np.ones(self.n_train, bool) if memory == "all" else self.mem_first.copy()
        if drop_censored:
            mask &= ~self.mem_censored
        return mask

    def query_neighbours(self, q_pos: np.ndarray | None, q_unit: np.ndarray,
                         exclude_group: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Neighbours in every memory: {"all", "first", "all-uncensored", "first-uncensored"}."""
        masks = {f"{mem}{'-uncensored' if drop else ''}": self.memory_mask(mem, drop)
                 for drop in (False, True) for mem in MEMORIES}
        qg = self.mem_group[q_pos] if exclude_group else None
        return neighbours(q_unit, self.mem_unit, qg, self.mem_group, masks)


def phase_fit(su: Setup) -> dict:
    out: dict = {"fit_rows": len(su.fit_idx), "diag_rows": len(su.diag_idx), "grid": {}}
    y_tok = su.m["tokens"][: su.n_train]
    for rows_name, qi in (("fit", su.fit_idx), ("diag_first_turns", su.diag_idx)):
        ref = su.train_refined_oof[qi]
        tt = y_tok[qi]
        out[f"{rows_name}_refined_tau"] = tau(ref, tt)
        print(f"## {rows_name}: {len(qi)} rows; refined prior (OOF lexical) tau_b {out[f'{rows_name}_refined_tau']:.4f}",
              flush=True)
        started = time.perf_counter()
        nb = su.query_neighbours(qi, su.mem_unit[qi], True)
        print(f"  (neighbours: {time.perf_counter() - started:.0f} s)", flush=True)
        labels = su.mem_y
        for memory, drop in (("all", False), ("first", False), ("all", True), ("first", True)):
            idx, sim = nb[f"{memory}{'-uncensored' if drop else ''}"]
            for k in KS:
                for wt in WEIGHTINGS:
                    kn = knn_score(idx, sim, labels, k, wt)
                    taus = {v: tau(blend(ref, kn, v), tt) for v in V_GRID}
                    d = kn - ref
                    v_mse = float(np.dot(d, np.log(np.maximum(tt, 1)) - ref) / np.dot(d, d))
                    best = max(taus, key=lambda v: taus[v])
                    name = f"{memory}{'-uncensored' if drop else ''}/k{k}/{wt}"
                    out["grid"].setdefault(rows_name, {})[name] = {"knn_alone": taus[1.0], "tau_by_v": taus,
                                                                   "v_best": best, "tau_best": taus[best], "v_mse": v_mse}
                    print(f"| {name} | kNN alone {taus[1.0]:.4f} | best v {best} -> {taus[best]:.4f} "
                          f"(+{taus[best] - taus[0.0]:.4f}) | MSE-optimal v {v_mse:.3f} | "
                          + " ".join(f"{v}:{taus[v]:.4f}" for v in V_GRID[:11:2]), flush=True)
    fit = out["grid"]["fit"]
    main_names = [n for n in fit if "uncensored" not in n]
    pick = max(main_names, key=lambda n: fit[n]["tau_best"])
    memory, k, wt = pick.split("/")
    out["pick"] = {"name": pick, "memory": memory, "k": int(k[1:]), "weighting": wt, "v": fit[pick]["v_best"],
                   "fit_tau": fit[pick]["tau_best"]}
    cname = f"{memory}-uncensored/{k}/{wt}"
    out["pick_censored_dropped"] = {"name": cname, "memory": memory, "k": int(k[1:]), "weighting": wt,
                                    "v": fit[cname]["v_best"], "fit_tau": fit[cname]["tau_best"]}
    out["censored_rows_in_memory"] = {"all": int(su.mem_censored.sum()),
                                      "first": int((su.mem_censored & su.mem_first).sum())}
    print("PICK", json.dumps(out["pick"]), "| censored-dropped twin", json.dumps(out["pick_censored_dropped"]),
          "| censored rows", out["censored_rows_in_memory"], flush=True)
    return out


def phase_eval(su: Setup, fitted: dict) -> dict:
    from clairvoyant.tools.training.evaluate import load_alpaca_eval

    e, m = su.e, su.m
    held = e["part"] == 1
    al = e["part"] == 2
    n_held = int(held.sum())
    h_tok = m["tokens"][su.n_train :]
    h_hist = m["history"][su.n_train :]
    h_first = m["turn"][su.n_train :] == 0
    h_later = h_hist > 0
    h_ref = blend(m["prior"][su.n_train :], e["enc"][held], np.where(h_later, W_LATER, W_FIRST))
    a = np.load("/tmp/turn/study.alpaca.npz")
    alpaca = load_alpaca_eval(ALPACA)
    assert np.array_equal(a["lengths"], alpaca.lengths)
    a_ref = blend(a["prior"], e["enc"][al], W_FIRST)
    L = alpaca.lengths

    def figures(h: np.ndarray, s_a: np.ndarray) -> dict:
        per = [tau(s_a, L[:, j]) for j in range(L.shape[1])]
        return {"held_all": tau(h, h_tok), "held_first": tau(h[h_first], h_tok[h_first]),
                "held_later": tau(h[~h_first], h_tok[~h_first]), "alpaca": per, "alpaca_mean": float(np.mean(per))}

    def line(name: str, f: dict) -> str:
        return (f"| {name} | {f['held_all']:.4f} | {f['held_first']:.4f} | {f['held_later']:.4f} | "
                + " | ".join(f"{t:.3f}" for t in f["alpaca"]) + f" | **{f['alpaca_mean']:.4f}** |")

    out: dict = {"models": alpaca.models, "rows": {}}
    base = figures(h_ref, a_ref)
    out["rows"]["shipped refined prior"] = base
    print("| setting | held-out all | first | later | " + " | ".join(alpaca.models) + " | AlpacaEval mean |")
    print(line("shipped refined prior", base), flush=True)
    scores: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    pick = fitted["pick"]
    h_nb = su.query_neighbours(None, e["unit"][held], False)
    a_nb = su.query_neighbours(None, e["unit"][al], False)
    labels = su.mem_y
    for memory, drop in (("all", False), ("first", False), ("all", True), ("first", True)):
        hi, hs = h_nb[f"{memory}{'-uncensored' if drop else ''}"]
        ai, as_ = a_nb[f"{memory}{'-uncensored' if drop else ''}"]
        for k in KS:
            for wt in WEIGHTINGS:
                name = f"{memory}{'-uncensored' if drop else ''}/k{k}/{wt}"
                hk, ak = knn_score(hi, hs, labels, k, wt), knn_score(ai, as_, labels, k, wt)
                v = fitted["grid"]["fit"][name]["v_best"]
                for label, vv in (("kNN alone", 1.0), (f"blend v {v} (its OOF fit)", v),
                                  (f"blend v {pick['v']} (the pick's)", pick["v"])):
                    f = figures(blend(h_ref, hk, vv), blend(a_ref, ak, vv))
                    out["rows"][f"{name} {label}"] = f
                    print(line(f"{name} {label}", f), flush=True)
                scores[name] = (hk, ak)
    # paired bootstrap: the pick (and its censored-dropped twin) vs the shipped refined prior
    rng = np.random.default_rng(0)
    groups = m["group"][su.n_train :]
    ug, inv = np.unique(groups, return_inverse=True)
    members = [np.flatnonzero(inv == g) for g in range(len(ug))]
    boots = {}
    for key in ("pick", "pick_censored_dropped"):
        p = fitted[key]
        hk, ak = scores[p["name"]]
        h_new, a_new = blend(h_ref, hk, p["v"]), blend(a_ref, ak, p["v"])
        da = []
        for _ in range(1000):
            b = rng.integers(0, len(L), len(L))
            da.append(np.mean([tau(a_new[b], L[b, j]) - tau(a_ref[b], L[b, j]) for j in range(L.shape[1])]))
        dh = []
        for _ in range(200):
            b = np.concatenate([members[g] for g in rng.integers(0, len(ug), len(ug))])
            dh.append(tau(h_new[b], h_tok[b]) - tau(h_ref[b], h_tok[b]))
        f = figures(h_new, a_new)
        boots[key] = {"name": p["name"], "v": p["v"], "figures": f,
                      "alpaca_delta": f["alpaca_mean"] - base["alpaca_mean"],
                      "alpaca_p5_p95": [float(np.percentile(da, 5)), float(np.percentile(da, 95))],
                      "alpaca_share_pos": float(np.mean(np.array(da) > 0)),
                      "held_delta": f["held_all"] - base["held_all"],
                      "held_p5_p95": [float(np.percentile(dh, 5)), float(np.percentile(dh, 95))],
                      "held_share_pos": float(np.mean(np.array(dh) > 0))}
        print(key, json.dumps(boots[key]), flush=True)
    out["paired_bootstrap"] = boots
    out["n_held"] = n_held
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("meta", "fit", "eval"), required=True)
    args = parser.parse_args()
    if args.phase == "meta":
        m = load_meta(None)
        print(f"{len(m['rows'])} rows; censored (next turn asks to continue) {int(m['censored'].sum())}")
        return
    su = Setup()
    if args.phase == "fit":
        out = phase_fit(su)
        (KNN / "pick.json").write_text(json.dumps(out, indent=1))
    else:
        fitted = json.loads((KNN / "pick.json").read_text())
        out = phase_eval(su, fitted)
        (KNN / "eval.json").write_text(json.dumps(out, indent=1))
    print("saved")


if __name__ == "__main__":
    main()
