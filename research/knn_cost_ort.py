"""Issue 8, brief KNN, cost follow-up: the kNN mat-vec + top-k as an onnxruntime graph (what the encoder's session
could run on its own thread), fp32 and onnxruntime dynamic int8 (per-channel MatMul weights), one thread.

Graph: query [1, 384] float -> MatMul with the memory [384, N] -> TopK k -> (cosines, indices); the label mean is a
numpy gather of k values. Timed interleaved with numpy's fp32 mat-vec (knn_cost.py's path) on the same queries.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/knn_cost_ort.py --k 16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from knn_study import load_embeddings
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic
from threadpoolctl import threadpool_limits


def graph(mem: np.ndarray, k: int, path: Path) -> None:
    w = numpy_helper.from_array(np.ascontiguousarray(mem.T, dtype=np.float32), "memory")
    kk = numpy_helper.from_array(np.array([k], dtype=np.int64), "k")
    nodes = [helper.make_node("MatMul", ["query", "memory"], ["cos"]),
             helper.make_node("TopK", ["cos", "k"], ["top_cos", "top_idx"], axis=-1)]
    g = helper.make_graph(nodes, "knn", [helper.make_tensor_value_info("query", TensorProto.FLOAT, [1, mem.shape[1]])],
                          [helper.make_tensor_value_info("top_cos", TensorProto.FLOAT, [1, k]),
                           helper.make_tensor_value_info("top_idx", TensorProto.INT64, [1, k])], [w, kk])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def session(path: Path) -> ort.InferenceSession:
    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.inter_op_num_threads = 1
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--fidelity", action="store_true",
                        help="also: the pick (cosine-weighted, v from /tmp/knn/pick.json) through the int8 graph on the "
                             "held-out split and AlpacaEval")
    args = parser.parse_args()
    e = load_embeddings()
    meta = np.load("/tmp/knn/meta.npz")
    tr = e["part"] == 0
    y = np.log(np.maximum(meta["tokens"][: int(tr.sum())], 1)).astype(np.float32)
    mem = np.ascontiguousarray(e["unit"][tr], dtype=np.float32)
    rng = np.random.default_rng(0)
    queries = e["unit"][rng.choice(np.flatnonzero(e["part"] == 1), args.queries, replace=False)].astype(np.float32)
    tmp = Path(tempfile.mkdtemp())
    graph(mem, args.k, tmp / "fp32.onnx")
    quantize_dynamic(str(tmp / "fp32.onnx"), str(tmp / "int8.onnx"), per_channel=True, weight_type=QuantType.QInt8)
    sessions = {"ort fp32": session(tmp / "fp32.onnx"), "ort dynamic int8": session(tmp / "int8.onnx")}
    sizes = {name: (tmp / f"{name.split()[-1]}.onnx").stat().st_size for name in sessions}

    def run_ort(s: ort.InferenceSession, q: np.ndarray) -> tuple[float, np.ndarray]:
        _, idx = s.run(None, {"query": q[None, :]})
        return float(y[idx[0]].mean()), idx[0]

    def run_np(q: np.ndarray) -> tuple[float, np.ndarray]:
        top = np.argpartition(-(mem @ q), args.k)[: args.k]
        return float(y[top].mean()), top

    times: dict[str, list[float]] = {"numpy fp32": [], **{n: [] for n in sessions}}
    vals: dict[str, list[float]] = {n: [] for n in times}
    overlap: dict[str, list[float]] = {n: [] for n in times}
    with threadpool_limits(1):
        for q in queries:
            t0 = time.perf_counter()
            v_ref, i_ref = run_np(q)
            times["numpy fp32"].append(time.perf_counter() - t0)
            vals["numpy fp32"].append(v_ref)
            overlap["numpy fp32"].append(1.0)
            for name, s in sessions.items():
                t0 = time.perf_counter()
                v, i = run_ort(s, q)
                times[name].append(time.perf_counter() - t0)
                vals[name].append(v)
                overlap[name].append(len(set(i.tolist()) & set(i_ref.tolist())) / args.k)
    print(f"k {args.k}, {len(queries)} held-out queries, memory {mem.shape[0]:,} rows, one thread, interleaved")
    print("| path | file bytes | p50 ms | p99 ms | mean top-k overlap with numpy fp32 | max abs kNN diff (ln tokens) |")
    for name, t in times.items():
        t_ms = np.array(t) * 1000
        size = f"{sizes[name]:,}" if name in sizes else f"{mem.nbytes:,} (RAM)"
        print(f"| {name} | {size} | {np.percentile(t_ms, 50):.2f} | {np.percentile(t_ms, 99):.2f} | "
              f"{np.mean(overlap[name]):.3f} | {np.abs(np.array(vals[name]) - np.array(vals['numpy fp32'])).max():.3f} |")
    if args.fidelity:
        fidelity(e, meta, y, sessions["ort dynamic int8"], args.k)


def fidelity(e: dict, meta: dict, y: np.ndarray, s: ort.InferenceSession, k: int) -> None:
    import json

    from knn_study import KNN, W_FIRST, W_LATER, blend, tau

    pick = json.loads((KNN / "pick.json").read_text())["pick"]
    assert pick["k"] == k and pick["weighting"] == "cosine"
    n = int((e["part"] == 0).sum())
    held, al = e["part"] == 1, e["part"] == 2

    def knn(q: np.ndarray) -> float:
        c, i = s.run(None, {"query": q[None, :].astype(np.float32)})
        w = np.maximum(c[0], 0).astype(np.float64) + 1e-9
        return float((w * y[i[0]]).sum() / w.sum())

    with threadpool_limits(1):
        hk = np.array([knn(q) for q in e["unit"][held]])
        ak = np.array([knn(q) for q in e["unit"][al]])
    h_tok, h_first = meta["tokens"][n:], meta["turn"][n:] == 0
    h_ref = blend(meta["prior"][n:], e["enc"][held], np.where(meta["history"][n:] > 0, W_LATER, W_FIRST))
    a = np.load("/tmp/turn/study.alpaca.npz")
    a_ref = blend(a["prior"], e["enc"][al], W_FIRST)
    h_new, a_new = blend(h_ref, hk, pick["v"]), blend(a_ref, ak, pick["v"])
    print(f"pick through the ort int8 graph: held-out all {tau(h_new, h_tok):.4f}, first "
          f"{tau(h_new[h_first], h_tok[h_first]):.4f}, later {tau(h_new[~h_first], h_tok[~h_first]):.4f}; AlpacaEval "
          + " ".join(f"{tau(a_new, a['lengths'][:, j]):.3f}" for j in range(4))
          + f" mean {np.mean([tau(a_new, a['lengths'][:, j]) for j in range(4)]):.4f}", flush=True)
    # paired bootstraps vs the shipped refined prior, as knn_study.py's eval phase does them
    rng = np.random.default_rng(0)
    lengths = a["lengths"]
    da = [np.mean([tau(a_new[b], lengths[b, j]) - tau(a_ref[b], lengths[b, j]) for j in range(4)])
          for b in (rng.integers(0, len(lengths), len(lengths)) for _ in range(1000))]
    ug, inv = np.unique(meta["group"][n:], return_inverse=True)
    members = [np.flatnonzero(inv == g) for g in range(len(ug))]
    for name, sel in (("all turns", np.ones(len(h_tok), bool)), ("first turns", h_first), ("later turns", ~h_first)):
        dh = []
        for _ in range(200):
            b = np.concatenate([members[g] for g in rng.integers(0, len(ug), len(ug))])
            b = b[sel[b]]
            dh.append(tau(h_new[b], h_tok[b]) - tau(h_ref[b], h_tok[b]))
        print(f"held-out {name}: {tau(h_new[sel], h_tok[sel]) - tau(h_ref[sel], h_tok[sel]):+.4f}, p5..p95 "
              f"{np.percentile(dh, 5):+.4f}..{np.percentile(dh, 95):+.4f}, share > 0 {np.mean(np.array(dh) > 0):.2f}")
    print(f"AlpacaEval mean: {np.mean([tau(a_new, lengths[:, j]) - tau(a_ref, lengths[:, j]) for j in range(4)]):+.4f}, "
          f"p5..p95 {np.percentile(da, 5):+.4f}..{np.percentile(da, 95):+.4f}, share > 0 {np.mean(np.array(da) > 0):.2f}")


if __name__ == "__main__":
    main()
