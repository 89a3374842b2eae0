"""A TCP relay on loopback that a test can cut and restore: one replica's own path to Redis, so
that it alone is cut off while the others still reach the store. A cut resets the connections
(the other end learns at once), or with ``silently`` drops what they carry from then on, as a
network that loses packets does (the other end learns only from its own timeouts)."""

from __future__ import annotations

import socket
import threading


class TcpRelay:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._silent = threading.Event()  # set: nothing is relayed, nothing is closed
        self._held: list[socket.socket] = []  # connections accepted while silent, never answered
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, *, silently: bool = False) -> None:
        """Close every relayed connection and refuse new ones until ``restore``; ``silently``: keep
        them all open and relay nothing (new ones too) until ``close``."""
        if silently:
            self._silent.set()
            return
        self._open.clear()
        with self._lock:
            pairs, self._pairs = self._pairs, []
            pairs += [(held, held) for held in self._held]
            self._held = []
        for pair in pairs:
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._silent.clear()
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._silent.is_set():
                with self._lock:
                    self._held.append(client)
                continue
            if not self._open.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if not self._open.is_set():  # cut while this one connected: cut() has not seen it
                    client.close()
                    upstream.close()
                    continue
                self._pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self._silent.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.close()
                except OSError:
                    pass
