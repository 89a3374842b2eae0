"""Parked client connections (proxy/parking.py) against real sockets on 127.0.0.1, on both event
loops the proxy may run: asyncio's default loop and uvloop.

A small server parks each connection at its first bytes (``Parker``); the clients are plain
non-blocking sockets driven by the loop. Events are ordered by waiting for observable state (a
queue, a count, bytes queued in the kernel), never by sleeping; "no on_left" is checked behind a
barrier: a later parked client that leaves, whose on_left comes only after every earlier event.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import select
import socket
import ssl
import struct
import subprocess
import termios
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import pytest
import uvloop

from clairvoyant.proxy.parking import ParkingLot

TIMEOUT_S = 10.0
REQUEST = b"GET /1\n"  # the first bytes of a connection: the server parks it when they arrive
LIVE = b"live\n"  # what the server answers when park() returned None (the connection stays live)
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_factory(request: pytest.FixtureRequest) -> LoopFactory:
    return asyncio.new_event_loop if request.param == "asyncio" else uvloop.new_event_loop


def run(loop_factory: LoopFactory, scenario: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        await scenario()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())


# =================================================================================================
# The server, the clients
# =================================================================================================


class Harness:
    """A server whose connections park at their first bytes; the owner is the client's port."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lot: ParkingLot[int] = ParkingLot(loop, self._on_left)
        self.parked: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()  # (owner, handle)
        self.fds: dict[int, int] = {}  # owner -> handle
        self.left: list[int] = []  # owners, in on_left order
        self.left_queue: asyncio.Queue[int] = asyncio.Queue()
        self.fd_open_at_left: list[bool] = []
        self.lost = 0  # connection_lost calls on the parking protocols
        self.port = 0
        self.hook: Callable[[int], None] | None = None  # called by on_left after it recorded the call

    def _on_left(self, owner: int) -> None:
        self.left.append(owner)
        self.fd_open_at_left.append(fd_is_open(self.fds[owner]))
        self.left_queue.put_nowait(owner)
        if self.hook is not None:
            self.hook(owner)

    async def connect(self) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        await self.loop.sock_connect(sock, ("127.0.0.1", self.port))
        return sock

    async def park(self) -> tuple[socket.socket, int, int]:
        """A new client, parked: (its socket, the owner, the handle)."""
        sock = await self.connect()
        await self.loop.sock_sendall(sock, REQUEST)
        owner, fd = await asyncio.wait_for(self.parked.get(), TIMEOUT_S)
        assert owner == sock.getsockname()[1]
        assert fd is not None, "park() returned None"
        return sock, owner, fd

    async def next_left(self) -> int:
        return await asyncio.wait_for(self.left_queue.get(), TIMEOUT_S)

    async def barrier(self) -> None:
        """Park a client and let it leave; once its on_left came, so did every earlier one."""
        sock, owner, _ = await self.park()
        sock.close()
        while (left := await self.next_left()) != owner:
            self.left_queue.put_nowait(left)  # someone else's: keep it for the test (order kept)


class Parker(asyncio.Protocol):
    """Parks its connection at its first bytes; answers ``LIVE`` on it when it cannot park."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        h = self.harness
        owner = self.transport.get_extra_info("peername")[1]
        fd = h.lot.park(self.transport, owner)
        if fd is None:
            self.transport.write(LIVE)
        else:
            h.fds[owner] = fd
        h.parked.put_nowait((owner, fd))

    def connection_lost(self, exc: Exception | None) -> None:
        self.harness.lost += 1


class Resumed(asyncio.Protocol):
    """The protocol a resumed connection gets: keeps what it receives."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.made_before_data = False
        self.transport: asyncio.BaseTransport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.made_before_data = not self.received

    def data_received(self, data: bytes) -> None:
        self.received += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


