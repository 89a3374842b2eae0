"""Does a learner refit block the event loop? Loop lag of a 1 ms ticker while the learner's process refits.

    python benchmarks/bench_learner_refit.py [--seconds 20] [--models 17] [--rows 1024]

(Run it WITHOUT nice: the ticker is light, and it is the event loop being measured; the learner's
process lowers its own priority by ``worker_nice`` = 10, as in the proxy.)

An asyncio loop runs a ticker that sleeps 1 ms and records how late it woke (the loop lag), and
calls ``LearnerProcess.observe`` ``--completions-per-s`` times a second, as the proxy does on the
event loop at each completed request. The learner's process (the proxy's: ``LearnerProcess``) holds
``--models`` full buffers of ``--rows`` observations (16 models + "other" by default, the
learner's memory bound, restored from a state file) and refits whenever due (``refit_every`` = 1
and no ``min_refit_interval_s``: once per batch of observations, the most it can; the proxy refits
at most once a second). Refitting alternates with idle in 1-second
segments (A/B interleaved, so that the load of the machine's other tenants drifts equally over
both); in the idle ones the child is stopped (SIGSTOP) and the loop sends it the same
observations, so only the child's refitting differs.

Prints p50, p99, p99.9 and max lag of each, and what the loop itself spends on learning: each
``observe``, each batch of observations sent (``_flush``) and each message from the child (a fit)
handled once unpickled (the unpickling, ~20 us for a fit, is not in the figure). Target (issue 8): a refit never blocks the event loop for more than 1 ms. The rows are real
feature rows of varied synthetic prompts (no dataset needed). Session 19's design, a refit in a
thread of the proxy, is measured beside this one in docs/benchmarks.md section 18 (at fa4faca,
``--mode worker`` / ``cadence``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clairvoyant.prediction.features import Prompt  # noqa: E402
from clairvoyant.prediction.learner import LearnerConfig, OnlineLearner, PriorIdentity  # noqa: E402
from clairvoyant.prediction.learner_process import LearnerProcess  # noqa: E402
from clairvoyant.prediction.predictor import OnnxPredictor, Prediction  # noqa: E402

WORDS = (
    "write explain list why code essay story brief summary detailed python table poem steps "
    "compare what how translate history science"
).split()


def _predictions(predictor: OnnxPredictor, n: int, rng: np.random.Generator) -> list[Prediction]:
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 60))))
        out.append(predictor.predict(Prompt(text, context_chars=len(text) + int(rng.integers(0, 4000)))))
    return out


def _summary(lags: list[float]) -> dict[str, float]:
    ms = np.array(lags) * 1000
    return {
        "ticks": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "p999_ms": float(np.percentile(ms, 99.9)),
        "max_ms": float(ms.max()),
        "late_over_1ms_share": float(np.mean(ms > 1.0)),
    }


async def _run(
    seconds: float,
    learner: LearnerProcess,
    refitter: _Paused,
    traffic: list[Prediction],
    rng: np.random.Generator,
    completions_per_s: float,
) -> dict[str, list[float]]:
    lags: dict[str, list[float]] = {"idle": [], "refitting": [], "observe": []}
    loop = asyncio.get_running_loop()
    i = 0
    next_completion = loop.time()
    for segment in range(int(2 * seconds)):
        phase = "refitting" if segment % 2 else "idle"
        if phase == "refitting":
            refitter.on()
        end = loop.time() + 1.0
        while loop.time() < end:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            lags[phase].append(time.perf_counter() - before - 0.001)
            if loop.time() >= next_completion:  # a completed request
                tokens = int(rng.integers(1, 2000))
                started = time.perf_counter()
                learner.observe(traffic[i % len(traffic)], tokens)
                lags["observe"].append(time.perf_counter() - started)
                i += 1
                next_completion += 1.0 / completions_per_s
        if phase == "refitting":
            refitter.off()
    return lags


class _TimedProcess(LearnerProcess):
    """The proxy's side of the learner's process, with the loop's time on each of its callbacks
    recorded: a batch of observations sent (``_flush``), a message from the child handled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flush_s: list[float] = []
        self.receive_s: list[float] = []

    def _flush(self) -> None:
        started = time.perf_counter()
        super()._flush()
        self.flush_s.append(time.perf_counter() - started)

    def _receive(self, message: tuple[Any, ...]) -> None:
        # a message from the child, once unpickled (~20 us for a fit, not counted here): its swap-in
        started = time.perf_counter()
        super()._receive(message)
        self.receive_s.append(time.perf_counter() - started)


