"""The body budget against the REAL proxy process: 20 clients each holding a 15 MiB body.

Target: 20 clients each holding 15 MB of body grow the proxy's RSS by at most 100 MB
(10^6 bytes); beyond ``body_budget_bytes`` the proxy answers 503 with Retry-After.

The proxy runs as deployed (``python -m clairvoyant serve``, CLAIRVOYANT_* settings, ``harness.proxy_process``) in front of a holding backend: a small HTTP/1.1 server in a thread of this
process that holds every request whose body names the model "hold" until the benchmark releases it
(other requests are answered at once), and counts what it received. Settings: slots 1,
client_timeout_s 30, max_body_bytes 16 MiB, body_budget_bytes 64 MiB (all stated in the output).

1. Hold: 20 clients connect at once; each sends its head (Content-Length 15 MiB, no Expect) and
   then its body at ``--rate-mib-s`` MiB/s per client, all but its last 1 KiB, and holds the rest.
   A client answered meanwhile stops sending. The proxy's RSS is sampled every 0.1 s from before
   the first client until every client is holding or answered, and ``--hold-s`` seconds beyond.
   Judged: RSS growth (peak - before) <= 100 MB; budget // body clients admitted (64 // 15 = 4),
   every other one answered 503 with Retry-After.
2. Queued: the held clients send their last bytes. Their requests are parsed and queued (one at a
   time reaches the backend, which holds it), so their bodies are still held. A further 15 MiB
   client must get 503 with Retry-After. RSS peak stated.
3. Given back: the backend releases everything; every queued request is answered 200; a new
   15 MiB client is admitted (the budget was given back) and answered 200. RSS after stated.
4. One after another: 12 requests of 15 MiB, each answered at once. The budget is given back when
   a request ends, so it bounds memory only if the request's body is freed then: judged, RSS after
   the last request - after the 2nd <= 30 MB (the 2nd and later reuse the memory the 1st left).

Run against another build with ``--proxy-src`` (a build without a body budget ignores the setting,
and its log says so: the output states it):

    PYTHONPATH=src python benchmarks/bench_body_budget.py                      # 20-40 s
    PYTHONPATH=src python benchmarks/bench_body_budget.py --proxy-src /path/to/other/src --json FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from harness.proxy_process import PROXY_SRC, ProxyProcess, RssSampler
from harness.results import add_json_option, write_json
from harness.verdicts import Row, answer_complete, header_value, print_table, status_of

CHAT = "/v1/chat/completions"
MIB = 1024 * 1024
MB = 1000 * 1000
BODY_BYTES = 15 * MIB  # each client's Content-Length
TAIL_BYTES = 1024  # what a holding client keeps back
CLIENTS = 20
GROWTH_LIMIT_BYTES = 100 * MB
SEQUENTIAL = 12  # phase 4's requests
SEQUENTIAL_RATE_BPS = 64 * MIB  # phase 4's clients send at once (about 0.25 s a body)
# Phase 4: from the 2nd request on, a finished request's memory is reused by the next one.
SEQUENTIAL_GROWTH_LIMIT_BYTES = 30 * MB
ANSWER_WAIT_S = 10.0  # the longest a client waits for an answer the proxy owes it at once
SETTINGS = {
    "slots": 1,
    "client_timeout_s": 30,
    "max_body_bytes": 16 * MIB,
    "body_budget_bytes": 64 * MIB,
    "max_queue": 256,
}
_FILLER_WORDS = b"the lighthouse keeper wrote another line in the log "


# --------------------------------------------------------------------------------------------
# Pure helpers (unit-tested in tests/test_bench_body_budget.py)
# --------------------------------------------------------------------------------------------


def body_parts(tag: str, size: int, model: str = "hold") -> tuple[bytes, int, bytes]:
    """A chat request body of exactly ``size`` bytes as (prefix, filler length, suffix): the
    filler is the user message's text (``filler``), so no client's body is built whole."""
    prefix = json.dumps({"model": model, "user": tag, "max_tokens": 4, "stream": False})[:-1].encode()
    prefix += b', "messages": [{"role": "user", "content": "'
    suffix = b'"}]}'
    fill = size - len(prefix) - len(suffix)
    if fill < 0:
        raise ValueError(f"a body of {size} bytes cannot hold the request's fields")
    return prefix, fill, suffix


def filler(start: int, stop: int) -> bytes:
    """Bytes ``start:stop`` of the endless filler text (plain words, JSON-safe)."""
    n = len(_FILLER_WORDS)
    first = start - start % n
    reps = (stop - first + n - 1) // n
    return (_FILLER_WORDS * reps)[start - first : stop - first]


def body_slices(tag: str, size: int, chunk: int, *, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
    """Bytes ``start:stop`` of the body ``body_parts`` describes, in slices of at most ``chunk``."""
    prefix, fill, suffix = body_parts(tag, size)
    stop = size if stop is None else stop
    spans = ((0, len(prefix)), (len(prefix), len(prefix) + fill), (len(prefix) + fill, size))
    at = start
    while at < stop:
        end = min(stop, at + chunk)
        piece = b""
        for index, (lo, hi) in enumerate(spans):
            a, b = max(at, lo), min(end, hi)
            if a >= b:
                continue
            if index == 0:
                piece += prefix[a:b]
            elif index == 1:
                piece += filler(a - lo, b - lo)
            else:
                piece += suffix[a - hi + len(suffix) : b - hi + len(suffix)]
        yield piece
        at = end


def request_head(size: int, tag: str) -> bytes:
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\nX-Request-Id: {tag}\r\n\r\n"
    ).encode()


def max_admitted(budget_bytes: int, body_bytes: int) -> int:
    """How many bodies of ``body_bytes`` the budget holds at once."""
    return budget_bytes // body_bytes


@dataclass
class Holder:
    """One client's part in the hold phase."""

    tag: str
    sent_bytes: int = 0
    raw: bytes = b""  # what the proxy answered, if anything
    error: str | None = None  # the connection failed (reset, ...)
    answered_after_s: float | None = None  # from its connection
    done_sending: bool = False  # sent all it meant to before the hold

    @property
    def status(self) -> int | None:
        return status_of(self.raw)

    @property
    def retry_after(self) -> str | None:
        return header_value(self.raw, "retry-after") if self.raw else None

    def kind(self, meant_bytes: int) -> str:
        """One of: held (sent all but its tail, no answer), 503+retry-after, status N, failed: ..."""
        if self.status is None:
            if self.error is not None:
                return f"failed: {self.error}"
            return "held" if self.sent_bytes >= meant_bytes else "stalled short"
        if self.status == 503 and self.retry_after is not None:
            return "503+retry-after"
        return f"status {self.status}"


