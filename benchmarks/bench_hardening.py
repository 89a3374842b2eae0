"""The hardening probe: slow and load cases against the REAL proxy process, with targets.

The proxy runs as it is deployed: ``python -m clairvoyant serve`` (Granian serving the proxy's ASGI
app, aiohttp to the backend) in a child process configured by CLAIRVOYANT_* environment variables;
SIGTERM is a real signal. Backends: a small fake HTTP/1.1 backend in a thread of this process
(plain asyncio; exact timing and a count of every request it received), and the real llama.cpp
server (``EmbeddedLlamaServer``, SmolLM2, 1 slot) for cases 4, 5 and 8.

Each case states the settings its proxy runs with (in the output and the JSON); settings not
stated are the defaults. Each target and its measured figure are printed as a table, PASS/FAIL,
and written to ``--json FILE`` (default: a file in the system's temporary directory):

1. stalled clients, client_timeout_s=5: (1a) 500 connections with partial headers: the server
   closes each at client_timeout_s from the head's start, with no answer (a head gets no 408);
   (1b) 500 with headers + a body shorter than its Content-Length: each gets the app's 408 in the
   dialect's JSON; both within client_timeout_s + 1 s, with the proxy's RSS growth and the p50 of
   a small normal request before vs during; (1c) an 8 MB header: 431; (1d) max_connections=20 is
   the server's backpressure, not a refusal: with 20 connections held (each streaming), 10 more
   clients are not served, each held connection that ends lets exactly one of them in, and once
   all end every one is answered, delivered once (nothing lost); (1e) on a kept-alive connection
   after one answer: idle, a stalled second head (both closed within client_timeout_s + 1 s of the
   answer) and a 200 KB header (431); (1f) a pipelined partial request behind a stream.
2. SIGTERM with 1 stream in flight and 50 queued (slots=1): 50 x 503 shutting_down within 1 s,
   the stream completes (grace 8 s) or ends with an error event (grace 1 s), exit 0 within
   grace + 2 s.
3. a backend that reads the POST and closes 1 s later: one delivery and one 502, on a fresh and on
   a reused upstream connection.
4. llama.cpp, non-streamed forced-long request left after 0.5 s, then a short one at once: its
   queue wait, total and "hidden wait" (total - queue wait - own service), disconnect_mode auto vs
   abort (and abort while the backend's /metrics is scraped every 0.5 s).
5. llama.cpp restart (~10 s down) while 10 requests wait (slots=1): all 200, none 502; (5b) a
   non-streamed request whose client left while the backend was down is never sent; (5c) a backend
   down for good: each waiting request's 502 within backend_wait_s + 1 s.
6. 1,000 concurrent clients (fast fake backend, slots 8): 0 lost, 0 duplicated, proxy RSS.
7. an upstream URL with user:password: the password never appears in the proxy's log (log_level info).
8. llama.cpp, 20 back-to-back bursts of 20 short requests (half streamed): no 502.
9. a hung backend (accepts, never answers, /health too; first_byte_timeout_s=10, backend_wait_s=3):
   one request in flight gets its 504, the one queued behind it a 503 with Retry-After, both within
   20 s, and the backend receives only the first.
10. a backend that never accepts (a full accept queue; connect_timeout_s=2, backend_wait_s=3): a
   504 in each dialect's shape (OpenAI, Ollama) within backend_wait_s + 1 s.
11. streams back to back (slots=1, a queue always waiting, 1,500 requests): the proxy asks the
   backend to close after each stream, and it does without saying so, as llama.cpp's server does
   (harness/recording_backend.py); the next request goes out the moment the slot frees, racing that
   close. Target: no 502, every request read by the backend once.

    PYTHONPATH=src python benchmarks/bench_hardening.py                 # everything, 3-4.5 min
    PYTHONPATH=src python benchmarks/bench_hardening.py --cases 1,2,3,6,7,9,10,11   # fake-backend cases only
    ... --proxy-src /path/to/patched/src   # the same probe against another tree

Timing figures are noisy on a shared 2-core machine; "before/during" latencies are measured in the
same run, one right after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from harness import proxy_process
from harness.fake_backend import FakeBackend
from harness.proxy_process import ProxyProcess, RssSampler, free_port
from harness.recording_backend import RecordingBackend
from harness.results import add_json_option, write_json
from harness.verdicts import Row, answer_complete, print_table, sse_outcome, status_of

CHAT = "/v1/chat/completions"
ALL_CASES = "1,2,3,4,5,6,7,8,9,10,11"


# --------------------------------------------------------------------------------------------
# Pure helpers (unit-tested in tests/test_bench_hardening.py)
# --------------------------------------------------------------------------------------------


def latency_kept(before_p50_s: float, during_p50_s: float, *, factor: float = 2.0, slack_s: float = 0.005) -> bool:
    """The "usual latency" rule: during p50 <= max(factor x before p50, before p50 + slack)."""
    return during_p50_s <= max(factor * before_p50_s, before_p50_s + slack_s)


def error_code(raw: bytes) -> str | None:
    """The ``code`` of an OpenAI-style error answer (``{"error": {"code": ...}}``) in a raw
    response, or None when its body is not one."""
    body = raw.partition(b"\r\n\r\n")[2]
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return str(error.get("code")) if isinstance(error, dict) and "code" in error else None


def duplicates(deliveries: Counter[str], expected: set[str]) -> tuple[int, int]:
    """(extra deliveries of expected tags, deliveries of unexpected tags)."""
    extra = sum(n - 1 for tag, n in deliveries.items() if tag in expected and n > 1)
    stray = sum(n for tag, n in deliveries.items() if tag not in expected)
    return extra, stray


# --------------------------------------------------------------------------------------------
# Raw client sockets (exact control of what is sent, and of what arrives before a reset)
# --------------------------------------------------------------------------------------------


@dataclass
class RawResult:
    opened_s: float  # monotonic, connected
    closed_s: float | None  # monotonic, EOF or reset seen (None: still open at the deadline)
    data: bytes
    reset: bool


async def raw_exchange(
    port: int, payload: bytes, *, wait_s: float, on_connected: Callable[[], None] | None = None
) -> RawResult:
    """Connect, send ``payload`` (nothing more), and read until EOF, a reset or ``wait_s``."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        opened = time.monotonic()
        if on_connected:
            on_connected()
        if payload:
            await loop.sock_sendall(sock, payload)
        data = b""
        deadline = opened + wait_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return RawResult(opened, None, data, False)
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), remaining)
            except TimeoutError:
                return RawResult(opened, None, data, False)
            except ConnectionResetError:
                return RawResult(opened, time.monotonic(), data, True)
            if not chunk:
                return RawResult(opened, time.monotonic(), data, False)
            data += chunk
    finally:
        sock.close()


