"""Issue 8, brief SHIPKNN: the pre-registered kNN pick (research/RESULTS.md section h) as ONE served graph,
model/encoder.knn.onnx, measured in the int8 onnxruntime form section h's knn_cost_ort.py measured.

    embedding [N, 384] float32 (the encoder's pooled `embedding` output)
      -> L2-normalise (ReduceL2, Div)
      -> MatMul with the unit-normalised memory [384, 43,151] (onnxruntime quantize_dynamic, per-channel int8,
         MatMul only: the label initializer stays float32)
      -> TopK 16 (cosines, indices)
      -> cosine weights max(cos, 0) + 1e-9; labels (the memory rows' true ln tokens) gathered by the indices
      -> knn_log_tokens [N] = sum(w x label) / sum(w)

Memory: ALL 43,151 training-side rows of the leak-free split (seed 42; first and later turns), embedded as served
(research/knn_embed.py: /tmp/knn/emb*.npz), labels ln(max(answer tokens, 1)) (/tmp/knn/meta.npz). Never a held-out
row or AlpacaEval. One query per run: dynamic int8 quantisation scales the activations over the whole batch.

    PYTHONPATH=src:research nice -n 10 /work/main/.venv/bin/python research/export_knn.py --out model/encoder.knn.onnx

--check: the exported file's pick through serving's formula on the held-out split and AlpacaEval (the same tau
figures as knn_cost_ort.py --fidelity's int8 row: held-out all turns 0.4543, AlpacaEval mean 0.4032), and its
knn_log_tokens against the research path (knn_cost_ort.py's graph fed unit queries + a float64 numpy weighted mean).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

K = 16
V = 0.15  # the pre-registered blend weight (/tmp/knn/pick.json)


def build(mem_unit: np.ndarray, labels: np.ndarray, k: int, path: Path) -> None:
    """The fp32 graph (quantised afterwards by ``quantize``)."""
    dim = mem_unit.shape[1]
    inits = [
        numpy_helper.from_array(np.ascontiguousarray(mem_unit.T, dtype=np.float32), "memory"),
        numpy_helper.from_array(labels.astype(np.float32), "labels"),
        numpy_helper.from_array(np.array([k], dtype=np.int64), "k"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
        numpy_helper.from_array(np.array(1e-9, dtype=np.float32), "eps"),
    ]
    nodes = [
        helper.make_node("ReduceL2", ["embedding", "axis1"], ["norm"], keepdims=1),
        helper.make_node("Div", ["embedding", "norm"], ["unit"]),
        helper.make_node("MatMul", ["unit", "memory"], ["cos"]),
        helper.make_node("TopK", ["cos", "k"], ["top_cos", "top_idx"], axis=-1),
        helper.make_node("Max", ["top_cos", "zero"], ["pos"]),
        helper.make_node("Add", ["pos", "eps"], ["w"]),
        helper.make_node("Gather", ["labels", "top_idx"], ["top_y"], axis=0),
        helper.make_node("Mul", ["w", "top_y"], ["wy"]),
        helper.make_node("ReduceSum", ["wy", "axis1"], ["num"], keepdims=0),
        helper.make_node("ReduceSum", ["w", "axis1"], ["den"], keepdims=0),
        helper.make_node("Div", ["num", "den"], ["knn_log_tokens"]),
    ]
    g = helper.make_graph(
        nodes,
        "encoder_knn",
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", dim])],
        [helper.make_tensor_value_info("knn_log_tokens", TensorProto.FLOAT, ["N"])],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def quantize(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # MatMul only (as measured in knn_cost_ort.py): a quantised Gather would round the labels
    quantize_dynamic(str(src), str(dst), per_channel=True, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])


def session(path: Path):  # noqa: ANN201
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.inter_op_num_threads = 1
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])


def check(path: Path, e: dict, meta: dict, y: np.ndarray) -> dict:
    from knn_study import W_FIRST, W_LATER, blend, tau

    n = int((e["part"] == 0).sum())
    held, al = e["part"] == 1, e["part"] == 2
    s = session(path)

    def knn(q: np.ndarray) -> float:
        return float(s.run(None, {"embedding": q[None, :].astype(np.float32)})[0][0])

    hk = np.array([knn(q) for q in e["emb"][held]])
    ak = np.array([knn(q) for q in e["emb"][al]])
    h_tok, h_first = meta["tokens"][n:], meta["turn"][n:] == 0
    h_ref = blend(meta["prior"][n:], e["enc"][held], np.where(meta["history"][n:] > 0, W_LATER, W_FIRST))
    a = np.load("/tmp/turn/study.alpaca.npz")
    a_ref = blend(a["prior"], e["enc"][al], W_FIRST)
    h_new, a_new = blend(h_ref, hk, V), blend(a_ref, ak, V)
    per = [tau(a_new, a["lengths"][:, j]) for j in range(4)]
    out = {
        "held_out_all": tau(h_new, h_tok),
        "held_out_first": tau(h_new[h_first], h_tok[h_first]),
        "held_out_later": tau(h_new[~h_first], h_tok[~h_first]),
        "alpaca_eval_per_model": per,
        "alpaca_eval_mean": float(np.mean(per)),
        "knn_alone_held_out": tau(hk, h_tok),
        "knn_alone_alpaca_mean": float(np.mean([tau(ak, a["lengths"][:, j]) for j in range(4)])),
    }
    # the research path on the same queries: knn_cost_ort.py's int8 graph (unit query -> MatMul -> TopK),
    # weighted mean in float64 numpy
    from knn_cost_ort import graph
    from knn_cost_ort import session as ort_session

    tmp = Path(tempfile.mkdtemp())
    graph(np.ascontiguousarray(e["unit"][e["part"] == 0], dtype=np.float32), K, tmp / "fp32.onnx")
    quantize(tmp / "fp32.onnx", tmp / "int8.onnx")
    r = ort_session(tmp / "int8.onnx")

    def research(q: np.ndarray) -> float:
        c, i = r.run(None, {"query": q[None, :].astype(np.float32)})
        w = np.maximum(c[0], 0).astype(np.float64) + 1e-9
        return float((w * y[i[0]]).sum() / w.sum())

    rk = np.array([research(q) for q in e["unit"][al]])
    out["alpaca_max_abs_diff_vs_research_path"] = float(np.abs(rk - ak).max())
    out["alpaca_share_within_1e-3"] = float(np.mean(np.abs(rk - ak) < 1e-3))
    return out


def main() -> None:
    from knn_study import load_embeddings

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("model/encoder.knn.onnx"))
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    e = load_embeddings()
    meta = np.load("/tmp/knn/meta.npz")
    tr = e["part"] == 0
    n = int(tr.sum())
    assert n == 43151, n
    y = np.log(np.maximum(meta["tokens"][:n], 1)).astype(np.float32)
    tmp = Path(tempfile.mkdtemp())
    build(np.ascontiguousarray(e["unit"][tr], dtype=np.float32), y, K, tmp / "knn.fp32.onnx")
    quantize(tmp / "knn.fp32.onnx", args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes): {n:,} memory rows, k {K}, cosine weighting")
    if args.check:
        print(json.dumps(check(args.out, e, meta, y), indent=1))


if __name__ == "__main__":
    main()
