"""The online learner off the event loop: the one worker process of a ``ProcessPoolExecutor``.

Why a process, and not a thread: a thread's refit shares the event loop's interpreter lock. Each time the loop
wakes it waits for the lock, up to the 5 ms switch interval, and longer when the OS preempts the niced thread
while it holds it. With this process a refit no longer makes the loop later than two cores shared by three busy
processes do (docs/online-learning.md, "Cost on the event loop"; benchmarks/bench_learner_refit.py).

The proxy's side, ``LearnerProcess``, runs on the event loop:

- ``observe`` checks an observation as ``OnlineLearner.observe`` would and batches it; every ``FLUSH_S`` the
  batch goes to the worker (``_learn``), which observes it and refits when due. The fit comes back as that
  call's result. It never waits: past ``MAX_BACKLOG`` observations submitted and not yet learned, a batch is
  dropped and counted.
- ``correction``, the request path, reads a ``LearnedCorrection``: the last fit the worker returned (immutable,
  swapped whole) and the kNN memories, which live here, where the correction reads them. ``observe`` computes
  each residual with the fit in force and sends it along, so the worker's copy, which the state file keeps, is
  the same. A starting worker returns its restored copy.
- ``update_quality`` and ``save`` are submitted calls, awaited with a timeout, never blocking.

The worker (``_init``, then ``_start``) ignores SIGINT and SIGTERM: a terminal's Ctrl-C and systemd's stop
reach the whole process group, but its exit is the proxy's to make (the proxy saves the state through it, then
shuts the pool down). It runs at ``worker_nice`` above the proxy; its log records reach the proxy through a
``QueueHandler`` and a ``QueueListener``, under their own logger names; a thread in it ends it if the proxy
dies. It refits once ``refit_every`` new observations have arrived, at most once per ``min_refit_interval_s``;
fewer are fitted ``quiet_refit_s`` after the first of them. The worker cannot wake itself, so each call's result
says when the next refit falls due, and the proxy submits an empty batch then.

A dead worker (killed, out of memory) breaks the pool. The next call notices: the death is logged, predictions
keep the last fit, and observations are dropped. A new pool starts ``respawn_after_s`` later from the last saved
state.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from logging.handlers import QueueHandler, QueueListener
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from clairvoyant.prediction.learner import (
    FittedCorrection,
    LearnedCorrection,
    LearnerConfig,
    ModelQuality,
    OnlineLearner,
    PriorIdentity,
    ResidualKnn,
    bucket_key,
    usable_observation,
)
from clairvoyant.prediction.predictor import Prediction

__all__ = ["LearnerProcess", "LearnerUnavailable"]

logger = logging.getLogger(__name__)

# Seconds between two refits, at least: under heavy traffic refit_every observations arrive every
# few milliseconds, and refitting 20 times a second only takes a core from the proxy and the backend.
MIN_REFIT_INTERVAL_S = 1.0
MAX_BACKLOG = 4096  # observations submitted and not yet learned, at most (~1.8 KB each with an embedding)
FLUSH_S = 0.05  # seconds an observation may wait to be submitted with the next ones

T = TypeVar("T")
Packed = tuple[tuple[str, ...], bytes, tuple[float, ...], tuple[float, ...], int, int]  # FittedCorrection.packed
Observation = tuple[Prediction, int, float | None]  # a prediction, the observed tokens, its kNN residual


class LearnerUnavailable(RuntimeError):
    """The learner's worker is not running (it could not start, or died, or was stopped)."""


# -- the worker process ------------------------------------------------------------------------------
class _Learned(NamedTuple):
    fit: Packed | None  # a new fit, if the batch made one due
    refit_s: float | None  # seconds it took
    wake_in_s: float | None  # seconds until the observations not yet fitted are due (None: none wait)