def chat_body(
    tag: str, *, model: str = "fast", stream: bool = False, max_tokens: int = 4, **extra: Any
) -> dict[str, Any]:
    return {
        "model": model,
        "user": tag,
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Say OK."}],
        **extra,
    }


async def timed_requests(client: httpx.AsyncClient, url: str, n: int, prefix: str) -> list[float]:
    """``n`` small non-streamed requests one after another; their latencies in seconds."""
    out = []
    for i in range(n):
        started = time.perf_counter()
        response = await client.post(url, json=chat_body(f"{prefix}-{i}"))
        out.append(time.perf_counter() - started)
        if response.status_code != 200:
            raise RuntimeError(f"normal request got {response.status_code}: {response.text[:200]}")
    return out


# --------------------------------------------------------------------------------------------
# Case 1: stalled clients, oversized headers, the connection cap
# --------------------------------------------------------------------------------------------

PARTIAL_HEADERS = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nX-Stalled: yes"
)


def short_body_request() -> bytes:
    body = json.dumps(chat_body("stalled")).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body) + 1000}\r\n\r\n".encode()
        + body
    )


def closed_in_window(result: RawResult, timeout_s: float, slack_s: float = 1.0) -> bool:
    """Closed by the proxy within ``timeout_s`` +- ``slack_s`` of the connection's opening (not
    before: a slow client is not cut early)."""
    if result.closed_s is None:
        return False
    return timeout_s - slack_s <= result.closed_s - result.opened_s <= timeout_s + slack_s


async def stall_phase(proxy: ProxyProcess, what: str, payload: bytes, n: int, timeout_s: float) -> Row:
    """``n`` connections that send ``payload`` and stall. 1a (a partial head): the server closes
    each at client_timeout_s, with no answer. 1b (a short body): the app answers each 408 in the
    dialect's JSON (OpenAI's error object, code ``request_timeout``)."""
    url = f"{proxy.url}{CHAT}"
    async with httpx.AsyncClient(timeout=30) as client:
        await timed_requests(client, url, 10, f"warm-{what}")
        before = await timed_requests(client, url, 40, f"before-{what}")
        rss_before = proxy.rss_kib()
        connected = 0

        def count() -> None:
            nonlocal connected
            connected += 1

        with RssSampler(proxy.pid) as sampler:
            stalls = [
                asyncio.ensure_future(raw_exchange(proxy.port, payload, wait_s=timeout_s + 5, on_connected=count))
                for _ in range(n)
            ]
            while connected < n and not all(s.done() for s in stalls):
                await asyncio.sleep(0.01)
            during: list[float] = []
            while not all(s.done() for s in stalls):
                during += await timed_requests(client, url, 1, f"during-{what}")
            results = [s.result() for s in stalls]
        after = await timed_requests(client, url, 20, f"after-{what}")
    close_after = [r.closed_s - r.opened_s for r in results if r.closed_s is not None]
    statuses = Counter(status_of(r.data) for r in results)
    in_time = sum(closed_in_window(r, timeout_s) for r in results)
    if what == "a":  # a head: closed, no answer (Granian's header deadline)
        answered_right = statuses.get(None, 0)
        expected = "closed, no answer"
    else:  # a body: the app's 408 in the dialect's JSON
        answered_right = sum(status_of(r.data) == 408 and error_code(r.data) == "request_timeout" for r in results)
        expected = "408 in the dialect's JSON"
    growth_mb = (sampler.peak_kib - rss_before) / 1024
    p50_before, p50_during = statistics.median(before), statistics.median(during) if during else float("nan")
    kept = latency_kept(p50_before, p50_during)
    ok = in_time == n and answered_right == n and growth_mb < 50 and kept
    figures = {
        "connections": n,
        "client_timeout_s": timeout_s,
        "closed_within_timeout_plus_minus_1s": in_time,
        "close_s_min": min(close_after, default=None),
        "close_s_max": max(close_after, default=None),
        "statuses": {str(k): v for k, v in statuses.items()},
        "error_codes": dict(Counter(str(error_code(r.data)) for r in results if r.data)),
        "resets": sum(r.reset for r in results),
        "rss_before_mib": rss_before / 1024,
        "rss_peak_mib": sampler.peak_kib / 1024,
        "rss_growth_mib": growth_mb,
        "normal_p50_ms_before": p50_before * 1000,
        "normal_p50_ms_during": p50_during * 1000,
        "normal_p50_ms_after": statistics.median(after) * 1000,
        "normal_requests_during": len(during),
    }
    got = ", ".join(f"{'no answer' if k is None else k} x{v}" for k, v in statuses.most_common())
    measured = (
        f"{in_time}/{n} closed in {min(close_after, default=0):.2f}-{max(close_after, default=0):.2f} s, "
        f"{expected}: {answered_right}/{n} ({got}); RSS +{growth_mb:.1f} MiB; "
        f"p50 {p50_before * 1000:.1f} -> {p50_during * 1000:.1f} ms (n={len(during)})"
    )
    target = f"all closed in {timeout_s:g}+-1 s, {expected}; RSS +<50 MiB; p50 during <= max(2x, +5 ms)"
    return Row(
        f"1{what} {n} stalled: " + ("partial headers" if what == "a" else "short body"),
        target,
        measured,
        ok,
        figures,
        proxy.stated(),
    )


async def big_header(proxy: ProxyProcess, size: int = 8 * 1024 * 1024) -> Row:
    """One request with a ``size``-byte header, sent while reading: the 431 must arrive."""
    loop = asyncio.get_running_loop()
    trials: list[dict[str, Any]] = []
    for _ in range(5):
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", proxy.port))
        payload = b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Big: " + b"a" * size + b"\r\n\r\n"

        async def send_all(sock: socket.socket = sock, payload: bytes = payload) -> str:
            try:
                await loop.sock_sendall(sock, payload)
                return "sent"
            except (ConnectionResetError, BrokenPipeError) as exc:
                return type(exc).__name__

        sender = asyncio.ensure_future(send_all())
        data, reset = b"", False
        started = time.monotonic()
        while time.monotonic() - started < 10:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
            except (ConnectionResetError, TimeoutError):
                reset = True
                break
            if not chunk:
                break
            data += chunk
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        sock.close()
        trials.append({"status": status_of(data), "reset": reset, "seconds": time.monotonic() - started})
    got = sum(t["status"] == 431 for t in trials)
    return Row(
        "1c 8 MB header",
        "431 received (5 tries)",
        f"431 received {got}/5; resets seen {sum(t['reset'] for t in trials)}/5",
        got == len(trials),
        {"trials": trials},
        proxy.stated(),
    )


