"""The HTTP server: the proxy's own connections (proxy/connection.py) under uvicorn's server loop,
and a shutdown that answers everyone.

uvicorn keeps what it does well and the proxy does not need to own: binding the socket, running
the lifespan, signals, refreshing the Date header once a second, waiting for open connections and
tasks at shutdown. Its ``http=`` option takes the proxy's ``HttpConnection`` (a subclass carrying
the app and the client limits), which does all the HTTP: uvicorn's own protocol and ASGI cycle are
not on the request path (docs/design.md, "The client connection").

On SIGTERM (``ProxyServer.shutdown``): the dispatcher refuses every waiting request at once (503
``shutting_down``, Retry-After), then uvicorn stops accepting and waits for the open answers,
which the dispatcher ends with an error event after ``shutdown_grace_s``. uvicorn's own graceful
timeout, two seconds later, is the backstop for pass-through requests.
"""

from __future__ import annotations

from typing import Any

import uvicorn

from clairvoyant.config import Settings
from clairvoyant.proxy.connection import ClientLimits, HttpConnection

__all__ = ["ClientLimits", "ProxyServer", "build_server"]


class ProxyServer(uvicorn.Server):
    """uvicorn's server, with the dispatcher's refusal of the queue at the start of shutdown
    (uvicorn would otherwise wait for every open connection, queued ones included, before the
    application hears of it)."""

    def __init__(self, config: uvicorn.Config, grace_s: float) -> None:
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets: Any = None) -> None:
        proxy = getattr(self.config.app.state, "proxy", None) if hasattr(self.config.app, "state") else None
        if proxy is not None:
            proxy.dispatcher.begin_shutdown(self.grace_s)
        await super().shutdown(sockets)


def build_server(
    app: Any, settings: Settings, *, host: str | None = None, port: int | None = None, log_level: str | None = None
) -> ProxyServer:
    """The proxy's server for ``app`` (a ``ProxyApp``, from ``create_app``) with ``settings``' limits."""
    metrics = getattr(app, "metrics", None)

    def on_rejected(reason: str) -> None:
        if metrics is not None:
            metrics.client_rejections.labels(reason).inc()

    limits = ClientLimits(
        settings.client_timeout_s, settings.max_header_bytes, settings.max_body_bytes, settings.max_connections,
        settings.keep_alive_timeout_s, on_rejected, settings.client_keepalive_s,
    )  # fmt: skip
    protocol = type("ProxyConnection", (HttpConnection,), {"site": app, "limits": limits, "__slots__": ()})
    config = uvicorn.Config(
        app.asgi,
        host=settings.host if host is None else host,
        port=settings.port if port is None else port,
        http=protocol,
        log_level=settings.log_level if log_level is None else log_level,
        access_log=False,  # the proxy logs one line per request itself (clairvoyant.logs)
        log_config=None,  # uvicorn's loggers propagate to ours: one format
        lifespan="on",
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 2,  # backstop: the dispatcher ends answers first
        server_header=False,  # the backend's own Server header is relayed
        proxy_headers=False,  # nothing reads the client address: no X-Forwarded-* rewrite per request
        date_header=True,
    )
    return ProxyServer(config, grace_s=settings.shutdown_grace_s)