class _Started(NamedTuple):
    pid: int
    observed_total: int
    models: list[str]
    memories: dict[str, tuple[np.ndarray, ...]]  # per model key: kNN unit embeddings, residuals
    restored: _Learned  # the restored observations' fit


@dataclass(frozen=True)
class _WorkerSetup:
    """How the worker learns and saves (see ``LearnerProcess``'s arguments)."""

    state_path: Path | None
    fit: bool  # False: observe for the quality figures only
    quiet_refit_s: float
    min_refit_interval_s: float


@dataclass
class _Worker:
    """The worker process's learner and its refit clock."""

    learner: OnlineLearner
    setup: _WorkerSetup
    refit_after: float = 0.0  # monotonic seconds: no refit before
    quiet_until: float | None = None  # monotonic seconds: fewer than refit_every observations are fitted then

    def learn(self, batch: list[Observation]) -> _Learned:
        learner = self.learner
        for prediction, tokens, residual in batch:
            learner.observe(prediction, tokens, residual)
        if not (self.setup.fit and learner.unfitted):
            return _Learned(None, None, None)
        now = time.monotonic()
        if self.quiet_until is None:
            self.quiet_until = now + self.setup.quiet_refit_s
        if (learner.refit_due and now >= self.refit_after) or now >= self.quiet_until:
            return self.refit()
        due = min(self.quiet_until, self.refit_after) if learner.refit_due else self.quiet_until
        return _Learned(None, None, due - now)

    def refit(self) -> _Learned:
        self.quiet_until = None
        try:
            self.learner.refit()
        except Exception:  # a failed refit must not end learning; the old fit stays
            logger.exception("online learner: refit failed; keeping the previous correction")
        self.refit_after = time.monotonic() + self.setup.min_refit_interval_s
        fit = self.learner.corrector.fit
        return _Learned(None if fit is None else fit.packed(), self.learner.last_refit_s, None)


_worker: _Worker | None = None  # in the worker process: set by _start


def _init(log_queue: Any, nice: int) -> None:
    """The worker process's setup (the pool's initializer); see the module docstring."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    root = logging.getLogger()
    root.handlers[:] = [QueueHandler(log_queue)]
    root.setLevel(logging.INFO)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), name="exit-with-the-proxy", daemon=True).start()
    try:
        os.nice(nice)  # the refits yield the cores to the proxy and the backend (Linux niceness)
    except OSError:
        pass


def _exit_with(parent: multiprocessing.process.BaseProcess) -> None:
    parent.join()  # returns once the proxy's process is gone, however it ended
    os._exit(0)


def _start(identity: PriorIdentity, config: LearnerConfig, setup: _WorkerSetup) -> _Started:
    """Load the state file, and refit what it restored."""
    global _worker
    path = setup.state_path
    learner = OnlineLearner.load(path, identity, config) if path else OnlineLearner(identity, config)
    _worker = worker = _Worker(learner, setup)
    memories = {key: memory for key in learner.models() if (memory := learner.knn_memory(key)) is not None}
    restored = worker.refit() if setup.fit and learner.unfitted else _Learned(None, None, None)
    return _Started(os.getpid(), learner.observed_total, learner.models(), memories, restored)


def _learn(batch: list[Observation]) -> _Learned:
    assert _worker is not None
    return _worker.learn(batch)


def _quality() -> dict[str, ModelQuality]:
    assert _worker is not None
    _worker.learner.update_quality()  # only the models observed since the last update
    return dict(_worker.learner.quality())


def _save() -> None:
    assert _worker is not None
    if _worker.setup.state_path is None:
        return
    try:
        _worker.learner.save(_worker.setup.state_path)
    except OSError:
        raise
    except Exception as exc:  # whatever failed, the proxy is told as for a full disk: logged, not fatal
        raise OSError(f"{type(exc).__name__}: {exc}") from exc


# -- the proxy's side --------------------------------------------------------------------------------
class _ToLogger(logging.Handler):
    """Logs a worker's record under its own logger name here: the proxy's handlers, its format."""

    def emit(self, record: logging.LogRecord) -> None:
        named = logging.getLogger(record.name)
        if named.isEnabledFor(record.levelno):
            named.handle(record)


@dataclass
class _Pool:
    """One worker process, and the listener that logs what it logs."""

    executor: ProcessPoolExecutor
    listener: QueueListener
    pid: int | None = None

    @classmethod
    def create(cls, nice: int) -> _Pool:
        context = multiprocessing.get_context("spawn")  # fork is unsafe in a process with threads
        log_queue = context.Queue()
        listener = QueueListener(log_queue, _ToLogger())
        listener.start()
        executor = ProcessPoolExecutor(1, context, initializer=_init, initargs=(log_queue, nice))
        return cls(executor, listener)

    def discard(self) -> None:
        """Let the pool go without waiting for it (its worker failed, or did not start in time)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        # A worker killed while writing a log record leaves the queue's lock held, and then the
        # listener's stop would wait forever: it stops in a thread nobody waits for.
        threading.Thread(target=self.listener.stop, name="learner-log-listener-stop", daemon=True).start()

    def close(self) -> None:
        """Wait for the worker to finish its calls and exit, then for its last log records. Blocking."""
        self.executor.shutdown(wait=True)
        self.listener.stop()