async def kept_alive_second_request(proxy: ProxyProcess, timeout_s: float, tries: int = 5) -> Row:
    """On a kept-alive connection (one request answered): nothing more (idle), a second head that
    stalls, or a second head too big. The idle and the stalled connection are closed within
    client_timeout_s + 1 s of the answer (the deadline runs from the head's start, and an idle
    connection's next head starts when the answer ends), with no answer; the big head gets 431."""
    loop = asyncio.get_running_loop()
    first = b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n"
    seconds = {
        "idle": b"",
        "stalled headers": PARTIAL_HEADERS,
        "200 KB header": b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    }
    expect: dict[str, int | None] = {"idle": None, "stalled headers": None, "200 KB header": 431}

    async def one(payload: bytes) -> tuple[int | None, float | None]:
        """The second answer's status and when the connection closed, from the first answer's end."""
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", proxy.port))
        await loop.sock_sendall(sock, first)
        head = b""
        while not head.endswith(b'{"status":"ok"}'):
            head += await loop.sock_recv(sock, 65536)
        answered_s = time.monotonic()
        if payload:
            try:
                await loop.sock_sendall(sock, payload)
            except OSError:
                pass
        data, closed_s = b"", None
        try:
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), timeout_s + 5):
                data += chunk
            closed_s = time.monotonic()
        except ConnectionResetError:
            closed_s = time.monotonic()
        except TimeoutError:
            pass
        sock.close()
        return status_of(data), None if closed_s is None else closed_s - answered_s

    got = {name: list(await asyncio.gather(*(one(payload) for _ in range(tries)))) for name, payload in seconds.items()}

    def right(name: str, status: int | None, closed_after_s: float | None) -> bool:
        if status != expect[name]:
            return False
        return expect[name] is not None or (closed_after_s is not None and closed_after_s <= timeout_s + 1.0)

    answered = {name: sum(right(name, *result) for result in results) for name, results in got.items()}

    def said(name: str) -> str:
        closes = [c for _, c in got[name] if c is not None]
        when = f", closed {min(closes):.2f}-{max(closes):.2f} s after the answer" if closes else ""
        statuses = Counter("no answer" if s is None else s for s, _ in got[name]).most_common()
        return f"{name}: {answered[name]}/{tries} ({statuses}{when})"

    return Row(
        "1e kept-alive connection after an answer: idle / 2nd head stalled / 200 KB header",
        f"idle and stalled: closed, no answer, <= {timeout_s:g}+1 s after the answer; 431 ({tries} tries each)",
        "; ".join(said(name) for name in got),
        all(n == tries for n in answered.values()),
        {"results": {name: [{"status": s, "closed_after_s": c} for s, c in v] for name, v in got.items()}},
        proxy.stated(),
    )


async def pipelined_behind_stream(backend: FakeBackend, log_dir: Path, timeout_s: float = 1.0, events: int = 30) -> Row:
    """HTTP pipelining: a 3 s stream, and behind it on the same connection the first bytes of a
    second request. The second request's deadline must not cut the first one's answer."""
    proxy = ProxyProcess("pipelined", backend.base_url, log_dir, client_timeout_s=timeout_s).start()
    try:
        body = json.dumps(chat_body("c1f-stream", model="slow-stream", stream=True, max_tokens=events)).encode()
        first = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        result = await raw_exchange(
            proxy.port,
            first + b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Part: 1",
            wait_s=events * backend.stream_delay_s + timeout_s + 5,
        )
    finally:
        proxy.stop()
    got = result.data.count(b"chat.completion.chunk")
    complete = b"[DONE]" in result.data
    took = None if result.closed_s is None else result.closed_s - result.opened_s
    return Row(
        f"1f pipelined partial request behind a {events * backend.stream_delay_s:g} s stream (client_timeout_s={timeout_s:g})",
        "the stream in progress completes ([DONE])",
        f"stream {'complete' if complete else 'CUT'}: {got}/{events} events, connection closed after "
        f"{'-' if took is None else f'{took:.2f}'} s",
        complete,
        {"events": got, "of": events, "done": complete, "closed_after_s": took},
        proxy.stated(),
    )


class KeptClient:
    """A raw kept-alive connection that sends one request and reads its answer (Content-Length
    framed), then stays open until ``close``: while open it counts against max_connections."""

    def __init__(self, port: int, request: bytes) -> None:
        self.port, self.request = port, request
        self.raw = b""
        self.answered_s: float | None = None  # monotonic, the whole answer read
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None

    async def open(self) -> KeptClient:
        reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writer.write(self.request)
        self._reading = asyncio.ensure_future(self._read(reader))
        return self

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while not answer_complete(self.raw):
                chunk = await reader.read(65536)
                if not chunk:
                    return
                self.raw += chunk
            self.answered_s = time.monotonic()
        except OSError:
            pass

    def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        if self._writer is not None:
            self._writer.transport.abort()


