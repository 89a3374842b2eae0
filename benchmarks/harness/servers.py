"""Servers the request-path benchmarks start and stop: nginx, the bare pass-through, the proxy under test.

Shared by bench_proxy_overhead.py, bench_proxy_throughput.py and bench_http_conformance.py. Every
server is a child process on a free loopback port, stopped by the context manager.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from .request_path import expand_command
from .results import add_json_option

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# The deployed shape: `clairvoyant serve` as its own process. {python}, {upstream}, {port} and
# {slots} are filled in; pass --proxy-cmd (or CLAIRVOYANT_BENCH_PROXY_CMD) to measure another proxy.
DEFAULT_PROXY_CMD = (
    "{python} -m clairvoyant.cli serve --upstream {upstream} --port {port} --slots {slots} "
    "--max-queue 10000 --log-level warning"
)
PROXY_CMD_ENV = "CLAIRVOYANT_BENCH_PROXY_CMD"
MISSING_TOOLS_HINT = "make bench-tools, or: apt-get install nginx wrk"


def add_target_options(parser: argparse.ArgumentParser, name: str, *, slots_note: str = "") -> None:
    """The options both proxy benchmarks take: the proxy under test, a baseline beside it, the results file."""
    parser.add_argument(
        "--proxy-cmd",
        help=f"command of the proxy under test, with {{python}} {{upstream}} {{port}} {{slots}} "
        f"(default: ${PROXY_CMD_ENV} or: {DEFAULT_PROXY_CMD}{slots_note})",
    )
    parser.add_argument(
        "--baseline-cmd",
        help="a second proxy command run side by side as target 'baseline' (same placeholders), e.g. another "
        "checkout's `env PYTHONPATH=/tmp/other/src {python} -m clairvoyant.cli serve ...`",
    )
    add_json_option(parser, name)


def require_tools(*names: str) -> None:
    """Exit with a clear message if a Debian tool the benchmark drives is not installed."""
    missing = [n for n in names if shutil.which(n) is None and not Path(f"/usr/sbin/{n}").exists()]
    if missing:
        sys.exit(f"{', '.join(missing)} not found: this benchmark needs them ({MISSING_TOOLS_HINT})")


def nginx_binary() -> str:
    return shutil.which("nginx") or "/usr/sbin/nginx"


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Return once ``url`` gives any HTTP answer; raise if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before answering")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{proc.args!r} did not answer on {url} within {timeout_s} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def running(argv: list[str], port: int, *, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``argv``, wait until port answers HTTP, yield the process, stop it at exit."""
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{port}/", proc)
        yield proc
    finally:
        _stop(proc)


@contextlib.contextmanager
def nginx(render: Callable[[Path], str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    """Run nginx in the foreground with the configuration ``render(prefix)`` returns, in a temporary prefix."""
    with tempfile.TemporaryDirectory(prefix="bench-nginx-") as tmp:
        prefix = Path(tmp)
        conf = prefix / "nginx.conf"
        conf.write_text(render(prefix))
        os.chmod(prefix, 0o755)  # workers run as an unprivileged user when we are root
        argv = [nginx_binary(), "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
        with running(argv, port) as proc:
            yield proc


def passthrough_argv(upstream: str, port: int) -> list[str]:
    return [sys.executable, str(HERE / "passthrough.py"), upstream, str(port)]


def stack_floor_argv(upstream: str, port: int) -> list[str]:
    return [sys.executable, str(HERE / "stack_floor.py"), upstream, str(port)]


def proxy_argv(template: str | None, upstream: str, port: int, slots: int) -> list[str]:
    """argv of the proxy under test from --proxy-cmd, else the environment, else `clairvoyant serve`."""
    template = template or os.environ.get(PROXY_CMD_ENV) or DEFAULT_PROXY_CMD
    return expand_command(template, python=sys.executable, upstream=upstream, port=str(port), slots=str(slots))


def proxy_env() -> dict[str, str]:
    """PYTHONPATH with src/ first, so a fresh clone runs the checkout's proxy even when not installed."""
    src = str(ROOT / "src")
    old = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{src}{os.pathsep}{old}" if old else src}
