"""The online learner in its own process, so that a refit never holds the event loop's GIL.

Why a process: a refit in a thread of the proxy (session 19's design) held the interpreter lock
in steps of at most 0.15 ms of work, but on a shared machine the OS may preempt the thread while it
holds the lock, and the event loop then waits for the whole preemption. On this project's 2-core
host, steps of 0.4-1.7 ms of CPU took 5-30 ms of wall time (docs/benchmarks.md, section 18). A child
process has its own interpreter: nothing it does, or suffers, holds the loop's lock.

The parent side, ``LearnerProcess``, lives on the event loop and does three small things:

- ``observe``: checks the observation as ``OnlineLearner.observe`` would (``usable_observation``) and keeps it
  for the next batch, about a microsecond. Every ``FLUSH_S`` the batch goes down the child's stdin
  as one pickle of plain tuples (~0.2 KB and 0.2 us an observation; the dataclass would be 4 us).
  Never a wait: the pipe's transport buffers, and past ``max_backlog_bytes`` an observation is
  dropped and counted (only if the child stalls). The child sleeps on the pipe, and each batch's
  write wakes it: ~0.1 ms of the loop's time a batch, at most 20 a second (polling the pipe every
  20 ms measured no cheaper for the loop and cost the child ~10 ms of CPU a second);
- ``correction``: the request path's read of the last fit the child sent (``FittedCorrection``,
  immutable, swapped whole), plus the residual kNN's for a row with the encoder's embedding:
  exactly ``OnlineLearner.correction``'s arithmetic. The kNN memories live here, where the
  correction reads them: ``observe`` computes an observation's residual with the fit in force (as
  in-process) and appends it, and sends the residual with the observation so that the child's
  copy, which the state file keeps, is the same; the child sends its restored copy at start;
- ``quality``/``save``/``stop``: requests to the child, awaited (``asyncio``), never blocking.

The child (``python -m clairvoyant.prediction.learner_process``) owns an ``OnlineLearner``: it loads
the state file (a refused file is logged exactly as in-process), takes the observations, refits
once ``refit_every`` new ones have arrived (at most once per ``MIN_REFIT_INTERVAL_S``), sends each new fit back,
and saves the state when asked. It runs at ``worker_nice`` above the proxy, ignores SIGINT and
SIGTERM (a terminal's Ctrl-C, and systemd's stop, reach the whole process group; the proxy asks it to
save, then to stop) and exits
when its stdin closes, so it never outlives the proxy. Its log lines come back as frames and are
logged by the proxy under the child's logger names, in the proxy's format.

Frames, both ways: a 4-byte big-endian length, then a pickle (trusted: the proxy's own child).
Down: ``("init", identity, config, state_path, fit, quiet_refit_s, min_refit_interval_s)`` then ``("observe",
[(each field of the Prediction..., tokens, kNN residual or None), ...])``, ``("quality", id)``,
``("save", id)``, ``("stop", id)``. Up: ``("log", logger, level, message)``, ``("ready",
observed_total, model_keys, kNN memories)``, ``("fit", packed fit, refit_s)``
(``FittedCorrection.packed``: plain values, ~20 us to read against ~150 us for the pickled
dataclasses and arrays), ``("quality", quality)`` (only when asked), ``("done", id, error)``.

If the child dies (killed, out of memory), the proxy logs it, keeps predicting with the last fit,
drops observations until a new child is up, and starts one again (``respawn_after_s`` later), which
restores the last saved state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import select
import signal
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

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

_LENGTH = struct.Struct(">I")
# Seconds between two refits, at least: under heavy traffic refit_every observations arrive every
# few milliseconds, and refitting 20 times a second only takes a core from the proxy and the backend.
MIN_REFIT_INTERVAL_S = 1.0
MAX_BACKLOG_BYTES = 4 << 20  # bytes of observations waiting for the child before new ones are dropped
FLUSH_S = 0.05  # seconds an observation may wait to be sent with the next ones


class LearnerUnavailable(RuntimeError):
    """The learner's process is not running (it could not start, or died, or was stopped)."""


def _frame(message: tuple[Any, ...]) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


