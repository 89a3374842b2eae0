"""The floor of a Python request path (issue 12): how fast and how small can a leaner design be here?

A measurement, not a product. It answers one question: are issue 12's targets (>= 5,000 scheduled
requests/s at 64 clients x 64 slots, <= 1.0 ms added TTFB, < 1 KB per waiting request besides its
body) reachable in Python on this machine at all, and with what architecture? It runs, side by side
in one run, against the same fake backend as bench_proxy_throughput.py (nginx `return 200` with a
fixed chat-completion JSON):

* ``backend``: wrk straight at the fake backend (it is not the bottleneck).
* ``nginx``: nginx as a reverse proxy (proxy_buffering off, upstream keepalive), the C reference.
* ``floor-raw``: the HTTP/1.1 reverse proxy below, on asyncio Protocols + uvloop + httptools. Per
  request it parses the client's request (httptools.HttpRequestParser callbacks), reads the JSON
  body with json.loads and looks at one field (``max_tokens``, the queue key), pushes the request on
  an in-memory heap and pops it again (the stand-in for the scheduler's queue; 64 "slots"), forwards
  it over a pool of persistent keep-alive backend connections (a second Protocol with
  httptools.HttpResponseParser) and relays the answer (Content-Length, or chunked: re-chunked as it
  comes). No ASGI, no task per request (callbacks only; a task only to open a new backend
  connection), keep-alive on both sides.
* ``floor-raw+predict``: the same, plus the project's real request parsing and prediction per
  scheduled request (``prediction.dialects.parse_request`` then ``OnnxPredictor(None).predict``, as
  app.py does); the prediction's score is the heap key.
* ``asgi-min``: uvicorn (httptools, uvloop) with a ~20-line raw ASGI app and an aiohttp
  ClientSession pass-through (body read, sent, answer read whole and sent back; no JSON, no queue):
  the cost of the ASGI server + client pair the product is built on, without the product.
* ``proxy``: today's ``clairvoyant serve --slots 64 --max-queue 10000`` (started as servers.py does).

What floor-raw does NOT do (so nobody mistakes it for a drop-in): no client or backend timeouts, no
handling of a client that disconnects while its request is in flight (the backend answer is dropped;
a waiting one is skipped when popped), no pipelining (a second request on a connection before the
first is answered closes the connection), no request-body size limit, no Expect: 100-continue, no
retry beyond one resend of a request whose pooled backend connection closed before any answer byte
(a 502 otherwise), no HEAD/1xx/204 special cases, no backpressure (pause_reading) on either side, no
TLS, no metrics, no logs, no fairness, no learning, no API keys, no response headers of its own, no
error bodies in the client's dialect, no graceful shutdown, no reason phrase but "OK". It is what a
scheduler must do per request and nothing else.

Reported per design: requests/s (median over rounds; each round runs every design once in a fresh
random order), wrk's p50/p99 (medians over rounds) and the server process tree's CPU ms per request
(/proc/<pid>/stat utime + stime). Then an "added latency" pass: one wrk connection per design, p50
minus the backend's own p50 (a request/answer to nginx, not a llama.cpp stream: the proxy's own
per-request floor on an idle path). Then the memory floor: floor-raw with a queue that never
dispatches ("--hold"); 10,000 client connections are opened (RSS read), then each sends a complete
scheduled request that is held waiting (RSS read again); bytes per connection and per waiting
request, the body stated separately, for floor-raw as it is, for floor-raw with each connection's
parser freed while its request waits (``--drop-parser``: a new parser when the next bytes come) and
for floor-raw+predict; a tracemalloc pass (2,000 connections) says what the bytes are. RSS counts
user-space memory only: the kernel's socket buffers and structures are not in it (nor in the
proxy's figure from bench_waiting_memory.py, measured the same way).
``--proxy-memory`` also runs benchmarks/bench_waiting_memory.py --n N for the real proxy.

    PYTHONPATH=src python benchmarks/bench_http_floor.py [--duration 5] [--rounds 3] [--memory 10000]
        [--proxy-memory] [--json FILE]

The same file is the servers' entry point (``--serve floor-raw|asgi-min``, used by the driver).
Needs nginx and wrk (apt-get install nginx wrk), uvloop, httptools, aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import heapq
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httptools

# =============================================================================================
# floor-raw: the server (run as `--serve floor-raw --upstream http://H:P --port N [--predict]`)
# =============================================================================================

HOP = frozenset((b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host", b"te",
                 b"trailer", b"upgrade", b"proxy-connection"))  # fmt: skip
SCHEDULED = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/api/chat", b"/api/generate"))


class Floor:
    """Process-wide state: the backend connection pool, the heap (the stand-in queue), the slots."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        upstream: str,
        slots: int,
        predict: bool,
        hold: bool,
        drop_parser: bool,
        park: bool,
    ) -> None:
        hostport = upstream.removeprefix("http://").rstrip("/")
        self.host, port = hostport.rsplit(":", 1)
        self.port = int(port)
        self.host_header = hostport.encode()
        self.loop = loop
        self.idle: list[Backend] = []  # idle keep-alive backend connections (LIFO)
        self.heap: list[tuple[float, int, Client, bytes]] = []
        self.seq = 0
        self.free = slots
        self.hold = hold  # the memory probe: the queue never dispatches
        self.connections = 0  # client connections open
        self.backends = 0  # backend connections open
        self.drop_parser = drop_parser  # a parser only while a request is read (memory probe)
        self.park = park  # a waiting request's connection parked as a bare fd (memory probe)
        self.predictor: Any = None
        self.endpoints: Any = None
        if predict:
            from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, parse_request
            from clairvoyant.prediction.predictor import OnnxPredictor

            self.predictor = OnnxPredictor(None)
            self.endpoints = {k.encode(): v for k, v in SCHEDULED_ENDPOINTS.items()}
            self.parse_request = parse_request

    def key_of(self, path: bytes, body: bytes) -> tuple[float, bytes] | None:
        """The queue key and the body to forward; None = a 400 (not a JSON object)."""
        if self.predictor is not None:
            try:
                parsed = self.parse_request(self.endpoints[path], body)
            except Exception:  # BadRequest
                return None
            prediction = self.predictor.predict(parsed.prompt, model=parsed.model, cap_tokens=parsed.cap_tokens)
            return prediction.score, parsed.forward_body
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if type(obj) is not dict:
            return None
        cap = obj.get("max_tokens")  # the one field looked at: shortest cap first
        return (float(cap) if type(cap) is int else 1e9), body

    def submit(self, key: float, client: Client, data: bytes) -> None:
        if self.park and self.hold:
            # Park the waiting connection outside the event loop: keep a duplicate of its socket's
            # fd (a bare int) and drop the transport, protocol and parser. Closing the transport's
            # own fd neither ends nor resets the connection while the duplicate is open; at dispatch
            # the fd gets a new transport (_resume). The client's leaving goes unseen meanwhile.
            fd = os.dup(client.transport.get_extra_info("socket").fileno())  # type: ignore[union-attr]
            client.transport.abort()  # type: ignore[union-attr]
            heapq.heappush(self.heap, (key, self.seq, fd, data))  # type: ignore[arg-type]
        else:
            heapq.heappush(self.heap, (key, self.seq, client, data))
        self.seq += 1
        if not self.hold:
            self.pump()

    def pump(self) -> None:
        heap = self.heap
        while self.free and heap:
            _, _, client, data = heapq.heappop(heap)
            if type(client) is int:  # parked (--park)
                self.free -= 1
                self.loop.create_task(self._resume(client, data))
                continue
            if client.transport is None:  # left while it waited
                continue
            self.free -= 1
            self.forward(client, data, scheduled=True)

    def release(self) -> None:
        self.free += 1
        if self.heap and not self.hold:
            self.pump()

    def forward(self, client: Client, data: bytes, scheduled: bool) -> None:
        if self.idle:
            self.idle.pop().start(client, data, scheduled)
        else:  # the only task: opening a backend connection (the pool grows to the peak in flight)
            self.loop.create_task(self._open(client, data, scheduled))

    async def _resume(self, fd: int, data: bytes) -> None:
        _, client = await self.loop.connect_accepted_socket(lambda: Client(self), socket.socket(fileno=fd))
        client.busy = True
        self.forward(client, data, scheduled=True)

    async def _open(self, client: Client, data: bytes, scheduled: bool) -> None:
        try:
            _, backend = await self.loop.create_connection(lambda: Backend(self), self.host, self.port)
        except OSError:
            client.answer(502, b'{"error":"backend unreachable"}')
            if scheduled:
                self.release()
            return
        backend.start(client, data, scheduled)

    def drop_waiting(self) -> int:
        """The memory probe's reset: close every waiting client and empty the heap."""
        n = len(self.heap)
        for _, _, client, _ in self.heap:
            if type(client) is int:
                os.close(client)
            elif client.transport is not None:
                client.transport.close()
        self.heap = []
        return n