def post_request(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def wait_for_count(count: Callable[[], int], at_least: int, timeout_s: float) -> int:
    """Poll ``count()`` until it reaches ``at_least`` or ``timeout_s`` passes; its last value."""
    deadline_s = time.monotonic() + timeout_s
    while (value := count()) < at_least and time.monotonic() < deadline_s:
        await asyncio.sleep(0.005)
    return value


async def connection_bound(
    backend: FakeBackend, log_dir: Path, cap: int = 20, extra: int = 10, observe_s: float = 2.0
) -> Row:
    """max_connections is the server's backpressure: a connection beyond it waits to be accepted
    until one ends (no 503). ``cap`` connections each hold a streaming request (slots = cap, so the
    backend shows all of them served); ``extra`` clients then send a small request each on a
    kept-alive connection. None of them is served within ``observe_s``; the held connections are
    then closed one at a time, each letting exactly one extra request in (answered, kept alive, it
    holds its connection); once all are closed every extra request has been answered 200 and
    delivered once, and a new request gets 200."""
    proxy = ProxyProcess("cap", backend.base_url, log_dir, max_connections=cap, slots=cap, client_timeout_s=5).start()
    holders: list[KeptClient] = []
    extras: list[KeptClient] = []
    stepped: list[tuple[int, int]] = []  # (holders closed, extra requests answered) after each close
    try:
        for i in range(cap):
            body = chat_body(f"c1d-hold-{i}", model="slow-stream", stream=True, max_tokens=600)  # 60 s of events
            holders.append(await KeptClient(proxy.port, post_request(body)).open())
        all_held = await wait_for_count(lambda: len(backend.tags("c1d-hold-")), cap, 10) >= cap
        extras = [await KeptClient(proxy.port, post_request(chat_body(f"c1d-x{i}"))).open() for i in range(extra)]

        def answered() -> int:
            return sum(e.answered_s is not None for e in extras)

        await asyncio.sleep(observe_s)  # the observation window: nothing is expected to happen in it
        served_while_held = answered()
        delivered_while_held = len(backend.tags("c1d-x"))
        # One at a time: each close frees one connection (the answered extra keeps its own open,
        # until its idle deadline, client_timeout_s, which this loop stays well within).
        for k in range(1, extra + 1):
            holders[k - 1].close()
            await wait_for_count(answered, k, 3.0)
            stepped.append((k, answered()))
        for holder in holders[extra:]:
            holder.close()
        await wait_for_count(answered, extra, 10.0)
        statuses = Counter(status_of(e.raw) for e in extras)
        async with httpx.AsyncClient(timeout=10) as client:
            after = (await client.post(f"{proxy.url}{CHAT}", json=chat_body("c1d-after"))).status_code
    finally:
        for client_ in holders + extras:
            client_.close()
        proxy.stop()
    delivered = backend.tags("c1d-x")
    extra_once = sum(delivered.get(f"c1d-x{i}", 0) == 1 for i in range(extra))
    one_per_close = all(n == k for k, n in stepped)
    ok = (
        all_held
        and served_while_held == 0
        and delivered_while_held == 0
        and one_per_close
        and statuses.get(200, 0) == extra
        and extra_once == extra
        and after == 200
    )
    return Row(
        f"1d {extra} requests beyond max_connections={cap} ({cap} held, streaming)",
        f"none served in {observe_s:g} s; each close lets one in; all {extra} x 200, each delivered once; 200 after",
        f"served while held {served_while_held} (delivered {delivered_while_held}); answered after each close "
        f"{[n for _, n in stepped]}; statuses {dict(statuses)}; delivered once {extra_once}/{extra}; after: {after}",
        ok,
        {
            "max_connections": cap,
            "all_holders_served": all_held,
            "extra": extra,
            "observe_s": observe_s,
            "served_while_held": served_while_held,
            "delivered_while_held": delivered_while_held,
            "answered_after_each_close": stepped,
            "statuses": {str(k): v for k, v in statuses.items()},
            "delivered_once": extra_once,
            "status_after": after,
        },
        proxy.stated(),
    )


# --------------------------------------------------------------------------------------------
# Case 2: SIGTERM with one stream in flight and 50 queued
# --------------------------------------------------------------------------------------------


async def sigterm_case(backend: FakeBackend, log_dir: Path, grace_s: float, stream_events: int) -> Row:
    proxy = ProxyProcess(
        f"sigterm-grace{grace_s:g}", backend.base_url, log_dir, slots=1, shutdown_grace_s=grace_s, log_level="info"
    ).start()
    url = f"{proxy.url}{CHAT}"
    signalled = 0.0
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def the_stream() -> tuple[str, float]:
            async with client.stream(
                "POST", url, json=chat_body("sig-stream", model="slow-stream", stream=True, max_tokens=stream_events)
            ) as response:
                text = ""
                async for piece in response.aiter_text():
                    text += piece
            return sse_outcome(text), time.monotonic() - signalled

        async def queued(i: int) -> tuple[int, str, float]:
            response = await client.post(url, json=chat_body(f"sig-q{i}", stream=bool(i % 2)))
            try:
                code = response.json().get("error", {}).get("code", "")
            except ValueError:
                code = ""
            return response.status_code, str(code), time.monotonic() - signalled

        stream = asyncio.ensure_future(the_stream())
        await asyncio.sleep(0.5)
        waiting = [asyncio.ensure_future(queued(i)) for i in range(50)]
        deadline = time.monotonic() + 10
        depth = 0
        async with httpx.AsyncClient(timeout=5) as probe:
            while time.monotonic() < deadline:
                depth = len((await probe.get(f"{proxy.url}/queue")).json()["waiting"])
                if depth >= 50:
                    break
                await asyncio.sleep(0.05)
        signalled = time.monotonic()
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGTERM)
        exit_s = None
        while time.monotonic() - signalled < grace_s + 10:
            if proxy.proc.poll() is not None:
                exit_s = time.monotonic() - signalled
                break
            await asyncio.sleep(0.02)
        answers = await asyncio.gather(*waiting, return_exceptions=True)
        stream_result = await asyncio.gather(stream, return_exceptions=True)
    proxy.stop()
    refused = [a for a in answers if isinstance(a, tuple) and a[0] == 503 and a[1] == "shutting_down"]
    refused_s = [a[2] for a in refused]
    outcome = stream_result[0] if isinstance(stream_result[0], tuple) else (repr(stream_result[0]), float("nan"))
    expected = "done" if grace_s >= stream_events * backend.stream_delay_s else "error"
    ok = (
        len(refused) == 50
        and max(refused_s, default=99) <= 1.0
        and outcome[0] == expected
        and exit_s is not None
        and exit_s <= grace_s + 2
        and proxy.proc.returncode == 0
    )
    return Row(
        f"2 SIGTERM, 1 stream + {depth} queued, grace {grace_s:g} s",
        f"50x503 shutting_down <=1 s; stream {expected}; exit 0 <= {grace_s + 2:g} s",
        f"{len(refused)}x503 by {max(refused_s, default=float('nan')):.2f} s; stream {outcome[0]} at {outcome[1]:.2f} s; "
        f"exit {'none' if exit_s is None else f'{exit_s:.2f} s'} (rc {proxy.proc.returncode})",
        ok,
        {
            "grace_s": grace_s,
            "stream_s_total": stream_events * backend.stream_delay_s,
            "queued_at_signal": depth,
            "refused_503": len(refused),
            "refused_max_s": max(refused_s, default=None),
            "other_answers": [repr(a)[:120] for a in answers if a not in refused],
            "stream_outcome": outcome[0],
            "stream_end_s": outcome[1],
            "exit_s": exit_s,
            "returncode": proxy.proc.returncode,
        },
        proxy.stated(),
    )


# --------------------------------------------------------------------------------------------
# Case 3: a backend that reads the POST and closes
# --------------------------------------------------------------------------------------------


async def close_after_read(proxy: ProxyProcess, backend: FakeBackend) -> list[Row]:
    rows = []
    url = f"{proxy.url}{CHAT}"
    async with httpx.AsyncClient(timeout=30) as client:
        for kind in ("fresh", "reused"):
            await asyncio.sleep(2.5)  # the proxy's pooled upstream connections expire after 2 s
            if kind == "reused":
                warm = await client.post(url, json=chat_body("c3-warm"))
                assert warm.status_code == 200
            tag = f"c3-{kind}"
            started = time.monotonic()
            response = await client.post(url, json=chat_body(tag, model="close-after-read"))
            took = time.monotonic() - started
            got = [d for d in backend.deliveries if d.tag == tag]
            on_reused = [d.nth_on_connection > 1 for d in got]
            ok = len(got) == 1 and response.status_code == 502  # (the reuse itself is the proxy's choice: reported)
            rows.append(
                Row(
                    f"3 backend reads then closes, {kind} upstream connection",
                    "1 delivery, 1 x 502",
                    f"{len(got)} delivery(ies) (on a reused connection: {on_reused}), status {response.status_code} after {took:.2f} s",
                    ok,
                    {
                        "deliveries": len(got),
                        "reused_connection": on_reused,
                        "status": response.status_code,
                        "seconds": took,
                    },
                    proxy.stated(),
                )
            )
    return rows


