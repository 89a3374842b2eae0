"""The HTTP/1.1 client to the backend (proxy/backend_connection.py) against real servers: a tiny
asyncio server per test for framing and faults, the embedded llama.cpp server for the real thing.
Events are ordered by polling state, never by sleeping."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from clairvoyant.proxy.backend_connection import HIGH_WATER_BYTES, MAX_HEAD_BYTES, ProtocolTransport
from clairvoyant.proxy.upstream import TransportError, Upstream

Handler = Callable[["Server", asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Server:
    """A test backend: ``handler(server, reader, writer, n)`` serves its n-th connection (0-based)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []  # every request head read, in order
        self.closed = 0  # connections the client closed (EOF seen by the server)
        self.url = ""
        self.writers: list[asyncio.StreamWriter] = []  # one per connection

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = self.connections
        self.connections += 1
        try:
            self.writers.append(writer)
            await self.handler(self, reader, writer, n)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request (head + body); None at EOF (the client closed the connection)."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed += 1
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self.requests.append(head)
        return head + body


@asynccontextmanager
async def serving(handler: Handler, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Server]:
    server = Server(handler)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0, ssl=ssl_context)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
    async with listener:
        yield server


async def poll(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0)."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def read_all(transport: ProtocolTransport, url: str, method: str = "POST", **kw: Any) -> tuple[int, bytes]:
    response = await transport.send(method, url, [("Content-Type", "application/json")], b"{}", close_connection=False)
    try:
        return response.status_code, b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()


def transport(**kw: Any) -> ProtocolTransport:
    return ProtocolTransport(connect_timeout_s=kw.pop("connect_timeout_s", 5.0), read_timeout_s=None, **kw)


# --- framing ----------------------------------------------------------------------------------


def test_a_chunked_answer_is_relayed_de_chunked_and_its_connection_reused() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await server.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (b"hello ", b"chunked ", b"world"):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"0\r\nX-Trailer: dropped\r\n\r\n")

    async def scenario() -> None:
        async with serving(handler) as server:
            client = transport()
            try:
                first = await read_all(client, server.url + "/a")
                second = await read_all(client, server.url + "/b")
            finally:
                await client.aclose()
            assert first == second == (200, b"hello chunked world")
            assert server.connections == 1  # the second request went out on the pooled connection
            assert [h.split(b" ")[1] for h in server.requests] == [b"/a", b"/b"]

    asyncio.run(scenario())


def test_a_body_delimited_by_the_close_is_read_to_the_close_and_never_pooled() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
        await writer.drain()
        writer.write(b"the close")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with serving(handler) as server:
            client = transport()
            try:
                assert await read_all(client, server.url) == (200, b"until the close")
                assert client.pool(server.url).idle == []
                assert await read_all(client, server.url) == (200, b"until the close")
            finally:
                await client.aclose()
            assert server.connections == 2

    asyncio.run(scenario())


def test_head_204_and_304_answers_have_no_body_and_1xx_answers_are_skipped() -> None:
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n",  # HEAD: the length of the GET's body
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nX-Final: yes\r\nContent-Length: 4\r\n\r\ndone",
        OK,
    ]

    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for answer in answers:
            if await server.read_request(reader) is None:
                return
            writer.write(answer)
        await server.read_request(reader)

    async def scenario() -> None:
        async with serving(handler) as server:
            client = transport()
            try:
                results = [await read_all(client, server.url, method="HEAD")]
                results += [await read_all(client, server.url) for _ in range(3)]
                last = await client.send("GET", server.url, [], b"", close_connection=False)
                await last.aclose()
            finally:
                await client.aclose()
            assert results == [(200, b""), (204, b""), (304, b""), (201, b"done")]
            assert last.status_code == 200 and server.connections == 1  # all on one connection
            assert b"content-length" not in server.requests[-1].lower()  # a bodiless GET has none

    asyncio.run(scenario())