class Client(asyncio.Protocol):
    """One client connection: its parser and the request being read (nothing else is kept)."""

    __slots__ = ("floor", "transport", "parser", "url", "headers", "body", "busy", "keep_alive")

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = (
            None if floor.drop_parser else httptools.HttpRequestParser(self)
        )
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.body: list[bytes] | None = None
        self.busy = False
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.floor.connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.floor.connections -= 1

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:  # dropped while the previous request waited (--drop-parser)
            parser = self.parser = httptools.HttpRequestParser(self)
        try:
            parser.feed_data(data)
        except httptools.HttpParserError:
            self.answer(400, b'{"error":"bad request"}', close=True)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        self.body.append(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        if self.busy:  # pipelining is not supported: give up on the connection
            if self.transport is not None:
                self.transport.close()
            return
        floor = self.floor
        parser = self.parser
        self.keep_alive = parser.should_keep_alive()
        method = parser.get_method()
        if floor.drop_parser:
            self.parser = None  # a waiting request needs no parser: the next data makes a new one
        body = b"".join(self.body) if self.body else b""  # type: ignore[arg-type]
        headers, url = self.headers, self.url
        self.headers = self.body = None
        self.url = b""
        self.busy = True
        if url.startswith(b"/_floor/"):
            return self.control(url)
        path = url.split(b"?", 1)[0]
        if method == b"POST" and path in SCHEDULED:
            keyed = floor.key_of(path, body)
            if keyed is None:
                return self.answer(400, b'{"error":"body is not a JSON object"}')
            key, body = keyed
        else:
            key = None
        # The upstream request: the client's headers less the hop-by-hop ones, our Host and length.
        parts = [method, b" ", url, b" HTTP/1.1\r\nhost: ", floor.host_header, b"\r\n"]
        for name, value in headers:  # type: ignore[union-attr]
            if name.lower() not in HOP:
                parts += (name, b": ", value, b"\r\n")
        if body or method in (b"POST", b"PUT", b"PATCH"):
            parts.append(b"content-length: %d\r\n" % len(body))
        parts += (b"\r\n", body)
        data = b"".join(parts)
        if key is None:
            floor.forward(self, data, scheduled=False)  # pass-through: no queue
        else:
            floor.submit(key, self, data)

    def answer(self, status: int, body: bytes, close: bool = False) -> None:
        """An answer of the floor's own (errors, control endpoints)."""
        if self.transport is None:
            return
        reason = {200: b"OK", 400: b"Bad Request", 502: b"Bad Gateway"}.get(status, b"Error")
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status, reason, len(body), b"connection: close\r\n" if close or not self.keep_alive else b"", body)
        )
        self.done(close)

    def done(self, close: bool = False) -> None:
        self.busy = False
        if (close or not self.keep_alive) and self.transport is not None:
            self.transport.close()

    def control(self, url: bytes) -> None:
        """The memory probe's endpoints (never forwarded)."""
        floor = self.floor
        if url == b"/_floor/state":
            out: Any = {"waiting": len(floor.heap), "connections": floor.connections, "backends": floor.backends,
                        "idle_backends": len(floor.idle)}  # fmt: skip
        elif url == b"/_floor/release":  # the held queue dispatches everything
            floor.hold = False
            floor.pump()
            out = {"released": True}
        elif url == b"/_floor/drop":
            out = {"dropped": floor.drop_waiting()}
        elif url == b"/_floor/snapshot":  # tracemalloc baseline
            gc.collect()
            floor.snapshot = tracemalloc_snapshot()  # type: ignore[attr-defined]
            out = {"ok": True}
        elif url.startswith(b"/_floor/tracemalloc"):
            gc.collect()
            diff = tracemalloc_snapshot().compare_to(floor.snapshot, "lineno")  # type: ignore[attr-defined]
            import linecache

            out = [[d.size_diff, d.count_diff, f"{Path(f.filename).name}:{f.lineno} "
                    f"{linecache.getline(f.filename, f.lineno).strip()[:70]}"]
                   for d in diff[:25] for f in (d.traceback[0],)]  # fmt: skip
        else:
            out = {"error": "unknown"}
        self.answer(200, json.dumps(out).encode())


