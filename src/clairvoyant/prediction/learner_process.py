"""The online learner off the event loop: the one worker process of a ``ProcessPoolExecutor``.

Why a process, and not a thread: a thread's refit shares the event loop's interpreter lock. Each
time the loop wakes it waits for the lock, up to the 5 ms switch interval, and longer when the OS
preempts the niced thread while it holds the lock. Both were measured on a 2-core host with the
other core kept busy. The learner held 17 full buffers and ran at the default refit settings: 10
observations a second, a refit at most once a second, about 20 ms of CPU each. There were four runs of the process and two of each thread, 20 s per phase.
During a refit, a 1 ms asyncio timer was late by p99 13-14 ms and at worst 39-48 ms with a thread
at ``worker_nice``. Unniced, so competing with the backend for CPU, it was late by p99 3.5-12 ms
and at worst 4-21 ms. With this worker process it was late by p99 4-6 ms and at worst 6-15 ms. That
is within the worst of the segments without a refit (6-17 ms): what is left is two cores shared by
three busy processes, not a lock.

The proxy's side, ``LearnerProcess``, runs on the event loop:

- ``observe`` checks the observation as ``OnlineLearner.observe`` would (``usable_observation``) and
  keeps it for the next batch. Every ``FLUSH_S`` the batch is submitted to the worker (``_learn``), which observes it and refits when a refit is due.
  The fit comes back as that call's result. It never waits: at most ``max_backlog`` observations
  may be submitted and not yet learned, and past that a batch is dropped and counted.
- ``correction``, the request path, reads the last fit the worker returned. That fit is an immutable
  ``FittedCorrection``, swapped whole. To it the residual kNN's part is added for a row with the
  encoder's embedding, exactly as ``OnlineLearner.correction`` does. The kNN memories live here,
  where the correction reads them. ``observe`` computes each residual with the fit in force and
  submits it with the observation, so the worker's copy, which the state file keeps, is the same.
  A starting worker returns its restored copy.
- ``update_quality`` and ``save`` are submitted calls, awaited with a timeout, never blocking.

The worker (``_init``, then ``_start``) ignores SIGINT and SIGTERM. A terminal's Ctrl-C and systemd's
stop reach the whole process group, but its exit is the proxy's to make: the proxy saves the state
through it, then shuts the pool down. It runs at ``worker_nice`` above the proxy. Its log records
reach the proxy through a ``QueueHandler`` and a ``QueueListener``, and are logged under their own
logger names. A thread in it waits on ``multiprocessing.parent_process()`` and ends it if the proxy
dies, so the worker never outlives the proxy. It loads the state file (a refused file is logged as
in-process), takes the observations, and refits once ``refit_every`` new ones have arrived, at most
once per ``min_refit_interval_s``. Fewer than ``refit_every`` are fitted ``quiet_refit_s`` after the
first of them. The worker cannot wake itself, so each call's result says when the next refit falls
due, and the proxy submits an empty batch then.

A dead worker (killed, out of memory) breaks the pool. The next call notices: the death is logged,
predictions keep the last fit, and observations are dropped. A new pool starts ``respawn_after_s``
later and restores the last saved state.
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
from dataclasses import dataclass, replace
from logging.handlers import QueueHandler, QueueListener
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from clairvoyant.prediction.learner import (
    DEFAULT_MODEL,
    FittedCorrection,
    LearnerConfig,
    ModelQuality,
    OnlineLearner,
    PriorIdentity,
    ResidualKnn,
    bucket_key,
    clipped_residual,
    usable_observation,
)
from clairvoyant.prediction.predictor import Prediction, log_tokens

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
class _Started(NamedTuple):
    pid: int
    observed_total: int
    models: list[str]
    memories: dict[str, tuple[np.ndarray, np.ndarray]]  # per model key: kNN unit embeddings, residuals
    fit: Packed | None  # the restored observations' fit
    refit_s: float | None  # seconds that refit took


class _Learned(NamedTuple):
    fit: Packed | None  # a new fit, if the batch made one due
    refit_s: float | None  # seconds it took
    wake_in_s: float | None  # seconds until the observations not yet fitted are due (None: none wait)


@dataclass
class _Worker:
    """The worker process's learner and its refit clock (see ``LearnerProcess``'s arguments)."""

    learner: OnlineLearner
    state_path: Path | None
    fit: bool  # False: observe for the quality figures only
    quiet_refit_s: float
    min_refit_interval_s: float
    refit_after: float = 0.0  # monotonic seconds: no refit before
    quiet_until: float | None = None  # monotonic seconds: fewer than refit_every observations are fitted then

    def learn(self, batch: list[Observation]) -> _Learned:
        learner = self.learner
        for prediction, tokens, residual in batch:
            learner.observe(prediction, tokens, residual)
        if not (self.fit and learner.unfitted):
            return _Learned(None, None, None)
        now = time.monotonic()
        if self.quiet_until is None:
            self.quiet_until = now + self.quiet_refit_s
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
        self.refit_after = time.monotonic() + self.min_refit_interval_s
        fit = self.learner.current_fit
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


def _start(identity: PriorIdentity, config: LearnerConfig, state_path: Path | None, *timing: Any) -> _Started:
    """Load the state file; ``timing``: the rest of ``_Worker``'s fields (fit, quiet_refit_s...)."""
    global _worker
    learner = OnlineLearner.load(state_path, identity, config) if state_path else OnlineLearner(identity, config)
    _worker = worker = _Worker(learner, state_path, *timing)
    memories = {key: memory for key in learner.models() if (memory := learner.knn_memory(key)) is not None}
    restored = worker.refit() if worker.fit and learner.unfitted else _Learned(None, None, None)
    return _Started(os.getpid(), learner.observed_total, learner.models(), memories, restored.fit, restored.refit_s)