# --------------------------------------------------------------------------------------------
# A backend that holds requests until released
# --------------------------------------------------------------------------------------------


class HoldingBackend:
    """HTTP/1.1 in a thread: a POST whose body names the model "hold" is answered only once
    ``release`` is called (later ones at once); any other request at once. ``received``: the
    tags ("user") of the POSTs it has read whole."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._released: asyncio.Event | None = None
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HoldingBackend:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="holding-backend", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the holding backend did not start")
        return self

    def tags(self, prefix: str) -> list[str]:
        return [tag for tag in list(self.received) if tag.startswith(prefix)]

    def release(self) -> None:
        assert self._loop is not None and self._released is not None
        self._loop.call_soon_threadsafe(self._released.set)

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(10)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._released, self._stopped = asyncio.Event(), asyncio.Event()
        handlers: set[asyncio.Task[None]] = set()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers.add(task)
            try:
                await self._handle(reader, writer)
            finally:
                handlers.discard(task)

        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=2 * MIB)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stopped.wait()
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._released is not None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                model, tag = "", ""
                if lines[0].startswith("POST"):
                    data = json.loads(body)
                    model, tag = str(data.get("model", "")), str(data.get("user", ""))
                    self.received.append(tag)
                    del data, body
                if model == "hold":
                    await self._released.wait()
                answer = json.dumps({
                    "id": f"x-{tag}", "object": "chat.completion", "model": model or "-",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }).encode()  # fmt: skip
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(answer)
                    + answer
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


# --------------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------------


class BodyClient:
    """One raw connection sending a 15 MiB body: paced, all but its tail, then (on ``finish``)
    the tail; it reads the proxy's answer meanwhile and stops sending once one arrives."""

    def __init__(self, port: int, tag: str, *, size: int, tail: int, rate_bps: float, chunk: int = 256 * 1024) -> None:
        self.port, self.size, self.tail, self.rate_bps, self.chunk = port, size, tail, rate_bps, chunk
        self.holder = Holder(tag)
        self.answered = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._opened_s = 0.0

    async def hold(self) -> Holder:
        """Connect, send the head and all but the tail of the body (paced); return when sent or answered."""
        holder = self.holder
        try:
            reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
            self._opened_s = time.monotonic()
            self._reading = asyncio.ensure_future(self._read(reader))
            self._writer.write(request_head(self.size, holder.tag))
            await self._send(0, self.size - self.tail, paced=True)
        except OSError as exc:
            holder.error = type(exc).__name__
        holder.done_sending = True
        return holder

    async def finish(self, wait_s: float) -> Holder:
        """Send the tail, then wait up to ``wait_s`` for the answer."""
        try:
            await self._send(self.size - self.tail, self.size, paced=False)
        except OSError as exc:
            self.holder.error = type(exc).__name__
        return await self.answer(wait_s)

    async def answer(self, wait_s: float) -> Holder:
        """Wait up to ``wait_s`` for the proxy's answer (none: the request is still held)."""
        if self._reading is not None:
            await asyncio.wait([self._reading], timeout=wait_s)
        return self.holder

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.gather(self._reading, return_exceptions=True)
        if self._writer is not None:
            self._writer.transport.abort()

    async def _send(self, start: int, stop: int, *, paced: bool) -> None:
        assert self._writer is not None
        started_s = time.monotonic()
        for piece in body_slices(self.holder.tag, self.size, self.chunk, start=start, stop=stop):
            if self.answered.is_set():
                return
            self._writer.write(piece)
            await self._writer.drain()
            self.holder.sent_bytes += len(piece)
            if paced:  # the client's pace, not a wait for an event: an answer still wakes it
                due_s = started_s + (self.holder.sent_bytes - start) / self.rate_bps - time.monotonic()
                if due_s > 0:
                    try:
                        await asyncio.wait_for(self.answered.wait(), due_s)
                    except TimeoutError:
                        pass

    async def _read(self, reader: asyncio.StreamReader) -> None:
        holder = self.holder
        try:
            while not answer_complete(holder.raw):
                chunk = await reader.read(65536)
                if not chunk:
                    break
                holder.raw += chunk
        except OSError as exc:
            holder.error = type(exc).__name__
        holder.answered_after_s = time.monotonic() - self._opened_s
        self.answered.set()


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