def test_a_head_beyond_the_limit_fails() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(MAX_HEAD_BYTES // 1000 + 2):
            writer.write(b"X-Filler-%d: %s\r\n" % (i, b"x" * 1000))
        writer.write(b"Content-Length: 2\r\n\r\nok")
        await reader.read()

    async def scenario() -> None:
        async with serving(handler) as server:
            client = transport()
            try:
                with pytest.raises(TransportError) as caught:
                    await read_all(client, server.url)
            finally:
                await client.aclose()
            assert caught.value.kind == "failed" and not caught.value.never_read
            assert "head exceeds" in str(caught.value)

    asyncio.run(scenario())


@pytest.mark.parametrize("split", [False, True], ids=["one-packet", "two-packets"])
def test_bytes_after_the_answer_keep_the_answer_and_close_the_connection(split: bool) -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await server.read_request(reader) is not None:
            writer.write(OK)
            if split:
                await writer.drain()
                await asyncio.sleep(0.05)  # not an ordering: either arrival must give the same result
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra")

    async def scenario() -> None:
        async with serving(handler) as server:
            client = transport()
            try:
                response = await client.send("GET", server.url, [], b"", close_connection=False)
                if split:
                    await poll(lambda: server.closed == 1 or client.pool(server.url).live == set())
                body = b"".join([chunk async for chunk in response.aiter_raw()])
                await response.aclose()
                assert body == b"ok" and client.pool(server.url).idle == []
                assert await read_all(client, server.url) == (200, b"ok")
            finally:
                await client.aclose()
            assert server.connections == 2  # the first connection was never reused

    asyncio.run(scenario())


# --- faults: what may be resent ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["reset", "close"])
def test_a_connection_ended_before_the_first_byte_is_never_read_only_when_reset(how: str) -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        if how == "reset":
            reset(writer)
        else:
            writer.close()  # a FIN: the backend may have read it and be generating

    async def scenario() -> TransportError:
        async with serving(handler) as server:
            client = transport()
            try:
                with pytest.raises(TransportError) as caught:
                    await client.send("POST", server.url, [], b"{}", close_connection=False)
            finally:
                await client.aclose()
            return caught.value

    error = asyncio.run(scenario())
    assert error.kind == "failed"
    assert error.never_read is (how == "reset")


def test_a_reset_mid_body_fails_the_body_and_is_not_never_read() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nfirst")
        await writer.drain()
        await server.read_request(reader)  # never comes: waits for the client to have read "first"

    async def scenario() -> tuple[bytes, TransportError]:
        async with serving(handler) as server:
            client = transport()
            try:
                response = await client.send("POST", server.url, [], b"{}", close_connection=False)
                body = response.aiter_raw()
                first = await anext(body)
                reset(server.writers[0])
                with pytest.raises(TransportError) as caught:
                    await anext(body)
                await response.aclose()
            finally:
                await client.aclose()
            return first, caught.value

    first, error = asyncio.run(scenario())
    assert first == b"first"
    assert error.kind == "failed" and not error.never_read


def test_the_upstream_resends_a_request_reset_unread_and_only_that() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        if n == 0:
            reset(writer)
        else:
            writer.write(OK)
            await server.read_request(reader)

    async def scenario() -> None:
        async with serving(handler) as server:
            upstream = Upstream(server.url)
            try:
                response = await upstream.open("POST", "/x", body=b"{}")
                body = b"".join([c async for c in upstream.iter_body(response)])
                await response.aclose()
            finally:
                await upstream.aclose()
            assert (response.status_code, body) == (200, b"ok")
            assert server.connections == 2 and len(server.requests) == 2

    asyncio.run(scenario())


def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def scenario() -> TransportError:
        client = transport()
        try:
            with pytest.raises(TransportError) as caught:
                await client.send("GET", f"http://127.0.0.1:{port}/", [], b"", close_connection=False)
        finally:
            await client.aclose()
        return caught.value

    assert asyncio.run(scenario()).kind == "connect"


# --- the pool, timeouts, backpressure ---------------------------------------------------------


def test_an_idle_connection_is_closed_after_the_keepalive_expiry() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await server.read_request(reader) is not None:
            writer.write(OK)

    async def scenario() -> None:
        async with serving(handler) as server:
            client = transport(keepalive_expiry_s=0.2)
            try:
                assert await read_all(client, server.url) == (200, b"ok")
                pool = client.pool(server.url)
                assert len(pool.idle) == 1
                await poll(lambda: server.closed == 1)  # the proxy closed it: the server saw EOF
                assert pool.idle == [] and pool.live == set()
                assert await read_all(client, server.url) == (200, b"ok")
            finally:
                await client.aclose()
            assert server.connections == 2

    asyncio.run(scenario())


def test_a_stream_that_asks_to_close_is_never_pooled_and_a_spare_is_opened_for_the_next() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await server.read_request(reader) is not None:
            writer.write(OK)  # keeps it alive: only the request's own ask closes it

    async def scenario() -> None:
        async with serving(handler) as server:
            client = transport()
            try:
                response = await client.send(
                    "POST", server.url, [("Connection", "close")], b"{}", close_connection=True
                )
                assert b"".join([c async for c in response.aiter_raw()]) == b"ok"
                await response.aclose()
                pool = client.pool(server.url)
                await poll(lambda: pool.spare is not None)
                spare = pool.spare
                assert pool.idle == []
                await poll(lambda: server.closed == 1)  # the asked-to-close connection is closed
                assert await read_all(client, server.url) == (200, b"ok")  # goes out on the spare
                assert pool.spare is None and pool.idle == [spare]
            finally:
                await client.aclose()
            assert server.connections == 2

    asyncio.run(scenario())


def test_no_byte_within_the_read_timeout_is_a_timeout() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await reader.read()  # then nothing until the client gives up

    async def scenario() -> tuple[bytes, TransportError]:
        async with serving(handler) as server:
            client = ProtocolTransport(connect_timeout_s=5.0, read_timeout_s=0.2)
            try:
                response = await client.send("GET", server.url, [], b"", close_connection=False)
                chunks = []
                with pytest.raises(TransportError) as caught:
                    async for chunk in response.aiter_raw():
                        chunks.append(chunk)
                await response.aclose()
            finally:
                await client.aclose()
            return b"".join(chunks), caught.value

    body, error = asyncio.run(scenario())
    assert body == b"abc" and error.kind == "timeout"


def test_a_slow_reader_pauses_the_backend_and_reading_resumes_when_it_takes_the_bytes() -> None:
    total = 8 * 1024 * 1024
    sent = [0]

    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = b"x" * 65536
        while sent[0] < total:
            writer.write(block)
            await writer.drain()
            sent[0] += len(block)

    async def scenario() -> None:
        async with serving(handler) as server:
            client = transport()
            try:
                response = await client.send("GET", server.url, [], b"", close_connection=False)
                conn = client.pool(server.url).live.copy().pop()
                await poll(lambda: conn.paused)
                stalled_at = sent[0]
                await poll(lambda: sent[0] == stalled_at, 1.0)
                # Paused: what the proxy holds is bounded by the high-water mark plus one socket read,
                # and the backend is stuck on a full socket, far from the end of its answer.
                assert conn.buffered < HIGH_WATER_BYTES + 512 * 1024
                assert sent[0] < total // 2
                received = 0
                async for chunk in response.aiter_raw():
                    received += len(chunk)
                await response.aclose()
            finally:
                await client.aclose()
            assert received == total and sent[0] == total

    asyncio.run(scenario())


def test_time_paused_for_a_slow_reader_is_not_a_read_timeout() -> None:
    total = 4 * 1024 * 1024

    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        writer.write(b"y" * total)
        await writer.drain()

    async def scenario() -> int:
        async with serving(handler) as server:
            client = ProtocolTransport(connect_timeout_s=5.0, read_timeout_s=0.1)
            try:
                response = await client.send("GET", server.url, [], b"", close_connection=False)
                conn = client.pool(server.url).live.copy().pop()
                await poll(lambda: conn.paused)
                await asyncio.sleep(0.5)  # the reader is slow: five read timeouts pass while paused
                assert conn.error is None and not conn.lost
                received = 0
                async for chunk in response.aiter_raw():
                    received += len(chunk)
                await response.aclose()
            finally:
                await client.aclose()
            return received

    assert asyncio.run(scenario()) == total


def test_closing_an_unread_answer_closes_the_connection() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await server.read_request(reader)  # EOF once the proxy closes: counted in server.closed

    async def scenario() -> None:
        async with serving(handler) as server:
            client = transport()
            try:
                response = await client.send("GET", server.url, [], b"", close_connection=False)
                assert await anext(response.aiter_raw()) == b"first"
                await response.aclose()
                await poll(lambda: server.closed == 1)
                assert client.pool(server.url).idle == []
            finally:
                await client.aclose()

    asyncio.run(scenario())


def test_a_cancelled_send_closes_its_connection() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        await server.read_request(reader)  # never answers; EOF when the proxy gives up

    async def scenario() -> None:
        async with serving(handler) as server:
            upstream = Upstream(server.url, first_byte_timeout_s=0.2)
            try:
                with pytest.raises(Exception) as caught:
                    await upstream.open("POST", "/", body=b"{}")
                await poll(lambda: server.closed == 1)
            finally:
                await upstream.aclose()
            assert type(caught.value).__name__ == "UpstreamTimeout"

    asyncio.run(scenario())


# --- TLS and the real backend -----------------------------------------------------------------


def test_an_https_backend(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    serverctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serverctx.load_cert_chain(cert, key)

    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await server.read_request(reader) is not None:
            writer.write(OK)

    async def scenario() -> None:
        async with serving(handler, serverctx) as server:
            client = transport()
            try:
                with pytest.raises(TransportError) as caught:  # not trusted by the system's store
                    await read_all(client, server.url)
                assert caught.value.kind == "connect" and isinstance(caught.value.cause, ssl.SSLError)
                client.pool(server.url).ssl.load_verify_locations(cert)  # type: ignore[union-attr]
                assert await read_all(client, server.url) == (200, b"ok")
                assert await read_all(client, server.url) == (200, b"ok")
            finally:
                await client.aclose()
            assert server.connections == 1  # one kept alive (the refused handshake never got to the server's handler)

    asyncio.run(scenario())


def test_streams_from_llama_cpp_relay_whole_and_the_next_goes_out_on_the_spare(llama_server: Any) -> None:
    body = b'{"messages":[{"role":"user","content":"Say hi"}],"max_tokens":4,"stream":true,"ignore_eos":true,"temperature":0}'

    async def scenario() -> None:
        upstream = Upstream(llama_server.base_url)
        pool = upstream._transport.pool(upstream.base_url)  # type: ignore[attr-defined]
        try:
            answers = []
            for _ in range(2):
                response = await upstream.open(
                    "POST", "/v1/chat/completions", headers=[("Content-Type", "application/json")], body=body,
                    close_connection=True,
                )  # fmt: skip
                answers.append(b"".join([c async for c in upstream.iter_body(response)]))
                await response.aclose()
                await poll(lambda: pool.spare is not None)
            first_spare = pool.spare
            response = await upstream.open("GET", "/health")
            assert b"ok" in b"".join([c async for c in upstream.iter_body(response)])
            await response.aclose()
            assert response.status_code == 200 and pool.spare is None  # taken: nothing was pooled
            assert first_spare is not None and first_spare in pool.idle  # and pooled after /health
        finally:
            await upstream.aclose()
        for answer in answers:
            events = [line for line in answer.split(b"\n") if line.startswith(b"data: ")]
            # the whole stream: its last chunk says why it ended (4 tokens: "length"), then [DONE]
            assert events[-1] == b"data: [DONE]" and b'"finish_reason":"length"' in events[-2]

    asyncio.run(scenario())
