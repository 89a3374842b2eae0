"""What the proxy relies on from Granian, whose embedded server is marked experimental.

Each test drives ``granian.server.embed.Server``, configured as proxy/server.py configures it, with
a small ASGI app and a raw socket, and asserts one behaviour that proxy/ code depends on (named in
each test). A Granian release that changes one of them fails here, by name, rather than in
production. Behaviours the proxy's own tests already pin through the whole proxy are named at the
end, with where. Not relied on, so not pinned: the scope's ``client`` and ``server`` (Granian gives
their ports as strings, where ASGI says integers).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.server.embed import Server
from polling import wait_until

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

HEAD_TIMEOUT_MS = 1000


class Embedded:
    """One embedded Granian server on its own event loop in a thread, configured as
    proxy/server.py configures it; ``handler`` answers every HTTP request."""

    def __init__(self, handler: Handler, **overrides: Any) -> None:
        self.handler = handler
        self.scopes: list[Scope] = []
        self.app_loops: list[asyncio.AbstractEventLoop] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lifespan: list[str] = []
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        options: dict[str, Any] = {
            "address": "127.0.0.1", "port": self.port, "interface": Interfaces.ASGI, "http": HTTPModes.http1,
            "websockets": False, "runtime_threads": 1, "backlog": 1024, "backpressure": 64,
            "http1_settings": HTTP1Settings(header_read_timeout=HEAD_TIMEOUT_MS, keep_alive=True, max_buffer_size=16384),
            "log_enabled": False,
        }  # fmt: skip
        self.server = Server(self.app, **{**options, **overrides})
        self.started = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.lifespan.append("startup")
                    await send({"type": "lifespan.startup.complete"})
                    self.started.set()
                else:
                    self.lifespan.append("shutdown")
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        self.scopes.append(scope)
        self.app_loops.append(asyncio.get_running_loop())
        await self.handler(scope, receive, send)

    def __enter__(self) -> Embedded:
        self.thread.start()
        assert self.started.wait(30), "the embedded server did not start"
        wait_until(self._accepting, what="the port to accept")
        return self

    def _accepting(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def __exit__(self, *exc: object) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.server.stop)
        self.thread.join(15)
        assert not self.thread.is_alive(), "the embedded server did not stop"

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.settimeout(10)  # a guard: a test that waits longer has failed
        return sock


def read_to_close(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def read_until(sock: socket.socket, marker: bytes, received: bytes = b"") -> bytes:
    while marker not in received:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


async def read_all(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return body


async def answer(send: Send, status: int = 200, body: bytes = b"ok") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    await read_all(receive)
    await answer(send)


@contextmanager
def embedded(handler: Handler = echo, **overrides: Any) -> Iterator[Embedded]:
    with Embedded(handler, **overrides) as server:
        yield server


# --- the scope (proxy/app.py, proxy/target.py, proxy/access.py) --------------------------------


def test_the_scope_carries_the_raw_target_the_decoded_path_and_the_headers_as_sent() -> None:
    # target.py routes on ``path``, forwards ``raw_path`` and refuses what decodes differently;
    # access.py and target.py read repeated headers (a second Host, two keys) as separate pairs.
    with embedded() as server, server.connect() as sock:
        sock.sendall(
            b"POST /v1/a%20b/%2e?x=%20&y HTTP/1.1\r\nHost: h\r\nX-Dup: 1\r\nX-DUP: 2\r\nContent-Length: 2\r\n"
            b"Connection: close\r\n\r\nhi"
        )
        assert read_to_close(sock).startswith(b"HTTP/1.1 200 ")
    scope = server.scopes[0]
    assert scope["type"] == "http" and scope["method"] == "POST"
    assert scope["raw_path"] == b"/v1/a%20b/%2e" and scope["path"] == "/v1/a b/."
    assert scope["query_string"] == b"x=%20&y"
    headers = scope["headers"]
    assert all(isinstance(name, bytes) and name == name.lower() for name, _ in headers)
    assert [v for n, v in headers if n == b"x-dup"] == [b"1", b"2"]
    assert scope["http_version"] == "1.1"


def test_http10_is_reported_as_1_and_a_missing_host_as_an_empty_one() -> None:
    # target.http_version reads "1" as HTTP/1.0; check_host lets 1.0 leave Host out, and takes an
    # empty value as missing.
    with embedded() as server, server.connect() as sock:
        sock.sendall(b"POST /x HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi")
        assert read_to_close(sock).split(b"\r\n", 1)[0] == b"HTTP/1.0 200 OK"
    scope = server.scopes[0]
    assert scope["http_version"] in ("1", "1.0")
    assert [v for n, v in scope["headers"] if n == b"host"] in ([], [b""])


def test_the_app_runs_on_the_loop_that_serves() -> None:
    # The dispatcher, the learner's hand-overs and every request share one event loop.
    with embedded() as server, server.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        read_to_close(sock)
    assert server.app_loops == [server.loop]
    assert server.lifespan == ["startup", "shutdown"]


# --- the body and 100 Continue (proxy/body.py, proxy/app.py) -----------------------------------


def test_100_continue_goes_out_only_when_the_app_reads_the_body() -> None:
    # The app refuses (queue full, a bad key) before reading: the client is never invited to upload.
    async def refuse_or_read(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/refuse":
            await answer(send, 503, b"full")
        else:
            await answer(send, 200, await read_all(receive))

    with embedded(refuse_or_read) as server:
        with server.connect() as sock:
            sock.sendall(b"POST /refuse HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
            refused = read_until(sock, b"full")
        with server.connect() as sock:
            sock.sendall(b"POST /read HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
            interim = read_until(sock, b"\r\n\r\n")
            sock.sendall(b"body")
            read = read_until(sock, b"body", interim)
    assert refused.startswith(b"HTTP/1.1 503 ") and b"100 Continue" not in refused
    assert interim.startswith(b"HTTP/1.1 100 Continue\r\n") and b"HTTP/1.1 200 " in read


def test_a_body_cut_short_is_a_disconnect_and_a_client_gone_after_its_body_is_one_too() -> None:
    # body.py reads ``http.disconnect`` mid-body as an incomplete body; relay.disconnected (the
    # watch on a waiting or streaming request) needs one after the body, when the client leaves.
    seen: list[str] = []
    gone = threading.Event()

    async def wait_for_disconnect(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            seen.append(f"{scope['path']}:{message['type']}")
            if message["type"] == "http.disconnect":
                gone.set()
                return

    with embedded(wait_for_disconnect) as server:
        with server.connect() as sock:
            sock.sendall(b"POST /cut HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\nhalf")
            wait_until(lambda: "/cut:http.request" in seen, what="the first part of the body")
        assert gone.wait(10), "no http.disconnect for a body cut short"
        gone.clear()
        with server.connect() as sock:
            sock.sendall(b"POST /whole HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\nbody")
            wait_until(lambda: "/whole:http.request" in seen, what="the whole body")
        assert gone.wait(10), "no http.disconnect for a client that left after its body"
    assert seen[-1] == "/whole:http.disconnect"


# --- the answer (proxy/relay.py) -----------------------------------------------------------------


def test_each_body_message_goes_out_as_it_is_sent() -> None:
    # A stream's first token reaches the client while the rest is being generated.
    more = threading.Event()

    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        await read_all(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
        await asyncio.to_thread(more.wait, 10)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    with embedded(stream) as server, server.connect() as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        before = read_until(sock, b"data: first")
        more.set()
        rest = read_to_close(sock)
    assert b"data: first" in before and b"[DONE]" not in before  # out before the next was sent
    assert b"data: [DONE]" in rest and (before + rest).endswith(b"0\r\n\r\n")  # chunked, ended


def test_the_apps_content_length_is_kept_and_date_and_server_are_the_servers_own() -> None:
    # The relay forwards the backend's Content-Length and drops its Date and Server.
    with embedded() as server, server.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        head, _, body = read_to_close(sock).partition(b"\r\n\r\n")
    lines = [line.lower() for line in head.split(b"\r\n")[1:]]
    assert b"content-length: 2" in lines and body == b"ok"
    assert sum(line.startswith(b"date: ") for line in lines) == 1
    assert [line for line in lines if line.startswith(b"server: ")] == [b"server: granian"]
    assert not any(line.startswith(b"transfer-encoding") for line in lines)


def test_send_waits_while_the_client_does_not_read() -> None:
    # A client that stops reading holds the relay at its send, and the relay stops reading the
    # backend: what a slow client costs is the sockets' buffers, not the whole answer in memory.
    chunks, size = 400, 65536  # 25 MiB: well beyond the buffers of both sockets
    sent = [0]

    async def flood(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(chunks):
            await send({"type": "http.response.body", "body": b"x" * size, "more_body": True})
            sent[0] += 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    with embedded(flood) as server, server.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        wait_until(lambda: sent[0] > 0, what="the first chunk")
        with pytest.raises(AssertionError):  # held while nothing is read
            wait_until(lambda: sent[0] == chunks, timeout_s=2.0, what="every chunk sent to a client not reading")
        assert sent[0] < chunks
        received = read_to_close(sock)
    assert sent[0] == chunks and received.endswith(b"0\r\n\r\n")


def test_a_send_after_the_client_left_does_not_raise() -> None:
    # The relay may send a chunk before the server's http.disconnect reaches its watch.
    outcome: list[str] = []
    left = threading.Event()

    async def late(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await asyncio.to_thread(left.wait, 10)
        try:
            while (await receive())["type"] != "http.disconnect":  # the server has seen the close
                pass
            for _ in range(20):
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            outcome.append("no error")
        except Exception as exc:  # noqa: BLE001 - the contract under test is that there is none
            outcome.append(repr(exc))

    with embedded(late) as server:
        with server.connect() as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
            read_until(sock, b"first")
        left.set()
        wait_until(lambda: outcome, what="the app's sends after the client left")
    assert outcome == ["no error"]


@pytest.mark.parametrize("length", [b"100", None], ids=["content-length", "chunked"])
def test_an_app_that_returns_mid_body_leaves_the_body_unfinished(length: bytes | None) -> None:
    # relay.end_with_error cuts a plain body short by returning without its end: the client must
    # see it broken (a short read, no last chunk), never a complete-looking answer.
    async def cut(scope: Scope, receive: Receive, send: Send) -> None:
        await read_all(receive)
        headers = [] if length is None else [(b"content-length", length)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"0123456789", "more_body": True})

    with embedded(cut) as server, server.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")  # kept alive: only the server's close ends it
        received = read_to_close(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    if length is None:
        assert b"0123456789" in body and not body.endswith(b"0\r\n\r\n")
    else:
        assert body == b"0123456789"  # 10 of 100 bytes, then the close


# --- limits (proxy/server.py) ----------------------------------------------------------------------


def test_a_head_not_whole_within_the_header_read_timeout_is_closed_unanswered() -> None:
    # client_timeout_s bounds a head trickled or stalled: Granian's header_read_timeout.
    with embedded() as server, server.connect() as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: h\r\n")
        assert read_to_close(sock) == b""  # closed (within the 10 s guard), no answer
    assert server.scopes == []


def test_a_head_beyond_the_buffer_never_reaches_the_app() -> None:
    # max_buffer_size bounds the head roughly; target.check_head_size then counts it exactly.
    with embedded() as server, server.connect() as sock:
        try:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
            received = read_to_close(sock)
        except ConnectionResetError:
            received = b""
    assert received == b"" or received.startswith(b"HTTP/1.1 431 ")
    assert server.scopes == []


def test_backpressure_holds_connections_beyond_it_unserved_until_one_ends() -> None:
    # max_connections is Granian's backpressure: a connection beyond it waits, it is not refused.
    release = threading.Event()

    async def hold(scope: Scope, receive: Receive, send: Send) -> None:
        await read_all(receive)
        if scope["path"] == "/hold":
            await asyncio.to_thread(release.wait, 10)
        await answer(send)

    with embedded(hold, backpressure=1) as server:
        with server.connect() as held, server.connect() as waiting:
            held.sendall(b"GET /hold HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
            wait_until(lambda: len(server.scopes) == 1, what="the held request")
            waiting.sendall(b"GET /next HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
            waiting.settimeout(0.5)
            with pytest.raises(TimeoutError):
                waiting.recv(1)  # not served while the other holds the only place
            assert [s["path"] for s in server.scopes] == ["/hold"]
            release.set()
            waiting.settimeout(10)
            assert read_to_close(held).startswith(b"HTTP/1.1 200 ")
            assert read_to_close(waiting).startswith(b"HTTP/1.1 200 ")
    assert [s["path"] for s in server.scopes] == ["/hold", "/next"]


def _tcp_timer(local_port: int, remote_port: int) -> int | None:
    """The kernel's timer kind on the TCP socket (local_port -> remote_port) from /proc/net/tcp:
    0 none, 1 retransmit, 2 keepalive (None: no such socket)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == local_port and int(fields[2].rsplit(":", 1)[1], 16) == remote_port:
            return int(fields[5].split(":", 1)[0], 16)
    return None


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_client_connections_have_no_tcp_keepalive() -> None:
    # Granian offers no TCP keepalive setting and sets none: docs/operations.md says what follows
    # (a client whose host vanishes without a FIN is not noticed while its request waits). A
    # release that starts setting it fails here, so that the docs are brought up to date.
    with embedded() as server, server.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")  # kept alive: idle after its answer
        assert read_until(sock, b"ok").endswith(b"ok")
        client_port = sock.getsockname()[1]
        assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)  # the test's own side: off too
        assert _tcp_timer(server.port, client_port) == 0  # the server's side, idle: no keepalive timer


# Pinned through the whole proxy elsewhere:
# - a port already taken ends serve() before the app starts, and a failing lifespan ends it too
#   (tests/test_server_startup.py: exit codes 2 and 3);
# - an idle kept-alive connection is closed at client_timeout_s (tests/test_hardening.py);
# - framing and smuggling vectors (tests/test_http_conformance.py).
