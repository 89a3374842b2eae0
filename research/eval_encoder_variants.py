"""Issue 8, task B: each exported encoder variant (export_encoder_v3.py) scored as serving would run it: `tokenizers`
(tokenizer.json: lowercasing inside, truncation to 128 word pieces incl. [CLS]/[SEP], no padding), one prompt per
run, onnxruntime with 1 intra-op thread, loaded by load_encoder (fp16-stored initializers upcast at load).
Per variant: file size, AlpacaEval dev tau_b per model + mean, largest |log_tokens - fp32| and smallest embedding
cosine to fp32. With --time: p50/p99 per prompt on ShareGPT prompts, idle and while llama.cpp generates
(benchmarks/predictor_load.py). With --dump NAME: the variant's log_tokens + embeddings for AlpacaEval and every
English ShareGPT held-out row (all turns: the turn's user text only) -> --out/scores_NAME.npz for the blend study.
torch is never imported.

    PYTHONPATH=benchmarks nice -n 10 /tmp/encvenv/bin/python research/eval_encoder_variants.py --dir /tmp/rcache/enc3 \
        --time fp32,emb8_fp16 --dump emb8_fp16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from export_encoder_v3 import load_encoder

MAIN_PYTHON = "/work/main/.venv/bin/python"
CACHE = Path("/tmp/rcache")
MAX_TOKENS = 128
MAX_CHARS = 4000


def main() -> None:
    from scipy.stats import kendalltau
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--alpaca", type=Path, default=Path("/work/shared/data/alpaca_eval_dev.jsonl"))
    parser.add_argument("--variants", default="fp32,fp16,emb8,emb8_fp16,emb8_mm8")
    parser.add_argument("--time", default="", help="comma-separated variants to time")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--dump", default="", help="a variant whose scores and embeddings to save")
    args = parser.parse_args()
    tok = Tokenizer.from_file(str(args.dir / "tokenizer.json"))
    tok.enable_truncation(MAX_TOKENS)
    tok.no_padding()
    rows = [json.loads(line) for line in args.alpaca.read_text().splitlines() if line.strip()]
    models = sorted(rows[0]["output_tokens"])
    atexts = [r["prompt"] for r in rows]
    lengths = np.array([[r["output_tokens"][m] for m in models] for r in rows])
    a_ids = [np.asarray([tok.encode(t[:MAX_CHARS]).ids], dtype=np.int64) for t in atexts]
    sharegpt = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    bench = [sharegpt[i] for i in np.random.default_rng(0).permutation(len(sharegpt))[: args.requests]]
    timed = set(filter(None, args.time.split(",")))
    results: dict = {}
    ref = None
    for name in args.variants.split(","):
        path = args.dir / "variants" / f"{name}.onnx"
        session = load_encoder(path)

        def run(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            out = session.run(["log_tokens", "embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
            return out[0], out[1]

        outs = [run(ids) for ids in a_ids]
        lt = np.array([o[0][0] for o in outs])
        emb = np.stack([o[1][0] for o in outs])
        per = [float(kendalltau(lt, lengths[:, m], variant="b").statistic) for m in range(len(models))]
        entry: dict = {"bytes": path.stat().st_size, "alpaca": per, "alpaca_mean": float(np.mean(per))}
        if ref is None:
            ref = (lt, emb)
        entry["max_abs_log_tokens_diff_vs_fp32"] = float(np.abs(lt - ref[0]).max())
        cos = (emb * ref[1]).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref[1], axis=1)
        entry["min_embedding_cosine_vs_fp32"] = float(cos.min())
        if name in timed:

            def timing() -> dict:
                ts = []
                for t in bench:
                    a = time.perf_counter_ns()
                    run(np.asarray([tok.encode(t[:MAX_CHARS]).ids], dtype=np.int64))
                    ts.append(time.perf_counter_ns() - a)
                ms = np.array(ts) / 1e6
                return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "n": len(ms),
                        "loadavg_1min": float(open("/proc/loadavg").read().split()[0])}

            entry["idle"] = timing()
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
        results[name] = entry
        print(name, json.dumps(entry), flush=True)
        if name == args.dump:
            s = np.load(CACHE / "sharegpt.npz")
            held = np.flatnonzero(s["test"] & s["english"])
            h_lt = np.empty(len(held), np.float32)
            h_emb = np.empty((len(held), 384), np.float32)
            for k, i in enumerate(held):
                o = run(np.asarray([tok.encode(sharegpt[i][:MAX_CHARS]).ids], dtype=np.int64))
                h_lt[k], h_emb[k] = o[0][0], o[1][0]
            np.savez(args.dir / f"scores_{name}.npz", alpaca=lt, alpaca_emb=emb, heldout_rows=held, heldout=h_lt,
                     heldout_emb=h_emb)
            print("saved", args.dir / f"scores_{name}.npz", flush=True)
    out = args.dir / "variants.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**old, **results}, indent=1))


if __name__ == "__main__":
    main()
