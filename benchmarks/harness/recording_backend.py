"""A backend that records every request exactly as its bytes arrived, for tests and benchmarks
that judge what a proxy sends on.

``RecordingBackend`` is ``fake_backend.FakeBackend`` (a plain asyncio HTTP/1.1 server in a
thread of the calling process) with its own request reader: it frames each request itself
(Content-Length, chunked, or none) and keeps its bytes (``Received.raw``); bytes it cannot frame
as a request are kept too (framing ``incomplete``, ``garbage`` or ``invalid: ...``), so a second
request hidden inside a first one shows up as a request of its own. It answers:

- POST to the OpenAI paths (``/v1/chat/completions``, ``/v1/completions``): a small chat
  completion, or an SSE stream when the body asks for one; to the Ollama paths (``/api/chat``,
  ``/api/generate``): an Ollama answer. A body with ``"model": "hold"`` is answered after ``hold_s``
  (to keep a proxy's slot busy);
- ``/health``: ``{"status":"ok"}``; ``/echo``: the header lines it received, one per line;
- anything else: ``OK`` (text/plain; no body to a HEAD).

With ``token_s`` it generates at a fixed pace instead: an answer of exactly ``max_tokens`` tokens
(from the body), streamed one event every ``token_s`` when the body asks for a stream, else
answered whole after ``max_tokens x token_s``. With ``slots`` it counts the inference requests in
progress at once, from the moment one is read to the end of its answer (or its connection's),
and every moment that count went above ``slots`` (``violations``): a backend that keeps its own
slot count, as llama.cpp does, and reports any proxy (or set of proxies) that oversubscribed it.
``served`` holds each one's times (``Served``), for shares of served seconds and concurrency per
group. It is one server, so several proxies can share it.

``framing_problems`` says why a received request is not one a proxy framed itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from .fake_backend import FakeBackend

__all__ = ["OLLAMA_PATHS", "OPENAI_PATHS", "Received", "RecordingBackend", "Served", "framing_problems", "most_at_once"]

OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
OLLAMA_PATHS = frozenset({"/api/chat", "/api/generate"})


@dataclass
class Received:
    """One request as the backend read it."""

    raw: bytes  # its bytes exactly as received: head and body
    method: str
    target: str  # the request-target as sent to the backend
    version: str
    headers: list[tuple[str, str]]  # as received: names in their case, values stripped
    body: bytes  # decoded (chunked framing removed)
    framing: str  # "length", "chunked", "none", or "invalid: ..." / "incomplete" / "garbage"
    connection: int  # the backend's connection number
    nth_on_connection: int  # 1 = the connection's first request
    at_s: float  # time.monotonic() when it was complete

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name]


@dataclass
class Served:
    """One inference request at the backend: when it was read, when its answer's first byte and
    its end were written (``end_s`` None while it runs), and whether the answer was written whole."""

    tag: str  # the body's "user"
    max_tokens: int
    start_s: float  # time.monotonic() when it was read
    first_byte_s: float | None = None
    end_s: float | None = None
    completed: bool = False  # False: its connection ended before the answer did

    @property
    def seconds(self) -> float:
        return (self.end_s if self.end_s is not None else time.monotonic()) - self.start_s


def most_at_once(served: list[Served]) -> int:
    """The most of ``served`` in progress at one moment (an end at the same instant as a start
    counts as before it)."""
    events = sorted(
        [(s.start_s, 1) for s in served] + [(s.end_s if s.end_s is not None else float("inf"), -1) for s in served]
    )
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


class _Wire:
    """Buffered reads from a stream, keeping every byte taken for the request being read."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.buf = bytearray()
        self.taken = bytearray()

    async def _more(self) -> bool:
        chunk = await self.reader.read(65536)
        self.buf += chunk
        return bool(chunk)

    async def until(self, sep: bytes) -> bytes | None:
        while (at := self.buf.find(sep)) < 0:
            if not await self._more():
                return None
        return self._take(at + len(sep))

    async def exactly(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not await self._more():
                return None
        return self._take(n)

    def _take(self, n: int) -> bytes:
        out = bytes(self.buf[:n])
        del self.buf[:n]
        self.taken += out
        return out

    def start_request(self) -> None:
        self.taken = bytearray()


class RecordingBackend(FakeBackend):
    """FakeBackend's thread and loop, with a reader that records every request's bytes
    (``received``) and frames it itself. A chat body with ``"model": "hold"`` is answered after
    ``hold_s`` (to keep a slot busy). ``max_kept``: keep only the last requests (a long run;
    ``mark``/``since`` then count from the ones kept)."""

    def __init__(self, hold_s: float = 2.0, port: int = 0, max_kept: int | None = None, *,
                 slots: int | None = None, token_s: float | None = None) -> None:  # fmt: skip
        super().__init__(port=port, stream_delay_s=token_s or 0.0)
        self.hold_s = hold_s
        self.max_kept = max_kept
        self.received: list[Received] = []
        self.slots = slots
        self.token_s = token_s
        self.in_progress = 0
        self.max_in_progress = 0
        self.violations = 0  # moments a request started with more than ``slots`` in progress
        self.served: list[Served] = []

    def mark(self) -> int:
        """Where the record stands now: pass it to ``since``."""
        return len(self.received)

    def since(self, mark: int) -> list[Received]:
        return list(self.received[mark:])

    def wait_for(self, mark: int, count: int, timeout_s: float) -> list[Received]:
        """Poll until ``count`` requests arrived after ``mark`` or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while len(self.received) - mark < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.since(mark)

    def settle(self, mark: int, *, since_s: float, quiet_s: float = 0.2, max_s: float = 1.5) -> list[Received]:
        """The requests after ``mark`` once none arrived for ``quiet_s`` (at most ``max_s`` from
        now): the window in which a late or smuggled one would still be caught. The quiet counts
        from the last request after ``mark``, or from ``since_s`` (time.monotonic()) before any."""
        deadline = time.monotonic() + max_s

        def last_s() -> float:
            got = self.since(mark)
            return max(since_s, got[-1].at_s) if got else since_s

        while time.monotonic() < deadline and time.monotonic() - last_s() < quiet_s:
            time.sleep(0.02)
        return self.since(mark)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        connection, served = self._connections, 0
        self._writers.add(writer)
        wire = _Wire(reader)

        def record(method: str, target: str, version: str, headers: list[tuple[str, str]], body: bytes,
                   framing: str) -> Received:  # fmt: skip
            received = Received(bytes(wire.taken), method, target, version, headers, body, framing,
                                connection, served, time.monotonic())  # fmt: skip
            self.received.append(received)
            if self.max_kept is not None and len(self.received) > self.max_kept:
                del self.received[0]
            return received

        try:
            while True:
                wire.start_request()
                head = await wire.until(b"\r\n\r\n")
                served += 1
                if head is None:
                    if wire.buf:
                        wire.taken += wire.buf
                        record("", "", "", [], b"", "incomplete")
                    return
                lines = head[:-4].decode("latin-1").split("\r\n")
                parts = lines[0].split(" ")
                if len(parts) != 3:
                    record("", "", "", [], b"", "garbage")
                    await self._answer(writer, 400, b"bad request line", close=True)
                    return
                method, target, version = parts
                headers = [(k, v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:])]
                lower = {k.lower() for k, _ in headers}
                te = [v for k, v in headers if k.lower() == "transfer-encoding"]
                cl = [v for k, v in headers if k.lower() == "content-length"]
                body, framing = b"", "none"
                if te:
                    if te != ["chunked"] or cl:
                        record(method, target, version, headers, b"", f"invalid: transfer-encoding {te}, length {cl}")
                        await self._answer(writer, 400, b"ambiguous framing", close=True)
                        return
                    decoded = await self._chunked(wire)
                    if decoded is None:
                        record(method, target, version, headers, b"", "incomplete")
                        return
                    body, framing = decoded, "chunked"
                elif cl:
                    if len(cl) != 1 or not cl[0].isdigit():
                        record(method, target, version, headers, b"", f"invalid: content-length {cl}")
                        await self._answer(writer, 400, b"bad content-length", close=True)
                        return
                    got = await wire.exactly(int(cl[0]))
                    if got is None:
                        record(method, target, version, headers, b"", "incomplete")
                        return
                    body, framing = got, "length"
                received = record(method, target, version, headers, body, framing)
                close = "connection" in lower and any(
                    v.lower() == "close" for k, v in headers if k.lower() == "connection"
                )
                await self._respond(writer, received, close)
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    @staticmethod
    async def _chunked(wire: _Wire) -> bytes | None:
        body = bytearray()
        while True:
            line = await wire.until(b"\r\n")
            if line is None:
                return None
            size_text = line[:-2].split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                return None
            if size == 0:
                while (trailer := await wire.until(b"\r\n")) not in (b"\r\n", None):
                    pass
                return bytes(body) if trailer is not None else None
            data = await wire.exactly(size + 2)
            if data is None:
                return None
            body += data[:-2]

    async def _respond(self, writer: asyncio.StreamWriter, received: Received, close: bool) -> None:
        path = received.target.split("?", 1)[0]
        if received.method == "POST" and (path in OPENAI_PATHS or path in OLLAMA_PATHS):
            try:
                data = json.loads(received.body or b"{}")
            except ValueError:
                await self._answer(writer, 400, b'{"error":{"message":"bad json"}}', close=close)
                return
            if not isinstance(data, dict):
                data = {}
            served = Served(str(data.get("user", "")), int(data.get("max_tokens", 2)), received.at_s)
            self.served.append(served)
            self.in_progress += 1
            self.max_in_progress = max(self.max_in_progress, self.in_progress)
            if self.slots is not None and self.in_progress > self.slots:
                self.violations += 1
            try:
                await self._generate(writer, path, data, served, close)
                served.completed = True
            finally:
                served.end_s = time.monotonic()
                self.in_progress -= 1
            return
        if path == "/health":
            await self._answer(writer, 200, b'{"status":"ok"}', close=close, json_body=True)
        elif path == "/echo":
            lines = "".join(f"{k}: {v}\n" for k, v in received.headers)
            await self._answer(writer, 200, lines.encode("latin-1"), close=close)
        else:
            await self._answer(writer, 200, b"OK", close=close, head=received.method == "HEAD")

    async def _generate(self, writer: asyncio.StreamWriter, path: str, data: dict[str, Any], served: Served,
                        close: bool) -> None:  # fmt: skip
        if self.token_s is not None:
            tokens = served.max_tokens
            if data.get("stream") and path in OPENAI_PATHS:
                served.first_byte_s = time.monotonic()
                await self._stream(writer, served.tag, tokens, True)
                if close:
                    writer.close()
                return
            await asyncio.sleep(tokens * self.token_s)
        if data.get("model") == "hold":
            await asyncio.sleep(self.hold_s)
        tag = served.tag
        served.first_byte_s = time.monotonic()
        if path in OLLAMA_PATHS:
            answer = {"model": str(data.get("model", "m")), "created_at": "2024-01-01T00:00:00Z",
                      "message": {"role": "assistant", "content": f"ok {tag}"}, "response": f"ok {tag}",
                      "done": True, "prompt_eval_count": 3, "eval_count": 2}  # fmt: skip
            await self._answer(writer, 200, json.dumps(answer).encode(), close=close, json_body=True)
        elif data.get("stream"):
            await self._stream(writer, tag, int(data.get("max_tokens", 2)), False)
            if close:
                writer.close()
        else:
            await self._send(writer, 200, _chat_answer(tag, str(data.get("model", "m"))))

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, status: int, body: bytes, *, close: bool, json_body: bool = False,
                      head: bool = False) -> None:  # fmt: skip
        kind = b"application/json" if json_body else b"text/plain"
        writer.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n"
            % (
                status,
                b"OK" if status == 200 else b"Bad Request",
                kind,
                len(body),
                b"connection: close\r\n" if close else b"",
            )
            + (b"" if head else body)
        )
        await writer.drain()
        if close:
            writer.close()


def _chat_answer(tag: str, model: str) -> bytes:
    answer = {
        "id": f"x-{tag}",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": f"ok {tag}"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    return json.dumps(answer).encode()


def framing_problems(received: Received) -> list[str]:
    """Why ``received`` is not a request framed by the proxy: one Host, a body (if any) with a
    Content-Length that matches it, no Transfer-Encoding, no Expect, CRLF line ends and no
    folded or malformed header line. Empty: framed by us."""
    problems = []
    if received.framing not in ("length", "none"):
        problems.append(f"framing {received.framing}")
    head = received.raw.split(b"\r\n\r\n", 1)[0]
    lines = head.split(b"\r\n")
    if any(b"\n" in line or b"\r" in line for line in lines):
        problems.append("a bare CR or LF in the head")
    for line in lines[1:]:
        name, colon, _ = line.partition(b":")
        if not colon or not name or name != name.strip() or any(c <= 32 or c >= 127 for c in name):
            problems.append(f"malformed header line {line[:60]!r}")
    names = [k.lower() for k, _ in received.headers]
    if names.count("host") != 1:
        problems.append(f"{names.count('host')} Host headers")
    if "transfer-encoding" in names:
        problems.append("Transfer-Encoding forwarded")
    if "expect" in names:
        problems.append("Expect forwarded")
    lengths = received.header("content-length")
    if received.body and lengths != [str(len(received.body))]:
        problems.append(f"Content-Length {lengths} for a {len(received.body)}-byte body")
    if len(lengths) > 1:
        problems.append(f"{len(lengths)} Content-Length headers")
    return problems
