"""A real ``redis-server`` for the tests: on a free loopback port, nothing saved, stopped at the end.

``stop()`` and ``start()`` again (the same port, empty: nothing is persisted) are the fault
tests' way to lose Redis and to bring it back without its state.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def require_redis_server() -> None:
    """Skip when Debian's redis-server is not installed; with ``CLAIRVOYANT_REQUIRE_BACKEND=1`` (CI)
    fail instead, as for the embedded llama.cpp backend."""
    import pytest

    if redis_server_path() is None:
        reason = "redis-server is not installed (make install-test installs it)"
        if os.environ.get("CLAIRVOYANT_REQUIRE_BACKEND") == "1":
            pytest.fail(f"CLAIRVOYANT_REQUIRE_BACKEND=1 but {reason}")
        pytest.skip(reason)


class RedisServer:
    def __init__(self, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.extra_args = list(extra_args)  # more redis-server options (e.g. small stream nodes)
        self._proc: subprocess.Popen[bytes] | None = None

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self, timeout_s: float = 10.0) -> None:
        path = redis_server_path()
        if path is None:
            raise FileNotFoundError("redis-server is not installed (make install-test installs it)")
        self._proc = subprocess.Popen(
            [
                path,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not self._ping():
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode} on port {self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} in {timeout_s} s")
            time.sleep(0.01)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        os.kill(proc.pid, signal.SIGCONT)  # (a paused server dies only once resumed)
        proc.kill()  # as a crash would: nothing is saved either way
        proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing is answered (a stalled host); its state is kept."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    def restart_empty(self) -> None:
        """Stop and start again on the same port: the server comes back with no keys."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


@contextmanager
def running_redis_server(extra_args: Sequence[str] = ()) -> Iterator[RedisServer]:
    """A started server (skipped, or failed under CI, when none is installed), stopped at the end."""
    require_redis_server()
    server = RedisServer(extra_args=extra_args)
    server.start()
    try:
        yield server
    finally:
        server.stop()
