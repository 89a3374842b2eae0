"""The encoder with its int8 weights as exported (u8 x s8) against the same weights as uint8 + 128 (u8 x u8).

    python benchmarks/bench_u8u8.py [--alpaca-eval ../shared/data/alpaca_eval_dev.jsonl] [--timed 200]

On a CPU whose onnxruntime u8 x s8 kernel saturates (x86 with AVX2 and no VNNI) the two differ; on
one with VNNI, or on ARM, they should agree to the last bit. Prints: whether this CPU's kernel
saturates (a one-node MatMulInteger graph: 255 x 127 + 255 x 127 must be 64,770), the largest and
median difference per AlpacaEval prompt of the encoder's and the kNN's ln tokens and of the served
prediction (lexical model refined by both, as a waiting request is), each variant's Kendall tau_b
against each model's answer lengths, and the encoder's time per opinion, the two timed in turns on
the first ``--timed`` prompts. Evaluation data only: nothing is fitted. Not a timed test.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau

from clairvoyant.prediction.encoder import EncoderModel, refined_by
from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH, OnnxPredictor
from clairvoyant.tools.training.evaluate import load_alpaca_eval

ROOT = Path(__file__).resolve().parents[1]
ALPACA_EVAL = ROOT.parent / "shared" / "data" / "alpaca_eval_dev.jsonl"


def saturates() -> bool:
    """Whether onnxruntime's u8 x s8 MatMulInteger saturates on this CPU."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "a_zp", "w_zp"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
        [
            numpy_helper.from_array(np.array([[127], [127]], dtype=np.int8), "w"),
            numpy_helper.from_array(np.array(0, dtype=np.uint8), "a_zp"),
            numpy_helper.from_array(np.array([0], dtype=np.int8), "w_zp"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = int(session.run(["y"], {"a": np.array([[255, 255]], dtype=np.uint8)})[0][0, 0])
    assert onnx is not None
    return got != 64_770


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpaca-eval", type=Path, default=ALPACA_EVAL)
    parser.add_argument("--timed", type=int, default=200, help="prompts timed, each twice per variant (default 200)")
    args = parser.parse_args()
    data = load_alpaca_eval(args.alpaca_eval)
    texts = [p.instruction for p in data.prompts]
    predictor = OnnxPredictor(DEFAULT_MODEL_PATH)
    encoders = {"as exported (u8 x s8)": EncoderModel(u8u8=False), "uint8 + 128 (u8 x u8)": EncoderModel()}
    print(f"this CPU's u8 x s8 kernel saturates: {saturates()}; {len(texts)} AlpacaEval prompts\n")
    opinions, served = {}, {}
    for name, encoder in encoders.items():
        opinions[name] = np.array([encoder.opinion(t)[::2] for t in texts], dtype=np.float64)  # (encoder, kNN)
        served[name] = np.array(
            [refined_by(encoder, predictor, predictor.predict(p), p.instruction).predicted_tokens for p in data.prompts]
        )
    (a, b), (sa, sb) = opinions.values(), served.values()
    for column, what in ((0, "encoder ln tokens"), (1, "kNN ln tokens")):
        d = np.abs(a[:, column] - b[:, column])
        print(f"{what}: |difference| max {d.max():.4f}, p50 {np.median(d):.4f}, identical {np.mean(d == 0):.0%}")
    d = np.abs(np.log(sa / sb))
    print(f"served prediction, ln tokens: |difference| max {d.max():.4f}, p50 {np.median(d):.4f}\n")
    print("| variant | served tau_b, mean of the models | encoder alone | kNN alone |")
    print("|---|---:|---:|---:|")
    for name in encoders:

        def tau(score: np.ndarray) -> float:
            return float(np.mean([kendalltau(score, data.lengths[:, j]).statistic for j in range(len(data.models))]))

        print(
            f"| {name} | {tau(served[name]):.4f} | {tau(opinions[name][:, 0]):.4f} | {tau(opinions[name][:, 1]):.4f} |"
        )
    seconds: dict[str, list[float]] = {name: [] for name in encoders}
    names = list(encoders)
    for i, text in enumerate(texts[: args.timed] * 2):
        for name in names if i % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            encoders[name].opinion(text)
            seconds[name].append(time.perf_counter() - started)
    ratio = np.median(np.array(seconds[names[1]]) / np.array(seconds[names[0]]))
    timed = ", ".join(f"{name} p50 {1000 * np.median(s):.2f} ms" for name, s in seconds.items())
    print(f"\nencoder opinion (encoder + kNN), in turns: {timed}; paired ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
