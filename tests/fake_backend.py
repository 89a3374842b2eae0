"""A tiny HTTP/1.1 backend on raw sockets, for faults a real backend will not produce on demand:
reading a request and then dying, resetting, hanging, answering 503. One thread per connection.

``script(path, n)`` decides what the n-th request (0-based) for ``path`` gets, after it was read
in full: ``"ok"`` (200 JSON, kept alive), ``"close"`` (close 0.3 s later without answering: a
FIN), ``"reset"`` (an immediate RST), ``"hang"`` (never answer), ``"loading"`` (503 like
llama.cpp loading a model), ``("stream", n_events, interval_s)`` (an SSE stream ending in
[DONE]; a fourth element, ``end_after_s``, holds the body's end that long after [DONE]) or ``("json", value)`` (200 with that JSON). ``/health`` answers 200 and closes (once
``health_gate`` is set, when one is given), counted in ``health_checks``. Every read request is recorded in
``delivered`` as (path, body), unless its action was ``reset``: the proxy must treat a reset as
"never read", and the tests count what the backend would have acted on.

``silent_close``: a request that says ``Connection: close`` is answered without saying so in the
answer (allowed: RFC 9112 9.6 makes it a SHOULD), as llama.cpp's server does after a stream, and
its connection is closed late: held open until the client closes it or sends another request on
it. That request is read, counted in ``sent_after_close`` (not delivered), and met with a FIN
before any answer: the backend's close, deterministically losing the race with the client's reuse.
"""

from __future__ import annotations

import functools
import json
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

Action = Any  # str or ("stream", n_events, interval_s)


class FakeBackend:
    def __init__(self, script: Callable[[str, int], Action], port: int = 0, *, silent_close: bool = False) -> None:
        self.script = script
        self.silent_close = silent_close
        self.sent_after_close = 0  # requests sent on a connection after one that said Connection: close
        self.delivered: list[tuple[str, bytes]] = []
        self.resets = 0
        self.connections = 0
        self.health_checks = 0
        self.health_gate: threading.Event | None = None  # set: /health answers (None: at once)
        # Requests read and not yet answered in full, now and at most (a replica's slot count is
        # checked where it matters: at the backend).
        self.in_progress = 0
        self.max_in_progress = 0
        self._per_path: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()

    def __enter__(self) -> FakeBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def posts(self, path: str) -> int:
        return sum(1 for p, _ in self.delivered if p == path)

    # -- serving ---------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        try:
            while True:
                request, buffer = _read_request(conn, buffer)
                if request is None:
                    return
                method, path, body, asks_close = request
                if path == "/health":
                    # The gate is read before the check is counted: a gate installed once a check
                    # has been seen applies to the next check, never to that one.
                    gate = self.health_gate
                    with self._lock:
                        self.health_checks += 1
                    if gate is not None and not gate.wait(10):
                        return
                    _write(conn, 200, b'{"status":"ok"}', close=True)
                    return
                with self._lock:
                    n = self._per_path[path]
                    self._per_path[path] += 1
                action = self.script(path, n)
                if action == "reset":
                    with self._lock:
                        self.resets += 1
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                with self._lock:
                    self.delivered.append((path, body))
                    self.in_progress += 1
                    self.max_in_progress = max(self.max_in_progress, self.in_progress)
                finished = threading.Event()
                try:
                    self._act(conn, action, n, functools.partial(self._finish, finished))
                finally:
                    self._finish(finished)
                if action in ("close", "hang"):
                    return
                if asks_close and self.silent_close:
                    self._close_late(conn)
                    return
        except OSError:
            return
        finally:
            conn.close()

    def _close_late(self, conn: socket.socket) -> None:
        """Wait for the client's close or its next request; meet a request with a FIN, then read
        until the client closes (bytes left unread would turn the close into a reset)."""
        if not conn.recv(65536):
            return
        with self._lock:
            self.sent_after_close += 1
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):
            pass

    def _finish(self, finished: threading.Event) -> None:
        """A request's work is over: out of ``in_progress`` once, before its last bytes are sent
        (a client that has read them may send the next request at once)."""
        with self._lock:
            if not finished.is_set():
                finished.set()
                self.in_progress -= 1

    def _act(self, conn: socket.socket, action: Action, n: int, finish: Callable[[], None]) -> None:
        if action == "ok":
            finish()
            _write(conn, 200, json.dumps({"ok": True, "n": n}).encode())
        elif action == "loading":
            finish()
            _write(conn, 503, b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}')
        elif isinstance(action, tuple) and action[0] == "json":
            finish()
            _write(conn, 200, json.dumps(action[1]).encode())
        elif action == "close":
            time.sleep(0.3)  # the fault as scripted: a backend that worked a moment, then died
        elif action == "hang":
            self._stop.wait()
        elif isinstance(action, tuple) and action[0] == "stream":
            self._stream(conn, finish, *action[1:])
        else:
            raise ValueError(f"unknown action {action!r}")

    def _stream(
        self,
        conn: socket.socket,
        finish: Callable[[], None],
        n_events: int,
        interval_s: float,
        end_after_s: float = 0.0,
    ) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        conn.sendall(head)
        for i in range(n_events):
            event = b'data: {"choices":[{"delta":{"content":"x%d"}}]}\n\n' % i
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            time.sleep(interval_s)  # the stream's scripted pace
        done = b"data: [DONE]\n\n"
        finish()
        conn.sendall(b"%x\r\n%s\r\n" % (len(done), done))
        if end_after_s:
            self._stop.wait(end_after_s)  # the scripted pause before the body's end
        conn.sendall(b"0\r\n\r\n")


def _read_request(conn: socket.socket, buffer: bytes) -> tuple[tuple[str, str, bytes, bool] | None, bytes]:
    """The next request: (method, path, body, whether its Connection header says close), and the bytes after it."""
    while b"\r\n\r\n" not in buffer:
        data = conn.recv(65536)
        if not data:
            return None, b""
        buffer += data
    head, buffer = buffer.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    length = 0
    asks_close = False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
        elif name.strip().lower() == "connection":
            asks_close = asks_close or "close" in value.lower()
    while len(buffer) < length:
        data = conn.recv(65536)
        if not data:
            return None, b""
        buffer += data
    return (method, target.split("?", 1)[0], buffer[:length], asks_close), buffer[length:]


def _write(conn: socket.socket, status: int, body: bytes, *, close: bool = False) -> None:
    reason = {200: "OK", 503: "Service Unavailable"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "date: Sun, 22 Nov 2026 00:00:00 GMT\r\nserver: fake-backend\r\n"
    )
    if close:
        head += "connection: close\r\n"
    conn.sendall(head.encode() + b"\r\n" + body)