def tracemalloc_snapshot() -> Any:
    import tracemalloc

    return tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap*")]
    )


class Backend(asyncio.Protocol):
    """One keep-alive connection to the backend: relays one answer at a time to its client."""

    __slots__ = ("floor", "transport", "parser", "client", "scheduled", "head", "chunked", "headers", "sent",
                 "answered", "served")  # fmt: skip

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: Client | None = None
        self.scheduled = False
        self.head = b""  # the answer's head, held until its first body bytes (one write for both)
        self.chunked = False
        self.headers: list[tuple[bytes, bytes]] = []
        self.sent = b""  # the request in flight, kept to resend it once (see connection_lost)
        self.answered = False  # any byte of its answer received
        self.served = 0  # answers completed on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.floor.backends += 1

    def start(self, client: Client, data: bytes, scheduled: bool) -> None:
        self.client = client
        self.scheduled = scheduled
        self.sent = data
        self.answered = False
        self.transport.write(data)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        floor = self.floor
        floor.backends -= 1
        with contextlib.suppress(ValueError):
            floor.idle.remove(self)
        client, self.client = self.client, None
        if client is not None and not self.answered and self.served:
            # A pooled connection the backend closed as the request went out (llama.cpp does so after
            # a stream): nothing was answered, so send it once more on a fresh connection, as nginx
            # (proxy_next_upstream non_idempotent) and Clairvoyant's upstream do. The slot stays held.
            floor.loop.create_task(floor._open(client, self.sent, self.scheduled))
            return
        if client is not None:  # closed under a request: 502 if nothing was relayed yet
            if self.head or not self.headers:
                client.answer(502, b'{"error":"backend closed the connection"}', close=True)
            elif client.transport is not None:
                client.transport.close()
            if self.scheduled:
                floor.release()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.headers = []
        self.head = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        client = self.client
        self.chunked = True
        parts = [b"HTTP/1.1 %d OK\r\n" % self.parser.get_status_code()]
        for name, value in self.headers:
            low = name.lower()
            if low == b"content-length":
                self.chunked = False
            elif low in HOP:
                continue
            parts += (name, b": ", value, b"\r\n")
        if self.chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
        if client is not None and not client.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self.head = b"".join(parts)

    def on_body(self, body: bytes) -> None:
        client = self.client
        if client is None or client.transport is None:
            return
        if self.chunked:
            body = b"%x\r\n%s\r\n" % (len(body), body)
        if self.head:
            body = self.head + body
            self.head = b""
        client.transport.write(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if client is not None and client.transport is not None:
            tail = b"0\r\n\r\n" if self.chunked else b""
            if self.head or tail:
                client.transport.write(self.head + tail)
            self.head = b""
            client.done()
        self.headers = []
        self.sent = b""
        self.served += 1
        if self.parser.should_keep_alive():
            self.floor.idle.append(self)
        else:
            self.transport.close()  # type: ignore[union-attr]
        if self.scheduled:
            self.floor.release()


def serve_floor(
    upstream: str, port: int, slots: int, predict: bool, hold: bool, drop_parser: bool, park: bool, trace: bool
) -> None:
    import uvloop

    if trace:
        import tracemalloc

        tracemalloc.start(1)
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    floor = Floor(loop, upstream, slots, predict, hold, drop_parser, park)
    if trace:
        floor.snapshot = tracemalloc_snapshot()  # type: ignore[attr-defined]
    server = loop.run_until_complete(
        loop.create_server(lambda: Client(floor), "127.0.0.1", port, backlog=4096, reuse_address=True)
    )
    gc.collect()
    gc.freeze()  # as `clairvoyant serve` does: the start-up heap out of the collector's way
    try:
        loop.run_forever()
    finally:
        server.close()


# =============================================================================================
# asgi-min: uvicorn + raw ASGI + aiohttp pass-through (run as `--serve asgi-min ...`)
# =============================================================================================


def serve_asgi_min(upstream: str, port: int) -> None:
    import aiohttp
    import uvicorn

    session: list[aiohttp.ClientSession] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not session:  # created on the first request, inside the server's loop
            session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False))
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {"content-type": "application/json"} if body else {}
        async with session[0].request(scope["method"], upstream + scope["path"], data=body, headers=headers) as r:
            data = await r.read()
            ctype = r.headers.get("content-type", "application/json").encode()
        await send({"type": "http.response.start", "status": r.status,
                    "headers": [(b"content-type", ctype), (b"content-length", str(len(data)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": data})

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", lifespan="off",
                log_level="warning", access_log=False, proxy_headers=False)  # fmt: skip


# =============================================================================================
# the driver
# =============================================================================================

HERE = Path(__file__).resolve().parent
DESIGNS = ("floor-raw", "floor-raw+predict", "asgi-min", "proxy")
REFERENCE = ("backend", "nginx")
BODY_TEXT = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1})
MEM_BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
).encode()  # the same body as bench_waiting_memory.py


MEMORY_VARIANTS = {  # label: (extra server flags, all with --hold; requests sent)
    "floor-raw, idle connections (no request)": ((), False),
    "floor-raw": ((), True),
    "floor-raw, parser only while reading": (("--drop-parser",), True),
    "floor-raw, waiting connection parked as an fd": (("--drop-parser", "--park"), True),
    "floor-raw+predict": (("--predict",), True),
}
TRACE_VARIANTS = {"floor-raw": (), "floor-raw, parked": ("--drop-parser", "--park")}


def floor_argv(upstream: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--serve", "floor-raw", "--upstream", upstream,
            "--port", str(port), *extra]  # fmt: skip


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def control(port: int, what: str) -> Any:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/_floor/{what}", timeout=120).json()


def wait_state(port: int, key: str, n: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while control(port, "state")[key] < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"floor-raw did not reach {key} = {n}: {control(port, 'state')}")
        time.sleep(0.2)


REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(MEM_BODY), MEM_BODY))  # fmt: skip