def _learn(batch: list[Observation]) -> _Learned:
    assert _worker is not None
    return _worker.learn(batch)


def _quality() -> dict[str, ModelQuality]:
    assert _worker is not None
    _worker.learner.update_quality()  # only the models observed since the last update
    return dict(_worker.learner.quality())


def _save() -> None:
    assert _worker is not None
    if _worker.state_path is None:
        return
    try:
        _worker.learner.save(_worker.state_path)
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
        max_backlog: int = MAX_BACKLOG,
        respawn_after_s: float = 10.0,
    ) -> None:
        self.identity = identity
        # Learning off: the worker measures the quality only, and nothing reads a kNN memory
        self.config = (config or LearnerConfig()) if fit else replace(config or LearnerConfig(), knn_neighbours=0)
        self.state_path = state_path
        self.fit = fit  # False: observe for the quality figures only (online_learning = false)
        self.quiet_refit_s = quiet_refit_s
        self.min_refit_interval_s = min_refit_interval_s
        self.max_backlog = max_backlog
        self.respawn_after_s = respawn_after_s
        self.n_counts = len(identity.feature_names)
        self.n_features = self.n_counts + len(identity.component_names)
        self._fit: FittedCorrection | None = None
        self._keys: dict[str, None] = {}  # the model keys with a buffer, as the worker assigns them
        self._knn: dict[str, ResidualKnn] = {}  # per model key: the residual kNN's memory
        self._batch: list[Observation] = []  # not yet submitted
        self._flush_handle: asyncio.TimerHandle | None = None
        self._wake_handle: asyncio.TimerHandle | None = None  # an empty batch, when a refit falls due
        self._in_flight = 0  # observations submitted and not yet learned
        self._quality: dict[str, ModelQuality] = {}
        self.observed_total = 0  # restored + accepted here (the worker may not have taken them yet)
        self.dropped = 0  # observations not learned: no worker, a full backlog, or the worker died
        self.refits = 0  # fits received
        self.last_refit_s: float | None = None  # seconds the worker's last refit took
        self._pool: _Pool | None = None
        self._stopping = False
        self._restart: asyncio.Task[None] | None = None  # a worker started again after one died

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
            "learner_models": len(self._keys),
            "learner_knn_memories": len(self._knn),
            "learner_unsent": len(self._batch),
            "learner_in_flight": self._in_flight,
        }

    # -- life ------------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 60.0) -> bool:
        """Start the worker and wait until it has loaded the state file. False (logged) if it could
        not start: the proxy then predicts with the prior, or the last fit, and learns nothing."""
        self._stopping = False
        setup = (self.identity, self.config, self.state_path, self.fit, self.quiet_refit_s, self.min_refit_interval_s)
        pool: _Pool | None = None
        try:
            pool = _Pool.create(self.config.worker_nice)
            started = await asyncio.wait_for(asyncio.wrap_future(pool.executor.submit(_start, *setup)), timeout_s)
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
        self._keys = dict.fromkeys(started.models)
        self._knn = {
            key: ResidualKnn.filled(self.config.buffer_size, unit, residual)
            for key, (unit, residual) in started.memories.items()
        }
        self._took(_Learned(started.fit, started.refit_s, None))
        return True

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the worker down and wait for it (it saves nothing by itself: ``save`` first)."""
        self._stopping = True
        for handle in (self._flush_handle, self._wake_handle):
            if handle is not None:
                handle.cancel()
        self._flush_handle = self._wake_handle = None
        if self._restart is not None:  # not wanted now
            self._restart.cancel()
            await asyncio.gather(self._restart, return_exceptions=True)
            self._restart = None
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
        fit, cfg = self._fit, self.config
        key = model or DEFAULT_MODEL
        value = 0.0 if fit is None else fit.correction(key, self._keys, cfg.max_models, row, prior_log_tokens)
        if len(row) > self.n_features and self._knn:
            knn = self._knn.get(bucket_key(key, self._keys, cfg.max_models))
            if knn is not None:
                value += knn.correction(row[self.n_features :], cfg.knn_neighbours, cfg.knn_shrinkage)
        return value

    def observe(self, prediction: Prediction, observed_tokens: int) -> bool:
        """Keep an observation for the worker. False, as ``OnlineLearner.observe``, for an unusable
        one; an observation that cannot be learned (no worker, a full backlog) counts in ``dropped``."""
        if not usable_observation(prediction, observed_tokens, self.n_counts, self.n_features):
            return False
        self.observed_total += 1
        key = bucket_key(prediction.model, self._keys, self.config.max_models)  # OnlineLearner.observe's rule
        self._keys.setdefault(key, None)
        residual = self._remember(key, prediction, observed_tokens)
        if self._pool is None:
            self.dropped += 1
            return True
        self._batch.append((prediction, int(observed_tokens), residual))
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)
        return True

    def _remember(self, key: str, prediction: Prediction, observed_tokens: int) -> float | None:
        """The residual kNN's part of ``OnlineLearner.observe``: an uncensored observation whose row
        carries the embedding joins its model's memory, with its residual after the linear
        correction in force now. Returns that residual (None: no embedding, or the kNN is off)."""
        cap = prediction.cap_tokens
        if (
            not self.config.knn_neighbours
            or len(prediction.feature_row) <= 4 * self.n_features
            or (cap is not None and observed_tokens >= cap)
        ):
            return None
        row = np.frombuffer(prediction.feature_row, dtype=np.float32)
        embedding = row[self.n_features :]
        knn = self._knn.get(key)
        if knn is None:
            knn = self._knn[key] = ResidualKnn(self.config.buffer_size, len(embedding))
        prior = prediction.prior_log_tokens
        fit = self._fit
        model = prediction.model or DEFAULT_MODEL  # the fit's key, as in-process
        linear = 0.0 if fit is None else fit.correction(model, self._keys, self.config.max_models, row, prior)
        residual = clipped_residual(log_tokens(int(observed_tokens)) - (prior + linear), self.config.residual_clip)
        knn.remember(embedding, residual)  # the worker's copy gets the same residual (or refuses it alike)
        return residual

    def _flush(self) -> None:
        """Submit the batch of observations, unless there is no worker or its backlog is full."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        batch, self._batch = self._batch, []
        if batch and self._in_flight + len(batch) > self.max_backlog:
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
        self._in_flight += len(batch)

        def learned(future: asyncio.Future[_Learned]) -> None:
            self._in_flight -= len(batch)
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
            self._fit = FittedCorrection.unpacked(learned.fit)
            self.last_refit_s = learned.refit_s
            self.refits += 1
        if learned.wake_in_s is not None and not self._stopping:
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
        if self._stopping:
            return
        delay_s = self.respawn_after_s  # a worker that keeps dying is started at most this often
        logger.error(
            "online learner: its process (pid %s) died (%s); predictions keep the last fit, observations are "
            "dropped until it is started again in %.0f s (from the last saved state)",
            pool.pid,
            exc,
            delay_s,
        )
        self._restart = asyncio.get_running_loop().create_task(self._start_again(delay_s), name="learner-restart")

    async def _start_again(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if await self.start():
            logger.info("online learner: its process is running again (pid %s)", self.pid)
