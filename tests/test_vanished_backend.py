"""A backend whose host vanished mid-stream (no FIN, no reset) is found by TCP keepalive and the
user timeout on backend connections (``backend_keepalive_s``): the client's stream ends with the
dialect's error event. Real proxies and real sockets in network namespaces of their own
(tests/vanished_peer_scenario.py): a veth to the backend's namespace goes down under the streams."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clairvoyant.proxy.aiohttp_transport import tcp_keepalive

SCENARIO = Path(__file__).with_name("vanished_peer_scenario.py")


def _can_make_network_namespaces() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
    return probe.returncode == 0


def _scenario() -> dict[str, dict[str, object]]:
    if not _can_make_network_namespaces():
        pytest.skip("cannot make a network namespace here (unshare -rn, ip)")
    done = subprocess.run(
        ["unshare", "-rn", sys.executable, str(SCENARIO)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux's")
def test_a_stream_from_a_vanished_backend_ends_with_an_error_event_and_hangs_without() -> None:
    result = _scenario()
    # keepalive 1 s on backend connections: the silent backend is found gone, and the client's
    # stream ends with the dialect's error event (its client did not leave: no disconnect)
    assert result["keepalive"] == {"streaming_disconnects": 0.0, "ended": True, "error_event": True}
    # without it nothing ends the stream (read_timeout_s is unset by default)
    assert result["off"] == {"streaming_disconnects": 0.0, "ended": False, "error_event": False}


def test_keepalive_options_are_set_on_a_tcp_socket_and_a_unix_socket_is_left_alone() -> None:
    import socket

    with socket.socket() as tcp:
        tcp_keepalive(tcp, 60)
        assert tcp.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 15
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 120_000  # ms
    a, b = socket.socketpair()
    with a, b:
        tcp_keepalive(a, 60)  # not TCP: nothing to set, nothing raised
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
