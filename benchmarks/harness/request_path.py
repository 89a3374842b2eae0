"""Pure helpers of the request-path benchmarks (benchmarks/bench_proxy_overhead.py, bench_proxy_throughput.py).

What the two scripts share and what can be checked without a clock: the random target order per
round and its predecessor counts, the paired per-round differences against a baseline target,
percentile summaries in milliseconds, the CPU time of a process tree from ``/proc``, the nginx
configurations (reverse proxy and fixed-answer fake backend), the wrk Lua script and the parsing of
its report, and the expansion of a ``--proxy-cmd`` template.

Nothing here starts a process or reads a clock; the scripts do.
"""

from __future__ import annotations

import json
import os
import random
import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from clairvoyant.tools.bench.stats import percentile

__all__ = [
    "WRK_MARKER",
    "WrkResult",
    "expand_command",
    "main_thread_cpu_seconds",
    "nginx_fixed_answer_conf",
    "nginx_proxy_conf",
    "paired_differences",
    "parse_proc_stat_cpu_ticks",
    "parse_wrk_output",
    "predecessor_counts",
    "round_orders",
    "summarize_ms",
    "tree_cpu_seconds",
    "wrk_script",
]

WRK_MARKER = "CLAIRVOYANT-WRK "  # the line wrk's done() prints, followed by one JSON object


# -- order and paired statistics ----------------------------------------------------------------


def round_orders(names: Sequence[str], n_rounds: int, seed: int) -> list[list[str]]:
    """One independent random permutation of ``names`` per round (seeded, so a run can be repeated).

    A fixed rotation puts each target mostly after the same predecessor (whose leftover work, warm
    caches or open connections then bias it); a fresh shuffle per round makes every ordered pair
    equally likely."""
    rng = random.Random(seed)
    orders = []
    for _ in range(n_rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def predecessor_counts(orders: Sequence[Sequence[str]]) -> dict[str, Counter[str]]:
    """For each target, how often each other target ran right before it (``"-"`` = first in the round).

    Rounds run back to back, so the last target of round i precedes the first of round i + 1."""
    counts: dict[str, Counter[str]] = {}
    previous = "-"
    for order in orders:
        for name in order:
            counts.setdefault(name, Counter())[previous] += 1
            previous = name
    return counts


def paired_differences(samples: Mapping[str, Sequence[float]], baseline: str) -> dict[str, list[float]]:
    """Per target, its value minus the baseline's value of the same round (index), for every other target.

    Every target must hold one value per round; a round with a missing value (NaN) in either
    target is dropped from that pair only."""
    base = samples[baseline]
    out: dict[str, list[float]] = {}
    for name, values in samples.items():
        if name == baseline:
            continue
        if len(values) != len(base):
            raise ValueError(f"{name} has {len(values)} rounds, {baseline} has {len(base)}")
        out[name] = [v - b for v, b in zip(values, base) if v == v and b == b]
    return out


def summarize_ms(values_s: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """Percentiles of values in seconds, as milliseconds: ``{"p50_ms": ..., "p90_ms": ..., "n": ...}``."""
    out = {f"p{q:g}_ms": percentile(values_s, q) * 1000 for q in qs}
    out["n"] = float(len(values_s))
    return out


# -- CPU time from /proc ------------------------------------------------------------------------


def parse_proc_stat_cpu_ticks(stat_line: str) -> tuple[int, int]:
    """(ppid, utime + stime in clock ticks) from one ``/proc/<pid>/stat`` line.

    The command name (field 2) is in parentheses and may itself hold spaces and parentheses, so
    the fields are counted from the last ``)``."""
    rest = stat_line.rsplit(")", 1)[1].split()
    # rest[0] is field 3 (state); ppid is field 4, utime 14, stime 15
    return int(rest[1]), int(rest[11]) + int(rest[12])


def tree_cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (all their threads).

    nginx does its work in worker processes under the master, uvicorn and llama.cpp in threads:
    this counts both. A descendant that exited is not counted, so sample before and after a
    measurement while the servers run."""
    ticks: dict[int, tuple[int, int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ticks[int(entry.name)] = parse_proc_stat_cpu_ticks((entry / "stat").read_text())
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
    children: dict[int, list[int]] = {}
    for child, (ppid, _) in ticks.items():
        children.setdefault(ppid, []).append(child)
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        if current in ticks:
            total += ticks[current][1]
        stack.extend(children.get(current, ()))
    return total / os.sysconf("SC_CLK_TCK")


def main_thread_cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float:
    """User + system CPU seconds of ``pid``'s main thread alone: a Python server's event loop (the
    proxy's, uvicorn's), which one core bounds however many other threads the process has."""
    try:
        _, ticks = parse_proc_stat_cpu_ticks((proc / str(pid) / "task" / str(pid) / "stat").read_text())
    except (OSError, IndexError, ValueError):
        return 0.0  # exited
    return ticks / os.sysconf("SC_CLK_TCK")


# -- nginx --------------------------------------------------------------------------------------


def _nginx_main(prefix: Path, workers: int) -> str:
    return f"""daemon off;
master_process on;
worker_processes {workers};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; multi_accept on; }}
"""


def _nginx_http(prefix: Path) -> str:
    return f"""    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