# --------------------------------------------------------------------------------------------
# Case 6: 1,000 concurrent clients
# --------------------------------------------------------------------------------------------


async def thousand(proxy: ProxyProcess, backend: FakeBackend, n: int = 1000) -> Row:
    url = f"{proxy.url}{CHAT}"
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    tags = {f"c6-{i}" for i in range(n)}

    async def one(i: int, client: httpx.AsyncClient) -> str:
        tag = f"c6-{i}"
        stream = i % 2 == 1
        try:
            if stream:
                async with client.stream("POST", url, json=chat_body(tag, stream=True)) as response:
                    text = ""
                    async for piece in response.aiter_text():
                        text += piece
                complete = response.status_code == 200 and sse_outcome(text) == "done" and f'x-{tag}"' in text
            else:
                response = await client.post(url, json=chat_body(tag))
                complete = (
                    response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == f"ok {tag}"
                )
            return "ok" if complete else f"status {response.status_code}"
        except httpx.HTTPError as exc:
            return type(exc).__name__

    rss_before = proxy.rss_kib()
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        with RssSampler(proxy.pid, 0.05) as sampler:
            started = time.monotonic()
            outcomes = await asyncio.gather(*(one(i, client) for i in range(n)))
            took = time.monotonic() - started
    await asyncio.sleep(0.2)
    got = backend.tags("c6-")
    extra, stray = duplicates(got, tags)
    kinds = Counter(outcomes)
    lost = n - kinds.get("ok", 0)
    delivered = sum(got.values())
    missing = len(tags - set(got))
    ok = lost == 0 and extra == 0 and stray == 0 and delivered == n
    return Row(
        f"6 {n} concurrent clients (slots 8, half streamed)",
        "0 lost, 0 duplicated (deliveries == requests)",
        f"lost {lost}, duplicated {extra}, deliveries {delivered}/{n} (never delivered {missing}); {took:.1f} s; "
        f"proxy RSS {rss_before / 1024:.0f} -> peak {sampler.peak_kib / 1024:.0f} MiB",
        ok,
        {
            "requests": n,
            "outcomes": dict(kinds),
            "lost": lost,
            "duplicated": extra,
            "stray": stray,
            "deliveries": delivered,
            "seconds": took,
            "rss_before_mib": rss_before / 1024,
            "rss_peak_mib": sampler.peak_kib / 1024,
        },
        proxy.stated(),
    )


async def credentials_in_log(backend: FakeBackend, log_dir: Path) -> Row:
    """An upstream URL with user:password, the default log level (info), one request and one
    readiness probe: the password must not appear in the proxy's log."""
    secret = "s3cret-hbench"
    url = backend.base_url.replace("http://", f"http://bench:{secret}@")
    proxy = ProxyProcess("credentials", url, log_dir, log_level="info").start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            status = (await client.post(f"{proxy.url}{CHAT}", json=chat_body("c7"))).status_code
            await client.get(f"{proxy.url}/readyz")
    finally:
        proxy.stop()
    lines = [line for line in proxy.log_path.read_text(errors="replace").splitlines() if secret in line]
    loggers = Counter(line.split()[3] if len(line.split()) > 3 else "?" for line in lines)
    return Row(
        "7 upstream URL with user:password, log_level info",
        "the password never in the proxy's log",
        f"request {status}; password in {len(lines)} log line(s)" + (f" (logger {dict(loggers)})" if lines else ""),
        not lines,
        {"lines_with_password": len(lines), "loggers": dict(loggers)},
        proxy.stated(),
    )


# --------------------------------------------------------------------------------------------
# Cases 4 and 5: the real llama.cpp
# --------------------------------------------------------------------------------------------

LONG_PROMPT = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]
SHORT_PROMPT = [{"role": "user", "content": "Say OK."}]


def llama_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": False}


@dataclass
class LlamaTask:
    """One task as llama.cpp's server log shows it (seconds on the server's own clock)."""

    task: int
    launch_s: float
    release_s: float | None = None
    context_tokens: int | None = None  # prompt + generated tokens at release (n_tokens)
    cancelled: bool = False


def _log_seconds(stamp: str) -> float:
    """llama.cpp's log time stamp ``M.SS.mmm.uuu`` in seconds."""
    minutes, seconds, millis, micros = (int(x) for x in stamp.split("."))
    return minutes * 60 + seconds + millis / 1e3 + micros / 1e6


def llama_tasks(lines: list[str]) -> list[LlamaTask]:
    """Tasks in launch order, with release time and generated tokens, from llama.cpp server log lines."""
    tasks: dict[int, LlamaTask] = {}
    for line in lines:
        stamp, _, rest = line.partition(" ")
        if "cancel task, id_task = " in rest:
            cancelled = int(rest.rsplit("= ", 1)[1].split()[0])
            if cancelled in tasks:
                tasks[cancelled].cancelled = True
            continue
        if "| task " not in rest:
            continue
        try:
            when = _log_seconds(stamp)
            task = int(rest.split("| task ", 1)[1].split(" ", 1)[0])
        except ValueError:
            continue
        if "launch_slot_" in rest:
            tasks[task] = LlamaTask(task, when)
        elif task in tasks and "release:" in rest:
            tasks[task].release_s = when
            if "n_tokens = " in rest:
                tasks[task].context_tokens = int(rest.split("n_tokens = ", 1)[1].split(",")[0])
    return sorted(tasks.values(), key=lambda t: t.launch_s)


class MetricsScraper:
    """GETs the backend's /metrics every ``every_s`` (as a Prometheus scrape would) while running."""

    def __init__(self, base_url: str, every_s: float) -> None:
        self.base_url, self.every_s = base_url, every_s
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                await client.get(f"{self.base_url}/metrics")
                await asyncio.sleep(self.every_s)

    async def __aenter__(self) -> MetricsScraper:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


HIDDEN_CONDITIONS = (("auto", None), ("abort", None), ("abort", 0.5))  # (disconnect_mode, /metrics scrape interval)


