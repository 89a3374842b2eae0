"""A client whose host vanishes mid-stream (run in a network namespace of its own:
tests/test_vanished_client.py). The client lives in a second namespace, joined to the proxies'
by a veth pair; two proxies (client keepalive 1 s, and off), each with a backend that streams a
token every 20 ms until its connection closes. The client reads the start of both streams, then
the veth goes down: the client's packets are lost, the backends' keep flowing on the loopback.
Prints, for each proxy, its streaming disconnects and whether its backend's stream was closed.

    unshare -rn python tests/vanished_stream_scenario.py
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
DOWN_S = 6.0  # veth down: a 2 s user timeout finds the client gone well within it
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
CLIENT = """
import socket, sys, time
body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"Write a long story."}]}'
for port in sys.argv[1:]:
    s = socket.create_connection(("10.9.0.1", int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
              b"Content-Length: %d\\r\\n\\r\\n%b" % (len(body), body))
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(65536)
    globals().setdefault("held", []).append(s)
print("streaming", flush=True)
time.sleep(120)
"""


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


class StreamingBackend:
    """Answers one streamed request: a chunk every 20 ms, until the proxy closes the connection."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.server.accept()
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        if not conn.recv(65536).startswith(b"POST"):  # the proxy's health check at start
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            conn.close()
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                conn.sendall(b"%x\r\n%b\r\n" % (len(CHUNK), CHUNK))
                time.sleep(0.02)
        except OSError:
            self.closed.set()


def metric(base: str, name: str, label: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and label in line
    )


def main() -> None:
    sh("ip", "link", "set", "lo", "up")
    # The client's namespace: a process that only holds it, joined by a veth pair.
    holder = subprocess.Popen(["unshare", "-n", "sleep", "300"])
    time.sleep(0.3)
    sh("ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    sh("ip", "link", "set", "v1", "netns", str(holder.pid))
    sh("ip", "addr", "add", "10.9.0.1/24", "dev", "v0")
    sh("ip", "link", "set", "v0", "up")
    enter = ["nsenter", "-t", str(holder.pid), "-n"]
    sh(*enter, "ip", "addr", "add", "10.9.0.2/24", "dev", "v1")
    sh(*enter, "ip", "link", "set", "v1", "up")
    proxies = {}
    client = None
    try:
        for name, keepalive_s in (("keepalive", "1"), ("off", "0")):
            backend = StreamingBackend()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            env = {
                **os.environ, "PYTHONPATH": str(ROOT / "src"), "CLAIRVOYANT_CLIENT_KEEPALIVE_S": keepalive_s,
                "CLAIRVOYANT_ENCODER": "false", "CLAIRVOYANT_LOG_LEVEL": "warning", "CLAIRVOYANT_SHUTDOWN_GRACE_S": "0",
            }  # fmt: skip
            argv = [sys.executable, "-m", "clairvoyant.cli", "serve", "--host", "0.0.0.0", "--port", str(port),
                    "--upstream", f"http://127.0.0.1:{backend.port}", "--slots", "1"]  # fmt: skip
            proxies[name] = (subprocess.Popen(argv, env=env), f"http://127.0.0.1:{port}", port, backend)
        for _, base, _, _ in proxies.values():
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{base} did not start")
                time.sleep(0.2)
        ports = [str(port) for _, _, port, _ in proxies.values()]
        client = subprocess.Popen([*enter, sys.executable, "-c", CLIENT, *ports], stdout=subprocess.PIPE, text=True)
        assert client.stdout is not None
        timer = threading.Timer(30, client.kill)  # a client that never gets its streams ends the run
        timer.start()
        line = client.stdout.readline().strip()
        timer.cancel()
        if line != "streaming":
            raise RuntimeError("the client did not get its streams")
        sh("ip", "link", "set", "v0", "down")
        time.sleep(DOWN_S)
        result = {
            name: {
                "streaming_disconnects": metric(base, "clairvoyant_client_disconnects_total", 'stage="streaming"'),
                "backend_stream_closed": backend.closed.is_set(),
            }
            for name, (_, base, _, backend) in proxies.items()
        }
        print(json.dumps(result))
    finally:
        if client is not None:
            client.kill()
        holder.kill()
        for proc, _, _, _ in proxies.values():
            proc.terminate()
        for proc, _, _, _ in proxies.values():
            proc.wait(30)


if __name__ == "__main__":
    main()
