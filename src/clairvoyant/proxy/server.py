"""The HTTP server: Granian, embedded in this process's event loop (one process, one loop for the
dispatcher, the learner and the requests), serving the proxy's ASGI app. Granian is chosen for two
protections together: a deadline on the request head (``client_timeout_s``, also for an idle
kept-alive connection), and ``100 Continue`` only once the app reads the body, after its checks
(docs/design.md, "Who protects what").

``run``: bind the port (taken: exit 2, before anything says ready), start the app, serve. SIGHUP
reloads the config file's keys and tenants. SIGTERM or SIGINT: the dispatcher refuses every
waiting request (503 ``shutting_down``), answers in flight get ``shutdown_grace_s`` to finish (then
an error event), the server stops and the lifespan closes everything in reverse order.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable

from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.server.embed import Server

from clairvoyant.config import Settings
from clairvoyant.errors import ClairvoyantError
from clairvoyant.proxy.app import ProxyApp
from clairvoyant.scheduling.cluster.shared import StoreUnavailable

__all__ = ["ProxyServer", "StartupFailed", "serve_in_thread"]

logger = logging.getLogger(__name__)

EXIT_CANNOT_BIND = 2  # also: Redis unreachable at start-up (with replicas): the environment, not the settings
EXIT_STARTUP_FAILED = 3
STOP_POLL_S = 0.05  # seconds between checks that the answers in flight have ended, at shutdown


class StartupFailed(Exception):
    """The port could not be bound, or the app's start-up failed; ``exit_code`` says which."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# Granian warns on every start that its embedded mode is experimental; it is used on purpose.
logging.getLogger("_granian").addFilter(lambda record: "Embedded server is experimental" not in record.getMessage())


class ProxyServer:
    def __init__(
        self,
        app: ProxyApp,
        settings: Settings,
        *,
        host: str | None = None,
        port: int | None = None,
        reload_settings: Callable[[], Settings] | None = None,
    ) -> None:
        """``reload_settings``: the settings read again, for SIGHUP."""
        self.app = app
        self.settings = settings
        self.reload_settings = reload_settings
        self.host = settings.host if host is None else host
        self.port = settings.port if port is None else port
        self._server = Server(
            app,
            address=self.host,
            port=self.port,
            interface=Interfaces.ASGI,
            http=HTTPModes.http1,
            websockets=False,
            runtime_threads=1,
            backlog=1024,
            backpressure=settings.max_connections,
            http1_settings=HTTP1Settings(
                header_read_timeout=max(1, round(settings.client_timeout_s * 1000)),  # milliseconds
                keep_alive=True,
                max_buffer_size=settings.max_header_bytes,
            ),
            log_enabled=False,  # its loggers propagate to ours: one format
        )
        self.started = threading.Event()  # set once the port is bound and the app has started
        self.stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    async def serve(self) -> None:
        """Bind, start the app, serve until ``stop``. Raises ``StartupFailed``."""
        self._loop = asyncio.get_running_loop()
        serving = asyncio.create_task(self._server.serve(), name="granian")
        ready = asyncio.create_task(self.app.started.wait(), name="app-started")
        try:
            await asyncio.wait((serving, ready), return_when=asyncio.FIRST_COMPLETED)
            if serving.done():  # it ended before the app started: the port, or the app's start-up
                ready.cancel()
                error = serving.exception()  # retrieved in every case (else asyncio logs it at collection)
                failure = self.app.startup_error  # the app's own start-up, named as it was
                if isinstance(failure, StoreUnavailable):  # the environment, as a port taken is
                    raise StartupFailed(f"cannot reach redis: {failure}", EXIT_CANNOT_BIND)
                if failure is not None:
                    raise StartupFailed(f"the proxy failed to start: {failure}", EXIT_STARTUP_FAILED)
                if error is not None:
                    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]  # not the Rust backtrace
                    raise StartupFailed(f"cannot listen on {self.host}:{self.port}: {reason}", EXIT_CANNOT_BIND)
                raise StartupFailed("the proxy failed to start (see the log above)", EXIT_STARTUP_FAILED)
            self.started.set()
            logger.info("serving on http://%s:%d", self.host, self.port)
            await serving
        finally:
            ready.cancel()
            self.stopped.set()

    async def shutdown(self) -> None:
        """Refuse the queue, give answers in flight the grace period, then stop the server."""
        if self._stopping:
            return
        self._stopping = True
        state = self.app.proxy
        if state is not None:
            grace_s = self.settings.shutdown_grace_s
            state.dispatcher.begin_shutdown(grace_s)
            deadline_s = time.monotonic() + grace_s + 1.0  # the dispatcher ends late answers at grace_s
            while state.dispatcher.in_flight and time.monotonic() < deadline_s:
                await asyncio.sleep(STOP_POLL_S)
        self._server.stop()  # type: ignore[no-untyped-call]

    def reload_keys(self) -> None:
        """SIGHUP: take the config file's keys and tenants again."""
        if self.reload_settings is None:
            logger.warning("SIGHUP: nothing to reload from (no config file)")
            return
        try:
            self.app.reload_keys(self.reload_settings())
        except ClairvoyantError as exc:  # a broken file: the keys in force stay
            logger.error("SIGHUP: the keys were not reloaded: %s", exc)

    def stop(self) -> None:
        """Shut down from any thread (tests, the benchmarks' helpers)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.shutdown()))

    def run(self) -> int:
        """Serve in this thread until SIGTERM or SIGINT; the process's exit code."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, lambda: asyncio.ensure_future(self.shutdown()))
            loop.add_signal_handler(signal.SIGHUP, self.reload_keys)
            await self.serve()

        try:
            asyncio.run(main())
        except StartupFailed as failed:
            logger.error("%s", failed)
            return failed.exit_code
        return 0


def serve_in_thread(server: ProxyServer, timeout_s: float = 30.0) -> threading.Thread:
    """Run ``server`` in a daemon thread (its own event loop) until it serves; RuntimeError when it
    does not start within ``timeout_s``."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)
            server.stopped.set()

    thread = threading.Thread(target=target, name="clairvoyant-proxy", daemon=True)
    thread.start()
    deadline_s = time.monotonic() + timeout_s
    while not server.started.wait(0.01):
        if failure or server.stopped.is_set() or time.monotonic() > deadline_s:
            raise RuntimeError(f"the proxy did not start: {failure[0] if failure else 'timed out'}")
    return thread
