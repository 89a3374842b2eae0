"""Does a learner refit delay the event loop? The lateness of a 1 ms asyncio timer while the learner refits.

    python benchmarks/bench_learner_refit.py --mode process|thread [--seconds 20] [--busy]
        [--completions-per-s 1000] [--min-refit-interval-s 0] [--models 17] [--rows 1024]

The proxy's cadence, at its default settings: ``--completions-per-s 10 --min-refit-interval-s 1``.

Run it WITHOUT nice: the timer is light, and the event loop is what is measured. The learner lowers
its own priority by ``--worker-nice`` (``worker_nice``, 10), as in the proxy.

An asyncio loop runs a timer that sleeps 1 ms and records how late it woke: the loop's lag. The loop
also observes ``--completions-per-s`` completed requests a second, as the proxy does on the event
loop. The learner holds ``--models`` full buffers of ``--rows`` observations. That is 16 models plus
"other" by default, the learner's memory bound, restored from a state file. It refits as the proxy's
does: once ``refit_every`` (8) new observations have arrived, at most once per
``--min-refit-interval-s``. By default (0, and 1,000 completions a second) it refits back to back,
the worst case.

``--mode process`` is the proxy's learner, ``LearnerProcess``: one worker process of a
``ProcessPoolExecutor``. ``--mode thread`` does the same work (the same ``_Worker.learn`` on the same
batches) in one worker thread of this process, niced alike (Linux nices threads one by one).

Learning alternates with idle, in 1-second segments (A/B interleaved, so that the load of the
machine's other tenants drifts over both alike). In the idle segments the loop observes as usual but
holds the batches back from the worker, and submits them when learning resumes. ``--busy`` keeps the
other core busy with a spinning process at the loop's priority, as a backend would.

Prints the p50, p99, p99.9 and max lag of each kind of segment, and of the ticks that overlapped a
refit (its wall-clock window: from its result's arrival back by the refit's own duration).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clairvoyant.prediction.features import Prompt  # noqa: E402
from clairvoyant.prediction.learner import LearnerConfig, OnlineLearner, PriorIdentity  # noqa: E402
from clairvoyant.prediction.learner_process import (  # noqa: E402
    FLUSH_S,
    LearnerProcess,
    Observation,
    _Learned,
    _Worker,
    _WorkerSetup,
)
from clairvoyant.prediction.predictor import OnnxPredictor, Prediction  # noqa: E402

PHASES = ("idle", "refitting", "during a refit")
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


class _GatedProcess(LearnerProcess):
    """The proxy's learner, whose batches are held back while ``gated``; ``windows``: each refit's
    (start, end) in ``time.perf_counter`` seconds, its end taken as its result's arrival."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gated = True
        self.windows: list[tuple[float, float]] = []

    def _took(self, learned: _Learned) -> None:
        if learned.fit is not None and learned.refit_s is not None:
            now = time.perf_counter()
            self.windows.append((now - learned.refit_s, now))
        super()._took(learned)

    def _flush(self) -> None:
        if self.gated:  # the batch stays; the next observation schedules another try
            self._backlog.flush_handle = None
            return
        super()._flush()

    def _wake(self) -> None:
        if not self.gated:
            super()._wake()


class _ThreadLearner:
    """The same learning in one worker thread of this process: observations batched every
    ``FLUSH_S``, ``_Worker.learn`` on each batch in the thread, a wake-up when a refit falls due."""

    def __init__(self, learner: OnlineLearner, nice: int, min_refit_interval_s: float) -> None:
        self.worker = _Worker(learner, _WorkerSetup(None, True, 5.0, min_refit_interval_s))  # as LearnerProcess's
        self.executor = ThreadPoolExecutor(1, initializer=os.nice, initargs=(nice,))  # this thread only
        self.gated = True
        self.refits = 0
        self.last_refit_s: float | None = None
        self.windows: list[tuple[float, float]] = []  # as _GatedProcess.windows
        self._batch: list[Observation] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._wake_handle: asyncio.TimerHandle | None = None

    def observe(self, prediction: Prediction, tokens: int) -> None:
        self._batch.append((prediction, tokens, None))
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        if self.gated:
            return
        batch, self._batch = self._batch, []
        future = asyncio.get_running_loop().run_in_executor(self.executor, self.worker.learn, batch)
        future.add_done_callback(lambda f: self._took(f.result()))

    def _took(self, learned: _Learned) -> None:
        if learned.fit is not None and learned.refit_s is not None:
            self.refits += 1
            self.last_refit_s = learned.refit_s
            now = time.perf_counter()
            self.windows.append((now - learned.refit_s, now))
        if learned.wake_in_s is not None:
            if self._wake_handle is not None:
                self._wake_handle.cancel()
            self._wake_handle = asyncio.get_running_loop().call_later(learned.wake_in_s, self._flush)