@asynccontextmanager
async def serving(ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Harness]:
    loop = asyncio.get_running_loop()
    h = Harness(loop)
    server = await loop.create_server(lambda: Parker(h), "127.0.0.1", 0, backlog=4096, ssl=ssl_context)
    h.port = server.sockets[0].getsockname()[1]
    try:
        yield h
    finally:
        server.close()
        h.lot.close()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait until ``condition()`` holds, polling (one loop turn, then a millisecond) up to TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def recv_exactly(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = bytearray()
    while len(data) < n:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, n - len(data)), TIMEOUT_S)
        assert chunk, f"EOF after {len(data)} of {n} bytes"
        data += chunk
    return bytes(data)


async def recv_to_eof(sock: socket.socket) -> bytes:
    """Everything until the peer's FIN (a reset raises ConnectionResetError)."""
    loop = asyncio.get_running_loop()
    data = bytearray()
    while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), TIMEOUT_S):
        data += chunk
    return bytes(data)


def queued_bytes(fd: int) -> int:
    """Bytes in the socket's receive buffer, not yet read (FIONREAD)."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def epoll_targets() -> dict[int, set[int]]:
    """Each epoll instance of this process (by fd) -> the fd numbers registered in it."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                found[int(name)] = {int(line.split()[1]) for line in info if line.startswith("tfd:")}
        except OSError:  # an fd of the listing itself, gone by now
            continue
    return found