async def hidden_wait(
    backend_url: str,
    backend_log: Path,
    log_dir: Path,
    trials: int,
    long_tokens: int = 300,
    short_tokens: int = 4,
    leave_s: float = 0.5,
) -> list[Row]:
    proxies = {
        mode: ProxyProcess(f"disconnect-{mode}", backend_url, log_dir, slots=1, disconnect_mode=mode).start()
        for mode in ("auto", "abort")
    }
    samples: dict[tuple[str, float | None], list[dict[str, float]]] = {c: [] for c in HIDDEN_CONDITIONS}
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            # The short request's own service, measured directly on the idle backend in this run.
            own = []
            for i in range(7):
                started = time.perf_counter()
                (
                    await client.post(f"{backend_url}{CHAT}", json=llama_body(SHORT_PROMPT, short_tokens))
                ).raise_for_status()
                if i >= 2:
                    own.append(time.perf_counter() - started)
            own_s = statistics.median(own)
            probe = await client.post(f"{backend_url}{CHAT}", json=llama_body(LONG_PROMPT, 1))
            long_prompt_tokens = int(probe.json()["timings"]["prompt_n"]) + int(
                probe.json()["timings"].get("cache_n", 0)
            )
            for proxy in proxies.values():  # warm each proxy's path once
                (
                    await client.post(f"{proxy.url}{CHAT}", json=llama_body(SHORT_PROMPT, short_tokens))
                ).raise_for_status()
            for trial in range(trials):
                order = HIDDEN_CONDITIONS if trial % 2 == 0 else HIDDEN_CONDITIONS[::-1]
                for mode, scrape_s in order:
                    url = f"{proxies[mode].url}{CHAT}"
                    log_lines_before = len(backend_log.read_text(errors="replace").splitlines())
                    scraper = MetricsScraper(backend_url, scrape_s) if scrape_s else None
                    if scraper:
                        await scraper.__aenter__()
                    try:
                        async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=leave_s)) as leaver:
                            try:
                                await leaver.post(url, json=llama_body(LONG_PROMPT, long_tokens))
                                raise RuntimeError("the long request finished before the client left")
                            except httpx.ReadTimeout:
                                pass
                        left = time.perf_counter()
                        response = await client.post(url, json=llama_body(SHORT_PROMPT, short_tokens))
                        total_s = time.perf_counter() - left
                    finally:
                        if scraper:
                            await scraper.__aexit__()
                    response.raise_for_status()
                    queue_s = float(response.headers.get("x-clairvoyant-queue-wait-ms") or "nan") / 1000
                    await asyncio.sleep(0.3)
                    tasks = llama_tasks(backend_log.read_text(errors="replace").splitlines()[log_lines_before:])
                    long_task = tasks[0] if tasks else None  # the first task launched in the trial is the long one
                    busy_s = generated = float("nan")
                    if long_task is not None and long_task.release_s is not None:
                        # the client left leave_s after sending; the backend started it within milliseconds
                        busy_s = long_task.release_s - long_task.launch_s - leave_s
                        generated = float((long_task.context_tokens or 0) - long_prompt_tokens + 1)
                    samples[(mode, scrape_s)].append(
                        {
                            "total_s": total_s,
                            "queue_wait_s": queue_s,
                            "hidden_s": total_s - queue_s - own_s,
                            "long_tokens_generated": generated,
                            "long_cancelled_by_backend": float(bool(long_task and long_task.cancelled)),
                            "backend_busy_after_leave_s": busy_s,
                        }
                    )
    finally:
        for proxy in proxies.values():
            proxy.stop()
    rows = []
    for (mode, scrape_s), s in samples.items():
        med = {k: statistics.median(x[k] for x in s) for k in s[0]}
        label = f"disconnect_mode={mode}" + (f", backend /metrics scraped every {scrape_s:g} s" if scrape_s else "")
        threshold = max(0.3, 0.1 * med["backend_busy_after_leave_s"])
        ok = med["hidden_s"] <= threshold if mode == "auto" else None
        rows.append(
            Row(
                f"4 llama.cpp non-stream left at {leave_s:g} s, {label}",
                f"hidden wait <= {threshold:.2f} s (the wait is queue wait)"
                if mode == "auto"
                else "(compared: no target)",
                f"next short request: total {med['total_s']:.2f} s = queue {med['queue_wait_s']:.2f} + own {own_s:.2f} + hidden "
                f"{med['hidden_s']:.2f}; backend busy {med['backend_busy_after_leave_s']:.2f} s after the leave "
                f"({med['long_tokens_generated']:.0f}/{long_tokens} tokens generated)",
                ok,
                {
                    "disconnect_mode": mode,
                    "metrics_scrape_s": scrape_s,
                    "trials": s,
                    "median": med,
                    "own_service_s": own_s,
                    "own_service_samples_s": own,
                },
                proxies[mode].stated(),
            )
        )
    return rows


async def left_while_backend_down(log_dir: Path, away_s: float = 3.0) -> Row:
    """A non-streamed request is dispatched while the backend is down; its client leaves after 1 s;
    the backend comes back ``away_s`` later. Nothing was sent, so nothing should reach the backend."""
    port = free_port()
    backend = FakeBackend(port=port).start()
    proxy = ProxyProcess(
        "left-while-down", backend.base_url, log_dir, slots=1, disconnect_mode="auto", log_level="info"
    ).start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            (await client.post(f"{proxy.url}{CHAT}", json=chat_body("c5b-warm"))).raise_for_status()
        backend.stop()
        async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=1.0)) as client:
            try:
                await client.post(f"{proxy.url}{CHAT}", json=chat_body("c5b-gone"))
            except httpx.ReadTimeout:
                pass
        left = time.monotonic()
        await asyncio.sleep(away_s - 1.0)
        backend = FakeBackend(port=port).start()
        await asyncio.sleep(5.0)
        got = [d for d in backend.deliveries if d.tag == "c5b-gone"]
    finally:
        proxy.stop()
        backend.stop()
    return Row(
        "5b non-stream client left while the backend was down (auto)",
        "0 deliveries after the backend is back (never sent, nothing to drain)",
        f"{len(got)} delivery(ies)" + (f", {got[0].at_s - left:.1f} s after the client left" if got else ""),
        not got,
        {"deliveries": len(got), "after_leave_s": [d.at_s - left for d in got]},
        proxy.stated(),
    )


