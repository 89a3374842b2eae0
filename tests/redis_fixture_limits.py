"""A real ``redis-server`` for the limits' contract tests: a free loopback port, nothing saved.

``stop()`` loses Redis as a crash would; ``start()`` again brings it back on the same port, empty.
"""

from __future__ import annotations

import shutil
import socket
import subprocess

from polling import wait_until


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> None:
        path = shutil.which("redis-server")
        if path is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self._proc = subprocess.Popen(
            [path, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        proc = self._proc
        wait_until(lambda: self._answers() or proc.poll() is not None, 10.0, f"redis-server on port {self.port}")
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode} on port {self.port}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