"""


def nginx_proxy_conf(prefix: Path, port: int, upstream: str, *, workers: int = 1, keepalive: int = 64) -> str:
    """An nginx reverse proxy on 127.0.0.1:``port`` in front of ``upstream`` (``http://host:port``).

    Streaming as Clairvoyant does it: ``proxy_buffering off`` (each chunk is sent on as it comes)
    and HTTP/1.1 to the upstream with a pool of ``keepalive`` idle connections. A POST that meets a
    pooled connection the upstream had closed is sent again on a fresh one (``non_idempotent``; nginx
    gives a failed *cached* connection an extra try), as Clairvoyant's upstream does: llama.cpp's
    server closes some keep-alive connections after a streamed answer without saying so. For that
    retry the (small) request body stays buffered (nginx cannot resend an unbuffered body)."""
    hostport = upstream.removeprefix("http://").rstrip("/")
    return (
        _nginx_main(prefix, workers)
        + f"""http {{
{_nginx_http(prefix)}    upstream backend {{
        server {hostport};
        keepalive {keepalive};
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_next_upstream error timeout non_idempotent;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""
    )


def nginx_fixed_answer_conf(prefix: Path, port: int, answer: str, *, workers: int = 1) -> str:
    """An nginx on 127.0.0.1:``port`` answering every request (any method, any path) with ``answer`` as JSON."""
    if "'" in answer or "\\" in answer:
        raise ValueError("the fixed answer must not contain ' or \\ (nginx string quoting)")
    return (
        _nginx_main(prefix, workers)
        + f"""http {{
{_nginx_http(prefix)}    server {{
        listen 127.0.0.1:{port};
        default_type application/json;
        location / {{
            return 200 '{answer}';
        }}
    }}
}}
"""
    )


# -- wrk ----------------------------------------------------------------------------------------


def wrk_script(method: str, body: str | None = None, content_type: str = "application/json") -> str:
    """A wrk Lua script: every request uses ``method`` (and ``body``), and the run ends with one
    machine-readable line (:data:`WRK_MARKER` + JSON) holding counts, errors and latency percentiles
    in microseconds, so nothing depends on wrk's human-readable units."""
    lines = [f'wrk.method = "{method}"']
    if body is not None:
        lines.append(f"wrk.body = {json.dumps(body)}")
        lines.append(f'wrk.headers["Content-Type"] = "{content_type}"')
    lines.append(
        f"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{WRK_MARKER}{{"requests": %d, "duration_us": %d, "bytes": %d, '
    .. '"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d, '
    .. '"p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d, "mean_us": %.1f}}\\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
"""
    )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class WrkResult:
    """One wrk run, from the line :func:`wrk_script`'s ``done`` prints."""

    requests: int  # completed requests (wrk counts non-2xx/3xx answers here too, and in status_errors)
    duration_s: float  # wall seconds of the run
    p50_ms: float  # latency percentiles over requests, milliseconds
    p90_ms: float
    p99_ms: float
    max_ms: float
    socket_errors: int  # connect + read + write + timeout
    status_errors: int  # answers with a status >= 400

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else float("nan")

    @property
    def ok(self) -> bool:
        """No socket error and no error status: the figures describe answered requests."""
        return self.socket_errors == 0 and self.status_errors == 0 and self.requests > 0


def parse_wrk_output(stdout: str) -> WrkResult:
    """The :class:`WrkResult` of a wrk run's stdout; ValueError if the marker line is missing (wrong script)."""
    for line in stdout.splitlines():
        if line.startswith(WRK_MARKER):
            raw = json.loads(line[len(WRK_MARKER) :])
            return WrkResult(
                requests=int(raw["requests"]),
                duration_s=raw["duration_us"] / 1e6,
                p50_ms=raw["p50_us"] / 1000,
                p90_ms=raw["p90_us"] / 1000,
                p99_ms=raw["p99_us"] / 1000,
                max_ms=raw["max_us"] / 1000,
                socket_errors=int(raw["connect"] + raw["read"] + raw["write"] + raw["timeout"]),
                status_errors=int(raw["status"]),
            )
    raise ValueError("no wrk summary line in the output: was the script from wrk_script() used?")


# -- the command under test ---------------------------------------------------------------------


def expand_command(template: str, **values: str) -> list[str]:
    """argv of a ``--proxy-cmd`` template: split like a shell would, then ``{name}`` placeholders filled.

    Placeholders are filled per argument after splitting, so a value with spaces stays one argument.
    An unknown placeholder raises KeyError naming it."""
    return [arg.format_map(values) for arg in shlex.split(template)]