class _Paused:
    """The learner's process, refitting (SIGCONT) or stopped (SIGSTOP) per segment."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def on(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def off(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)


async def _run_process(
    seconds: float,
    learner: OnlineLearner,
    traffic: list[Prediction],
    rng: np.random.Generator,
    completions_per_s: float,
    state: Path,
) -> tuple[dict[str, list[float]], _TimedProcess]:
    learner.save(state)
    remote = _TimedProcess(learner.identity, learner.config, state, min_refit_interval_s=0.0)
    if not await remote.start():
        raise SystemExit("the learner's process did not start")
    assert remote.pid is not None
    while remote.refits == 0:  # the restored buffers' first fit: the child is warm
        await asyncio.sleep(0.01)
    paused = _Paused(remote.pid)
    paused.off()
    try:
        lags = await _run(seconds, remote, paused, traffic, rng, completions_per_s)
    finally:
        paused.on()
        await remote.stop()
    return lags, remote


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of each phase (interleaved)")
    parser.add_argument("--models", type=int, default=17, help="buffers to fill (max_models=16 + 'other')")
    parser.add_argument("--rows", type=int, default=1024, help="observations per buffer (buffer_size)")
    parser.add_argument(
        "--completions-per-s",
        type=float,
        default=1000.0,
        help="completed requests observed per second (default: one per tick)",
    )
    parser.add_argument(
        "--worker-nice",
        type=int,
        default=LearnerConfig().worker_nice,
        help="the learner process's niceness above this one's",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--components", type=int, default=16, help="encoder components per row, as the proxy learns with the encoder on"
    )
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    predictor = OnnxPredictor()
    config = LearnerConfig(
        buffer_size=args.rows,
        max_models=max(args.models - 1, 1),
        refit_every=1,
        worker_nice=args.worker_nice,
    )
    identity = PriorIdentity.of(predictor)
    identity = replace(
        identity, component_names=tuple(f"c{i}" for i in range(args.components)), encoder_sha256="e" * 64
    )
    learner = OnlineLearner(identity, config)
    pool = [
        replace(p, feature_row=p.feature_row + rng.normal(0, 1, args.components).astype(np.float32).tobytes())
        for p in _predictions(predictor, 2000, rng)
    ]
    for m in range(args.models):
        for _ in range(args.rows):
            p = pool[int(rng.integers(len(pool)))]
            learner.observe(replace(p, model=f"model-{m}"), int(np.exp(rng.normal(5, 1))))
    traffic = [replace(p, model="model-0") for p in pool[:256]]
    with tempfile.TemporaryDirectory() as tmp:
        lags, remote = asyncio.run(
            _run_process(args.seconds, learner, traffic, rng, args.completions_per_s, Path(tmp) / "state.npz")
        )
    refits = remote.refits

    observe_us = np.array(lags["observe"]) * 1e6
    result: dict[str, object] = {
        "completions_per_s": args.completions_per_s,
        "process_nice": os.getpriority(os.PRIO_PROCESS, 0),
        "worker_nice": args.worker_nice,
        "buffers": args.models,
        "encoder_components": args.components,
        "rows_per_buffer": args.rows,
        "seconds_per_phase": args.seconds,
        "loadavg_1min_at_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "idle": _summary(lags["idle"]),
        "refitting": _summary(lags["refitting"]),
        "refits": refits,
        # the loop's own share of learning: one observe (a tuple kept for the next batch)
        "observe_us": {q: float(np.percentile(observe_us, v)) for q, v in (("p50", 50), ("p99", 99), ("max", 100))},
    }
    print(
        f"learner: {args.models} buffers x {args.rows} observations; {args.seconds:.0f} s per phase, "
        f"interleaved in 1 s segments; load average {result['loadavg_1min_at_end']:.2f} on {result['cpus']} CPUs"
    )
    print(f"{'phase':12s} {'ticks':>7s} {'p50 ms':>8s} {'p99 ms':>8s} {'p99.9 ms':>9s} {'max ms':>8s} {'> 1 ms':>8s}")
    for phase in ("idle", "refitting"):
        row = _summary(lags[phase])
        print(
            f"{phase:12s} {row['ticks']:7d} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} {row['p999_ms']:9.3f} "
            f"{row['max_ms']:8.3f} {100 * row['late_over_1ms_share']:7.2f}%"
        )
    o = result["observe_us"]
    assert isinstance(o, dict)
    print(f"observe on the loop, us: p50 {o['p50']:.1f}, p99 {o['p99']:.1f}, max {o['max']:.1f}")

    def _us(values: list[float]) -> dict[str, float]:
        us = np.array(values or [0.0]) * 1e6
        return {
            "n": len(values),
            "p50": float(np.median(us)),
            "p99": float(np.percentile(us, 99)),
            "max": float(us.max()),
        }

    result["last_refit_ms"] = (remote.last_refit_s or 0.0) * 1000
    result["flush_us"] = _us(remote.flush_s)
    result["receive_us"] = _us(remote.receive_s)
    result["dropped_observations"] = remote.dropped
    print(
        f"refits (process, {args.completions_per_s:g} completions/s): {refits} in the refitting segments and the "
        f"warm-up; the last took {result['last_refit_ms']:.1f} ms in the child; observations dropped: {remote.dropped}"
    )
    for name, key in (
        ("a batch of observations sent", "flush_us"),
        ("a message from the child handled", "receive_us"),
    ):
        v = result[key]
        assert isinstance(v, dict)
        print(f"the loop's time on {name}, us: n {v['n']}, p50 {v['p50']:.1f}, p99 {v['p99']:.1f}, max {v['max']:.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