async def _run(
    seconds: float, learner: Any, traffic: list[Prediction], rng: np.random.Generator, completions_per_s: float
) -> dict[str, list[float]]:
    """Lags (seconds) per segment, and of the ticks that overlapped a refit ("during a refit")."""
    lags: dict[str, list[float]] = {"idle": [], "refitting": []}
    ticks: list[tuple[float, float]] = []  # the refitting segments' ticks: (start, end), perf_counter seconds
    loop = asyncio.get_running_loop()
    i = 0
    next_completion = loop.time()
    for segment in range(int(2 * seconds)):
        phase = "refitting" if segment % 2 else "idle"
        learner.gated = phase == "idle"
        end = loop.time() + 1.0
        while loop.time() < end:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            after = time.perf_counter()
            lags[phase].append(after - before - 0.001)
            if phase == "refitting":
                ticks.append((before, after))
            if loop.time() >= next_completion:  # a completed request
                learner.observe(traffic[i % len(traffic)], int(rng.integers(1, 2000)))
                i += 1
                next_completion += 1.0 / completions_per_s
    learner.gated = True
    starts, ends = (np.array(side) for side in zip(*learner.windows))
    lags["during a refit"] = [end - start - 0.001 for start, end in ticks if np.any((starts < end) & (ends > start))]
    return lags


async def _run_process(args: argparse.Namespace, config: LearnerConfig, identity: PriorIdentity, **run: Any) -> Any:
    remote = _GatedProcess(identity, config, run.pop("state"), min_refit_interval_s=args.min_refit_interval_s)
    if not await remote.start():
        raise SystemExit("the learner's process did not start")
    try:  # the restored buffers were fitted at start: the worker is warm
        lags = await _run(args.seconds, remote, **run)
    finally:
        await remote.stop()
    return lags, remote.refits - 1, remote.last_refit_s  # less the restored state's fit at start


async def _run_thread(args: argparse.Namespace, config: LearnerConfig, identity: PriorIdentity, **run: Any) -> Any:
    learner = OnlineLearner.load(run.pop("state"), identity, config)
    local = _ThreadLearner(learner, args.worker_nice, args.min_refit_interval_s)
    await asyncio.get_running_loop().run_in_executor(local.executor, local.worker.refit)  # warm, as the process
    try:
        lags = await _run(args.seconds, local, **run)
    finally:
        local.executor.shutdown()
    return lags, local.refits, local.last_refit_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("process", "thread"), default="process", help="where the learner runs")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of each phase (interleaved)")
    parser.add_argument("--busy", action="store_true", help="keep another core busy with a spinning process")
    parser.add_argument("--models", type=int, default=17, help="buffers to fill (max_models=16 + 'other')")
    parser.add_argument("--rows", type=int, default=1024, help="observations per buffer (buffer_size)")
    parser.add_argument(
        "--completions-per-s",
        type=float,
        default=1000.0,
        help="completed requests observed per second (the proxy takes learner_max_observations_per_s, 10)",
    )
    parser.add_argument(
        "--min-refit-interval-s", type=float, default=0.0, help="seconds between refits, at least (the proxy's: 1)"
    )
    parser.add_argument(
        "--worker-nice", type=int, default=LearnerConfig().worker_nice, help="the learner's niceness above the loop's"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--components", type=int, default=16, help="encoder components per row, as the proxy learns with the encoder on"
    )
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    predictor = OnnxPredictor()
    config = LearnerConfig(buffer_size=args.rows, max_models=max(args.models - 1, 1), worker_nice=args.worker_nice)
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
    busy = None
    if args.busy:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp) / "state.npz"
            learner.save(state)
            run = _run_process if args.mode == "process" else _run_thread
            lags, refits, last_refit_s = asyncio.run(
                run(
                    args,
                    config,
                    identity,
                    state=state,
                    traffic=traffic,
                    rng=rng,
                    completions_per_s=args.completions_per_s,
                )
            )
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()

    result: dict[str, object] = {
        "mode": args.mode,
        "busy_core": args.busy,
        "completions_per_s": args.completions_per_s,
        "min_refit_interval_s": args.min_refit_interval_s,
        "process_nice": os.getpriority(os.PRIO_PROCESS, 0),
        "worker_nice": args.worker_nice,
        "buffers": args.models,
        "encoder_components": args.components,
        "rows_per_buffer": args.rows,
        "seconds_per_phase": args.seconds,
        "loadavg_1min_at_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        **{phase: _summary(lags[phase]) for phase in PHASES},
        "refits": refits,
        "last_refit_ms": (last_refit_s or 0.0) * 1000,
    }
    print(
        f"learner in a {args.mode}: {args.models} buffers x {args.rows} observations; "
        f"{args.completions_per_s:g} completions/s, refits >= {args.min_refit_interval_s:g} s apart; "
        f"{args.seconds:.0f} s per phase, interleaved in 1 s segments; other core "
        f"{'busy' if args.busy else 'not loaded'}; load average {result['loadavg_1min_at_end']:.2f} on "
        f"{result['cpus']} CPUs"
    )
    print(f"{'phase':15s} {'ticks':>7s} {'p50 ms':>8s} {'p99 ms':>8s} {'p99.9 ms':>9s} {'max ms':>8s} {'> 1 ms':>8s}")
    for phase in PHASES:
        row = _summary(lags[phase])
        print(
            f"{phase:15s} {row['ticks']:7d} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} {row['p999_ms']:9.3f} "
            f"{row['max_ms']:8.3f} {100 * row['late_over_1ms_share']:7.2f}%"
        )
    print(f"refits: {refits} in the refitting segments; the last took {result['last_refit_ms']:.1f} ms")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
