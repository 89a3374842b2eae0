"""A backend whose host vanishes mid-stream: every packet lost, no FIN, no reset (a machine powered
off, a network gone). Run in a network namespace of its own by tests/test_vanished_backend.py; two
real proxies side by side, one with TCP keepalive on its backend connections (1 s) and one with it
off.

    unshare -rn python tests/vanished_peer_scenario.py

The backend lives in a second namespace, joined by a veth pair that goes down after the streams
started; it sends a token every 20 ms until its connection closes. Prints, per proxy, its streaming
disconnects and whether the client's stream ended, and with an error event.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from polling import wait_until

ROOT = Path(__file__).resolve().parents[1]
BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"Write a long story."}]}'
REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
    len(BODY), BODY,
)  # fmt: skip
STREAM_DOWN_S = 6.0  # veth down: a 1 s keepalive (2 s user timeout) finds the peer gone well within it
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
            time.sleep(0.02)  # the token pace
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
time.sleep(300)  # serves until terminated
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
    wait_until(lambda: answers(base), timeout_s=60, what=f"{base} to start")
    return base, port


def answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


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


def streams(procs: list[subprocess.Popen[str]]) -> dict[str, dict[str, object]]:
    holder = subprocess.Popen(["unshare", "-n", "sleep", "300"], text=True)  # holds the far side's namespace
    procs.append(holder)
    ours = os.readlink("/proc/self/ns/net")
    wait_until(lambda: os.readlink(f"/proc/{holder.pid}/ns/net") != ours, what="the far side's namespace")
    sh("ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    sh("ip", "link", "set", "v1", "netns", str(holder.pid))
    sh("ip", "addr", "add", "10.9.0.1/24", "dev", "v0")
    sh("ip", "link", "set", "v0", "up")
    far = ["nsenter", "-t", str(holder.pid), "-n"]
    sh(*far, "ip", "addr", "add", "10.9.0.2/24", "dev", "v1")
    sh(*far, "ip", "link", "set", "v1", "up")
    sh(*far, "ip", "link", "set", "lo", "up")
    backend = subprocess.Popen([*far, sys.executable, "-c", BACKEND, "10.9.0.2"], stdout=subprocess.PIPE, text=True)
    procs.append(backend)
    backend_ports = first_line(backend, "the backend").split()
    readers: dict[str, tuple[threading.Thread, dict[str, object]]] = {}
    proxies = {}
    for (name, keepalive_s), backend_port in zip((("keepalive", "1"), ("off", "0")), backend_ports, strict=True):
        base, port = start_proxy(
            f"http://10.9.0.2:{backend_port}", {"CLAIRVOYANT_BACKEND_KEEPALIVE_S": keepalive_s}, procs
        )
        proxies[name] = base
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
    for thread, _ in readers.values():  # each ends with its stream, or STREAM_DOWN_S of silence
        thread.join(2 * STREAM_DOWN_S)
    return {
        name: {
            "streaming_disconnects": metric(base, "clairvoyant_client_disconnects_total", 'stage="streaming"'),
            **readers[name][1],
        }
        for name, base in proxies.items()
    }


def main() -> None:
    sh("ip", "link", "set", "lo", "up")
    procs: list[subprocess.Popen[str]] = []
    try:
        print(json.dumps(streams(procs)))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