def open_clients(port: int, n: int, send: bool) -> list[socket.socket]:
    """n client connections, in batches of 100; with send, each batch then sends its request at once
    (connections arrive with their requests, as they would in service: a parked design never holds
    more than a batch of transports at a time)."""
    socks: list[socket.socket] = []
    for start in range(0, n, 100):
        batch = [socket.create_connection(("127.0.0.1", port)) for _ in range(min(100, n - start))]
        if send:
            for sock in batch:
                sock.sendall(REQUEST)
        socks += batch
    return socks


def warm_up(port: int, n: int = 300) -> None:
    """Waiting requests that come and go before the baseline: first-use costs are paid."""
    socks = open_clients(port, n, send=True)
    wait_state(port, "waiting", n)
    control(port, "drop")
    for sock in socks:
        sock.close()
    time.sleep(1)


def memory_probe(servers: Any, backend_url: str, n: int, extra: tuple[str, ...], send: bool) -> dict[str, Any]:
    """RSS growth of floor-raw (queue on hold) per connection: idle (send False) or with its request waiting.

    Each probe is a fresh server process: RSS does not shrink when objects are freed, so two phases
    in one process would share (and hide) memory."""
    port = servers.free_port()
    with servers.running(floor_argv(backend_url, port, "--hold", *extra), port) as proc:
        warm_up(port)
        before = rss_kb(proc.pid)
        socks = open_clients(port, n, send)
        wait_state(port, "waiting" if send else "connections", n + (0 if send else 1))  # + the control connection
        time.sleep(0.5)
        after = rss_kb(proc.pid)
        answered = 0
        if send:
            control(port, "release")  # then every held request must get its answer from the backend
            for sock in socks:
                sock.settimeout(30)
                with contextlib.suppress(OSError):
                    answered += sock.recv(65536).startswith(b"HTTP/1.1 200")
        for sock in socks:
            sock.close()
    return {"n": n, "requests": send, "rss_before_kb": before, "rss_after_kb": after,
            "bytes_each": (after - before) * 1024 / n, "body_bytes": len(MEM_BODY) if send else 0,
            "answered_after_release": answered}  # fmt: skip


