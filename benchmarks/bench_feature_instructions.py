"""Instructions per rich_v3 feature extraction, under callgrind, for one or two builds (issue 12).

The predictor's tail is feature extraction on long prompts (benchmarks/predictor_results.json:
features_only p99 >> onnx_only p99). This counts, per ``FEATURE_SETS["rich_v3"].values(prompt)``
call, the instructions on four sets of bench_predictor's prompts (its first ``--requests``,
seed 0): the prompt nearest the median length, the one nearest the 99th-percentile length, all
prompts under 200 characters (the bulk, where p50 lives) and all of 600 or more (the scan window
is full: the tail). Only the extraction loop is counted (callgrind collects inside ``builtin_all``
alone), so start-up and prompt loading do not blur the figure.

    PYTHONPATH=src:benchmarks python benchmarks/bench_feature_instructions.py [--base /tmp/wt-base/src]

``--base``: another checkout's ``src`` (e.g. ``git worktree add /tmp/wt-base <commit>``), counted on
the same prompts, one process at a time. Needs valgrind.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHILD = """
import pickle, sys
from clairvoyant.prediction.features import FEATURE_SETS
values = FEATURE_SETS["rich_v3"].values
prompts = pickle.loads(open(sys.argv[1], "rb").read())
for p in prompts:
    values(p)  # warm: first-call allocations, hashes cached on the lexicon's keys
calls = prompts * int(sys.argv[2])
all(map(values, calls))  # the only builtin_all call: callgrind counts inside it
print("calls", len(calls), file=sys.stderr)
"""


def _count(src: str, prompts_file: str, repeat: int) -> float:
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--toggle-collect=builtin_all", "--callgrind-out-file=/dev/null",
         sys.executable, "-c", CHILD, prompts_file, str(repeat)],
        env={**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": "0"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    refs = re.search(r"refs:\s+([\d,]+)", out.stderr)
    calls = re.search(r"calls (\d+)", out.stderr)
    if refs is None or calls is None:
        raise RuntimeError(f"no count in valgrind's output: {out.stderr[-500:]}")
    return int(refs.group(1).replace(",", "")) / int(calls.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--base", help="another checkout's src directory, counted alike")
    args = parser.parse_args()
    from bench_predictor import _prompts

    prompts = _prompts(args.requests)
    lengths = np.array([len(p.instruction) for p in prompts])

    def nearest(q: float) -> list:
        target = np.percentile(lengths, q)
        return [min(prompts, key=lambda p: (abs(len(p.instruction) - target), p.instruction))]

    sets = {
        "median-length prompt": (nearest(50), 200),
        "p99-length prompt": (nearest(99), 200),
        "all < 200 chars": ([p for p in prompts if len(p.instruction) < 200], 2),
        "all >= 600 chars": ([p for p in prompts if len(p.instruction) >= 600], 5),
    }
    builds = {"this": str(Path(__file__).resolve().parents[1] / "src")}
    if args.base:
        builds["base"] = args.base
    print(f"{'prompts':22s} {'n':>5s} {'chars':>7s} " + " ".join(f"{b:>12s}" for b in builds) + "   ratio")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (chosen, repeat) in sets.items():
            path = os.path.join(tmp, "prompts.pickle")
            Path(path).write_bytes(pickle.dumps(chosen))
            counts = {b: _count(src, path, repeat) for b, src in builds.items()}
            chars = np.mean([len(p.instruction) for p in chosen])
            ratio = f"{counts['base'] / counts['this']:6.2f}x" if "base" in counts else ""
            print(
                f"{name:22s} {len(chosen):5d} {chars:7.0f} " + " ".join(f"{c:12,.0f}" for c in counts.values()),
                ratio,
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
