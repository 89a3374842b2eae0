"""Issue 8, brief KNN, step 3: what a kNN memory would cost to serve (one query at a time, one BLAS thread).

Per query: cosines of the query's unit embedding against every memory row (one mat-vec), top-k by argpartition, the
(weighted) mean of their ln tokens. Timed side by side in one run, interleaved, for each memory (all training rows /
first turns only) and storage (fp32 in memory; fp16 rows in the file, widened to fp32 at load; int8 rows with a
per-row scale, widened at load, and int8 kept as int8 with an int32 mat-vec). Queries: 500 held-out embeddings
(/tmp/knn, research/knn_embed.py). Also the agreement of each storage's kNN score with fp32 (max abs diff in ln tokens).

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/knn_cost.py --k 32
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from knn_study import load_embeddings  # research/ on sys.path when run as a script
from threadpoolctl import threadpool_limits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--queries", type=int, default=500)
    args = parser.parse_args()
    e = load_embeddings()
    meta = np.load("/tmp/knn/meta.npz")
    tr = e["part"] == 0
    n_train = int(tr.sum())
    y = np.log(np.maximum(meta["tokens"][:n_train], 1)).astype(np.float32)
    first = meta["turn"][:n_train] == 0
    rng = np.random.default_rng(0)
    held = np.flatnonzero(e["part"] == 1)
    queries = e["unit"][rng.choice(held, args.queries, replace=False)].astype(np.float32)
    k = args.k
    variants = {}
    for memory, mask in (("all", np.ones(n_train, bool)), ("first", first)):
        m32 = np.ascontiguousarray(e["unit"][tr][mask], dtype=np.float32)
        labels = y[mask]
        m16 = m32.astype(np.float16).astype(np.float32)
        scale = np.abs(m32).max(axis=1, keepdims=True) / 127.0
        q8 = np.round(m32 / scale).astype(np.int8)
        m8 = (q8.astype(np.float32) * scale).astype(np.float32)
        variants[f"{memory}/fp32"] = (m32, labels, m32.nbytes, "fp32")
        variants[f"{memory}/fp16 file, fp32 at load"] = (m16, labels, m32.nbytes // 2, "fp32")
        variants[f"{memory}/int8 file, fp32 at load"] = (m8, labels, q8.nbytes + scale.nbytes, "fp32")
        variants[f"{memory}/int8 rows, int32 mat-vec"] = ((q8, scale.reshape(-1)), labels, q8.nbytes + scale.nbytes, "int8")

    def one(v: tuple, q: np.ndarray) -> float:
        mat, labels, _, kind = v
        if kind == "fp32":
            s = mat @ q
        else:
            q8, scale = mat
            qs = np.abs(q).max() / 127.0
            s = (q8.astype(np.int32) @ np.round(q / qs).astype(np.int32)) * scale * qs  # not BLAS
        top = np.argpartition(-s, k)[:k]
        return float(labels[top].mean())

    times = {name: [] for name in variants}
    values = {name: [] for name in variants}
    with threadpool_limits(1):
        for v in variants.values():
            one(v, queries[0])  # warm up
        for q in queries:
            for name, v in variants.items():
                t0 = time.perf_counter()
                values[name].append(one(v, q))
                times[name].append(time.perf_counter() - t0)
    print(f"k {k}, {len(queries)} held-out queries, one BLAS thread, interleaved")
    print("| memory / storage | rows | bytes (file) | p50 ms | p99 ms | max abs diff vs fp32 (ln tokens) |")
    for name, v in variants.items():
        ref = np.array(values[f"{name.split('/')[0]}/fp32"])
        t = np.array(times[name]) * 1000
        print(f"| {name} | {len(v[1]):,} | {v[2]:,} | {np.percentile(t, 50):.2f} | {np.percentile(t, 99):.2f} | "
              f"{np.abs(np.array(values[name]) - ref).max():.4f} |")


if __name__ == "__main__":
    main()
