"""A fake OpenAI-style backend: plain asyncio HTTP/1.1 in a thread of the calling process, with exact
timing and a record of every request it read. The body's ``model`` chooses its behaviour."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass

__all__ = ["Delivery", "FakeBackend"]


@dataclass
class Delivery:
    tag: str
    model: str
    connection: int  # the backend's connection number
    nth_on_connection: int  # 1 = the connection's first request (a fresh connection)
    at_s: float  # time.monotonic()


class FakeBackend:
    """OpenAI-style backend. ``model`` in the body: "fast" (answer at once), "slow-stream" (SSE,
    ``max_tokens`` events ``delay_s`` apart), "close-after-read" (read the request, close 1 s later
    without answering). Every POST it fully read is a ``Delivery`` (tag = the body's "user").
    ``hung``: it reads every request, health checks included (counted in ``gets``), and never answers."""

    def __init__(self, service_s: float = 0.0, stream_delay_s: float = 0.1, port: int = 0, hung: bool = False) -> None:
        self.service_s = service_s
        self.hung = hung
        self.gets = 0
        self.stream_delay_s = stream_delay_s
        self.deliveries: list[Delivery] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()
        self.port = port

    def start(self) -> FakeBackend:
        self._thread = threading.Thread(target=self._run, name="fake-backend", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._stopped = asyncio.Event()

        async def serve() -> None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, backlog=4096, reuse_address=True
            )
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stopped.wait()
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            await asyncio.wait(others, timeout=2) if others else None
            for writer in list(self._writers):  # connections accepted while it was closing
                writer.transport.abort()
            await asyncio.sleep(0)  # the sockets close in the callbacks abort() scheduled

        loop.run_until_complete(serve())
        loop.close()

    def stop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(10)

    def tags(self, prefix: str) -> Counter[str]:
        return Counter(d.tag for d in list(self.deliveries) if d.tag.startswith(prefix))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        connection, served = self._connections, 0
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                served += 1
                if self.hung:
                    if method == "GET":
                        self.gets += 1
                    else:
                        data = json.loads(body or b"{}")
                        self.deliveries.append(
                            Delivery(
                                str(data.get("user", "")),
                                str(data.get("model", "")),
                                connection,
                                served,
                                time.monotonic(),
                            )
                        )
                    await self._stopped.wait()
                    return
                if method == "GET":
                    await self._send(writer, 200, b'{"status":"ok"}')
                    if headers.get("connection", "").lower() == "close":
                        return
                    continue
                data = json.loads(body or b"{}")
                model = str(data.get("model", "fast"))
                tag = str(data.get("user", ""))
                self.deliveries.append(Delivery(tag, model, connection, served, time.monotonic()))
                if model == "close-after-read":
                    await asyncio.sleep(1.0)
                    return  # finally: a clean close (FIN) with no answer
                if self.service_s:
                    await asyncio.sleep(self.service_s)
                if model == "slow-stream" or data.get("stream"):
                    await self._stream(writer, tag, int(data.get("max_tokens", 4)), model == "slow-stream")
                else:
                    answer = {
                        "id": f"x-{tag}",
                        "object": "chat.completion",
                        "model": model,
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": f"ok {tag}"},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                    }
                    await self._send(writer, 200, json.dumps(answer).encode())
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
        writer.write(
            f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, tag: str, events: int, slow: bool) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        def chunk(payload: str) -> bytes:
            data = f"data: {payload}\n\n".encode()
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        for i in range(events):
            delta = {
                "id": f"x-{tag}",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
            }
            writer.write(chunk(json.dumps(delta)))
            await writer.drain()
            if slow:
                await asyncio.sleep(self.stream_delay_s)
        writer.write(
            chunk(
                json.dumps(
                    {"id": f"x-{tag}", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": events}}
                )
            )
        )
        writer.write(chunk("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
