"""The ASGI response that waits for a backend slot, then relays the backend's answer as it arrives.

Used for scheduled requests (with a ticket) and for pass-through requests (without one).
The client's disconnect is watched the whole time (``receive`` yields ``http.disconnect``):

- while queued: the ticket is withdrawn and the request is never sent;
- while the backend generates: either ``abort`` (cancel the relay, which closes the backend
  connection; llama.cpp stops generating) or ``drain`` (keep reading the backend's answer into the
  void until it ends, so the slot is freed only when the backend really is free).

Once the status line is sent it cannot change: a backend failure after that point ends a stream
with one final error event in the dialect's framing, or truncates a plain body.

A scheduled answer that the backend completes (2xx, relayed or drained to its end) is read by a
``UsageTap`` as it passes, without buffering, and its ``Usage`` handed to ``on_usage``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, Literal

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from clairvoyant.dialects import Dialect
from clairvoyant.dispatcher import Dispatcher, Ticket
from clairvoyant.errors import RequestError, UpstreamTimeout
from clairvoyant.metrics import Metrics
from clairvoyant.upstream import Upstream, response_headers
from clairvoyant.usage import Usage, UsageTap

__all__ = ["ProxyResponse", "error_body"]

logger = logging.getLogger(__name__)


def error_body(dialect: Dialect, exc: RequestError) -> bytes:
    """The error in the client's own dialect."""
    if dialect is Dialect.OLLAMA:
        return json.dumps({"error": exc.message}).encode()
    return json.dumps(
        {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}
    ).encode()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ProxyResponse(Response):
    """An ASGI app for one request: [wait for a slot] -> open upstream -> relay -> release.

    A ``Response`` subclass only so that FastAPI returns it as is; status and headers come from
    the backend when it answers.
    """

    def __init__(
        self,
        *,
        upstream: Upstream,
        method: str,
        path: str,
        query: str,
        headers: list[tuple[str, str]],
        body: bytes,
        dialect: Dialect,
        metrics: Metrics,
        dispatcher: Dispatcher,  # owns the slot (scheduled requests) and every detached ending
        ticket: Ticket | None = None,  # None: a pass-through request, not queued
        disconnect_mode: Literal["drain", "abort"] = "abort",
        on_usage: Callable[[Ticket, Usage], None] | None = None,  # a completed scheduled answer's usage
    ) -> None:
        self.background = None
        self.status_code = 200
        self.raw_headers = []
        self.upstream = upstream
        self.method = method
        self.path = path
        self.query = query
        self.request_headers = headers
        self.body = body
        self.dialect = dialect
        self.metrics = metrics
        self.dispatcher = dispatcher
        self.ticket = ticket
        self.disconnect_mode = disconnect_mode
        self.on_usage = on_usage
        self.usage: Usage | None = None
        self._sent_s = 0.0  # clock seconds when the request went upstream
        self.status: int | None = None  # sent status, once sent
        self.outcome = "pending"
        self._client_gone = False
        self._first_byte_seen = False
        self._content_type = ""

    # -- the ASGI entry point ----------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        relay: asyncio.Task[None] | None = None
        handed_off = False
        try:
            if self.ticket is not None:
                if not await self._wait_for_slot(disconnect, send):
                    return
            relay = asyncio.ensure_future(self._relay(send))
            done, _ = await asyncio.wait({relay, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if relay in done:
                relay.result()
                return
            # The client left while the backend is still working.
            self._client_gone = True
            self.outcome = "client_left_streaming"
            self.metrics.disconnects_by_stage["streaming"].inc()
            if self.disconnect_mode == "abort" or self.ticket is None:
                relay.cancel()  # pass-through requests hold no slot: nothing to drain for
            handed_off = self._finish_later(relay)
        finally:
            disconnect.cancel()
            if relay is not None and not relay.done() and not handed_off:
                relay.cancel()  # we are being cancelled ourselves (shutdown)
                handed_off = self._finish_later(relay)
            if not handed_off:
                self._release()
                self._log()

    async def _wait_for_slot(self, disconnect: asyncio.Future[None], send: Send) -> bool:
        """True once a slot is held; False if the client left or the proxy refused (answered)."""
        assert self.ticket is not None
        turn = asyncio.ensure_future(self.dispatcher.wait_turn(self.ticket))
        try:
            done, _ = await asyncio.wait({turn, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not turn.done():
                turn.cancel()  # wait_turn withdraws the ticket on cancellation
        if turn not in done:
            self.dispatcher.abandon(self.ticket)
            self.outcome = "client_left_queued"
            self.metrics.disconnects_by_stage["queued"].inc()
            return False
        try:
            turn.result()
        except RequestError as exc:  # e.g. shutting down
            await self._send_error(send, exc)
            self.outcome = "refused"
            return False
        return True

    # -- relaying ------------------------------------------------------------------------------
    async def _relay(self, send: Send) -> None:
        self._sent_s = self.dispatcher.clock.now()
        try:
            response = await self.upstream.open(
                self.method, self.path, query=self.query, headers=self.request_headers, body=self.body
            )
        except RequestError as exc:
            self._count_upstream_error(exc)
            self.outcome = "upstream_error"
            if not self._client_gone:
                await self._send_error(send, exc)
            return
        try:
            await self._relay_body(response, send)
        finally:
            await response.aclose()

    async def _relay_body(self, response: httpx.Response, send: Send) -> None:
        self.status = response.status_code
        self._content_type = response.headers.get("content-type", "")
        headers = response_headers(response.headers) + self._own_headers()
        tap = UsageTap(self._content_type) if self.ticket is not None and 200 <= response.status_code < 300 else None
        if not self._client_gone:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                }
            )
        try:
            async for chunk in self.upstream.iter_body(response):
                if chunk and not self._first_byte_seen:
                    self._first_byte_seen = True
                    self._observe("ttft")
                if tap is not None:
                    tap.feed(chunk)
                if not self._client_gone:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except RequestError as exc:
            self._count_upstream_error(exc)
            self.outcome = "upstream_error_mid_body"
            if not self._client_gone:
                await send({"type": "http.response.body", "body": self._stream_error_event(exc), "more_body": False})
            return
        if tap is not None:  # before the last send: the observation is in once the client has it all
            self._record_usage(tap)
        if not self._client_gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.outcome = "completed"
        else:
            self.outcome = "client_left_streaming"
        self._observe("end_to_end")

    def _stream_error_event(self, exc: RequestError) -> bytes:
        """A final error in the stream's own framing (nothing for a plain body: it is truncated)."""
        if "text/event-stream" in self._content_type:
            return b"data: " + error_body(self.dialect, exc) + b"\n\n"
        if "ndjson" in self._content_type:
            return error_body(self.dialect, exc) + b"\n"
        return b""

    def _own_headers(self) -> list[tuple[str, str]]:
        ticket = self.ticket
        if ticket is None:
            return []
        wait = ticket.queue_wait_s()
        prediction = ticket.prediction
        headers = [
            ("x-request-id", ticket.request_id),
            ("x-clairvoyant-queue-wait-ms", "" if wait is None else f"{wait * 1000:.1f}"),
            ("x-clairvoyant-predicted-tokens", f"{prediction.predicted_tokens:.0f}"),
            ("x-clairvoyant-predicted-class", ticket.predicted_class),
        ]
        if prediction.p_long is not None:  # class models only
            headers.append(("x-clairvoyant-p-long", f"{prediction.p_long:.4f}"))
        return headers

    async def _send_error(self, send: Send, exc: RequestError) -> None:
        body = error_body(self.dialect, exc)
        self.status = exc.status_code
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (*exc.headers.items(), *self._own_headers())]
        await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    # -- endings -------------------------------------------------------------------------------
    def _finish_later(self, relay: asyncio.Future[None]) -> bool:
        """Release the slot only once the relay has ended (drained to the end, or aborted)."""

        async def finish() -> None:
            try:
                await relay
            except (asyncio.CancelledError, RequestError):
                pass
            finally:
                self._release()
                self._log()

        self.dispatcher.run_detached(finish(), name=f"finish-{self.ticket.request_id if self.ticket else 'passthrough'}")
        return True

    def _record_usage(self, tap: UsageTap) -> None:
        assert self.ticket is not None
        self.usage = tap.usage(wall_s=self.dispatcher.clock.now() - self._sent_s, request_model=self.ticket.model)
        if self.on_usage is not None:
            try:
                self.on_usage(self.ticket, self.usage)
            except Exception:  # the answer is already relayed: a failing observer must not break it
                logger.exception("request_id=%s: recording usage failed", self.ticket.request_id)

    def _release(self) -> None:
        if self.ticket is not None:
            self.dispatcher.release(self.ticket)

    def _count_upstream_error(self, exc: RequestError) -> None:
        self.metrics.upstream_errors_by_kind["timeout" if isinstance(exc, UpstreamTimeout) else "unavailable"].inc()

    def _observe(self, what: str) -> None:
        ticket = self.ticket
        if ticket is None:
            return
        elapsed = self.dispatcher.clock.now() - ticket.arrival_s
        by_class = self.metrics.ttft_by_class if what == "ttft" else self.metrics.end_to_end_by_class
        by_class[ticket.predicted_class].observe(elapsed)

    def _log(self) -> None:
        ticket = self.ticket
        endpoint = ticket.endpoint if ticket is not None else "passthrough"
        status = str(self.status) if self.status is not None else "client_closed"
        self.metrics.count_request(endpoint, self.dialect.value, status)
        if ticket is None or not logger.isEnabledFor(logging.INFO):
            return
        wait = ticket.queue_wait_s()
        service = None if ticket.dispatched_s is None else self.dispatcher.clock.now() - ticket.dispatched_s
        fields: dict[str, Any] = {
            "request_id": ticket.request_id,
            "endpoint": ticket.endpoint,
            "predicted_class": ticket.predicted_class,
            "predicted_tokens": f"{ticket.prediction.predicted_tokens:.0f}",
            "queue_wait_ms": "-" if wait is None else f"{wait * 1000:.1f}",
            "service_ms": "-" if service is None else f"{service * 1000:.1f}",
            "status": self.status if self.status is not None else "-",
            "outcome": self.outcome,
            "output_tokens": "-" if self.usage is None or self.usage.output_tokens is None else self.usage.output_tokens,
            "usage_source": "-" if self.usage is None else self.usage.source,
        }
        logger.info("request %s", " ".join(f"{k}={v}" for k, v in fields.items()))