async def backend_gone(log_dir: Path, wait_s: float = 2.0, n: int = 5) -> Row:
    """The backend is down for good (nothing listens), slots 1, backend_wait_s=``wait_s``: each of
    ``n`` requests sent together should get its 502 about ``wait_s`` after it arrived."""
    proxy = ProxyProcess(
        "backend-gone", f"http://127.0.0.1:{free_port()}", log_dir, slots=1, backend_wait_s=wait_s
    ).start()
    try:
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(i: int) -> tuple[int, float]:
                response = await client.post(f"{proxy.url}{CHAT}", json=chat_body(f"c5c-{i}"))
                return response.status_code, time.monotonic() - started

            answers = await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        proxy.stop()
    latest = max(a[1] for a in answers)
    ok = all(a[0] == 502 for a in answers) and latest <= wait_s + 1.0
    return Row(
        f"5c backend down for good, backend_wait_s={wait_s:g}, {n} requests at once (slots 1)",
        f"each 502 within backend_wait_s + 1 s = {wait_s + 1:g} s of its arrival",
        "502 at "
        + ", ".join(f"{a[1]:.1f}" for a in sorted(answers, key=lambda a: a[1]))
        + " s"
        + ("" if all(a[0] == 502 for a in answers) else f" (statuses {[a[0] for a in answers]})"),
        ok,
        {"answers": answers, "backend_wait_s": wait_s},
        proxy.stated(),
    )


async def hung_backend(log_dir: Path, first_byte_s: float = 10.0, wait_s: float = 3.0) -> Row:
    """The backend accepts and never answers, its health check included (slots 1). One request is in
    flight and one queued behind it: the first gets its 504 at the first-byte deadline; the queued one
    finds the backend suspect, is health-checked for ``wait_s`` and gets 503, never sent."""
    backend = FakeBackend(hung=True).start()
    proxy = ProxyProcess(
        "hung", backend.base_url, log_dir, slots=1, first_byte_timeout_s=first_byte_s, backend_wait_s=wait_s
    ).start()
    try:
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=60) as client:

            async def one(tag: str) -> tuple[int, float, str]:
                response = await client.post(f"{proxy.url}{CHAT}", json=chat_body(tag))
                return response.status_code, time.monotonic() - started, response.headers.get("retry-after", "")

            first = asyncio.ensure_future(one("c9-first"))
            while not backend.deliveries:
                await asyncio.sleep(0.01)
            queued = asyncio.ensure_future(one("c9-queued"))
            answers = await asyncio.gather(first, queued)
    finally:
        proxy.stop()
        backend.stop()
    sent = sorted(d.tag for d in backend.deliveries)
    latest = max(a[1] for a in answers)
    ok = latest <= 20.0 and sent == ["c9-first"] and [a[0] for a in answers] == [504, 503]
    return Row(
        f"9 hung backend (accepts, never answers), first_byte_timeout_s={first_byte_s:g}, backend_wait_s={wait_s:g}, "
        "1 in flight + 1 queued",
        "both answered within 20 s; the backend receives 1 request (the queued one never sent)",
        f"{answers[0][0]} at {answers[0][1]:.1f} s, {answers[1][0]} (Retry-After {answers[1][2] or '-'}) at "
        f"{answers[1][1]:.1f} s; the backend received {len(sent)} request(s), {backend.gets} health check(s)",
        ok,
        {"answers": answers, "requests_at_backend": sent, "health_checks": backend.gets},
        proxy.stated(),
    )


