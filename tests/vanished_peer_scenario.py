"""A peer whose host vanishes: every packet lost, no FIN, no reset (a laptop asleep, a machine
powered off). Run in a network namespace of its own by tests/test_vanished_client.py; real proxies
side by side, one with keepalive on the vanishing side (1 s) and one with it off.

    unshare -rn python tests/vanished_peer_scenario.py waiting   # clients of waiting requests
    unshare -rn python tests/vanished_peer_scenario.py client    # a client mid-stream
    unshare -rn python tests/vanished_peer_scenario.py backend   # a backend mid-stream

waiting: one slot each, a backend that never answers, a holder request and a waiting one; the
loopback goes down for a while, then up. A third proxy keeps its waiting connection live (not
parked). Prints each proxy's waiting requests and queued disconnects.

client, backend: the vanishing side lives in a second namespace, joined by a veth pair that goes
down after the streams started; the backend sends a token every 20 ms until its connection closes.
Prints each proxy's streaming disconnects and whether its backend's stream was closed (client),
or whether the client's stream ended and with an error event (backend).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"Write a long story."}]}'
REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
    len(BODY), BODY,
)  # fmt: skip
WAITING_DOWN_S = 8.0  # loopback down: keepalive 1 s finds an idle client gone after ~5 s
STREAM_DOWN_S = 6.0  # veth down: a 1 s keepalive (2 s user timeout) finds the peer gone well within it
# Runs in the client's namespace (client mode): opens both streams, reads their start, then holds them.
CLIENT = f"""
import socket, sys, time
held = []
for port in sys.argv[1:]:
    s = socket.create_connection(("10.9.0.1", int(port)))
    s.sendall({REQUEST!r})
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(65536)
    held.append(s)
print("streaming", flush=True)
time.sleep(120)
"""
# A backend that streams a token every 20 ms to each POST until its connection closes (a health
# check, any other request, gets 200 and a close). Runs in either namespace.
BACKEND = """
import socket, sys, threading, time
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\\n\\n'
def answer(conn):
    if not conn.recv(65536).startswith(b"POST"):
        conn.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\nconnection: close\\r\\n\\r\\nok")
        conn.close()
        return
    conn.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-type: text/event-stream\\r\\ntransfer-encoding: chunked\\r\\n\\r\\n")
    try:
        while True:
            conn.sendall(b"%x\\r\\n%b\\r\\n" % (len(CHUNK), CHUNK))
            time.sleep(0.02)
    except OSError:
        print("closed", conn.getsockname()[1], flush=True)
def serve(server):
    while True:
        conn, _ = server.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()
servers = [socket.create_server((sys.argv[1], 0)) for _ in range(2)]
for server in servers:
    threading.Thread(target=serve, args=(server,), daemon=True).start()
print(" ".join(str(s.getsockname()[1]) for s in servers), flush=True)
time.sleep(300)
"""


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


def metric(base: str, name: str, label: str = "") -> float:
    """The sum of a metric's series (with ``label`` in their labels)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and label in line
    )


def start_proxy(upstream: str, settings: dict[str, str], procs: list[subprocess.Popen[str]]) -> tuple[str, int]:
    """A real `clairvoyant serve` on every address, one slot, the encoder off, ``settings`` as
    environment variables; its base URL (on the loopback) and port, once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {
        **os.environ, "PYTHONPATH": str(ROOT / "src"), "CLAIRVOYANT_ENCODER": "false",
        "CLAIRVOYANT_LOG_LEVEL": "warning", "CLAIRVOYANT_SHUTDOWN_GRACE_S": "0", **settings,
    }  # fmt: skip
    argv = [sys.executable, "-m", "clairvoyant.cli", "serve", "--host", "0.0.0.0", "--port", str(port),
            "--upstream", upstream, "--slots", "1"]  # fmt: skip
    procs.append(subprocess.Popen(argv, env=env, text=True))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return base, port
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} did not start")
        time.sleep(0.2)


def first_line(proc: subprocess.Popen[str], what: str) -> str:
    """The process's first line of output, or an error after 30 s."""
    timer = threading.Timer(30, proc.kill)
    timer.start()
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    timer.cancel()
    if not line:
        raise RuntimeError(f"{what} said nothing")
    return line