def tracemalloc_probe(servers: Any, backend_url: str, n: int, extra: tuple[str, ...]) -> list[list[Any]]:
    """What the bytes are: the tracemalloc diff (by source line) across n waiting requests."""
    port = servers.free_port()
    with servers.running(floor_argv(backend_url, port, "--hold", "--tracemalloc", *extra), port):
        warm_up(port, 100)
        control(port, "snapshot")
        socks = open_clients(port, n, send=True)
        wait_state(port, "waiting", n)
        diff = control(port, "tracemalloc")
        for sock in socks:
            sock.close()
    return diff  # type: ignore[no-any-return]


def real_proxy_memory(n: int) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(HERE / "bench_waiting_memory.py"), "--n", str(n)],
                          capture_output=True, text=True, cwd=HERE.parent)  # fmt: skip
    line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    m = re.search(r"(\d+) bytes per waiting request, (-?\d+) besides", line)
    return {"line": line, "bytes_per_waiting_request": int(m[1]) if m else None,
            "besides_body": int(m[2]) if m else None}  # fmt: skip


def run_wrk(url: str, script: Path, connections: int, threads: int, duration_s: int) -> Any:
    from clairvoyant.tools.bench.request_path import parse_wrk_output

    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration_s}s", "--timeout", "10s", "-s", str(script), url]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return parse_wrk_output(done.stdout)


