"""The proxy as deployed: ``python -m clairvoyant serve`` in a child process, configured by
CLAIRVOYANT_* environment variables, and its resident memory."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = ["PROXY_SRC", "REPO", "ProxyProcess", "RssSampler", "free_port", "rss_kib", "serve_accepts", "wait_healthy"]

REPO = Path(__file__).resolve().parents[2]
PROXY_SRC = [REPO / "src"]  # the package the proxy processes import (a script's --proxy-src sets it)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_accepts(flag: str, src: Path | None = None) -> bool:
    """Whether ``clairvoyant serve`` of the tree at ``src`` (default ``PROXY_SRC[0]``) has ``flag``,
    by its ``--help``: how a benchmark finds out what the tree under test can do."""
    env = {"PYTHONPATH": str(src or PROXY_SRC[0]), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    out = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "serve", "--help"], env=env, capture_output=True, text=True, check=False
    )
    return flag in out.stdout.split()  # a whole word: "--redis" is not "--redis-fallback"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class ProxyProcess:
    """``python -m clairvoyant serve`` with CLAIRVOYANT_* settings; its log goes to a file. ``src``:
    the src/ directory it runs from (default ``PROXY_SRC[0]``, this checkout's or --proxy-src).
    ``args``: command-line flags after ``serve`` (they win over the settings)."""

    def __init__(
        self, name: str, upstream_url: str, log_dir: Path, *, src: Path | None = None, args: Sequence[str] = (),
        **settings: Any,
    ) -> None:  # fmt: skip
        self.name = name
        self.src = src
        self.args = list(args)
        self.port = free_port()
        self.settings = {"upstream_url": upstream_url, "port": self.port, "log_level": "warning", **settings}
        self.log_path = log_dir / f"proxy-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ProxyProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLAIRVOYANT_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.src or PROXY_SRC[0]), env.get("PYTHONPATH", "")]))
        env.update({f"CLAIRVOYANT_{k.upper()}": str(v) for k, v in self.settings.items()})
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "clairvoyant", "serve", *self.args], env=env, stdout=log, stderr=log, cwd=REPO
            )
        wait_healthy(self.proc, f"{self.url}/healthz", 60, f"proxy {self.name}", self.log_path)
        return self

    def rss_kib(self) -> int:
        return rss_kib(self.pid)

    def stated(self) -> str:
        """The settings this proxy runs with, but its port and backend URL; the rest are defaults."""
        shown = {k: v for k, v in self.settings.items() if k not in ("upstream_url", "port")}
        flags = " ".join(self.args)
        return " ".join(f"{k}={v}" for k, v in shown.items()) + (f" {flags}" if flags else "") + " (others default)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RssSampler:
    """Samples a process's VmRSS every ``every_s`` on the event loop while running."""

    def __init__(self, pid: int, every_s: float = 0.1) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[int] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.samples.append(rss_kib(self.pid))
            await asyncio.sleep(self.every_s)

    def __enter__(self) -> RssSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    @property
    def peak_kib(self) -> int:
        return max(self.samples) if self.samples else 0


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float, what: str, log_path: Path) -> None:
    """Wait until ``url`` answers 200; raise if ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited at start; see {log_path}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not start in {timeout_s:g} s; see {log_path}")
