"""A serial backend that switches models: a small front before a real llama.cpp server that makes it
pay a load, as Ollama or llama-swap does, whenever a request names another model than the last one.

llama.cpp serves one model and answers any model name with it, so on its own it never pays a load.
``SwitchingFront`` forwards every request to it; a POST whose JSON body names a ``model`` (a
generation) goes one at a time, and when its model is not the one the front holds, the front first
sleeps ``switch_s`` seconds (the load), then forwards. Everything else (``/health``, ``/props``,
``/slots``, ``/metrics``, ``/v1/models``) passes straight through. Answers are relayed chunk by
chunk as llama.cpp sends them, never buffered: a streamed answer's first byte comes ``switch_s``
late after a switch, which is how a proxy learns the load of a backend that does not report it.
Only the load is emulated; the generation is llama.cpp's.

    with SwitchingFront(llama.base_url, switch_s=3.0) as front:
        ... point the proxy at front.base_url ...
        front.switches            # model changes served so far (the first load is not one)
        front.served              # one ``Served`` per generation, in the order served

An aiohttp server in a thread of its own (its own event loop), so it outlives the proxies and the
clients that come and go in front of it. Times are ``time.monotonic()`` seconds: the proxy's clock
in the same process.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from types import TracebackType

import aiohttp
from aiohttp import web

__all__ = ["Served", "SwitchingFront"]

# Hop-by-hop headers and the framing ones: aiohttp frames what it relays itself.
_DROPPED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclass(slots=True)
class Served:
    """One generation as the front served it (monotonic seconds)."""

    model: str
    request_id: str  # its X-Request-Id (a proxy sends its own id on), "" if none
    received_s: float  # the request reached the front
    started_s: float = 0.0  # its turn came (the previous generation had ended)
    switched: bool = False  # it found another model held: it paid ``switch_s`` first
    cold: bool = False  # it found nothing held (the front's first generation): a load, not a switch
    load_s: float = 0.0  # seconds the front slept before forwarding it
    first_byte_s: float | None = None  # llama.cpp's first body bytes reached the front
    ended_s: float | None = None  # the answer's last bytes were relayed (or the relay broke)
    status: int | None = None


def model_of(body: bytes) -> str | None:
    """The ``model`` a JSON request body names, or None (not JSON, not an object, no string model)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


class SwitchingFront:
    """The front (see the module). ``switch_s``: seconds a switch costs."""

    def __init__(self, backend_url: str, *, switch_s: float = 3.0, host: str = "127.0.0.1") -> None:
        if switch_s < 0:
            raise ValueError("switch_s must be >= 0")
        self.backend_url = backend_url.rstrip("/")
        self.switch_s = switch_s
        self.host = host
        self.port = 0
        self.holds: str | None = None  # the model loaded now (the last one served)
        self.served: list[Served] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def switches(self) -> int:
        """Generations that found another model held (each paid ``switch_s``)."""
        return sum(1 for s in self.served if s.switched)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> SwitchingFront:
        """Serve on a free port; returns once it listens. Raises RuntimeError if it cannot."""
        self._thread = threading.Thread(target=self._run, name="switching-front", daemon=True)
        self._thread.start()
        if not self._ready.wait(15) or self._error is not None:
            raise RuntimeError(f"the switching front did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=15)

    def __enter__(self) -> SwitchingFront:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start(), or lost at exit
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._turn = asyncio.Lock()  # one generation at a time, as a serial backend runs them
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        # A connection per request: llama.cpp closes idle kept-alive ones, and a request sent on
        # one it has just closed would fail (loopback connections cost nothing).
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=connector) as session:
            self._session = session
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            try:
                site = web.TCPSite(runner, self.host, 0)
                await site.start()
                self.port = runner.addresses[0][1]
                self._ready.set()
                await self._stop.wait()
            finally:
                await runner.cleanup()

    # -- requests --------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        model = model_of(body) if request.method == "POST" else None
        if model is None:
            return await self._relay(request, body, None)
        served = Served(model, request.headers.get("X-Request-Id", ""), received_s=time.monotonic())
        async with self._turn:
            served.started_s = time.monotonic()
            if model != self.holds:
                served.cold, served.switched = self.holds is None, self.holds is not None
                self.holds = model
                await asyncio.sleep(self.switch_s)  # the load: nothing is sent to llama.cpp meanwhile
                served.load_s = time.monotonic() - served.started_s
            self.served.append(served)
            try:
                return await self._relay(request, body, served)
            finally:
                served.ended_s = time.monotonic()

    async def _relay(self, request: web.Request, body: bytes, served: Served | None) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        async with self._session.request(
            request.method, self.backend_url + request.path_qs, data=body, headers=headers
        ) as upstream:
            if served is not None:
                served.status = upstream.status
            out = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED},
            )
            await out.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    if served is not None and served.first_byte_s is None:
                        served.first_byte_s = time.monotonic()
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:
                pass  # the proxy left: leaving the block closes the upstream answer
            return out
