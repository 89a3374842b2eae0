"""One HTTP/1.1 exchange over a raw socket, for vectors a real client library would refuse to send
or would read differently.

``exchange`` sends a request's parts (between parts it waits, up to ``pause_s``, for an answer, as
a client sending ``Expect: 100-continue`` does; a final answer stops it sending the rest), then
reads until the final answers it expects are complete and the line has been quiet for
``settle_s``, the server closes, or ``wait_s`` passes. Every answer is parsed (interim 1xx ones
too) with the time its head arrived (``Response.at_s``); what follows the last whole answer is
``Exchange.leftover``.
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass

__all__ = ["Exchange", "Response", "exchange", "parse_responses"]


@dataclass
class Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]  # names lower-cased
    body: bytes
    at_s: float  # seconds after the first byte was sent when its head had arrived
    head_end: int = 0  # where its head ends in the bytes received

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)


@dataclass
class Exchange:
    """What the client saw."""

    responses: list[Response]  # in arrival order, interim (1xx) ones included
    closed: bool  # the server closed (EOF) or reset the connection before the deadline
    reset: bool
    leftover: bytes  # bytes after the last whole answer (an answer cut short, or not HTTP)
    elapsed_s: float  # from the first byte sent to the end of reading
    parts_sent: int  # how many of the vector's parts were sent

    @property
    def finals(self) -> list[Response]:
        return [r for r in self.responses if r.status >= 200]

    def interim_before_first_final(self) -> list[int]:
        out = []
        for r in self.responses:
            if r.status >= 200:
                break
            out.append(r.status)
        return out

    def outcome(self) -> str:
        """E.g. ``400+close``, ``100,200``, ``closed``, ``reset``, ``timeout``."""
        words = [str(r.status) for r in self.responses]
        text = ",".join(words)
        if self.closed:
            end = "reset" if self.reset else "close"
            return f"{text}+{end}" if text else ("reset" if self.reset else "closed")
        if not self.finals:
            return f"{text}+timeout" if text else "timeout"
        return text


def parse_responses(data: bytes, *, head: bool = False, eof: bool = False) -> tuple[list[Response], int]:
    """The whole answers at the start of ``data`` (no arrival times) and how many bytes they took.
    ``head``: the request was HEAD (final answers have no body); ``eof``: the connection ended, so
    an answer delimited by the close is complete."""
    out: list[Response] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            break
        lines = data[pos:end].split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or not status_line[1].isdigit():
            break
        status = int(status_line[1])
        reason = status_line[2].decode("latin-1") if len(status_line) > 2 else ""
        headers = [(k.strip().lower().decode("latin-1"), v.strip().decode("latin-1"))
                   for k, _, v in (ln.partition(b":") for ln in lines[1:])]  # fmt: skip
        start = end + 4
        names = dict(headers)
        if status < 200 or status in (204, 304) or head:
            body, nxt = b"", start
        elif "chunked" in names.get("transfer-encoding", "").lower():
            decoded = _dechunk(data, start)
            if decoded is None:
                break
            body, nxt = decoded
        elif "content-length" in names and names["content-length"].isdigit():
            nxt = start + int(names["content-length"])
            if nxt > len(data):
                break
            body = data[start:nxt]
        elif eof:
            body, nxt = data[start:], len(data)
        else:
            break
        out.append(Response(status, reason, headers, body, 0.0, start))
        pos = nxt
    return out, pos


def _dechunk(data: bytes, pos: int) -> tuple[bytes, int] | None:
    body = bytearray()
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(data[pos:eol].split(b";", 1)[0].strip(), 16)
        except ValueError:
            return None
        pos = eol + 2
        if size == 0:
            end = data.find(b"\r\n\r\n", pos - 2)
            return (bytes(body), end + 4) if end >= 0 else None
        if pos + size + 2 > len(data):
            return None
        body += data[pos : pos + size]
        pos += size + 2


def exchange(
    port: int,
    parts: tuple[bytes, ...],
    *,
    head: bool = False,
    finals: int = 1,
    wait_s: float = 3.0,
    pause_s: float = 1.0,
    settle_s: float = 0.25,
    host: str = "127.0.0.1",
) -> Exchange:
    """Send ``parts`` to ``host:port`` and read what comes back (see the module docstring)."""
    sock = socket.create_connection((host, port), timeout=wait_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    data = bytearray()
    arrivals: list[tuple[float, int]] = []  # (seconds after start, bytes received by then)
    closed = reset = False
    started = time.monotonic()
    deadline = started + wait_s

    def receive(until_s: float) -> bool:
        """Wait for bytes until ``until_s``; False when nothing came."""
        nonlocal closed, reset
        remaining = until_s - time.monotonic()
        if remaining <= 0 or not select.select([sock], [], [], remaining)[0]:
            return False
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            closed = reset = True
            return True
        except BlockingIOError:
            return True
        if not chunk:
            closed = True
        else:
            data.extend(chunk)
            arrivals.append((time.monotonic() - started, len(data)))
        return True

    def send(payload: bytes) -> bool:
        view = memoryview(payload)
        while view:
            if not select.select([], [sock], [], max(0.0, deadline - time.monotonic()))[1]:
                return False
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return False
        return True

    sent = 0
    try:
        for i, part in enumerate(parts):
            if i:
                pause_end = min(deadline, time.monotonic() + pause_s)
                while not closed and not data and receive(pause_end):
                    pass
                if closed or any(r.status >= 200 for r in parse_responses(bytes(data), head=head)[0]):
                    break  # a final answer (or the close) came first: the rest is not sent
            if not send(part):
                break
            sent += 1
        while not closed and time.monotonic() < deadline:
            got, _ = parse_responses(bytes(data), head=head)
            if sum(r.status >= 200 for r in got) >= finals:
                if not receive(min(deadline, time.monotonic() + settle_s)):
                    break  # quiet for settle_s after the answers expected
            else:
                receive(deadline)
    finally:
        sock.close()
    responses, used = parse_responses(bytes(data), head=head, eof=closed)
    for response in responses:  # its arrival: when the bytes up to its head's end had come
        response.at_s = next((t for t, n in arrivals if n >= response.head_end), time.monotonic() - started)
    return Exchange(responses, closed, reset, bytes(data[used:]), time.monotonic() - started, sent)