def rst_close(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.fixture
def many_fds() -> Iterator[None]:
    """Room for a few thousand sockets (each parked test client is two fds here)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 5000:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 5000")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 10_000)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# =================================================================================================
# Resume
# =================================================================================================


def test_a_resumed_connection_gets_a_new_transport_and_stays_usable(loop_factory: LoopFactory) -> None:
    async def scenario() -> None:
        async with serving() as h:
            sock, owner, fd = await h.park()
            assert len(h.lot) == 1
            assert [fd in targets for targets in epoll_targets().values()].count(True) == 1  # the lot's
            await until(lambda: h.lost == 1, "the aborted transport's connection_lost")  # the contract
            transport, protocol = await h.lot.resume(fd, Resumed)
            assert len(h.lot) == 0
            assert transport.get_extra_info("socket").fileno() == fd  # handed over as it is, no dup
            assert protocol.transport is transport
            transport.write(b"answer 1\n")
            assert await recv_exactly(sock, 9) == b"answer 1\n"
            await h.loop.sock_sendall(sock, b"GET /2\n")  # keep-alive: a second request, same socket
            await until(lambda: bytes(protocol.received) == b"GET /2\n", "the second request")
            assert [fd in targets for targets in epoll_targets().values()].count(True) == 1  # the loop's
            transport.write(b"answer 2\n")
            assert await recv_exactly(sock, 9) == b"answer 2\n"
            transport.close()
            assert await recv_to_eof(sock) == b""
            await until(lambda: protocol.lost, "connection_lost of the resumed protocol")
            sock.close()
            await h.barrier()
            assert h.left == [h.left[-1]]  # the barrier's only: the resumed one never "left"

    run(loop_factory, scenario)


def test_bytes_sent_while_parked_reach_the_resumed_protocol_in_order(loop_factory: LoopFactory) -> None:
    payload = bytes(range(256)) * 1024  # 256 KiB: more than the receive buffer takes while parked

    async def scenario() -> None:
        async with serving() as h:
            sock, owner, fd = await h.park()
            sender = asyncio.ensure_future(h.loop.sock_sendall(sock, payload))
            await until(lambda: queued_bytes(fd) > 0, "bytes queued on the parked socket")
            assert len(h.lot) == 1 and h.left == []  # bytes are not a leaving
            transport, protocol = await h.lot.resume(fd, Resumed)
            await until(lambda: len(protocol.received) == len(payload), "the pipelined bytes")
            await asyncio.wait_for(sender, TIMEOUT_S)
            assert protocol.made_before_data
            assert bytes(protocol.received) == payload
            transport.close()
            sock.close()
            await until(lambda: protocol.lost, "connection_lost")
            await h.barrier()
            assert len(h.left) == 1

    run(loop_factory, scenario)


def test_resume_of_a_handle_that_is_not_parked_raises(loop_factory: LoopFactory) -> None:
    async def scenario() -> None:
        async with serving() as h:
            sock, owner, fd = await h.park()
            h.lot.discard(fd)
            with pytest.raises(ConnectionError):
                await h.lot.resume(fd, Resumed)
            sock.close()

    run(loop_factory, scenario)


def test_a_resume_whose_protocol_factory_fails_closes_the_fd(loop_factory: LoopFactory) -> None:
    def broken() -> Resumed:
        raise RuntimeError("no protocol")

    async def scenario() -> None:
        async with serving() as h:
            sock, owner, fd = await h.park()
            with pytest.raises(RuntimeError, match="no protocol"):
                await h.lot.resume(fd, broken)
            assert not fd_is_open(fd) and len(h.lot) == 0
            assert await recv_to_eof(sock) == b""
            sock.close()

    run(loop_factory, scenario)


def test_a_cancelled_resume_closes_the_connection_once(loop_factory: LoopFactory) -> None:
    async def scenario() -> None:
        async with serving() as h:
            await h.barrier()
            await until(lambda: h.lost == 1, "the barrier's transport")
            before = open_fds()
            sock, owner, fd = await h.park()
            resuming = asyncio.ensure_future(h.lot.resume(fd, Resumed))
            await asyncio.sleep(0)  # one turn: the resume is under way, waiting for the new transport
            assert len(h.lot) == 0
            resuming.cancel()
            with pytest.raises(asyncio.CancelledError):
                await resuming
            assert await recv_to_eof(sock) == b""
            sock.close()
            await until(lambda: h.lost == 2, "the parked transport's connection_lost")
            await h.barrier()  # a new connection and a new park on the loop: nothing closed twice
            assert open_fds() == before

    run(loop_factory, scenario)


# =================================================================================================
# The client leaving while parked
# =================================================================================================


def test_a_client_fin_while_parked_calls_on_left_once_with_the_fd_closed(loop_factory: LoopFactory) -> None:
    async def scenario() -> None:
        async with serving() as h:
            sock, owner, fd = await h.park()
            sock.shutdown(socket.SHUT_WR)  # FIN
            assert await h.next_left() == owner
            assert h.fd_open_at_left == [False]
            assert len(h.lot) == 0
            assert await recv_to_eof(sock) == b""  # and the client sees the lot's close
            sock.close()
            # The number is free again: a new fd may take it, and the lot must leave that one alone.
            spare = socket.socket()
            h.lot.discard(fd)
            h.lot.refuse(fd, b"no")
            with pytest.raises(ConnectionError):
                await h.lot.resume(fd, Resumed)
            assert fd_is_open(spare.fileno())
            spare.close()
            await h.barrier()
            assert h.left.count(owner) == 1 and len(h.left) == 2

    run(loop_factory, scenario)


def test_a_client_reset_while_parked_calls_on_left(loop_factory: LoopFactory) -> None:
    async def scenario() -> None:
        async with serving() as h:
            sock, owner, fd = await h.park()
            rst_close(sock)
            assert await h.next_left() == owner
            assert h.fd_open_at_left == [False]
            assert len(h.lot) == 0

    run(loop_factory, scenario)


def test_bytes_then_fin_while_parked_is_a_leaving(loop_factory: LoopFactory) -> None:
    async def scenario() -> None:
        async with serving() as h:
            sock, owner, fd = await h.park()
            await h.loop.sock_sendall(sock, b"GET /2\n")
            await until(lambda: queued_bytes(fd) == 7, "the bytes queued")
            sock.shutdown(socket.SHUT_WR)
            assert await h.next_left() == owner
            sock.close()

    run(loop_factory, scenario)


def test_a_stale_event_of_a_batch_never_reaches_a_reused_fd_number(loop_factory: LoopFactory) -> None:
    """Two clients leave at once (one epoll batch). The first on_left discards the other's handle
    and parks 20 more connections, so the freed number is taken again before the batch's event for
    it is handled: that event must be dropped, not reported as the new owner leaving."""

    async def scenario() -> None:
        async with serving() as h:
            transports: list[asyncio.Transport] = []
            keeper = await h.loop.create_server(Keeper(transports), "127.0.0.1", 0)
            spares: list[socket.socket] = []
            try:
                for _ in range(20):
                    spares.append(spare := socket.socket())
                    spare.setblocking(False)
                    await h.loop.sock_connect(spare, keeper.sockets[0].getsockname())
                await until(lambda: len(transports) == 20, "the live connections")
                a, b = await h.park(), await h.park()
                handles = {a[1]: a[2], b[1]: b[2]}
                discarded: list[int] = []
                reparked: list[int] = []

                def hook(owner: int) -> None:
                    h.hook = None
                    other = next(o for o in handles if o != owner)
                    discarded.append(handles[other])
                    h.lot.discard(handles[other])
                    for i, transport in enumerate(transports):
                        fd = h.lot.park(transport, 100_000 + i)
                        assert fd is not None
                        reparked.append(fd)

                h.hook = hook
                a[0].close()  # both FINs are in the kernel before the loop polls again
                b[0].close()
                first = await h.next_left()
                await h.barrier()
                assert discarded[0] in reparked  # the scenario happened: the number was taken again
                assert h.left == [first, h.left[-1]] and h.left[-1] < 100_000  # the barrier's, nothing else
                assert len(h.lot) == 20
            finally:
                for spare in spares:
                    spare.close()
                keeper.close()

    run(loop_factory, scenario)


def test_an_exception_from_on_left_is_logged_and_the_lot_goes_on(
    loop_factory: LoopFactory, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with serving() as h:

            def fail(owner: int) -> None:
                raise RuntimeError("on_left failed on purpose")

            h.hook = fail
            for _ in range(2):
                sock, owner, fd = await h.park()
                sock.close()
                assert await h.next_left() == owner
            assert len(h.lot) == 0 and h.fd_open_at_left == [False, False]

    run(loop_factory, scenario)
    assert [r.message for r in caplog.records].count("parking: on_left failed") == 2


# =================================================================================================
# Refuse, discard, close
# =================================================================================================


def test_refuse_delivers_its_answer_then_eof_even_with_unread_bytes(loop_factory: LoopFactory) -> None:
    answer = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"

    async def scenario() -> None:
        async with serving() as h:
            sock, owner, fd = await h.park()
            await h.loop.sock_sendall(sock, b"GET /2\n")  # a pipelined request, unread when refused
            await until(lambda: queued_bytes(fd) == 7, "the bytes queued")
            h.lot.refuse(fd, answer)
            assert len(h.lot) == 0
            assert await recv_to_eof(sock) == answer
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0  # a FIN, and no reset after it
            sock.close()
            await h.barrier()
            assert len(h.left) == 1

    run(loop_factory, scenario)


def test_discard_closes_without_on_left(loop_factory: LoopFactory) -> None:
    async def scenario() -> None:
        async with serving() as h:
            sock, owner, fd = await h.park()
            h.lot.discard(fd)
            assert len(h.lot) == 0 and not fd_is_open(fd)
            assert await recv_to_eof(sock) == b""
            sock.close()
            await h.barrier()
            assert owner not in h.left and len(h.left) == 1

    run(loop_factory, scenario)


def test_close_closes_every_parked_connection_and_parks_no_more(loop_factory: LoopFactory) -> None:
    async def scenario() -> None:
        async with serving() as h:
            parked = [await h.park() for _ in range(3)]
            h.lot.close()
            h.lot.close()  # idempotent
            assert len(h.lot) == 0 and not h.lot.enabled
            assert not any(fd_is_open(fd) for _, _, fd in parked)
            for sock, _, _ in parked:
                assert await recv_to_eof(sock) == b""
                sock.close()
            late = await h.connect()  # parking refused now: the connection stays live
            await h.loop.sock_sendall(late, REQUEST)
            assert await recv_exactly(late, len(LIVE)) == LIVE
            assert (await h.parked.get())[1] is None
            late.close()
            assert h.left == []

    run(loop_factory, scenario)


# =================================================================================================
# When parking is not possible
# =================================================================================================


def test_without_epoll_the_lot_is_disabled_and_connections_stay_live(
    loop_factory: LoopFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(select, "epoll")  # as on macOS

    async def scenario() -> None:
        async with serving() as h:
            assert not h.lot.enabled
            sock = await h.connect()
            await h.loop.sock_sendall(sock, REQUEST)
            assert (await h.parked.get())[1] is None
            assert await recv_exactly(sock, len(LIVE)) == LIVE
            assert len(h.lot) == 0
            sock.close()

    run(loop_factory, scenario)


def test_a_tls_connection_is_not_parked(loop_factory: LoopFactory, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context()
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE

    async def scenario() -> None:
        async with serving(server_ctx) as h:
            reader, writer = await asyncio.open_connection("127.0.0.1", h.port, ssl=client_ctx)
            writer.write(REQUEST)
            assert (await asyncio.wait_for(h.parked.get(), TIMEOUT_S))[1] is None
            assert await asyncio.wait_for(reader.readexactly(len(LIVE)), TIMEOUT_S) == LIVE
            assert len(h.lot) == 0
            writer.close()
            await writer.wait_closed()

    run(loop_factory, scenario)


def test_a_transport_with_unsent_bytes_or_closing_is_not_parked(loop_factory: LoopFactory) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        lot: ParkingLot[int] = ParkingLot(loop, lambda owner: None)
        transports: list[asyncio.Transport] = []
        server = await loop.create_server(Keeper(transports), "127.0.0.1", 0)
        sock = socket.socket()  # never reads: a big write stays in the server transport's buffer
        sock.setblocking(False)
        await loop.sock_connect(sock, server.sockets[0].getsockname())
        await until(lambda: bool(transports), "the connection")
        transport = transports[0]
        transport.write(b"x" * (64 * 1024 * 1024))
        assert transport.get_write_buffer_size() > 0
        assert lot.park(transport, 1) is None
        assert not transport.is_closing() and len(lot) == 0
        transport.close()
        assert lot.park(transport, 2) is None  # closing
        assert len(lot) == 0
        sock.close()
        server.close()
        lot.close()

    run(loop_factory, scenario)


class Keeper:
    """A protocol factory whose protocols only keep their transports."""

    def __init__(self, transports: list[asyncio.Transport]) -> None:
        self.transports = transports

    def __call__(self) -> asyncio.Protocol:
        transports = self.transports

        class Keep(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                transports.append(cast(asyncio.Transport, transport))

        return Keep()


# =================================================================================================
# Resources: fds, the loop's epoll, CPU, memory
# =================================================================================================


def test_no_fd_leak_over_500_park_cycles(loop_factory: LoopFactory) -> None:
    endings = ("resume", "fin", "reset", "refuse", "discard")

    async def scenario() -> None:
        async with serving() as h:
            await h.barrier()  # the lot and the loop at their steady state before counting
            await until(lambda: h.lost == 1, "the barrier's transport")
            before = open_fds()
            resumed: list[Resumed] = []
            for i in range(500):
                ending = endings[i % len(endings)]
                sock, owner, fd = await h.park()
                if ending == "resume":
                    transport, protocol = await h.lot.resume(fd, Resumed)
                    resumed.append(protocol)
                    transport.write(b"ok\n")
                    assert await recv_exactly(sock, 3) == b"ok\n"
                    transport.close()
                    assert await recv_to_eof(sock) == b""
                elif ending == "fin":
                    sock.shutdown(socket.SHUT_WR)
                    assert await h.next_left() == owner
                elif ending == "reset":
                    rst_close(sock)
                    assert await h.next_left() == owner
                    continue
                elif ending == "refuse":
                    h.lot.refuse(fd, b"no\n")
                    assert await recv_to_eof(sock) == b"no\n"
                else:
                    h.lot.discard(fd)
                    assert await recv_to_eof(sock) == b""
                sock.close()
            await until(lambda: h.lost == 501 and all(p.lost for p in resumed), "every connection_lost")
            assert len(h.lot) == 0
            assert len(h.left) == 1 + 200  # the barrier, the 100 FINs and the 100 resets
            assert open_fds() == before

    run(loop_factory, scenario)


def test_parked_fds_leave_the_loops_epoll_and_the_process_idles(loop_factory: LoopFactory, many_fds: None) -> None:
    n = 1000

    async def scenario() -> None:
        async with serving() as h:
            parked = [await h.park() for _ in range(n)]
            for sock, _, _ in parked:  # bytes waiting unread on every parked socket: not an event
                await h.loop.sock_sendall(sock, b"GET /2\n")
            await until(lambda: all(queued_bytes(fd) == 7 for _, _, fd in parked), "bytes queued")
            await until(lambda: h.lost == n, "every aborted transport's connection_lost")
            handles = {fd for _, _, fd in parked}
            epolls = epoll_targets()
            ours = [targets for targets in epolls.values() if targets == handles]
            assert len(ours) == 1, "the lot's epoll watches exactly the parked fds"
            others = [len(t) for t in epolls.values() if t != handles]
            assert others and max(others) < 20, f"the loop's epoll still holds parked sockets: {others}"
            cpu_before = time.process_time()
            await asyncio.sleep(0.5)  # a measurement window: a spinning loop would burn all of it
            cpu = time.process_time() - cpu_before
            assert cpu < 0.1, f"{cpu:.3f} s of CPU in 0.5 s with {n} parked connections"
            assert h.left == [] and len(h.lot) == n
            for sock, _, _ in parked:
                sock.close()
            await until(lambda: len(h.left) == n, "every on_left")

    run(loop_factory, scenario)


def test_bytes_per_parked_connection(loop_factory: LoopFactory, many_fds: None) -> None:
    """What stays in the process per parked connection, by tracemalloc (Python's allocations, the
    loop's included; not the kernel's), the clients' sockets made before the first count. The lot's
    own share is its lines' growth; the rest is the loop's tables grown to the 2,000 transports that
    were live at once before they parked (asyncio: its selector map, its transports map, its set of
    accept tasks; none shrinks), a high-water mark rather than a cost per parked connection."""
    n = 2000

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        parked = 0
        lost = 0
        lot: ParkingLot[None] = ParkingLot(loop, lambda owner: None)

        class Lean(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def data_received(self, data: bytes) -> None:
                nonlocal parked
                assert lot.park(cast(asyncio.Transport, self.transport), None) is not None
                parked += 1

            def connection_lost(self, exc: Exception | None) -> None:
                nonlocal lost
                lost += 1

        server = await loop.create_server(Lean, "127.0.0.1", 0, backlog=4096)
        clients: list[socket.socket] = []
        try:
            for _ in range(n):  # blocking connects: the kernel's backlog holds them until the loop runs
                sock = socket.create_connection(server.sockets[0].getsockname())
                clients.append(sock)
                sock.sendall(REQUEST)
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.take_snapshot()
                base = tracemalloc.get_traced_memory()[0]
                await until(lambda: parked == n and lost == n, "every connection parked")
                gc.collect()
                total = (tracemalloc.get_traced_memory()[0] - base) / n
                stats = tracemalloc.take_snapshot().compare_to(before, "lineno")
            finally:
                tracemalloc.stop()
            ours = sum(s.size_diff for s in stats if s.traceback[0].filename.endswith("parking.py")) / n
            print(f"\n{loop_factory.__module__}: {total:.1f} B per parked connection in all, the lot's own "
                  f"{ours:.1f} B (tracemalloc, {n} parked); largest lines:")  # fmt: skip
            for stat in stats[:5]:
                print(f"  {stat.size_diff / n:8.1f} B  {stat.traceback}")
            assert len(lot) == n
            assert ours < 100, f"the lot keeps {ours:.0f} B per parked connection"
            assert total < 400, f"{total:.0f} B per parked connection"
        finally:
            lot.close()
            server.close()
            for sock in clients:
                sock.close()

    run(loop_factory, scenario)