async def wait_until(predicate: Any, timeout_s: float, every_s: float = 0.05) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            return False
        await asyncio.sleep(every_s)
    return True


def mb(kib: int | float) -> float:
    return kib * 1024 / MB


async def run(
    proxy_src: Path, log_dir: Path, *, clients: int, rate_bps: float, hold_s: float, sequential: int = SEQUENTIAL
) -> tuple[list[Row], dict[str, Any]]:
    backend = HoldingBackend().start()
    proxy = ProxyProcess("body-budget", backend.base_url, log_dir, src=proxy_src, log_level="info", **SETTINGS).start()
    stated = {k: v for k, v in proxy.settings.items() if k not in ("upstream_url", "port")}
    rows: list[Row] = []
    admitted_max = max_admitted(SETTINGS["body_budget_bytes"], BODY_BYTES)
    limit_mb = GROWTH_LIMIT_BYTES / MB
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(20):  # warm-up: lazy imports and first-use caches, small bodies only
                answer = await client.post(f"{proxy.url}{CHAT}", json={
                    "model": "fast", "user": f"warm-{i}", "messages": [{"role": "user", "content": "Say OK."}],
                })  # fmt: skip
                answer.raise_for_status()
        rss_before = proxy.rss_kib()

        # 1. Hold
        holders = [
            BodyClient(proxy.port, f"bb-{i:02d}", size=BODY_BYTES, tail=TAIL_BYTES, rate_bps=rate_bps)
            for i in range(clients)
        ]
        with RssSampler(proxy.pid) as hold_sampler:
            started = time.monotonic()
            await asyncio.gather(*(c.hold() for c in holders))
            settled_s = time.monotonic() - started
            await asyncio.sleep(hold_s)  # the measuring window: every client holding or answered
            rss_held = proxy.rss_kib()
        kinds = Counter(c.holder.kind(BODY_BYTES - TAIL_BYTES) for c in holders)
        held = [c for c in holders if c.holder.kind(BODY_BYTES - TAIL_BYTES) == "held"]
        growth_kib = hold_sampler.peak_kib - rss_before
        growth_ok = growth_kib * 1024 <= GROWTH_LIMIT_BYTES
        expected_admitted = min(clients, admitted_max)
        refused_ok = len(held) == expected_admitted and kinds["503+retry-after"] == clients - len(held)
        refused_after = sorted(c.holder.answered_after_s or 0 for c in holders if c.holder.status == 503)
        budget_ignored = "BODY_BUDGET_BYTES (ignored)" in proxy.log_path.read_text(errors="replace")
        rows.append(Row(
            f"1 {clients} clients holding {BODY_BYTES // MIB} MiB bodies: RSS growth",
            f"peak - before <= {limit_mb:g} MB",
            f"RSS {mb(rss_before):.0f} -> peak {mb(hold_sampler.peak_kib):.0f} MB (+{mb(growth_kib):.0f} MB); "
            f"{sum(c.holder.sent_bytes for c in holders) / MB:.0f} MB sent by the clients",
            growth_ok,
            {"settings": stated, "rss_before_mb": mb(rss_before), "rss_peak_mb": mb(hold_sampler.peak_kib),
             "rss_growth_mb": mb(growth_kib), "rss_end_of_hold_mb": mb(rss_held),
             "client_bytes_sent": sum(c.holder.sent_bytes for c in holders), "settled_s": settled_s, "hold_s": hold_s,
             "rate_mib_s": rate_bps / MIB, "budget_setting_ignored_by_build": budget_ignored},
        ))  # fmt: skip
        rows.append(Row(
            f"1 {clients} clients holding {BODY_BYTES // MIB} MiB bodies: admitted / refused",
            f"{expected_admitted} admitted (budget {SETTINGS['body_budget_bytes'] // MIB} MiB), the rest 503 + Retry-After",
            f"admitted {len(held)}, 503 with Retry-After {kinds['503+retry-after']}"
            + (f" (within {refused_after[0]:.2f}-{refused_after[-1]:.2f} s)" if refused_after else "")
            + "".join(f", {kind} {n}" for kind, n in sorted(kinds.items()) if kind not in ("held", "503+retry-after")),
            refused_ok,
            {"outcomes": dict(kinds), "admitted": len(held), "admitted_max": admitted_max,
             "retry_after": sorted({str(c.holder.retry_after) for c in holders if c.holder.status == 503}),
             "refused_after_s": refused_after},
        ))  # fmt: skip
        for c in holders:
            if c not in held:
                await c.close()

        # 2. Queued: the held bodies complete; one reaches the backend, the others wait in the queue.
        with RssSampler(proxy.pid) as queue_sampler:
            finishing = [asyncio.ensure_future(c.finish(wait_s=60)) for c in held]
            reached = await wait_until(lambda: len(backend.tags("bb-")) >= min(1, len(held)), 30)
            extra = BodyClient(proxy.port, "bb-extra", size=BODY_BYTES, tail=0, rate_bps=rate_bps)
            await extra.hold()
            await extra.answer(ANSWER_WAIT_S)
        extra_kind = extra.holder.kind(BODY_BYTES)
        await extra.close()
        rows.append(Row(
            f"2 the {len(held)} admitted bodies complete and wait (slots 1, backend holding)",
            "a further 15 MiB client gets 503 + Retry-After (RSS stated)",
            f"backend received {len(backend.tags('bb-'))}; further client: {extra_kind}; "
            f"RSS peak {mb(queue_sampler.peak_kib):.0f} MB (+{mb(queue_sampler.peak_kib - rss_before):.0f} MB)",
            extra_kind == "503+retry-after" if held else None,
            {"reached_backend": reached, "further_client": extra_kind,
             "rss_peak_mb": mb(queue_sampler.peak_kib), "rss_growth_mb": mb(queue_sampler.peak_kib - rss_before)},
        ))  # fmt: skip

        # 3. Given back
        backend.release()
        answered = await asyncio.gather(*finishing)
        queued_statuses = Counter(h.status for h in answered)
        after = BodyClient(proxy.port, "bb-after", size=BODY_BYTES, tail=0, rate_bps=rate_bps)
        await after.hold()
        await after.answer(ANSWER_WAIT_S)
        await after.close()
        rss_after = proxy.rss_kib()
        ok = queued_statuses.get(200, 0) == len(held) and after.holder.status == 200
        rows.append(Row(
            "3 backend releases; then one more 15 MiB client",
            "every queued request 200; the new client admitted and 200",
            f"queued: {dict(queued_statuses)}; new client: {after.holder.kind(BODY_BYTES)}; RSS after {mb(rss_after):.0f} MB",
            ok,
            {"queued_statuses": {str(k): v for k, v in queued_statuses.items()}, "new_client_status": after.holder.status,
             "rss_after_mb": mb(rss_after)},
        ))  # fmt: skip

        # 4. One after another: a finished request's body must be freed, or the budget bounds nothing.
        rss_after_each = []
        statuses: Counter[int | None] = Counter()
        for i in range(sequential):
            one = BodyClient(proxy.port, f"bb-seq-{i:02d}", size=BODY_BYTES, tail=0, rate_bps=SEQUENTIAL_RATE_BPS)
            await one.hold()
            await one.answer(ANSWER_WAIT_S)
            await one.close()
            statuses[one.holder.status] += 1
            rss_after_each.append(proxy.rss_kib())
        growth_kib = rss_after_each[-1] - rss_after_each[1]
        rows.append(Row(
            f"4 {sequential} requests of {BODY_BYTES // MIB} MiB one after another",
            f"all 200; RSS after the last - after the 2nd <= {SEQUENTIAL_GROWTH_LIMIT_BYTES / MB:g} MB",
            f"statuses {dict(statuses)}; RSS after each: "
            + " ".join(f"{mb(kib):.0f}" for kib in rss_after_each) + f" MB (+{mb(growth_kib):.0f} MB from the 2nd)",
            statuses.get(200, 0) == sequential and growth_kib * 1024 <= SEQUENTIAL_GROWTH_LIMIT_BYTES,
            {"statuses": {str(k): v for k, v in statuses.items()}, "rss_after_each_mb": [mb(k) for k in rss_after_each],
             "growth_from_second_mb": mb(growth_kib)},
        ))  # fmt: skip
    finally:
        proxy.stop()
        backend.stop()
    return rows, stated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--rate-mib-s", type=float, default=8.0, help="each client's body pace, MiB/s (default 8)")
    parser.add_argument("--hold-s", type=float, default=2.0, help="seconds the bodies are held once all are sent")
    parser.add_argument("--sequential", type=int, default=SEQUENTIAL, help="phase 4's requests (default 12)")
    add_json_option(parser, "body_budget")
    parser.add_argument("--log-dir", type=Path, help="where the proxy's log goes (default a temporary directory)")
    parser.add_argument("--proxy-src", type=Path, default=PROXY_SRC[0], help="src/ the proxy runs from")
    args = parser.parse_args()
    if args.sequential < 2:
        parser.error("--sequential needs at least 2 requests (growth is measured from the 2nd)")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-body-budget-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows, stated = asyncio.run(
        run(
            args.proxy_src.resolve(),
            log_dir,
            clients=args.clients,
            rate_bps=args.rate_mib_s * MIB,
            hold_s=args.hold_s,
            sequential=args.sequential,
        )
    )
    print(f"\nproxy from {args.proxy_src}; settings: " + ", ".join(f"{k}={v}" for k, v in stated.items()))
    if rows[0].figures.get("budget_setting_ignored_by_build"):
        print("this build has no body budget: its log says body_budget_bytes is unknown and ignored")
    print_table(rows)
    took = time.monotonic() - started
    print(
        f"\n{sum(r.ok is True for r in rows)} PASS, {sum(r.ok is False for r in rows)} FAIL in {took:.0f} s; log in {log_dir}"
    )
    result = {
        "command": " ".join(["PYTHONPATH=src python benchmarks/bench_body_budget.py", *sys.argv[1:]]),
        "proxy_src": str(args.proxy_src),
        "settings": stated,
        "seconds": took,
        "load_average": os.getloadavg(),
        "rows": [r.as_json() for r in rows],
    }
    write_json(args.json, result)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
