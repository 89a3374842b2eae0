"""A client whose host vanishes while its request waits (run in a network namespace of its own:
tests/test_vanished_client.py). Three proxies side by side, one slot each, a backend that never
answers: each gets a holder request and a waiting one; then the loopback goes down for a while (no
FIN, no reset: every packet is lost, as for a laptop that went to sleep), and comes back. Prints
each proxy's waiting requests and queued disconnects as JSON.

    unshare -rn python tests/vanished_client_scenario.py
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
DOWN_S = 8.0  # loopback down: keepalive 1 s finds the client gone after ~5 s
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say OK."}]}).encode()
REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
    len(BODY), BODY,
)  # fmt: skip


def silent_backend() -> int:
    """A backend that accepts and reads, and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            held.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    return int(server.getsockname()[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(base: str, name: str, label: str = "") -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and label in line
    )


def main() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    proxies = {}
    # "live": the waiting connection is not parked (as where parking is unavailable): the same
    for name, keepalive_s, park in (("keepalive", "1", "true"), ("off", "0", "true"), ("live", "1", "false")):
        port = free_port()
        env = {
            **os.environ, "PYTHONPATH": str(ROOT / "src"), "CLAIRVOYANT_CLIENT_KEEPALIVE_S": keepalive_s,
            "CLAIRVOYANT_ENCODER": "false", "CLAIRVOYANT_DISCONNECT_MODE": "drain", "CLAIRVOYANT_LOG_LEVEL": "warning",
            "CLAIRVOYANT_SHUTDOWN_GRACE_S": "0", "CLAIRVOYANT_PARK_WAITING": park,
        }  # fmt: skip
        argv = [sys.executable, "-m", "clairvoyant.cli", "serve", "--upstream", f"http://127.0.0.1:{silent_backend()}",
                "--port", str(port), "--slots", "1"]  # fmt: skip
        proxies[name] = (subprocess.Popen(argv, env=env), f"http://127.0.0.1:{port}", port)
    clients = []
    try:
        for _, base, port in proxies.values():
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
            for expected in (0, 1):  # the holder takes the slot; the second waits
                client = socket.create_connection(("127.0.0.1", port))
                client.sendall(REQUEST)
                clients.append(client)
                deadline = time.monotonic() + 10
                while metric(base, "clairvoyant_queue_depth") != expected:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{base}: waiting requests never reached {expected}")
                    time.sleep(0.1)
        subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
        time.sleep(DOWN_S)
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        time.sleep(0.5)
        result = {
            name: {
                "waiting": metric(base, "clairvoyant_queue_depth"),
                "queued_disconnects": metric(base, "clairvoyant_client_disconnects_total", 'stage="queued"'),
            }
            for name, (_, base, _) in proxies.items()
        }
        print(json.dumps(result))
    finally:
        for proc, _, _ in proxies.values():
            proc.terminate()
        for proc, _, _ in proxies.values():
            proc.wait(30)


if __name__ == "__main__":
    main()