def silent_backend() -> int:
    """A backend that accepts and reads, and never answers: its port."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            held.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    return int(server.getsockname()[1])


def waiting(procs: list[subprocess.Popen[str]]) -> dict[str, dict[str, object]]:
    proxies = {}
    clients = []
    # "live": the waiting connection is not parked (as where parking is unavailable): the same
    for name, keepalive_s, park in (("keepalive", "1", "true"), ("off", "0", "true"), ("live", "1", "false")):
        base, port = start_proxy(f"http://127.0.0.1:{silent_backend()}", {
            "CLAIRVOYANT_CLIENT_KEEPALIVE_S": keepalive_s, "CLAIRVOYANT_PARK_WAITING": park,
            "CLAIRVOYANT_DISCONNECT_MODE": "drain",  # the holder's slot stays held when its client goes
        }, procs)  # fmt: skip
        proxies[name] = base
        for expected in (0, 1):  # the holder takes the slot; the second waits
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(REQUEST)
            clients.append(client)
            deadline = time.monotonic() + 10
            while metric(base, "clairvoyant_queue_depth") != expected:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{base}: waiting requests never reached {expected}")
                time.sleep(0.1)
    sh("ip", "link", "set", "lo", "down")
    time.sleep(WAITING_DOWN_S)
    sh("ip", "link", "set", "lo", "up")
    time.sleep(0.5)
    return {
        name: {
            "waiting": metric(base, "clairvoyant_queue_depth"),
            "queued_disconnects": metric(base, "clairvoyant_client_disconnects_total", 'stage="queued"'),
        }
        for name, base in proxies.items()
    }


def read_stream(sock: socket.socket, seen: dict[str, object]) -> None:
    """Read a streamed answer to its end (or until the socket times out): whether it ended, and how."""
    got = b""
    try:
        while not got.endswith(b"0\r\n\r\n"):
            data = sock.recv(65536)
            if not data:
                break
            got += data
    except OSError:
        pass
    seen["ended"] = got.endswith(b"0\r\n\r\n")
    seen["error_event"] = b'"error"' in got[-2000:]


def streams(mode: str, procs: list[subprocess.Popen[str]]) -> dict[str, dict[str, object]]:
    holder = subprocess.Popen(["unshare", "-n", "sleep", "300"], text=True)  # holds the far side's namespace
    procs.append(holder)
    time.sleep(0.3)
    sh("ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    sh("ip", "link", "set", "v1", "netns", str(holder.pid))
    sh("ip", "addr", "add", "10.9.0.1/24", "dev", "v0")
    sh("ip", "link", "set", "v0", "up")
    far = ["nsenter", "-t", str(holder.pid), "-n"]
    sh(*far, "ip", "addr", "add", "10.9.0.2/24", "dev", "v1")
    sh(*far, "ip", "link", "set", "v1", "up")
    sh(*far, "ip", "link", "set", "lo", "up")
    setting = "CLAIRVOYANT_CLIENT_KEEPALIVE_S" if mode == "client" else "CLAIRVOYANT_BACKEND_KEEPALIVE_S"
    backend_host = "127.0.0.1" if mode == "client" else "10.9.0.2"
    backend_argv = [sys.executable, "-c", BACKEND, backend_host]
    backend = subprocess.Popen(backend_argv if mode == "client" else [*far, *backend_argv], stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    procs.append(backend)
    backend_ports = first_line(backend, "the backend").split()
    proxies = {}
    for (name, keepalive_s), backend_port in zip((("keepalive", "1"), ("off", "0")), backend_ports, strict=True):
        base, port = start_proxy(f"http://{backend_host}:{backend_port}", {setting: keepalive_s}, procs)
        proxies[name] = (base, port, backend_port)
    readers: dict[str, tuple[threading.Thread, dict[str, object]]] = {}
    if mode == "client":
        client = subprocess.Popen([*far, sys.executable, "-c", CLIENT, *(str(p) for _, p, _ in proxies.values())],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        procs.append(client)
        if first_line(client, "the client") != "streaming":
            raise RuntimeError("the client did not get its streams")
    else:
        for name, (_, port, _) in proxies.items():
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(REQUEST)
            got = b""
            while got.count(b"data: ") < 3:
                got += sock.recv(65536)
            sock.settimeout(STREAM_DOWN_S)
            seen: dict[str, object] = {}
            readers[name] = (threading.Thread(target=read_stream, args=(sock, seen), daemon=True), seen)
    sh("ip", "link", "set", "v0", "down")
    for thread, _ in readers.values():
        thread.start()
    time.sleep(STREAM_DOWN_S)
    for thread, _ in readers.values():
        thread.join(STREAM_DOWN_S)
    closed_ports = set()
    if mode == "client":
        backend.kill()
        assert backend.stdout is not None
        closed_ports = {line.split()[1] for line in backend.stdout.read().splitlines() if line.startswith("closed")}
    result: dict[str, dict[str, object]] = {}
    for name, (base, _, backend_port) in proxies.items():
        disconnects = metric(base, "clairvoyant_client_disconnects_total", 'stage="streaming"')
        if mode == "client":
            result[name] = {"streaming_disconnects": disconnects, "backend_stream_closed": backend_port in closed_ports}
        else:
            result[name] = {"streaming_disconnects": disconnects, **readers[name][1]}
    return result


def main(mode: str) -> None:
    sh("ip", "link", "set", "lo", "up")
    procs: list[subprocess.Popen[str]] = []
    try:
        print(json.dumps(waiting(procs) if mode == "waiting" else streams(mode, procs)))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main(sys.argv[1])
