"""The encoder's cost per waiting request, idle and under llama.cpp load (issue 8: "state its cost").

    python benchmarks/bench_encoder.py [--requests 400] [--load-nice 0 10] [--json FILE]

Times ``EncoderModel.encode(instruction)`` (tokenize + one onnxruntime run on one thread, the
components included), as the proxy's encoder thread runs it, over real ShareGPT instructions
(bench_predictor's prompts), one at a time. Phases: idle, then with a real llama.cpp server
generating continuously on the same cores (``predictor_load.LoadProcess``), at each ``--load-nice``.
The lexical predictor is timed in the same phases, in its own pass, for the ratio. Prints p50/p99 in ms.

With a kNN in the encoder's card (``encoder.knn.onnx``): its graph alone (pooled embedding in,
``knn_log_tokens`` out: what a waiting request adds after its encode) in its own pass over the
same instructions' embeddings, and ``EncoderModel.opinion`` (encoder + kNN: a waiting request's
whole cost on the encoder thread) in another.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_predictor import _prompts  # noqa: E402
from predictor_load import LoadProcess  # noqa: E402

from clairvoyant.prediction.encoder import EncoderModel  # noqa: E402
from clairvoyant.prediction.predictor import OnnxPredictor  # noqa: E402


def _phase(encoder: EncoderModel, predictor: OnnxPredictor, prompts: list) -> dict[str, float]:
    # Two passes, not interleaved: an encoder run evicts the caches, and the lexical predictor timed
    # right after one measures that, not itself (bench_predictor.py times it alone).
    enc, lex = [], []
    for prompt in prompts:
        started = time.perf_counter()
        encoder.encode(prompt.instruction)
        enc.append(time.perf_counter() - started)
    for prompt in prompts:
        started = time.perf_counter()
        predictor.predict(prompt)
        lex.append(time.perf_counter() - started)
    e, x = np.array(enc) * 1e3, np.array(lex) * 1e3
    out = {
        "encoder_p50_ms": float(np.percentile(e, 50)),
        "encoder_p99_ms": float(np.percentile(e, 99)),
        "lexical_p50_ms": float(np.percentile(x, 50)),
        "lexical_p99_ms": float(np.percentile(x, 99)),
    }
    if encoder.has_knn:
        knn_session = encoder._knn  # the served graph, run as EncoderModel.opinion runs it
        embeddings = [_embedding(encoder, prompt.instruction) for prompt in prompts]
        knn, both = [], []
        for embedding in embeddings:
            started = time.perf_counter()
            knn_session.run(None, {"embedding": embedding})
            knn.append(time.perf_counter() - started)
        for prompt in prompts:
            started = time.perf_counter()
            encoder.opinion(prompt.instruction)
            both.append(time.perf_counter() - started)
        k, b = np.array(knn) * 1e3, np.array(both) * 1e3
        out |= {
            "knn_p50_ms": float(np.percentile(k, 50)),
            "knn_p99_ms": float(np.percentile(k, 99)),
            "encoder_with_knn_p50_ms": float(np.percentile(b, 50)),
            "encoder_with_knn_p99_ms": float(np.percentile(b, 99)),
        }
    out["loadavg_1min"] = os.getloadavg()[0]
    return out


def _embedding(encoder: EncoderModel, text: str) -> np.ndarray:
    ids = np.asarray([encoder.word_pieces(text)], dtype=np.int64)
    out = encoder._session.run(["embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    return np.asarray(out[0], dtype=np.float32).reshape(1, -1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--load-nice", type=int, nargs="*", default=[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    encoder, predictor = EncoderModel(), OnnxPredictor()
    prompts = _prompts(args.requests)
    for prompt in prompts[:20]:  # warm up
        encoder.encode(prompt.instruction)
    phases = {"idle": _phase(encoder, predictor, prompts)}
    for nice in args.load_nice:
        with LoadProcess(nice=nice):
            phases[f"llama.cpp load, backend nice {nice}"] = _phase(encoder, predictor, prompts)
    print(f"encoder {encoder.card.onnx_path.name} ({encoder.card.onnx_path.stat().st_size / 1e6:.1f} MB), "
          f"{len(prompts)} ShareGPT instructions, one at a time, 1 thread")  # fmt: skip
    print(f"{'phase':36s} {'encoder p50':>12s} {'p99':>9s} {'lexical p50':>12s} {'p99':>9s} {'ratio p50':>10s}")
    for name, p in phases.items():
        print(
            f"{name:36s} {p['encoder_p50_ms']:10.2f}ms {p['encoder_p99_ms']:7.1f}ms {p['lexical_p50_ms'] * 1e3:10.1f}us "
            f"{p['lexical_p99_ms'] * 1e3:7.0f}us {p['encoder_p50_ms'] / p['lexical_p50_ms']:9.0f}x"
        )
    if encoder.has_knn:
        assert encoder.card.knn_path is not None
        print(
            f"kNN {encoder.card.knn_path.name} ({encoder.card.knn_path.stat().st_size / 1e6:.1f} MB), same instructions: "
            "its graph alone on the pooled embedding, and encoder + kNN (EncoderModel.opinion: a waiting request)"
        )
        print(f"{'phase':36s} {'kNN p50':>12s} {'p99':>9s} {'enc+kNN p50':>12s} {'p99':>9s} {'load avg':>9s}")
        for name, p in phases.items():
            print(
                f"{name:36s} {p['knn_p50_ms']:10.2f}ms {p['knn_p99_ms']:7.1f}ms {p['encoder_with_knn_p50_ms']:10.2f}ms "
                f"{p['encoder_with_knn_p99_ms']:7.1f}ms {p['loadavg_1min']:9.2f}"
            )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"encoder_sha256": encoder.card.onnx_sha256, "knn_sha256": encoder.card.knn_sha256, "phases": phases},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
