"""Parked client connections: a waiting request's socket held as a bare file descriptor.

Why: the proxy must hold 10,000 waiting requests at under 1 KB each besides their bodies, and a
live transport + protocol + HTTP parser per waiting connection costs about 2 KB by itself
(benchmarks/bench_http_floor.py, ``--park``). A parked connection costs one int and one dict entry
in user space (measured: tests/test_parking.py, ``test_bytes_per_parked_connection``).

How:

- **park**: the socket's fd is ``os.dup``-ed and the transport aborted. Closing one of two fds of a
  socket neither ends nor resets the TCP connection; the dup is now its only fd.
- **watching**: one ``select.epoll`` for every parked fd, its own fd registered once with the event
  loop (``loop.add_reader``). A parked fd is watched for ``EPOLLRDHUP`` only; ``EPOLLHUP`` and
  ``EPOLLERR`` are always reported. Any event means the client left: FIN (``EPOLLRDHUP``), reset or
  error (``EPOLLERR | EPOLLHUP``). The lot closes the fd, then calls ``on_left(owner)``, once.
- **resume**: the fd gets a new transport (``loop.connect_accepted_socket``).

The contracts the callers rely on:

- **FIN means left.** An HTTP client does not half-close while it waits for an answer, and the
  server treats EOF as the client leaving; so a FIN while parked is reported (``on_left``) even
  when bytes came before it.
- **Bytes sent while parked stay in the kernel.** The lot never reads a parked socket (it does not
  watch ``EPOLLIN``): a pipelined next request waits in the socket's receive buffer and the resumed
  transport reads it first, in order, with whatever follows. No bytes are held in user space, none
  can be reordered around ``connection_made``, and TCP flow control bounds what a client can send
  meanwhile (the receive buffer; its send then blocks).
- **Who owns the fd.** From ``park`` until ``resume``, ``refuse``, ``discard``, ``close`` or the
  client's leaving, the lot. ``resume`` hands it to the new transport: both loops take the socket
  object over without a dup (asyncio closes it in ``connection_lost``; uvloop's libuv closes the fd
  and ``detach()``-es the socket object, so it is never closed twice). A handle no longer parked is
  never touched again, whatever now has its number: ``resume`` raises and the others do nothing.
- **Old registrations.** Both loops remove an aborted transport's fd from their own epoll before
  they close it (asyncio: ``_remove_reader`` in ``abort``; libuv: ``EPOLL_CTL_DEL`` in
  ``uv_close``), which matters because an epoll registration lives as long as the open file
  description, that is as long as the dup: the tests check the loop's epoll holds no parked fd.

Linux only: where ``select.epoll`` does not exist (macOS), ``enabled`` is False, ``park`` returns
None and callers keep their connections live.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["ParkingLot"]

logger = logging.getLogger(__name__)

OwnerT = TypeVar("OwnerT")
ProtocolT = TypeVar("ProtocolT", bound=asyncio.Protocol)

# The peer's FIN; EPOLLERR | EPOLLHUP (reset, error) are always reported. Never EPOLLIN: see above.
# (getattr: the name exists on Linux only, where the lot is enabled; 0x2000 is its Linux value.)
_WATCH: int = getattr(select, "EPOLLRDHUP", 0x2000)
_PARKABLE_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)  # what connect_accepted_socket takes
_FREE = object()  # an fd's place in the owners list when it is not parked
_DRAIN_BYTES = 64 * 1024  # bytes read and dropped before a refused fd is closed (see refuse)


class ParkingLot(Generic[OwnerT]):
    """Waiting client connections held as bare file descriptors, watched for the client leaving.

    Per parked connection the lot keeps its owner at the fd's index in one list (the fd is the
    handle; fds are small dense ints, and a list slot is 8 bytes where a dict entry is ~46);
    nothing else, and no per-connection callback or object. Every method runs on the loop's thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_left: Callable[[OwnerT], None]) -> None:
        """``on_left(owner)`` is called once, from the loop, when the client of a parked connection
        closed it (FIN), reset it or it failed; the lot has closed the fd by then, and the handle
        is no longer parked. An exception from it is logged, never raised into the loop.

        Raises OSError when the epoll cannot be created (out of file descriptors).
        """
        self._loop = loop
        self._on_left = on_left
        self._owners: list[Any] = []  # at a parked fd's index: the caller's owner (else _FREE)
        self._parked = 0  # fds parked now
        # fds released while _on_ready runs: a later event of the same batch naming one of them is
        # stale (its number may already belong to a connection parked by a callback).
        self._batch: set[int] | None = None
        self._closed = False
        epoll_type = getattr(select, "epoll", None)
        self._epoll: select.epoll | None = None if epoll_type is None else epoll_type()
        if self._epoll is not None:
            loop.add_reader(self._epoll.fileno(), self._on_ready)

    @property
    def enabled(self) -> bool:
        """Whether ``park`` can park at all: False where ``select.epoll`` does not exist (macOS,
        Windows) and after ``close``. Callers then keep their connections live."""
        return self._epoll is not None and not self._closed

    def __len__(self) -> int:
        """Connections parked now."""
        return self._parked

    def park(self, transport: asyncio.Transport, owner: OwnerT) -> int | None:
        """Detach the connection from ``transport``: dup its socket's fd, abort the transport, watch
        the dup. Returns the handle (the dup'ed fd), or None when it cannot park: the lot is
        disabled or closed, the transport has no stream socket (or one of another family), is TLS,
        is closing, has unsent bytes (``abort`` would drop them) or no fd is left to dup. On None
        nothing was changed and the caller keeps the transport live.

        The caller guarantees that its protocol holds no unparsed bytes and is done with the
        transport. The aborted transport still calls the protocol's ``connection_lost(None)``,
        soon after (never within ``park``): the protocol must know that it parked and not take
        that for the client leaving.
        """
        epoll = self._epoll
        if epoll is None or self._closed or transport.is_closing():
            return None
        if transport.get_extra_info("sslcontext") is not None or transport.get_write_buffer_size():
            return None  # a TLS session's state lives in the transport; unsent bytes die in abort()
        sock = transport.get_extra_info("socket")
        if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in _PARKABLE_FAMILIES:
            return None
        try:
            fd = os.dup(sock.fileno())
        except OSError as exc:  # EMFILE: keep the connection live rather than fail the request
            logger.warning("cannot park a connection: dup failed (%s)", exc)
            return None
        try:
            epoll.register(fd, _WATCH)
        except OSError as exc:
            os.close(fd)
            logger.warning("cannot park a connection: epoll register failed (%s)", exc)
            return None
        owners = self._owners
        if fd >= len(owners):
            owners.extend([_FREE] * (fd + 1 - len(owners)))
        owners[fd] = owner
        self._parked += 1
        transport.abort()  # closes the transport's own fd (after removing it from the loop's epoll)
        return fd

    async def resume(self, fd: int, protocol_factory: Callable[[], ProtocolT]) -> tuple[asyncio.Transport, ProtocolT]:
        """Stop watching ``fd`` and give its connection a new transport and protocol
        (``loop.connect_accepted_socket``). Bytes the client sent while parked are still in the
        kernel: the new transport reads them right after ``connection_made``, in order.

        The fd stops being watched in the coroutine's first step (before its first ``await``), so
        ``on_left`` is never called for it once ``resume`` has started; a coroutine cancelled
        before it started leaves the fd parked. From then on the fd is the new transport's, or
        closed when this fails or is cancelled (never closed twice). Raises ConnectionError when
        ``fd`` is not parked (the client left, or it was resumed, refused or discarded); OSError
        or the protocol factory's exception when the loop cannot take the connection.
        """
        if not self._is_parked(fd):
            raise ConnectionError(f"fd {fd} is not parked (its client left, or it was released)")
        self._release(fd)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            raise
        try:
            return await self._loop.connect_accepted_socket(protocol_factory, sock)
        except BaseException:
            # The transport closed the fd on failure (uvloop: and detached the socket object); if
            # it failed before taking the socket, the fd is still the socket object's: close it.
            # asyncio's transport closes its socket object later, a no-op once detached.
            if sock.fileno() != -1:
                os.close(sock.detach())
            raise

    def refuse(self, fd: int, data: bytes) -> None:
        """Stop watching ``fd``, write ``data`` (a small complete HTTP answer) without blocking,
        then end the connection with a FIN. Best effort: what the socket buffer does not take at
        once is dropped (a truncated answer, then the FIN), and errors (the client left meanwhile)
        are ignored. No ``on_left``.

        Before closing, bytes the client already sent (a pipelined request) are read and dropped:
        closing a socket with unread bytes sends a reset, which can destroy the answer at the
        client before it is read. Does nothing when ``fd`` is not parked.
        """
        if not self._is_parked(fd):
            return
        self._release(fd)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            return
        with sock:
            try:
                sock.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                # The FIN right behind the answer: a reset from bytes that arrive after the drain
                # then reaches a client that already has the whole answer and its end.
                sock.shutdown(socket.SHUT_WR)
                drained = 0
                while drained < _DRAIN_BYTES:
                    chunk = sock.recv(_DRAIN_BYTES, socket.MSG_DONTWAIT)
                    if not chunk:
                        break
                    drained += len(chunk)
            except OSError:  # BlockingIOError ends the drain; anything else: the client is gone
                pass

    def discard(self, fd: int) -> None:
        """Stop watching ``fd`` and close it (no answer, no ``on_left``). Does nothing when ``fd``
        is not parked."""
        if self._is_parked(fd):
            self._release(fd)
            os.close(fd)

    def close(self) -> None:
        """Close every parked fd (no ``on_left``) and the epoll; ``park`` returns None afterwards.
        Idempotent; safe after the loop is closed."""
        if self._closed:
            return
        self._closed = True
        epoll = self._epoll
        if epoll is not None:
            self._loop.remove_reader(epoll.fileno())  # False, not an error, on a closed loop
            epoll.close()  # drops every registration at once: no EPOLL_CTL_DEL per fd
        parked = [fd for fd, owner in enumerate(self._owners) if owner is not _FREE]
        if self._batch is not None:
            self._batch.update(parked)
        for fd in parked:
            os.close(fd)
        self._owners = []
        self._parked = 0

    def _is_parked(self, fd: int) -> bool:
        owners = self._owners
        return 0 <= fd < len(owners) and owners[fd] is not _FREE

    def _release(self, fd: int) -> None:
        """Forget a parked ``fd`` and stop watching it; the caller then closes or hands it over."""
        self._owners[fd] = _FREE
        self._parked -= 1
        if self._batch is not None:
            self._batch.add(fd)
        assert self._epoll is not None  # an fd is only ever parked with an epoll
        try:
            self._epoll.unregister(fd)
        except OSError:  # cannot happen while the fd is open and registered; do not lose the fd over it
            logger.exception("parking: epoll unregister of fd %d failed", fd)

    def _on_ready(self) -> None:
        """The loop's reader on the epoll: every event is a client that left. Never raises."""
        epoll = self._epoll
        if epoll is None or self._closed:
            return
        try:
            # Level-triggered: events left over (more than a batch) come at the loop's next turn.
            events = epoll.poll(0)
        except OSError:
            logger.exception("parking: epoll poll failed")
            return
        batch: set[int] = set()
        self._batch = batch
        try:
            for fd, _mask in events:
                if fd in batch or not self._is_parked(fd):
                    continue  # released by a callback of this batch (the number may be reused)
                owner = self._owners[fd]
                self._release(fd)
                os.close(fd)
                try:
                    self._on_left(owner)
                except Exception:
                    logger.exception("parking: on_left failed")
        except Exception:
            logger.exception("parking: handling a client that left failed")
        finally:
            self._batch = None