def drive(args: argparse.Namespace) -> int:
    import httpx

    sys.path.insert(0, str(HERE))
    import servers  # benchmarks/servers.py

    from clairvoyant.tools.bench.request_path import (
        nginx_fixed_answer_conf,
        nginx_proxy_conf,
        round_orders,
        tree_cpu_seconds,
        wrk_script,
    )

    sys.path.insert(0, str(HERE))
    from bench_proxy_throughput import ANSWER  # the same fixed answer as the throughput benchmark

    servers.require_tools("nginx", "wrk")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    targets = REFERENCE + tuple(d for d in DESIGNS if d in args.designs.split(","))
    ports = {t: servers.free_port() for t in REFERENCE + DESIGNS}
    backend_url = f"http://127.0.0.1:{ports['backend']}"
    summary: dict[str, Any] = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", *sys.argv]),
        "connections": args.connections, "wrk_threads": args.threads, "duration_s": args.duration,
        "rounds": args.rounds, "slots": args.slots, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
    }  # fmt: skip
    argvs = {
        "floor-raw": floor_argv(backend_url, ports["floor-raw"], "--slots", str(args.slots)),
        "floor-raw+predict": floor_argv(backend_url, ports["floor-raw+predict"], "--slots", str(args.slots),
                                        "--predict"),
        "asgi-min": [sys.executable, str(Path(__file__).resolve()), "--serve", "asgi-min", "--upstream", backend_url,
                     "--port", str(ports["asgi-min"])],
        "proxy": servers.proxy_argv(None, backend_url, ports["proxy"], args.slots),
    }  # fmt: skip
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
        procs = {
            "backend": stack.enter_context(servers.nginx(
                lambda p: nginx_fixed_answer_conf(p, ports["backend"], ANSWER, workers=1), ports["backend"])),
            "nginx": stack.enter_context(servers.nginx(
                lambda p: nginx_proxy_conf(p, ports["nginx"], backend_url, workers=1, keepalive=args.connections),
                ports["nginx"])),
        }  # fmt: skip
        for t in targets[2:]:
            env = servers.proxy_env()
            procs[t] = stack.enter_context(servers.running(argvs[t], ports[t], env=env))
        script = Path(tmp) / "post.lua"
        script.write_text(wrk_script("POST", BODY_TEXT))
        urls = {t: f"http://127.0.0.1:{ports[t]}/v1/chat/completions" for t in targets}
        for t in targets:  # sanity: the fixed answer comes back whole from every target
            r = httpx.post(urls[t], content=BODY_TEXT, headers={"content-type": "application/json"}, timeout=30)
            if r.status_code != 200 or json.loads(r.content) != json.loads(ANSWER):
                sys.exit(f"{t} answered {r.status_code}: {r.text[:200]}")
            run_wrk(urls[t], script, args.connections, args.threads, args.warmup)

        def measure(target: str, connections: int, threads: int, duration: int) -> dict[str, Any]:
            cpu_before = tree_cpu_seconds(procs[target].pid)
            res = run_wrk(urls[target], script, connections, threads, duration)
            cpu = tree_cpu_seconds(procs[target].pid) - cpu_before
            return {"requests_per_s": res.requests_per_s, "p50_ms": res.p50_ms, "p99_ms": res.p99_ms,
                    "requests": res.requests, "errors": res.socket_errors + res.status_errors,
                    "cpu_ms_per_request": cpu / max(res.requests, 1) * 1000}  # fmt: skip

        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
        lat: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
        for i, order in enumerate(round_orders(list(targets), args.rounds, args.seed)):
            for t in order:
                runs[t].append(m := measure(t, args.connections, args.threads, args.duration))
                print(f"round {i + 1} {t:18} {m['requests_per_s']:8.0f} req/s  p50 {m['p50_ms']:7.2f}  "
                      f"p99 {m['p99_ms']:7.2f} ms  cpu {m['cpu_ms_per_request']:.3f} ms/req  errors {m['errors']}",
                      flush=True)  # fmt: skip
        for i, order in enumerate(round_orders(list(targets), args.latency_rounds, args.seed + 1)):
            for t in order:
                lat[t].append(m := measure(t, 1, 1, args.latency_duration))
                print(f"1 connection, round {i + 1} {t:18} {m['requests_per_s']:7.0f} req/s  p50 {m['p50_ms']:.3f} ms",
                      flush=True)  # fmt: skip
        summary["loadavg_after_throughput"] = os.getloadavg()

        table = {}
        for t in targets:
            med = {k: statistics.median(r[k] for r in runs[t]) for k in ("requests_per_s", "p50_ms", "p99_ms",
                                                                          "cpu_ms_per_request")}  # fmt: skip
            med["errors"] = sum(r["errors"] for r in runs[t])
            med["c1_p50_ms"] = statistics.median(r["p50_ms"] for r in lat[t]) if lat[t] else float("nan")
            med["c1_cpu_ms_per_request"] = statistics.median(r["cpu_ms_per_request"] for r in lat[t]) if lat[t] else 0
            table[t] = {**med, "runs": runs[t], "one_connection_runs": lat[t]}
        summary["targets"] = table

        if args.memory:
            summary["memory"] = {label: memory_probe(servers, backend_url, args.memory, extra, send)
                                 for label, (extra, send) in MEMORY_VARIANTS.items()}  # fmt: skip
            summary["tracemalloc"] = {label: tracemalloc_probe(servers, backend_url, args.trace_n, extra)
                                      for label, extra in TRACE_VARIANTS.items()}  # fmt: skip
    if args.proxy_memory and args.memory:
        summary["proxy_memory"] = real_proxy_memory(args.memory)
    summary["loadavg_end"] = os.getloadavg()

    print(f"\n{args.connections} connections, wrk -t{args.threads}, {args.duration} s per run, median of "
          f"{args.rounds} rounds (random order), --slots {args.slots}; POST /v1/chat/completions; load "
          f"{summary['loadavg_start'][0]:.2f} -> {summary['loadavg_end'][0]:.2f}\n")  # fmt: skip
    base = table["backend"]["c1_p50_ms"]  # NaN when the 1-connection pass was skipped
    print("| target | requests/s | p50 ms | p99 ms | server CPU ms/request | errors | 1-conn p50 ms | added p50 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for t in targets:
        row = table[t]
        added = "" if t == "backend" else f"{row['c1_p50_ms'] - base:+.3f}"
        print(f"| {t} | {row['requests_per_s']:,.0f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | "
              f"{row['cpu_ms_per_request']:.3f} | {row['errors']} | {row['c1_p50_ms']:.3f} | {added} |")  # fmt: skip
    if "memory" in summary:
        print(f"\nMemory: RSS growth per connection, {args.memory} connections, queue on hold (one server each)\n")
        print(
            "| floor-raw variant | RSS before -> after MiB | bytes each | besides the body | answered once released |"
        )
        print("|---|---|---:|---:|---:|")
        for label, m in summary["memory"].items():
            print(f"| {label} | {m['rss_before_kb'] / 1024:.1f} -> {m['rss_after_kb'] / 1024:.1f} | "
                  f"{m['bytes_each']:,.0f} | {m['bytes_each'] - m['body_bytes']:,.0f} | "
                  f"{m['answered_after_release'] if m['requests'] else '-'} |")  # fmt: skip
    for label, diff in summary.get("tracemalloc", {}).items():
        print(f"\ntracemalloc, {label}, {args.trace_n} waiting requests (bytes each, allocations each, where):")
        for size, count, where in diff[:10]:
            print(f"  {size / args.trace_n:8.1f} B  {count / args.trace_n:5.2f}  {where}")
        print(f"  total traced: {sum(d[0] for d in diff) / args.trace_n:.1f} B each (top 25 lines)")
    if "proxy_memory" in summary:
        print(f"\nclairvoyant serve (bench_waiting_memory.py --n {args.memory}): {summary['proxy_memory']['line']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, every design once each (default 3)")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (default 2)")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1, help="seconds of wrk per target before timing")
    parser.add_argument("--latency-rounds", type=int, default=3, help="rounds of the 1-connection pass (0: skip)")
    parser.add_argument("--latency-duration", type=int, default=3, help="seconds per 1-connection run")
    parser.add_argument("--designs", default=",".join(DESIGNS), help=f"comma-separated subset of {DESIGNS}")
    parser.add_argument("--memory", type=int, default=10_000, help="waiting requests of the memory probe (0: skip)")
    parser.add_argument("--trace-n", type=int, default=2_000, help="connections of the tracemalloc pass")
    parser.add_argument("--proxy-memory", action="store_true",
                        help="also run bench_waiting_memory.py --n MEMORY for clairvoyant serve")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every figure here (default: print only)")
    # server mode (the driver starts these)
    parser.add_argument("--serve", choices=("floor-raw", "asgi-min"), help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--predict", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tracemalloc", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--drop-parser", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--park", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "floor-raw":
        serve_floor(
            args.upstream, args.port, args.slots, args.predict, args.hold, args.drop_parser, args.park, args.tracemalloc
        )
        return 0
    if args.serve == "asgi-min":
        serve_asgi_min(args.upstream, args.port)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