async def never_accepts(log_dir: Path, connect_s: float = 2.0, wait_s: float = 3.0) -> Row:
    """The backend's accept queue is full (a backlog of 0, never accepted, filled by one connection):
    a connection is neither accepted nor refused. One request in each dialect, one after the other."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname())
    proxy = ProxyProcess(
        "never-accepts", f"http://127.0.0.1:{listener.getsockname()[1]}", log_dir, connect_timeout_s=connect_s,
        backend_wait_s=wait_s,
    ).start()  # fmt: skip
    answers: list[tuple[str, int, float, bool]] = []
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            for path, body in (
                (CHAT, chat_body("c10-openai")),
                ("/api/generate", {"model": "m", "prompt": "Say OK.", "stream": False}),
            ):
                started = time.monotonic()
                response = await client.post(f"{proxy.url}{path}", json=body)
                error = response.json().get("error")
                shaped = isinstance(error, dict) if path == CHAT else isinstance(error, str)  # OpenAI's, Ollama's
                answers.append((path, response.status_code, time.monotonic() - started, shaped))
    finally:
        proxy.stop()
        filler.close()
        listener.close()
    ok = all(status == 504 and took_s <= wait_s + 1.0 and shaped for _, status, took_s, shaped in answers)
    return Row(
        f"10 backend never accepts, connect_timeout_s={connect_s:g}, backend_wait_s={wait_s:g}",
        f"504 in the dialect's shape within backend_wait_s + 1 s = {wait_s + 1:g} s",
        ", ".join(
            f"{path} {status}{'' if shaped else ' (wrong shape)'} after {took_s:.1f} s"
            for path, status, took_s, shaped in answers
        ),
        ok,
        {"answers": answers},
        proxy.stated(),
    )


async def llama_bursts(backend_url: str, log_dir: Path, bursts: int = 20, size: int = 20) -> Row:
    """Back-to-back bursts of short requests (half streamed) through the proxy to llama.cpp: no 502
    (llama.cpp closes some connections right after a streamed answer; a pooled one may be reused first)."""
    proxy = ProxyProcess("bursts", backend_url, log_dir, slots=1).start()
    statuses: Counter[int] = Counter()
    try:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=size + 10)) as client:

            async def one(stream: bool) -> int:
                body = {**llama_body(SHORT_PROMPT, 2), "stream": stream}
                async with client.stream("POST", f"{proxy.url}{CHAT}", json=body) as response:
                    await response.aread()
                return response.status_code

            for _ in range(bursts):
                statuses.update(await asyncio.gather(*(one(i % 2 == 0) for i in range(size))))
                await asyncio.sleep(0.3)
    finally:
        proxy.stop()
    n = bursts * size
    return Row(
        f"8 llama.cpp, {bursts} bursts of {size} short requests (half streamed), slots 1",
        "0 x 502 (every request answered 200)",
        f"statuses {dict(statuses)}",
        statuses.get(200, 0) == n,
        {"statuses": {str(k): v for k, v in statuses.items()}, "requests": n},
        proxy.stated(),
    )


async def restart_case(log_dir: Path, down_s: float = 10.0, n: int = 10) -> Row:
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

    port = free_port()
    server = EmbeddedLlamaServer(port=port, n_threads=1)
    server.start()
    proxy = ProxyProcess("restart", server.base_url, log_dir, slots=1, backend_wait_s=30).start()
    try:
        url = f"{proxy.url}{CHAT}"
        async with httpx.AsyncClient(timeout=120) as client:
            (await client.post(url, json=llama_body(SHORT_PROMPT, 4))).raise_for_status()
            await asyncio.to_thread(server.stop)
            stopped = time.monotonic()
            await asyncio.sleep(0.5)

            async def one() -> tuple[int, float]:
                response = await client.post(url, json=llama_body(SHORT_PROMPT, 8))
                return response.status_code, time.monotonic() - stopped

            waiting = [asyncio.ensure_future(one()) for _ in range(n)]
            await asyncio.sleep(max(0.0, stopped + down_s - time.monotonic()))
            early = sum(w.done() for w in waiting)
            await asyncio.to_thread(server.start)
            back = time.monotonic() - stopped
            answers = await asyncio.gather(*waiting, return_exceptions=True)
    finally:
        proxy.stop()
        server.stop()
    statuses = Counter(a[0] if isinstance(a, tuple) else type(a).__name__ for a in answers)
    last = max((a[1] for a in answers if isinstance(a, tuple)), default=float("nan"))
    ok = statuses.get(200, 0) == n and early == 0
    return Row(
        f"5 llama.cpp down {down_s:g} s while {n} wait (slots 1)",
        f"{n} x 200 after it is back, 0 x 502",
        f"statuses {dict(statuses)}; answered before restart {early}; backend back at {back:.1f} s, last answer {last:.1f} s",
        ok,
        {
            "statuses": {str(k): v for k, v in statuses.items()},
            "answered_while_down": early,
            "backend_back_s": back,
            "last_answer_s": last,
        },
        proxy.stated(),
    )


# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Case 11: a backend that closes after each stream, without saying so
# --------------------------------------------------------------------------------------------


async def closes_after_each_stream(log_dir: Path, n: int = 1500, clients: int = 4) -> Row:
    backend = RecordingBackend(slots=1, token_s=0.0005).start()
    proxy = ProxyProcess("closes", backend.base_url, log_dir, slots=1, encoder=False, online_learning=False).start()
    statuses: Counter[str] = Counter()
    gate = asyncio.Semaphore(clients)  # more clients than slots: the next request waits for the slot

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with gate:
            try:
                r = await client.post(f"{proxy.url}{CHAT}", json=chat_body(f"c11-{i}", stream=True, max_tokens=4))
                statuses[str(r.status_code) if r.status_code != 200 or "[DONE]" in r.text else "200 cut"] += 1
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1

    try:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(one(i, client) for i in range(n)))
    finally:
        proxy.stop()
        backend.stop()
    read = Counter(
        tag
        for r in backend.received
        if r.method == "POST" and (tag := json.loads(r.body).get("user", "")).startswith("c11-")
    )
    failed = n - statuses["200"]
    twice = sum(count > 1 for count in read.values())
    return Row(
        f"11 {n} streams back to back, the backend closing after each without saying so",
        "0 x 502, each read once",
        f"{statuses['502']} x 502 ({statuses['502'] / n:.2%}), other failures {failed - statuses['502']}, "
        f"read {len(read)}/{n}, read twice {twice}",
        failed == 0 and twice == 0 and len(read) == n,
        {
            "requests": n,
            "statuses": dict(statuses),
            "rate_502": statuses["502"] / n,
            "read": len(read),
            "read_twice": twice,
        },
        proxy.stated(),
    )


async def run(cases: set[str], log_dir: Path, trials: int) -> list[Row]:
    rows: list[Row] = []

    async def step(name: str, coro: Awaitable[Row | list[Row]]) -> None:
        started = time.monotonic()
        result = await coro
        new = result if isinstance(result, list) else [result]
        rows.extend(new)
        for row in new:
            print(
                f"[{time.monotonic() - started:5.1f} s] {row.case}: {'-' if row.ok is None else ('PASS' if row.ok else 'FAIL')} {row.measured}",
                flush=True,
            )

    if cases & {"1", "3", "6", "7"}:
        backend = FakeBackend(service_s=0.005).start()
        main = ProxyProcess(
            "main", backend.base_url, log_dir, slots=8, max_queue=2000, client_timeout_s=5, max_header_bytes=65536,
            max_connections=2048,
        ).start()  # fmt: skip
        try:
            if "1" in cases:
                await step("1a", stall_phase(main, "a", PARTIAL_HEADERS, 500, 5.0))
                await step("1b", stall_phase(main, "b", short_body_request(), 500, 5.0))
                await step("1c", big_header(main))
                await step("1e", kept_alive_second_request(main, 5.0))
            if "3" in cases:
                await step("3", close_after_read(main, backend))
            if "6" in cases:
                await step("6", thousand(main, backend))
            if "7" in cases:
                await step("7", credentials_in_log(backend, log_dir))
        finally:
            main.stop()
        if "1" in cases:
            await step("1d", connection_bound(backend, log_dir))
            await step("1f", pipelined_behind_stream(backend, log_dir))
        backend.stop()
    if "2" in cases:
        backend = FakeBackend(stream_delay_s=0.1).start()
        await step("2", sigterm_case(backend, log_dir, grace_s=8.0, stream_events=30))
        await step("2", sigterm_case(backend, log_dir, grace_s=1.0, stream_events=30))
        backend.stop()
    if cases & {"4", "8"}:
        from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

        llama_log = log_dir / "llama-case4.log"
        with EmbeddedLlamaServer(n_threads=1, log_path=llama_log) as llama:
            if "4" in cases:
                await step("4", hidden_wait(llama.base_url, llama_log, log_dir, trials))
            if "8" in cases:
                await step("8", llama_bursts(llama.base_url, log_dir))
    if "5" in cases:
        await step("5", restart_case(log_dir))
        await step("5b", left_while_backend_down(log_dir))
        await step("5c", backend_gone(log_dir))
    if "9" in cases:
        await step("9", hung_backend(log_dir))
    if "10" in cases:
        await step("10", never_accepts(log_dir))
    if "11" in cases:
        await step("11", closes_after_each_stream(log_dir))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=ALL_CASES, help="comma-separated case numbers (default all)")
    parser.add_argument("--trials", type=int, default=2, help="case 4: trials per disconnect mode (default 2)")
    add_json_option(parser, "hardening")
    parser.add_argument("--log-dir", type=Path, help="where the proxies' logs go (default a temporary directory)")
    parser.add_argument(
        "--proxy-src",
        type=Path,
        default=proxy_process.PROXY_SRC[0],
        help="src/ directory the proxy runs from (default this checkout's)",
    )
    args = parser.parse_args()
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    proxy_process.PROXY_SRC[0] = args.proxy_src.resolve()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-hardening-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = asyncio.run(run(cases, log_dir, args.trials))
    print_table(rows)
    took = time.monotonic() - started
    print(
        f"\n{sum(r.ok is True for r in rows)} PASS, {sum(r.ok is False for r in rows)} FAIL in {took:.0f} s; proxy logs in {log_dir}"
    )
    load = os.getloadavg()
    result = {
        "command": "PYTHONPATH=src python benchmarks/bench_hardening.py"
        + ("" if args.cases == ALL_CASES else f" --cases {args.cases}"),
        "seconds": took,
        "load_average": load,
        "rows": [r.as_json() for r in rows],
    }
    write_json(args.json, result)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
