"""Per-request predictor overhead: features + ONNX, one request at a time, real ShareGPT prompts.

    python benchmarks/bench_predictor.py [--model model/predictor.onnx] [--requests 12000]
        [--no-load] [--load-nice 0 10] [--compare OTHER.onnx ...] [--no-gc-freeze] [--json FILE] [--write-card]

Phases: idle, then with a real llama.cpp server (xllamacpp + SmolLM2-135M, 2 threads) generating
continuously in a background process on the same cores (optionally also with the backend at a
lower CPU priority, ``--load-nice 0 10``: a deployment choice that the p99 depends on). Each phase times, per request, the full
``OnnxPredictor.predict(prompt)`` call and, separately, feature extraction alone and the model's
bound ONNX Runtime run alone, plus the floor: ``run_with_iobinding`` of a one-node Identity ONNX graph (the bare
cost of calling ONNX Runtime from Python). A first, separately reported pass touches every
prompt once (as the proxy's JSON parsing does) before the timed passes. Prompts are the proxy's own Prompts (history included)
for every user turn of ShareGPT, shuffled with seed 0. With ``--write-card``, p50 and p99 go into
the model card (model/predictor.card.json and MODEL_CARD.md).

The four timings are interleaved: per prompt, predict, features, ONNX run and floor in turn (the
order rotating from prompt to prompt). These shared cores change speed by up to ~1.7x from one
second to the next (the floor's p50 moved 2.6 -> 4.7 us between phases of one run), so timing
each in its own pass could put predict and its parts in different speeds; interleaved, the floor
is a reference taken at the same moments.

The cyclic garbage collector stays on, as in the proxy, and the heap built before the timed phases
(the predictor, the loaded prompts) is frozen out of its way with ``gc.freeze()``, as
``clairvoyant serve`` freezes its start-up heap; ``--no-gc-freeze`` times without the freeze.

Not a timed test: numbers depend on the machine and its neighbours; the JSON result records the
load average at the start of each phase.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from harness.results import add_json_option, write_json

from clairvoyant.errors import ModelError
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH, OnnxPredictor, _bound_runner, load_card


def _prompts(n: int) -> list[Prompt]:
    from clairvoyant.tools.training.dataset import load_pairs

    pairs = load_pairs()
    order = np.random.default_rng(0).permutation(len(pairs))[:n]
    return [pairs[i].prompt for i in order]


def _identity_session() -> tuple[Any, Any]:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "floor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.zeros((1, 3), dtype=np.float32)
    y = np.zeros((1, 3), dtype=np.float32)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x))
    binding.bind_output("y", "cpu", 0, np.float32, [1, 3], y.ctypes.data)
    assert onnx is not None
    return session, (_bound_runner(session, binding), x, y)


class CardPathTimer:
    """The serving hot path for any schema-2 card, for models the installed OnnxPredictor cannot load
    (a regressor card before the card-contract predictor is merged): pack the feature row into a bound
    buffer, run ONNX once, read the score, map it to ln tokens through the card's calibration
    (bisect + linear interpolation, what np.interp does for one value). Same session options as serving.
    """

    def __init__(self, path: Path) -> None:
        import bisect
        import struct

        import onnxruntime as ort

        from clairvoyant.prediction.features import get_feature_set

        self.card = load_card(path)
        self.feature_set = get_feature_set(self.card["feature_set"])
        self.feature_set_name = self.feature_set.name
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        output = self.card.get("output", "probabilities")
        width = 3 if self.card.get("kind", "classifier") == "classifier" else 1
        self._column = 2 if width == 3 else 0
        self._row = np.zeros((1, self.feature_set.size), dtype=np.float32)
        self._out = np.zeros((1, width), dtype=np.float32)
        self._binding = self._session.io_binding()
        self._binding.bind_ortvalue_input(
            self._session.get_inputs()[0].name, ort.OrtValue.ortvalue_from_numpy(self._row)
        )
        self._binding.bind_output(output, "cpu", 0, np.float32, [1, width], self._out.ctypes.data)
        self._run_bound = functools.partial(self._session.run_with_iobinding, self._binding)
        self._pack_into = struct.Struct(f"={self.feature_set.size}f").pack_into
        self._values = self.feature_set.values
        calib = self.card.get("calibration") or {"score": [0.0, 1.0], "log_tokens": [0.0, 1.0]}
        self._xs, self._ys = list(calib["score"]), list(calib["log_tokens"])
        self._bisect = bisect.bisect_right

    def predict(self, prompt: Prompt) -> tuple[float, float]:
        self._pack_into(self._row, 0, *self._values(prompt))
        self._run_bound()
        score = float(self._out[0, self._column])
        xs, ys = self._xs, self._ys
        k = self._bisect(xs, score)
        if k == 0:
            return score, ys[0]
        if k == len(xs):
            return score, ys[-1]
        x0, x1 = xs[k - 1], xs[k]
        return score, ys[k - 1] + (ys[k] - ys[k - 1]) * (score - x0) / (x1 - x0)


def _time_each(fn: Callable[[Any], object], items: list[Any]) -> np.ndarray:
    """Microseconds of fn(item) for each item, one at a time (perf_counter_ns around each call)."""
    return _time_interleaved([fn], items)[0]


def _time_interleaved(fns: list[Callable[[Any], object]], items: list[Any]) -> list[np.ndarray]:
    """Microseconds of each fn(item), per item every fn in turn, the order rotating with the item
    (no fn always runs first, on the colder caches)."""
    clock = time.perf_counter_ns
    n = len(fns)
    out = np.empty((n, len(items)), dtype=np.float64)
    for k, item in enumerate(items):
        for j in range(n):
            f = (k + j) % n
            fn = fns[f]
            t0 = clock()
            fn(item)
            out[f, k] = clock() - t0
    return list(out / 1000.0)


def _stats(us: np.ndarray) -> dict[str, float]:
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p90_us": float(np.percentile(us, 90)),
        "p99_us": float(np.percentile(us, 99)),
        "mean_us": float(us.mean()),
        "n": int(len(us)),
    }


def _phase(predictor: Any, prompts: list[Prompt], floor: tuple[Any, Any]) -> dict[str, Any]:
    fs = predictor.feature_set
    row = np.zeros(fs.size, dtype=np.float32)
    _, (run_floor, _, _) = floor
    onnx_run = predictor._bound.run if isinstance(predictor, OnnxPredictor) else predictor._run_bound
    # First pass: every prompt's memory touched once, as a proxy request's text is (it was just
    # parsed from the body). Timed and reported separately: cold caches, page faults.
    cold = _stats(_time_each(predictor.predict, prompts))
    load = os.getloadavg()[0]
    fns = [
        predictor.predict,
        lambda p: fs.extract_into(p, row),
        lambda _: onnx_run(),
        lambda _: run_floor(),
    ]
    predict, features, onnx, floor_run = _time_interleaved(fns, prompts)
    return {
        "loadavg_1min_at_start": load,
        "predict_first_pass_cold": cold,
        "predict": _stats(predict),
        "features_only": _stats(features),
        "onnx_only": _stats(onnx),  # the model's bound ONNX Runtime run
        "floor_identity_run": _stats(floor_run),
    }


def _bench_model(path: Path, prompts: list[Prompt], floor: tuple[Any, Any]) -> dict[str, Any]:
    try:
        predictor: Any = OnnxPredictor(path)
        timed_with = "clairvoyant.prediction.predictor.OnnxPredictor.predict"
    except ModelError:  # a card this checkout's predictor does not read yet (e.g. a schema-2 regressor)
        predictor = CardPathTimer(path)
        timed_with = "bench_predictor.CardPathTimer.predict (features + bound ONNX run + calibration)"
    return {
        "model": str(path),
        "feature_set": predictor.feature_set_name,
        "timed_with": timed_with,
        "trees": predictor.card.get("hyperparameters", {}),
        **_phase(predictor, prompts, floor),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--requests", type=int, default=12_000)
    parser.add_argument("--compare", type=Path, nargs="*", default=[], help="other models to time alike")
    parser.add_argument("--no-load", action="store_true", help="idle phase only")
    parser.add_argument(
        "--write-card", action="store_true", help="write p50/p99 into the card of --model (default: print only)"
    )
    parser.add_argument(
        "--load-nice",
        type=int,
        nargs="*",
        default=[0],
        help="nice values of the llama.cpp load, one loaded phase each (0 = same priority)",
    )
    parser.add_argument("--no-gc-freeze", action="store_true", help="do not gc.freeze() the start-up heap")
    add_json_option(parser, "predictor")
    args = parser.parse_args(argv)

    prompts = _prompts(args.requests)
    floor = _identity_session()
    chars = np.array([len(p.instruction) for p in prompts])
    report: dict[str, Any] = {
        "requests": len(prompts),
        "prompt_chars": {"p50": float(np.percentile(chars, 50)), "p99": float(np.percentile(chars, 99))},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "gc": "enabled (as in the proxy)"
        + ("" if args.no_gc_freeze else ", start-up heap frozen (as in clairvoyant serve)"),
        "phases": {},
    }
    models = [args.model, *args.compare]
    gc.collect()
    if not args.no_gc_freeze:
        gc.freeze()
    report["phases"]["idle"] = [_bench_model(m, prompts, floor) for m in models]
    if not args.no_load:
        from harness.predictor_load import LoadProcess

        for nice in args.load_nice:
            with LoadProcess(nice=nice):
                time.sleep(2.0)
                name = "under_llamacpp_load" + (f"_nice{nice}" if nice else "")
                report["phases"][name] = [_bench_model(m, prompts, floor) for m in models]
    for phase, rows in report["phases"].items():
        for r in rows:
            print(
                f"{phase:22s} {Path(r['model']).name:24s} predict p50 {r['predict']['p50_us']:7.1f} us  "
                f"p99 {r['predict']['p99_us']:7.1f} us | features p50 {r['features_only']['p50_us']:6.1f} | "
                f"model p50 {r['onnx_only']['p50_us']:6.1f} | "
                f"floor p50 {r['floor_identity_run']['p50_us']:5.1f} "
                f"p99 {r['floor_identity_run']['p99_us']:5.1f} (load {r['loadavg_1min_at_start']:.1f})"
            )
    write_json(args.json, report)
    if args.write_card:
        from clairvoyant.tools.training import card as card_md
        from clairvoyant.tools.training.export import update_card

        latency: dict[str, Any] = {
            "benchmark": "benchmarks/bench_predictor.py",
            "requests": len(prompts),
            "paper_go_onnx_reference_ms": 0.029,
        }
        for phase, rows in report["phases"].items():
            r = rows[0]
            latency[f"{phase}_predict_p50_ms"] = round(r["predict"]["p50_us"] / 1000, 4)
            latency[f"{phase}_predict_p99_ms"] = round(r["predict"]["p99_us"] / 1000, 4)
            latency[f"{phase}_features_p50_ms"] = round(r["features_only"]["p50_us"] / 1000, 4)
            latency[f"{phase}_onnx_p50_ms"] = round(r["onnx_only"]["p50_us"] / 1000, 4)
            latency[f"{phase}_floor_identity_run_p50_ms"] = round(r["floor_identity_run"]["p50_us"] / 1000, 4)
            latency[f"{phase}_floor_identity_run_p99_ms"] = round(r["floor_identity_run"]["p99_us"] / 1000, 4)
            latency[f"{phase}_loadavg_1min"] = round(r["loadavg_1min_at_start"], 2)
        update_card(args.model, "latency", latency)
        card_md.write_markdown(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
