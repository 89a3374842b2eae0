"""Step 4 (research): cost per prompt of the ONNX MiniLM regressor without torch: `tokenizers` + onnxruntime
(single-threaded session, as serving runs its models), idle and under a real llama.cpp generation load
(benchmarks/predictor_load.py), plus its transfer figure from the ONNX file (to check the export and the
int8 quantization). The timed process never imports torch: it runs in a venv with onnxruntime, numpy, scipy and
`tokenizers` only (the research venv; the main venv has no `tokenizers`); the llama.cpp load child runs with the
main venv's Python (xllamacpp lives there).

    PYTHONPATH=benchmarks /tmp/encvenv/bin/python research/bench_encoder.py --dir /tmp/rcache/enc --alpaca /work/shared/data/alpaca_eval_dev.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

MAIN_PYTHON = "/work/main/.venv/bin/python"


def main() -> None:
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from scipy.stats import kendalltau
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--alpaca", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-load", action="store_true")
    args = parser.parse_args()
    fp32 = args.dir / "minilm_regressor.fp32.onnx"
    int8 = args.dir / "minilm_regressor.int8.onnx"
    if not int8.exists():
        quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    tok = Tokenizer.from_file(str(args.dir / "tokenizer.json"))
    tok.enable_truncation(args.max_tokens)
    tok.no_padding()
    rows = [json.loads(line) for line in args.alpaca.read_text().splitlines() if line.strip()]
    models = sorted(rows[0]["output_tokens"])
    texts = [r["prompt"] for r in rows]
    sharegpt = [json.loads(line)["instruction"] for line in Path("/tmp/rcache/texts.jsonl").read_text().splitlines()]
    bench_texts = [sharegpt[i] for i in np.random.default_rng(0).permutation(len(sharegpt))[: args.requests]]
    result: dict = {}
    for name, path in (("fp32", fp32), ("int8", int8)):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

        def score(text: str) -> float:
            enc = tok.encode(text[:4000])
            ids = np.asarray([enc.ids], dtype=np.int64)
            return float(session.run(["log_tokens"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0])

        s = np.array([score(t) for t in texts])
        per = [float(kendalltau(s, [r["output_tokens"][m] for r in rows], variant="b").statistic) for m in models]
        entry = {"bytes": path.stat().st_size, "alpaca_tau": per, "alpaca_mean_tau": float(np.mean(per))}

        def timing() -> dict:
            ts = []
            for t in bench_texts:
                a = time.perf_counter_ns()
                score(t)
                ts.append(time.perf_counter_ns() - a)
            us = np.array(ts) / 1000
            return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)), "n": len(us)}

        entry["idle"] = timing()
        if not args.no_load:
            import sys

            from predictor_load import LoadProcess

            own = sys.executable
            sys.executable = MAIN_PYTHON  # LoadProcess starts its child with sys.executable
            try:
                with LoadProcess():
                    time.sleep(2.0)
                    entry["under_llamacpp_load"] = timing()
            finally:
                sys.executable = own
            assert "torch" not in sys.modules
        result[name] = entry
        print(name, json.dumps(entry), flush=True)
    (args.dir / "bench.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
