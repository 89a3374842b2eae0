"""The predictor of two builds side by side: this checkout's against another's (by default the build
issue 12 measured), on the same prompts, in the same minutes.

    python benchmarks/bench_predictor_builds.py --baseline-src /tmp/wt-issue/src
        [--requests 4000] [--batch 100] [--load-nice 0 10] [--no-load] [--json FILE]

    git worktree add /tmp/wt-issue 89bb859   # the build issue 12 measured (its "42-53 us")

Why: the predictor's microseconds move with the host (a floor of 2.6-3.2 us on one CPU, 6-15 on
another: docs/benchmarks.md 29c), so a figure from one host says little against a target set on
another. Run side by side, the ratio of the two builds says what the code changed.

Each build runs in its own worker process (``--worker``, with ``PYTHONPATH`` at that build's src),
loads its own default model (``OnnxPredictor()``) and times ``predict(prompt)`` one call at a time
(``perf_counter_ns`` around each), after one untimed pass over every prompt and with its start-up
heap frozen, as ``clairvoyant serve`` does. The prompts are ``bench_predictor.py``'s (ShareGPT
user turns with their history, shuffled with seed 0), sent to both. The parent hands both workers
the same batch of prompts in turn, in a random order per batch, so that each batch is timed by
both within a fraction of a second. Phases: idle, then with a real llama.cpp generating
(``predictor_load.py``) at each ``--load-nice``.

Prints, per phase, each build's p50 and p99 in us and the ratios this / baseline: of the p50s, of
the p99s, and the median over batches of the per-batch p50 ratio. Not a timed test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # bench_predictor's prompts, predictor_load's llama.cpp (when imported, not run)
RESULTS = HERE / "predictor_builds_results.json"


def _worker(prompt_file: str) -> int:
    """The worker's loop: reads ``start end`` lines, answers each with one JSON line: the us of every
    ``predict`` in ``prompts[start:end]`` and the predicted tokens (the builds' answers compared)."""
    from clairvoyant.prediction.features import Prompt
    from clairvoyant.prediction.predictor import OnnxPredictor

    prompts = [Prompt(*fields) for fields in json.loads(Path(prompt_file).read_text())]
    predictor = OnnxPredictor()
    predict = predictor.predict
    for prompt in prompts:  # every prompt's memory touched once, as a request's text is by parsing
        predict(prompt)
    gc.collect()
    gc.freeze()
    clock = time.perf_counter_ns
    print(json.dumps({"ready": str(predictor.model_path)}), flush=True)
    for line in sys.stdin:
        start, end = map(int, line.split())
        times_us: list[float] = []
        tokens: list[float] = []
        for prompt in prompts[start:end]:
            t0 = clock()
            prediction = predict(prompt)
            times_us.append((clock() - t0) / 1000.0)
            tokens.append(prediction.predicted_tokens)
        print(json.dumps({"us": times_us, "tokens": tokens}), flush=True)
    return 0


class Worker:
    """One build's worker process."""

    def __init__(self, name: str, src: Path, prompt_file: str) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", prompt_file],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        try:
            self.model = str(self._read()["ready"])
        except BaseException:
            self.close()
            raise
        self.times_us: list[float] = []
        self.tokens: list[float] = []

    def _read(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited ({self.proc.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def time_batch(self, start: int, end: int) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{start} {end}\n")
        self.proc.stdin.flush()
        answer = self._read()
        self.times_us += answer["us"]
        self.tokens += answer["tokens"]
        return list(answer["us"])

    def close(self) -> None:
        """Ends the worker (its stdin closed ends its loop) and closes the pipes."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def run_phase(workers: list[Worker], n: int, batch: int, rng: random.Random) -> dict[str, Any]:
    """Every batch of ``batch`` prompts timed by every worker in a random order; the phase's
    figures (us) per worker and the ratios of the first worker to the second."""
    for w in workers:
        w.times_us, w.tokens = [], []
    batch_p50_ratios: list[float] = []
    orders = {"this first": 0, "baseline first": 0}
    for start in range(0, n, batch):
        end = min(n, start + batch)
        order = list(workers)
        rng.shuffle(order)
        orders["this first" if order[0] is workers[0] else "baseline first"] += 1
        p50 = {w.name: statistics.median(w.time_batch(start, end)) for w in order}
        batch_p50_ratios.append(p50[workers[0].name] / p50[workers[1].name])
    this, base = workers
    result: dict[str, Any] = {
        "loadavg_1min_at_end": os.getloadavg()[0],
        "orders": orders,
        "different_predictions": sum(a != b for a, b in zip(this.tokens, base.tokens, strict=True)),
    }
    for w in workers:
        result[w.name] = {
            "p50_us": _percentile(w.times_us, 50),
            "p90_us": _percentile(w.times_us, 90),
            "p99_us": _percentile(w.times_us, 99),
            "n": len(w.times_us),
        }
    result["ratio_p50"] = result["this"]["p50_us"] / result["baseline"]["p50_us"]
    result["ratio_p99"] = result["this"]["p99_us"] / result["baseline"]["p99_us"]
    result["ratio_p50_median_of_batches"] = statistics.median(batch_p50_ratios)
    return result


def _prompt_fields(n: int) -> list[list[Any]]:
    from bench_predictor import _prompts

    return [[p.instruction, p.context_chars, p.turns, p.system_chars] for p in _prompts(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", type=Path, required=True, help="the other build's src directory")
    parser.add_argument(
        "--this-src", type=Path, default=ROOT / "src", help="this build's src (default: the checkout's)"
    )
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=100, help="prompts a turn")
    parser.add_argument("--no-load", action="store_true", help="idle phase only")
    parser.add_argument("--load-nice", type=int, nargs="*", default=[0, 10], help="llama.cpp load phases, by nice")
    parser.add_argument("--seed", type=int, default=0, help="the order of the builds per batch")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "this_src": str(args.this_src),
        "baseline_src": str(args.baseline_src),
        "phases": {},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        fields = _prompt_fields(args.requests)
        json.dump(fields, fh)
    workers: list[Worker] = []
    try:
        workers.append(Worker("this", args.this_src, fh.name))
        workers.append(Worker("baseline", args.baseline_src, fh.name))
        report["models"] = {w.name: w.model for w in workers}
        phases: list[tuple[str, int | None]] = [("idle", None)]
        if not args.no_load:
            phases += [("under_llamacpp_load" + (f"_nice{nice}" if nice else ""), nice) for nice in args.load_nice]
        for name, nice in phases:
            if nice is None:
                report["phases"][name] = run_phase(workers, len(fields), args.batch, rng)
                continue
            from predictor_load import LoadProcess

            with LoadProcess(nice=nice):
                time.sleep(2.0)
                report["phases"][name] = run_phase(workers, len(fields), args.batch, rng)
    finally:
        for w in workers:
            w.close()
        os.unlink(fh.name)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"this: {args.this_src} ({report['models']['this']}); baseline: {args.baseline_src}")
    print(
        "| phase | this p50 / p99 us | baseline p50 / p99 us | ratio p50 | ratio p99 | p50 ratio, median of batches |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in report["phases"].items():
        print(
            f"| {name} | {r['this']['p50_us']:.1f} / {r['this']['p99_us']:.1f} | "
            f"{r['baseline']['p50_us']:.1f} / {r['baseline']['p99_us']:.1f} | {r['ratio_p50']:.3f} | "
            f"{r['ratio_p99']:.3f} | {r['ratio_p50_median_of_batches']:.3f} |"
        )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2]))
    sys.exit(main())