class LearnerProcess:
    """The proxy's side of a learner running in a child process (see the module docstring).
    Use from one event loop: ``await start()``, then ``observe``/``correction`` from the loop's
    callbacks, ``await save()`` / ``update_quality()``, and ``await stop()``."""

    def __init__(
        self,
        identity: PriorIdentity,
        config: LearnerConfig | None = None,
        state_path: Path | None = None,
        *,
        fit: bool = True,
        quiet_refit_s: float = 5.0,  # seconds after which fewer than refit_every new observations are fitted
        min_refit_interval_s: float = MIN_REFIT_INTERVAL_S,
        max_backlog_bytes: int = MAX_BACKLOG_BYTES,
        respawn_after_s: float = 10.0,
    ) -> None:
        self.identity = identity
        # Learning off: the child measures the quality only, and nothing reads a kNN memory
        self.config = (config or LearnerConfig()) if fit else replace(config or LearnerConfig(), knn_neighbours=0)
        self.state_path = state_path
        self.fit = fit  # False: observe for the quality figures only (online_learning = false)
        self.quiet_refit_s = quiet_refit_s
        self.min_refit_interval_s = min_refit_interval_s
        self.max_backlog_bytes = max_backlog_bytes
        self.respawn_after_s = respawn_after_s
        self.n_counts = len(identity.feature_names)
        self.n_features = self.n_counts + len(identity.component_names)
        self._fit: FittedCorrection | None = None
        self._keys: dict[str, None] = {}  # the model keys with a buffer, as the child assigns them
        self._knn: dict[str, ResidualKnn] = {}  # per model key: the residual kNN's memory
        self._batch: list[tuple[Any, ...]] = []  # not yet sent: (the Prediction's fields..., tokens, kNN residual)
        self._flush_handle: asyncio.TimerHandle | None = None
        self._quality: dict[str, ModelQuality] = {}
        self.observed_total = 0  # restored + accepted here (the child may not have taken them yet)
        self.dropped = 0  # observations not sent: no child, or its backlog was full
        self.refits = 0  # fits received
        self.last_refit_s: float | None = None  # seconds the child's last refit took
        self.pid: int | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: dict[int, asyncio.Future[str | None]] = {}
        self._next_id = 0
        self._ready: asyncio.Future[int] | None = None
        self._stopping = False
        self._respawn: asyncio.TimerHandle | None = None

    # -- life ------------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 60.0) -> bool:
        """Start the child and wait until it has loaded the state file. False (logged) if it could
        not start: the proxy then predicts with the prior and learns nothing."""
        self._stopping = False
        try:
            await asyncio.wait_for(self._spawn(), timeout_s)
        except Exception as exc:  # no interpreter, a broken install, a child that hangs...
            logger.error("online learner: its process did not start (%s: %s); learning is off", type(exc).__name__, exc)
            await self._kill()
            return False
        return True

    async def _spawn(self) -> int:
        package_root = str(Path(__file__).resolve().parents[2])  # the clairvoyant this proxy runs
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env.setdefault("OPENBLAS_NUM_THREADS", "1")  # p x p solves: one core is plenty, and leaves one
        self._process = process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        self.pid = process.pid
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._reader = loop.create_task(self._read(process), name="learner-process-reader")
        init = (
            "init",
            self.identity,
            self.config,
            self.state_path,
            self.fit,
            self.quiet_refit_s,
            self.min_refit_interval_s,
        )
        self._write(_frame(init))
        return await self._ready

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the child to stop and wait for it (it saves nothing by itself: ``save`` first)."""
        self._stopping = True
        if self._respawn is not None:
            self._respawn.cancel()
            self._respawn = None
        try:
            await self._request("stop", timeout_s)
        except (LearnerUnavailable, TimeoutError):
            pass
        await self._kill(timeout_s)

    async def _kill(self, timeout_s: float = 5.0) -> None:
        process = self._process
        if process is not None:
            if process.stdin is not None:
                process.stdin.close()  # the child exits when its stdin closes
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None

    # -- the request path ------------------------------------------------------------------------
    def correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        """``OnlineLearner.correction`` on the last fit the child sent (0.0 before the first)."""
        fit, cfg = self._fit, self.config
        key = model or DEFAULT_MODEL
        value = 0.0 if fit is None else fit.correction(key, self._keys, cfg.max_models, row, prior_log_tokens)
        if len(row) > self.n_features and self._knn:
            knn = self._knn.get(bucket_key(key, self._keys, cfg.max_models))
            if knn is not None:
                value += knn.correction(row[self.n_features :], cfg.knn_neighbours, cfg.knn_shrinkage)
        return value

    def observe(self, prediction: Prediction, observed_tokens: int) -> bool:
        """Send an observation to the child. False, as ``OnlineLearner.observe``, for an unusable
        one; an observation that cannot be sent (no child, a full backlog) counts in ``dropped``."""
        if not usable_observation(prediction, observed_tokens, self.n_counts, self.n_features):
            return False
        self.observed_total += 1
        key = self._bucket_key(prediction.model)
        residual = self._remember(key, prediction, observed_tokens)
        if self._stdin() is None:
            self.dropped += 1
            return True
        p = prediction  # its fields as a plain tuple: pickled 15x faster than the dataclass
        self._batch.append(
            (
                p.score,
                p.predicted_tokens,
                p.probabilities,
                p.prior_log_tokens,
                p.feature_row,
                p.model,
                p.cap_tokens,
                int(observed_tokens),
                residual,
            )
        )
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)
        return True

    def _bucket_key(self, model: str | None) -> str:
        """The buffer the child puts this model's observation in (``OnlineLearner.observe``'s rule)."""
        key = bucket_key(model, self._keys, self.config.max_models)
        self._keys.setdefault(key, None)
        return key

    def _remember(self, key: str, prediction: Prediction, observed_tokens: int) -> float | None:
        """The residual kNN's part of ``OnlineLearner.observe``: an uncensored observation whose row
        carries the embedding joins its model's memory, with its residual after the linear
        correction in force now. Returns that residual (None: no embedding, or the kNN is off)."""
        row_bytes = len(prediction.feature_row)
        cap = prediction.cap_tokens
        if (
            not self.config.knn_neighbours
            or row_bytes <= 4 * self.n_features
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
        knn.remember(embedding, residual)  # the child's copy gets the same residual (or refuses it alike)
        return residual

    def _flush(self) -> None:
        """Send the batch of observations (one write), unless the child is gone or backed up."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        batch, self._batch = self._batch, []
        if not batch:
            return
        stdin = self._stdin()
        if stdin is None or stdin.transport.get_write_buffer_size() > self.max_backlog_bytes:
            self.dropped += len(batch)
            return
        stdin.write(_frame(("observe", batch)))

    # -- reading ---------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether a child is up (False between a child's death and its successor's start)."""
        return self._process is not None and self._process.returncode is None

    def quality(self) -> Mapping[str, ModelQuality]:
        """Rolling quality per model key, as the child last computed it."""
        return self._quality

    async def update_quality(self, timeout_s: float = 5.0) -> None:
        """Have the child bring the rolling quality up to date with what it was sent."""
        await self._request("quality", timeout_s)

    async def save(self, timeout_s: float = 60.0) -> None:
        """Have the child write the state file (atomically). Raises OSError with the child's reason
        if it could not, LearnerUnavailable if there is no child."""
        error = await self._request("save", timeout_s)
        if error is not None:
            raise OSError(error)

    # -- the pipe --------------------------------------------------------------------------------
    def _stdin(self) -> asyncio.StreamWriter | None:
        """The child's stdin, if a child runs and it is open."""
        process = self._process
        if process is None or process.returncode is not None or process.stdin is None or process.stdin.is_closing():
            return None
        return process.stdin

    async def _request(self, kind: str, timeout_s: float) -> str | None:
        self._next_id += 1
        request_id = self._next_id
        reply: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._replies[request_id] = reply
        try:
            self._flush()  # what was observed before the request is in the child's answer
            self._write(_frame((kind, request_id)))
            return await asyncio.wait_for(reply, timeout_s)
        finally:
            self._replies.pop(request_id, None)

    def _write(self, frame: bytes) -> None:
        stdin = self._stdin()
        if stdin is None:
            raise LearnerUnavailable("the online learner's process is not running")
        stdin.write(frame)

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        stdout = process.stdout
        assert stdout is not None
        try:
            while True:
                header = await stdout.readexactly(_LENGTH.size)
                payload = await stdout.readexactly(_LENGTH.unpack(header)[0])
                self._receive(pickle.loads(payload))
        except asyncio.IncompleteReadError:
            pass  # the child closed its stdout: it exited
        except Exception:  # a frame we cannot read: the child is not one we understand; end it
            logger.exception("online learner: unreadable message from its process")
            process.kill()
        code = await process.wait()
        self._gone(process, code)

    def _receive(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "fit":
            _, packed, refit_s = message
            self._fit = FittedCorrection.unpacked(packed)
            self.last_refit_s = refit_s
            self.refits += 1
        elif kind == "quality":
            self._quality = message[1]
        elif kind == "done":
            reply = self._replies.get(message[1])
            if reply is not None and not reply.done():
                reply.set_result(message[2])
        elif kind == "log":
            _, name, level, text = message
            logging.getLogger(name).log(level, "%s", text)
        elif kind == "ready":
            _, total, keys, memories = message
            self.observed_total = total
            self._keys = dict.fromkeys(keys)
            self._knn = {
                key: ResidualKnn.filled(
                    self.config.buffer_size, np.frombuffer(unit, np.float32).reshape(n, -1), np.frombuffer(residual)
                )
                for key, n, unit, residual in memories
            }
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(total)

    def _gone(self, process: asyncio.subprocess.Process, code: int) -> None:
        """The child exited: fail what waits for it; unless stopping, or it never came up (``start``
        says so and gives up), start another later."""
        error = LearnerUnavailable(f"the online learner's process exited with code {code}")
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(error)
        ready = self._ready
        came_up = ready is not None and ready.done() and not ready.cancelled() and ready.exception() is None
        if ready is not None and not ready.done():
            ready.set_exception(error)
        if self._stopping or process is not self._process or not came_up:
            return
        self._process = None
        delay_s = self.respawn_after_s  # a child that keeps dying is started at most this often
        logger.error(
            "online learner: its process (pid %s) exited with code %s; predictions keep the last fit, "
            "observations are dropped until it is started again in %.0f s (from the last saved state)",
            process.pid,
            code,
            delay_s,
        )
        self._respawn = asyncio.get_running_loop().call_later(delay_s, self._start_again)

    def _start_again(self) -> None:
        self._respawn = None
        if self._stopping:
            return

        async def again() -> None:
            if await self.start():
                logger.info("online learner: its process is running again (pid %s)", self.pid)

        asyncio.get_running_loop().create_task(again(), name="learner-process-respawn")


# -- the child ---------------------------------------------------------------------------------------
class _FrameLogHandler(logging.Handler):
    """Sends the child's log lines to the proxy, which logs them in its own format."""

    def __init__(self, send: Any) -> None:
        super().__init__(logging.DEBUG)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self._send(("log", record.name, record.levelno, text))
        except Exception:  # a log line must never end the child
            self.handleError(record)


class _Child:
    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._read_fd, self._write_fd = read_fd, write_fd
        self._buffer = bytearray()
        self._eof = False

    def send(self, message: tuple[Any, ...]) -> None:
        frame = _frame(message)
        view = memoryview(frame)
        while view:
            written = os.write(self._write_fd, view)
            view = view[written:]

    def _read_available(self) -> list[tuple[Any, ...]]:
        """The complete frames in the pipe now (never waits: the fd is non-blocking)."""
        while not self._eof:
            try:
                chunk = os.read(self._read_fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                self._eof = True
            self._buffer += chunk
        messages: list[tuple[Any, ...]] = []
        while len(self._buffer) >= _LENGTH.size:
            size = _LENGTH.unpack_from(self._buffer)[0]
            if len(self._buffer) < _LENGTH.size + size:
                break
            messages.append(pickle.loads(bytes(self._buffer[_LENGTH.size : _LENGTH.size + size])))
            del self._buffer[: _LENGTH.size + size]
        return messages

    def run(self) -> None:
        os.set_blocking(self._read_fd, False)
        init: list[tuple[Any, ...]] = []
        while not init and not self._eof:
            select.select([self._read_fd], [], [])  # the proxy writes the init frame as it starts the child
            init = self._read_available()
        if not init or init[0][0] != "init":
            return
        _, identity, config, state_path, fit, quiet_refit_s, min_refit_interval_s = init[0]
        _lower_priority(config.worker_nice)
        learner = OnlineLearner.load(state_path, identity, config) if state_path else OnlineLearner(identity, config)
        memories = []
        for key in learner.models():
            memory = learner.knn_memory(key)
            if memory is not None:
                memories.append((key, len(memory[1]), memory[0].tobytes(), memory[1].tobytes()))
        self.send(("ready", learner.observed_total, learner.models(), memories))
        if fit and learner.unfitted:
            self._refit(learner)  # restored observations: fitted at once
        pending = init[1:]
        quiet_until: float | None = None  # when observations fewer than refit_every are fitted anyway
        refit_after = 0.0  # no refit before (monotonic seconds): at most one per MIN_REFIT_INTERVAL_S
        while True:
            for message in pending:
                kind = message[0]
                if kind == "observe":
                    for *fields, tokens, residual in message[1]:
                        learner.observe(Prediction(*fields), tokens, residual)
                elif kind == "quality":
                    learner.update_quality()  # only the models observed since the last update
                    self.send(("quality", dict(learner.quality())))
                    self.send(("done", message[1], None))
                elif kind == "save":
                    self.send(("done", message[1], self._save(learner, state_path)))
                elif kind == "stop":
                    self.send(("done", message[1], None))
                    return
            if self._eof:
                return
            refitted = False
            if fit and learner.unfitted:
                now = time.monotonic()
                if quiet_until is None:
                    quiet_until = now + quiet_refit_s
                if (learner.refit_due and now >= refit_after) or now >= quiet_until:
                    self._refit(learner)  # and the rolling quality, sent when asked
                    quiet_until, refitted = None, True
                    refit_after = time.monotonic() + min_refit_interval_s
            if not pending and not refitted:  # sleep on the pipe until a write or a refit is due
                deadlines = [quiet_until] if quiet_until is not None else []
                if fit and learner.refit_due:
                    deadlines.append(refit_after)
                timeout_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                select.select([self._read_fd], [], [], timeout_s)
            pending = self._read_available()

    def _refit(self, learner: OnlineLearner) -> None:
        try:
            learner.refit()
        except Exception:  # a failed refit must not end learning; the old fit stays
            logger.exception("online learner: refit failed; keeping the previous correction")
            return
        fit = learner.current_fit
        if fit is not None:
            self.send(("fit", fit.packed(), learner.last_refit_s))

    @staticmethod
    def _save(learner: OnlineLearner, state_path: Path | None) -> str | None:
        if state_path is None:
            return None
        try:
            learner.save(state_path)
        except Exception as exc:  # disk full, permissions, a directory...: the proxy logs it
            return f"{type(exc).__name__}: {exc}"
        return None


def _lower_priority(increment: int) -> None:
    """The refits yield the cores to the proxy and the backend (Linux niceness). Best effort."""
    try:
        os.nice(increment)
    except OSError:
        pass


def main() -> None:
    """The child's entry point (``python -m clairvoyant.prediction.learner_process``)."""
    # Ctrl-C reaches the terminal's whole process group, and systemd's default KillMode sends SIGTERM
    # to every process of the unit: both are the proxy's to handle. It saves the state through this
    # process, then asks it to stop; if the proxy dies instead, stdin closes and this process exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    write_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print() must not corrupt the frames
    child = _Child(0, write_fd)
    root = logging.getLogger()
    root.handlers[:] = [_FrameLogHandler(child.send)]
    root.setLevel(logging.INFO)
    try:
        child.run()
    except (BrokenPipeError, KeyboardInterrupt):
        pass


if __name__ == "__main__":
    main()