@dataclass
class _Backlog:
    """Observations on their way to the worker."""

    batch: list[Observation] = field(default_factory=list)  # not yet submitted
    flush_handle: asyncio.TimerHandle | None = None  # submits the batch
    in_flight: int = 0  # observations submitted and not yet learned


@dataclass
class _Respawn:
    """A worker started again ``after_s`` after one died (so at most that often), unless stopping."""

    after_s: float
    stopping: bool = False
    task: asyncio.Task[None] | None = None

    def schedule(self, process: LearnerProcess) -> None:
        self.task = asyncio.get_running_loop().create_task(self._start_again(process), name="learner-restart")

    async def _start_again(self, process: LearnerProcess) -> None:
        await asyncio.sleep(self.after_s)
        if await process.start():
            logger.info("online learner: its process is running again (pid %s)", process.pid)

    async def stop(self) -> None:
        self.stopping = True
        if self.task is not None:  # not wanted now
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None


class LearnerProcess:
    """The proxy's side of the learner's worker process (see the module docstring). Use from one
    event loop: ``await start()``, then ``observe``/``correction`` from the loop's callbacks,
    ``await save()`` / ``update_quality()``, and ``await stop()``."""

    def __init__(
        self,
        identity: PriorIdentity,
        config: LearnerConfig | None = None,
        state_path: Path | None = None,
        *,
        fit: bool = True,
        quiet_refit_s: float = 5.0,  # seconds after which fewer than refit_every new observations are fitted
        min_refit_interval_s: float = MIN_REFIT_INTERVAL_S,
        respawn_after_s: float = 10.0,
    ) -> None:
        self.identity = identity
        # Learning off: the worker measures the quality only, and nothing reads a kNN memory
        config = (config or LearnerConfig()) if fit else replace(config or LearnerConfig(), knn_neighbours=0)
        self.corrector = LearnedCorrection(config, identity.n_features, {})
        self._setup = _WorkerSetup(state_path, fit, quiet_refit_s, min_refit_interval_s)
        self._backlog = _Backlog()
        self._wake_handle: asyncio.TimerHandle | None = None  # an empty batch, when a refit falls due
        self._quality: dict[str, ModelQuality] = {}
        self.observed_total = 0  # restored + accepted here (the worker may not have taken them yet)
        self.dropped = 0  # observations not learned: no worker, a full backlog, or the worker died
        self.refits = 0  # fits received
        self.last_refit_s: float | None = None  # seconds the worker's last refit took
        self._pool: _Pool | None = None
        self._respawn = _Respawn(respawn_after_s)

    @property
    def pid(self) -> int | None:
        """The worker's process id, while one runs."""
        return None if self._pool is None else self._pool.pid

    @property
    def running(self) -> bool:
        """Whether a worker is up, as last seen (a death is noticed at the next call)."""
        return self._pool is not None

    def retained(self) -> dict[str, int]:
        """Entries held on the proxy's side: model keys, kNN memories, observations not yet learned."""
        return {
            "learner_models": len(self.corrector.known),
            "learner_knn_memories": len(self.corrector.knn),
            "learner_unsent": len(self._backlog.batch),
            "learner_in_flight": self._backlog.in_flight,
        }

    # -- life ------------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 60.0) -> bool:
        """Start the worker and wait until it has loaded the state file. False (logged) if it could
        not start: the proxy then predicts with the prior, or the last fit, and learns nothing."""
        self._respawn.stopping = False
        config = self.corrector.config
        pool: _Pool | None = None
        try:
            pool = _Pool.create(config.worker_nice)
            submitted = pool.executor.submit(_start, self.identity, config, self._setup)
            started = await asyncio.wait_for(asyncio.wrap_future(submitted), timeout_s)
        except BaseException as exc:  # a broken install, a worker that hangs or dies at once, a cancelled start
            if pool is not None:
                pool.discard()
            if not isinstance(exc, Exception):
                raise
            logger.error("online learner: its process did not start (%s: %s); learning is off", type(exc).__name__, exc)
            return False
        pool.pid = started.pid
        self._pool = pool
        self.observed_total = started.observed_total
        self.corrector.known = dict.fromkeys(started.models)
        self.corrector.knn = {
            key: ResidualKnn.filled(config.buffer_size, unit, residual)
            for key, (unit, residual) in started.memories.items()
        }
        self._took(started.restored)
        return True

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the worker down and wait for it (it saves nothing by itself: ``save`` first)."""
        for handle in (self._backlog.flush_handle, self._wake_handle):
            if handle is not None:
                handle.cancel()
        self._backlog.flush_handle = self._wake_handle = None
        await self._respawn.stop()
        pool, self._pool = self._pool, None
        if pool is None:
            return
        closing = asyncio.ensure_future(asyncio.to_thread(pool.close))
        try:
            await asyncio.wait_for(asyncio.shield(closing), timeout_s)
        except TimeoutError:  # a call that does not end: the worker is killed, which ends the wait
            if pool.pid is not None:
                os.kill(pool.pid, signal.SIGKILL)
            await closing

    # -- the request path ------------------------------------------------------------------------
    def correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        """``OnlineLearner.correction`` on the last fit the worker returned (0.0 before the first)."""
        return self.corrector.correction(model, row, prior_log_tokens)

    def observe(self, prediction: Prediction, observed_tokens: int) -> bool:
        """Keep an observation for the worker. False, as ``OnlineLearner.observe``, for an unusable
        one; an observation that cannot be learned (no worker, a full backlog) counts in ``dropped``.
        Its kNN residual is computed here, with the fit in force, and sent with it, so that the
        worker's copy of the memory (the one the state file keeps) is the same."""
        if not usable_observation(prediction, observed_tokens, self.identity.n_counts, self.identity.n_features):
            return False
        self.observed_total += 1
        corrector = self.corrector
        key = bucket_key(prediction.model, corrector.known, corrector.config.max_models)  # OnlineLearner.observe's rule
        corrector.known.setdefault(key, None)
        residual = corrector.remember(key, prediction, observed_tokens)
        if self._pool is None:
            self.dropped += 1
            return True
        backlog = self._backlog
        backlog.batch.append((prediction, int(observed_tokens), residual))
        if backlog.flush_handle is None:
            backlog.flush_handle = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)
        return True

    def _flush(self) -> None:
        """Submit the batch of observations, unless there is no worker or its backlog is full."""
        backlog = self._backlog
        if backlog.flush_handle is not None:
            backlog.flush_handle.cancel()
            backlog.flush_handle = None
        batch, backlog.batch = backlog.batch, []
        if batch and backlog.in_flight + len(batch) > MAX_BACKLOG:
            self.dropped += len(batch)
        elif batch:
            self._submit_learn(batch)

    def _wake(self) -> None:
        self._wake_handle = None
        self._submit_learn([])  # the observations already sent are due for a refit

    def _submit_learn(self, batch: list[Observation]) -> None:
        pool = self._pool
        try:
            future = self._submit(pool, _learn, batch)
        except LearnerUnavailable:
            self.dropped += len(batch)
            return
        self._backlog.in_flight += len(batch)

        def learned(future: asyncio.Future[_Learned]) -> None:
            self._backlog.in_flight -= len(batch)
            if future.cancelled():
                return
            exc = future.exception()
            if isinstance(exc, BrokenProcessPool):
                self.dropped += len(batch)
                assert pool is not None
                self._lost(pool, exc)
            elif exc is not None:  # a fault in the learner's code: logged; the worker carries on
                logger.error("online learner: a batch of observations failed", exc_info=exc)
            else:
                self._took(future.result())

        future.add_done_callback(learned)

    def _took(self, learned: _Learned) -> None:
        if learned.fit is not None:
            self.corrector.fit = FittedCorrection.unpacked(learned.fit)
            self.last_refit_s = learned.refit_s
            self.refits += 1
        if learned.wake_in_s is not None and not self._respawn.stopping:
            if self._wake_handle is not None:
                self._wake_handle.cancel()
            self._wake_handle = asyncio.get_running_loop().call_later(learned.wake_in_s, self._wake)

    # -- reading ---------------------------------------------------------------------------------
    def quality(self) -> Mapping[str, ModelQuality]:
        """Rolling quality per model key, as the worker last computed it."""
        return self._quality

    async def update_quality(self, timeout_s: float = 5.0) -> None:
        """Have the worker bring the rolling quality up to date with every observation so far."""
        self._flush()  # the batch not yet sent goes first: the worker takes calls in order
        self._quality = await self._call(_quality, timeout_s)

    async def save(self, timeout_s: float = 60.0) -> None:
        """Have the worker write the state file (atomically). Raises OSError if it could not,
        LearnerUnavailable if there is no worker."""
        self._flush()  # every observation so far is in the file, the last batch too
        await self._call(_save, timeout_s)

    # -- calls -----------------------------------------------------------------------------------
    def _submit(self, pool: _Pool | None, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if pool is None:
            raise LearnerUnavailable("the online learner's process is not running")
        try:
            submitted: Future[T] = pool.executor.submit(fn, *args)
        except BrokenProcessPool as exc:
            self._lost(pool, exc)
            raise LearnerUnavailable(f"the online learner's process died: {exc}") from exc
        return asyncio.wrap_future(submitted)

    async def _call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn``'s result in the worker, after the observations made before this call."""
        self._flush()
        pool = self._pool
        future = self._submit(pool, fn)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except BrokenProcessPool as exc:
            assert pool is not None
            self._lost(pool, exc)
            raise LearnerUnavailable(f"the online learner's process died: {exc}") from exc

    def _lost(self, pool: _Pool, exc: BaseException) -> None:
        """``pool``'s worker died: unless stopping, log it and start another later."""
        if pool is not self._pool:
            return  # already seen
        self._pool = None
        pool.discard()
        if self._wake_handle is not None:
            self._wake_handle.cancel()
            self._wake_handle = None
        if self._respawn.stopping:
            return
        logger.error(
            "online learner: its process (pid %s) died (%s); predictions keep the last fit, observations are "
            "dropped until it is started again in %.0f s (from the last saved state)",
            pool.pid,
            exc,
            self._respawn.after_s,
        )
        self._respawn.schedule(self)
