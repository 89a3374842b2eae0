"""How far the shipped models' outputs move with ONNX Runtime's execution settings and the CPU's
instruction set: the evidence behind the golden tests' tolerances (tests/test_encoder.py) and
docs/operations.md, "What can differ across CPUs".

    python benchmarks/bench_cpu_drift.py [--save FILE] [--against FILE] [--json FILE]

For each golden prompt (tests/fixtures/encoder_golden.json) it computes, as the proxy does: the
lexical predictor's prior (ln tokens), the encoder's ln tokens, the kNN's ln tokens, the learner's
columns (16 components and the 384-d pooled embedding) and the refined prior the queue is keyed
on. Then it does the same with sessions built other ways, and prints, per variant, the largest
absolute difference of each output from the product's own sessions, and whether the golden
prompts keep their order by each output:

- the graph optimisation level: none, basic, extended, all (the product pins all): with fewer
  fusions, the int8 MatMuls, LayerNorm, GELU and attention run as other kernels;
- 2 intra-op threads instead of 1 (another split of the work and of the reductions);
- B prepacking off (``session.disable_prepacking``: the int8 GEMM reads its weights unpacked);
- flush-to-zero of denormals on; ``session.x64quantprecision`` on (int8 promoted to int16).

The instruction set itself cannot be chosen inside one process (MLAS picks its kernels from
CPUID). Under qemu-user, CPUID is the emulated CPU's, so ``--save`` on the real CPU and
``--against`` under ``qemu-x86_64 -cpu Haswell`` (AVX2 and FMA, no AVX-512, no VNNI) compare the
two kernel families (``make`` does not run this: qemu takes about a minute):

    python benchmarks/bench_cpu_drift.py --save /tmp/native.json
    qemu-x86_64 -cpu Haswell .venv/bin/python benchmarks/bench_cpu_drift.py --against /tmp/native.json

arm64 the same way, with ``qemu-aarch64 -cpu neoverse-n1`` (or ``max``), an arm64 Python (Debian's
python3.11-minimal and its libraries, unpacked with ``dpkg -x`` into a folder given to ``-L``) and
the arm64 wheels of numpy, onnxruntime and tokenizers (``pip install --target DIR --platform
manylinux_2_28_aarch64 --only-binary :all: --no-deps``). qemu 7.2 shows the host's /proc/cpuinfo,
on which ONNX Runtime's CPU detection crashes: bind an arm64 one over it in a mount namespace of
its own (``unshare -m``, then ``mount --bind``).

Not a timed benchmark: the figures are differences of values, the same on every run of one CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from harness.results import add_json_option, write_json

from clairvoyant.prediction import encoder as encoder_module
from clairvoyant.prediction import predictor as predictor_module
from clairvoyant.prediction.encoder import EncoderModel, refined_by
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import OnnxPredictor

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "encoder_golden.json"
OUTPUTS = ("lexical", "encoder", "knn", "refined", "columns")
RANKED = ("lexical", "encoder", "knn", "refined")  # the columns are no ranking


def _variant(level: str = "ORT_ENABLE_ALL", threads: int = 1, **config: str) -> Callable[..., Any]:
    """A stand-in for ``predictor.single_threaded_session`` that builds its session another way."""

    def build(path: Path, what: str, content: bytes | None = None) -> Any:
        import onnxruntime as ort

        options = predictor_module.pinned_session_options()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        options.intra_op_num_threads = threads
        for key, value in config.items():
            options.add_session_config_entry(key, value)
        model = str(path) if content is None else content
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])

    return build


VARIANTS: dict[str, Callable[..., Any] | None] = {
    "product (all optimisations, 1 thread)": None,
    "no graph optimisation": _variant("ORT_DISABLE_ALL"),
    "basic graph optimisation": _variant("ORT_ENABLE_BASIC"),
    "extended graph optimisation": _variant("ORT_ENABLE_EXTENDED"),
    "2 intra-op threads": _variant(threads=2),
    "no weight prepacking": _variant(**{"session.disable_prepacking": "1"}),
    "denormals flushed to zero": _variant(**{"session.set_denormal_as_zero": "1"}),
    "x64 quant precision (int8 as int16)": _variant(**{"session.x64quantprecision": "1"}),
}


def outputs(texts: list[str], build: Callable[..., Any] | None) -> dict[str, list[Any]]:
    """Every output the golden prompts get from sessions made by ``build`` (None: the product's)."""
    product = predictor_module.single_threaded_session
    if build is not None:
        predictor_module.single_threaded_session = build  # type: ignore[assignment]
        encoder_module.single_threaded_session = build  # type: ignore[assignment]
    try:
        predictor, encoder = OnnxPredictor(), EncoderModel()
    finally:
        predictor_module.single_threaded_session = product
        encoder_module.single_threaded_session = product
    got: dict[str, list[Any]] = {name: [] for name in OUTPUTS}
    for text in texts:
        lexical = predictor.predict(Prompt(text))
        value, columns, knn = encoder.opinion(text)
        got["lexical"].append(lexical.prior_log_tokens)
        got["encoder"].append(value)
        got["knn"].append(knn)
        got["refined"].append(refined_by(encoder, predictor, lexical, text).prior_log_tokens)
        got["columns"].append(np.frombuffer(columns, dtype=np.float32).tolist())
    return got


def drift(base: dict[str, list[Any]], other: dict[str, list[Any]]) -> dict[str, Any]:
    """The largest absolute difference of each output, and whether each ranking is kept."""
    row: dict[str, Any] = {}
    for name in OUTPUTS:
        row[f"{name}_max_abs"] = float(np.max(np.abs(np.asarray(base[name]) - np.asarray(other[name]))))
    for name in RANKED:
        row[f"{name}_order_kept"] = bool(np.argsort(base[name], kind="stable").tolist() == _order(other[name]))
    return row


def _order(values: list[float]) -> list[int]:
    return np.argsort(values, kind="stable").tolist()  # type: ignore[no-any-return]


def smallest_gaps(base: dict[str, list[Any]]) -> dict[str, float]:
    """Per ranking, the smallest gap between two golden prompts' values: a drift below half of it
    cannot swap two of them."""
    return {name: float(np.min(np.diff(np.sort(np.asarray(base[name]))))) for name in RANKED}


def _cpu() -> dict[str, Any]:
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features  # numpy 2: read from CPUID
    except ImportError:  # pragma: no cover - numpy 1
        from numpy.core._multiarray_umath import __cpu_features__ as features
    wanted = ("AVX2", "FMA3", "AVX512F", "AVX512VNNI", "AVX512_SPR")  # numpy names; AMX is not among them
    return {"machine": platform.machine(), **{name: bool(features.get(name)) for name in wanted}}


def _print_row(label: str, row: dict[str, Any]) -> None:
    figures = "  ".join(f"{row[f'{n}_max_abs']:9.2e}" for n in OUTPUTS)
    kept = " ".join("yes" if row[f"{n}_order_kept"] else "NO " for n in RANKED)
    print(f"{label:40s} {figures}   {kept}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", type=Path, help="write the product's outputs here (to compare under another CPU)")
    parser.add_argument("--against", type=Path, help="compare the product's outputs here with ones --save wrote")
    add_json_option(parser, "cpu_drift")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # the variants overwrite a pinned entry on purpose: no warning for it
    texts = [case["text"] for case in json.loads(GOLDEN.read_text())["cases"]]
    cpu = _cpu()
    print(f"CPU as ONNX Runtime's CPUID sees it: {cpu}")
    base = outputs(texts, None)
    result: dict[str, Any] = {"cpu": cpu, "smallest_gaps": smallest_gaps(base), "variants": {}}
    if args.save:
        args.save.write_text(json.dumps({"cpu": cpu, "outputs": base}))
        print(f"wrote {args.save}")
    header = "  ".join(f"{n:>9s}" for n in OUTPUTS)
    print(f"{'largest |difference|, ln tokens':40s} {header}   order kept ({', '.join(RANKED)})")
    if args.against:
        saved = json.loads(args.against.read_text())
        row = drift(saved["outputs"], base)
        result["against"] = {"saved_cpu": saved["cpu"], **row}
        _print_row("this CPU vs the saved one", row)
    else:
        for label, build in VARIANTS.items():
            row = drift(base, base if build is None else outputs(texts, build))
            result["variants"][label] = row
            _print_row(label, row)
    gaps = ", ".join(f"{n} {g:.4f}" for n, g in result["smallest_gaps"].items())
    print(f"smallest gap between two golden prompts (ln tokens): {gaps}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
