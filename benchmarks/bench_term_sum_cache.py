"""The feature extractor with its keyword and lexicon table out of cache, for one or two builds (issue 12).

The rich_v3 term table is about 2.6 MB (1 MiB of slots, 1.25 MiB of values, ~10,000 keys):
between requests the proxy touches enough other memory that much of it is no longer cached, and
each word's probe then waits for memory. This times, on bench_predictor's prompts (its first ``--requests``, seed 0), the
compiled term sum alone and the whole ``FEATURE_SETS["rich_v3"].values(prompt)``, each call
either right after the same call (``warm``) or after ``--evict-mib`` MiB of other memory was
written (``cold``), on two sets: the windows with the most words (``heavy``: the predictor's p99)
and the first prompts (``typical``). Words are split afresh before each term-sum call, as the
extractor does.

    PYTHONPATH=src:benchmarks python benchmarks/bench_term_sum_cache.py [--base /tmp/wt-base-lib] [--turns 3]

``--base``: another build's package root, e.g. ``git worktree add /tmp/wt-base <commit> && python -m
pip install --no-deps --target /tmp/wt-base-lib /tmp/wt-base`` (its extensions built as pip builds
them), then ``--base /tmp/wt-base-lib``. The builds run
in turns, each in its own process, ``--turns`` times; the table gives each build's median over its
turns of the per-turn medians (us). Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = ("term_sum heavy", "term_sum typical", "features heavy", "features typical")


def measure(requests: int, heavy: int, typical: int, evict_mib: int) -> dict[str, dict[str, float]]:
    """Median us per case, warm and cold, in this process's build."""
    import numpy as np
    from bench_predictor import _prompts  # beside this script (run as one: sys.path[0])

    from clairvoyant.prediction import features

    table = features._rich_v3_table()
    term_sum = features._term_sum
    if term_sum is None or table.compiled is None:
        raise SystemExit("this build has no compiled term sum")
    values = features.FEATURE_SETS["rich_v3"].values
    prompts = _prompts(requests)

    head, tail = features.RICH_V2_HEAD_CHARS, features.RICH_V2_TAIL_CHARS

    def window(text: str) -> bytes:  # the rich_v3 scan window, as the extractor cuts it
        text = text if len(text) <= head + tail else text[:head] + "\n" + text[-tail:]
        return text.encode("utf-8", "surrogatepass").lower()

    raws = [window(p.instruction) for p in prompts]
    by_words = sorted(range(len(prompts)), key=lambda i: len(raws[i].split()))
    sets = {"heavy": by_words[-heavy:], "typical": list(range(typical))}
    junk = np.zeros(evict_mib << 20, dtype=np.uint8)
    clock = time.perf_counter_ns
    compiled = table.compiled
    word_table = features._WORD_TABLE

    def term_sum_call(i: int) -> int:
        words = raws[i].translate(word_table).split()  # split afresh: the words hot, as in the extractor
        t0 = clock()
        term_sum.term_sum(compiled, words, True)
        return clock() - t0

    def features_call(i: int) -> int:
        prompt = prompts[i]
        t0 = clock()
        values(prompt)
        return clock() - t0

    out: dict[str, dict[str, float]] = {}
    for name, chosen in sets.items():
        for part, timed in (("term_sum", term_sum_call), ("features", features_call)):
            result = {}
            for mode in ("warm", "cold"):
                times = []
                for i in chosen:
                    if mode == "warm":
                        timed(i)  # the same call just before: the table's lines for these words cached
                    else:
                        junk[::64] += 1  # one write a cache line: evicts what the table left in cache
                    times.append(timed(i) / 1000.0)
                result[mode] = float(np.median(times))
            out[f"{part} {name}"] = result
    return out


def _run_build(src: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    argv = [
        sys.executable, __file__, "--measure", "--requests", str(args.requests), "--heavy", str(args.heavy),
        "--typical", str(args.typical), "--evict-mib", str(args.evict_mib),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{HERE}"}
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    result: dict[str, dict[str, float]] = json.loads(done.stdout.splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="another build's package root (pip install --target)")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--heavy", type=int, default=240, help="windows with the most words")
    parser.add_argument("--typical", type=int, default=2000, help="the first prompts")
    parser.add_argument("--evict-mib", type=int, default=4, help="memory written before each cold call")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.requests, args.heavy, args.typical, args.evict_mib)))
        return 0
    builds = {"this": ROOT / "src"}
    if args.base is not None:
        builds["base"] = args.base
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in builds}
    for turn in range(args.turns):
        order = list(builds) if turn % 2 == 0 else list(builds)[::-1]
        for name in order:
            runs[name].append(_run_build(builds[name], args))
    print(f"median of {args.turns} turns of per-call medians, us; cold = after writing {args.evict_mib} MiB")
    header = " | ".join(f"{name} warm | {name} cold" for name in builds)
    print(f"| case | {header} |")
    print("|---|" + "---:|" * (2 * len(builds)))
    for case in CASES:
        cells = []
        for name in builds:
            for mode in ("warm", "cold"):
                cells.append(f"{statistics.median(run[case][mode] for run in runs[name]):.2f}")
        print(f"| {case} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
