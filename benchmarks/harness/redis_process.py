"""A real ``redis-server`` (Debian's package) in a child process on a free loopback port, and the
faults a benchmark puts it through.

- ``restart_empty``: SIGKILL and start again on the same port with nothing saved: a Redis that came
  back having lost every key (a restart without persistence, a failover to an empty replica).
- ``pause`` / ``resume`` (SIGSTOP / SIGCONT): "Redis gone" as a replica meets it when the host
  stalls or the network splits. Nothing is refused: connections stay open (the kernel even accepts
  new ones into the backlog), commands are neither answered nor failed, and each replica learns
  only through its own timeouts. It is the harder fault and the likelier one: a command sent before
  the pause runs after it, on a clock that jumped, and the state (leases, queue) is all still there.
- ``stop`` and ``start`` with ``keep_state``: Redis restarted with its data (an ordinary restart):
  connections are refused or reset at once, the easy fault to detect.

The benchmarks use ``pause`` for "Redis gone for N seconds", ``restart_empty`` for "Redis came back
empty". Refuses to start without ``redis-server`` on PATH (``apt-get install -y redis-server``).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .proxy_process import free_port

__all__ = ["RedisProcess", "redis_server_path"]


def redis_server_path() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not installed: apt-get install -y redis-server")
    return path


class RedisProcess:
    """``redis-server`` on 127.0.0.1 and a free port, no persistence unless ``keep_state`` asks for
    it; its log and any dump go to ``log_dir`` (a temporary directory by default)."""

    def __init__(self, log_dir: Path | None = None, port: int | None = None) -> None:
        self.dir = log_dir if log_dir is not None else Path(tempfile.mkdtemp(prefix="clairvoyant-redis-"))
        self.port = port if port is not None else free_port()
        self.log_path = self.dir / f"redis-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        """A client that fails at once (no retries): the harness wants to see each fault."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s,
                           socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))  # fmt: skip

    def start(self, *, keep_state: bool = False, timeout_s: float = 10.0) -> RedisProcess:
        """Start on ``self.port``; with ``keep_state``, load the dump a ``stop(save=True)`` wrote."""
        dump = self.dir / "dump.rdb"
        if not keep_state:
            dump.unlink(missing_ok=True)
        command = [
            redis_server_path(), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
            "--appendonly", "no", "--dir", str(self.dir), "--dbfilename", dump.name, "--logfile", str(self.log_path),
        ]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.paused = False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start; see {self.log_path}")
            try:
                if self.client(0.5).ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer PING in {timeout_s:g} s; see {self.log_path}")

    def stop(self, *, save: bool = False) -> None:
        """End it: with ``save``, SHUTDOWN SAVE (a ``start(keep_state=True)`` then loads the data)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        if save:
            try:
                self.client().shutdown(save=True)
            except redis.ConnectionError:
                pass  # the server closes the connection as it exits
        else:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: gone at once, nothing saved."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.paused = False

    def restart_empty(self) -> float:
        """SIGKILL and start again on the same port with no keys; returns the seconds it was away."""
        started = time.monotonic()
        self.kill()
        self.start()
        return time.monotonic() - started

    def pause(self) -> None:
        """SIGSTOP: unreachable without refusing anything (see the module's docstring)."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def dbsize(self) -> int:
        return int(self.client().dbsize())

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
