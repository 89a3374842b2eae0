"""TCP keepalive and a user timeout on a backend connection's socket (``backend_keepalive_s``,
proxy/aiohttp_transport.py): a backend whose host vanished without a FIN or a reset is found in
minutes, not hours.
"""

from __future__ import annotations

import socket
from typing import Any

__all__ = ["tcp_keepalive"]


def tcp_keepalive(sock: Any, idle_s: float) -> None:
    """Find a peer whose host vanished without a FIN or a reset (a laptop asleep, a machine
    powered off, a network gone) in about 2 x ``idle_s``, where the system takes hours (keepalive)
    or ~15 minutes (unacknowledged bytes). Idle: TCP keepalive probes after ``idle_s`` of silence,
    4 of them ``idle_s`` / 4 apart (whole seconds, at least 1). Bytes in flight: TCP_USER_TIMEOUT,
    at most 2 x ``idle_s`` unacknowledged. The socket then errors out (ETIMEDOUT) and its owner
    sees the connection lost.

    A peer that is there answers probes and acknowledges bytes: not affected, however long it takes
    to generate."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # ``sock``: a transport's "socket" (None, or a Unix one: nothing to set)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux (macOS has TCP_KEEPALIVE for the idle time only)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(idle_s)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(idle_s / 4)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; milliseconds
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(2000 * idle_s)))
    except OSError:  # a socket that refuses them still serves; the system's default applies
        pass
