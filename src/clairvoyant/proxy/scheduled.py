"""A scheduled request's life (docs/design.md, "A request's life"): parsed and predicted,
``dispatcher.submit`` (or ``dispatch_at_once``: a free slot and nobody waiting, predicted while
the backend works), then one coroutine in ``async with dispatcher.lease(ticket)`` that waits for
its turn and relays the answer (proxy/relay.py); leaving the block withdraws or releases it, once.
A waiting client receives nothing, not even a status line (``GET /queue/{request_id}`` says where
it stands).

A second task watches for the client leaving (``http.disconnect``). Waiting, the request is
withdrawn, never sent. Relaying, ``disconnect_mode`` decides: ``abort`` closes the backend
connection (llama.cpp and Ollama stop generating) and frees the slot; ``drain`` reads the answer
to its end, so the slot frees when the backend does; ``auto`` aborts, and for a non-streamed
request holds the slot until llama.cpp's ``/slots`` shows it idle (llama.cpp notices a closed
non-streamed request only late; a stream it stops within ~0.2 s).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from clairvoyant.config import Settings
from clairvoyant.errors import BadRequest, GenerationTimeLimit, RequestError, Superseded
from clairvoyant.logs import REQUEST_LOG, log_request
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.dialects import Endpoint, ParsedRequest, parse_request, with_upstream_fields
from clairvoyant.prediction.encoder import Refiner
from clairvoyant.prediction.predictor import Prediction, Predictor
from clairvoyant.prediction.usage import Usage
from clairvoyant.proxy.access import Identity
from clairvoyant.proxy.limits import TenantLimits
from clairvoyant.proxy.pool import BackendPool
from clairvoyant.proxy.relay import Receive, Relay, RelayHooks, Responder, UpstreamRequest, disconnected
from clairvoyant.proxy.transport import Headers
from clairvoyant.scheduling.dispatcher import Dispatcher
from clairvoyant.scheduling.request import RequestStatus, Ticket

__all__ = ["Arrival", "ScheduledHooks", "ScheduledRequest", "Scheduling", "SupersedeKeys", "admit_scheduled"]

logger = logging.getLogger(__name__)

SLOTS_POLL_S = 1.5  # seconds between /slots polls while a left client's slot is held
HOLD_MAX_S = 600.0  # the longest a left client's slot is held waiting for the backend to go idle
VLLM_CLASS_STRIDE = 100_000  # vLLM priority = client class x this + predicted tokens (capped below it)
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
REQUEST_ID = "x-request-id"
DEADLINE = "x-clairvoyant-deadline"  # seconds the client will wait before its request is sent
SUPERSEDE = "x-clairvoyant-supersede"  # a key: a newer request with it replaces this one
# With replicas: seconds a request's grant may take (Redis round trips) before it is taken to wait
# and worth the encoder's refinement.
CLUSTER_GRANT_WAIT_S = 0.01
# Seconds after an at-once dispatch when its prediction is made, if its answer has not started by
# then: the request is on its way to the backend by then, so the prediction is off its critical path.
PREDICT_AFTER_S = 0.001


@dataclass(frozen=True, slots=True, eq=False)
class Scheduling:
    """What every scheduled request shares (built once, in the lifespan)."""

    settings: Settings
    predictor: Predictor
    pool: BackendPool
    metrics: Metrics
    dispatcher: Dispatcher
    on_usage: Callable[[Ticket, Usage, bytes], None] | None  # a completed answer's usage and its body (the learner)
    refiner: Refiner | None  # the encoder's second opinion for waiting requests (None: off)
    limits: TenantLimits  # tenants' use against their limits
    supersede: SupersedeKeys  # the latest request per (tenant, X-Clairvoyant-Supersede key)

    @property
    def at_once(self) -> bool:
        """A request may go before its prediction: not in a pool (routing weighs the prediction),
        nor to a vLLM backend that reads it as its priority."""
        return len(self.pool) == 1 and not (self.settings.vllm_priority and self.pool.members[0].kind.priority_field)

    @property
    def own_headers(self) -> tuple[str, ...]:
        """Read, never forwarded."""
        settings = self.settings
        return (REQUEST_ID, settings.tenant_header.lower(), settings.priority_header.lower(), DEADLINE, SUPERSEDE)


def _priority(header: str | None, given: int | None, settings: Settings, identity: Identity | None) -> int:
    """The body's priority, else the header's, else 0; clamped to the key's range, else the settings'."""
    if given is None and header is not None:
        try:
            given = int(header.strip())
        except ValueError:
            raise BadRequest(f"header {settings.priority_header} must be an integer") from None
    value = 0 if given is None else given
    bounds = settings if identity is None else identity
    return max(bounds.min_priority, min(bounds.max_priority, value))


def _deadline_s(header: str | None, default_s: float | None) -> float:
    """Seconds it may wait before it is sent: its header's, else the default (inf: none)."""
    if header is None:
        return math.inf if default_s is None else default_s
    try:
        value = float(header.strip())
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise BadRequest(f"header {DEADLINE} must be a number of seconds > 0", param=DEADLINE)
    return value


@dataclass(frozen=True, slots=True)
class Arrival:
    """A scheduled request as it arrived."""

    endpoint: Endpoint
    target: str  # the raw path and query, checked (proxy/target.py)
    headers: Headers  # the client's end-to-end headers, to forward
    authorization: str | None  # the client's Authorization value, if any
    own: dict[str, str]  # the proxy's own request headers (``Scheduling.own_headers``), lower-case names
    body: bytes
    identity: Identity | None  # the API key's, when the request came with one
    tenant: str


def _ticket(shared: Scheduling, arrival: Arrival, parsed: ParsedRequest) -> Ticket:
    settings = shared.settings
    own = arrival.own
    arrival_s = shared.dispatcher.clock.now()
    given_id = own.get(REQUEST_ID, "")
    deadline_s = _deadline_s(own.get(DEADLINE), settings.default_queue_deadline_s)
    return Ticket(
        given_id if _REQUEST_ID_RE.match(given_id) else "", arrival.endpoint.path, arrival.endpoint.dialect.value,
        parsed.model, None, parsed.prompt.context_chars // 4,  # ~4 characters a token until usage says better
        arrival_s,
        priority=_priority(own.get(settings.priority_header.lower()), parsed.priority, settings, arrival.identity),
        tenant=arrival.tenant, expires_s=arrival_s + deadline_s,
    )  # fmt: skip


def _predict(shared: Scheduling, parsed: ParsedRequest, ticket: Ticket) -> Prediction:
    """The prediction, into the ticket (its queue key, predicted tokens and seconds)."""
    settings = shared.settings
    started = time.perf_counter()
    prediction = shared.predictor.predict(parsed.prompt, model=parsed.model, cap_tokens=parsed.cap_tokens)
    shared.metrics.prediction.latency.observe(time.perf_counter() - started)
    score, predicted_tokens = prediction.score, prediction.predicted_tokens
    oracle = parsed.proxy_options.get("output_tokens")
    if settings.allow_oracle and isinstance(oracle, (int, float)) and not isinstance(oracle, bool):
        score = predicted_tokens = float(oracle)  # benchmark-only: the true length, the ideal ordering
        if parsed.cap_tokens is not None:  # the predictor applied the cap itself; the oracle must too
            predicted_tokens = min(predicted_tokens, float(parsed.cap_tokens))
    ticket.prediction = prediction
    ticket.score = score
    ticket.predicted_tokens = predicted_tokens
    ticket.predicted_s = shared.dispatcher.predicted_s(parsed.model, ticket.prompt_tokens, predicted_tokens)
    return prediction


def _refine_if_waiting(refiner: Refiner, ticket: Ticket, prediction: Prediction, instruction: str) -> None:
    """Hand a request still waiting after the dispatcher's turn to the encoder (one granted a free
    slot then is not worth its time)."""
    if ticket.waiting:
        refiner.want(  # plain reads, from its thread
            (ticket, prediction.feature_row), instruction, lambda: ticket.waiting,
            lambda: ticket.placement is not None,
        )  # fmt: skip


def admit_scheduled(shared: Scheduling, arrival: Arrival, out: Responder) -> ScheduledRequest:
    """Parse, predict and queue a request; ``serve`` answers it. Raises ``RequestError`` for what
    is refused at once (a bad body, a full queue, a model no backend serves, an ETA past its deadline)."""
    settings = shared.settings
    dispatcher = shared.dispatcher
    parsed = parse_request(arrival.endpoint, arrival.body, keep_priority=settings.forward_priority)
    forward_body = parsed.forward_body
    bench_fields = parsed.proxy_options.get("upstream")
    if settings.bench_upstream_fields and isinstance(bench_fields, dict):
        forward_body = with_upstream_fields(forward_body, bench_fields)  # the prediction never sees these
    ticket = _ticket(shared, arrival, parsed)
    if settings.log_prompts:
        logger.debug("request_id=%s prompt=%r", ticket.request_id, parsed.prompt.instruction[:2000])
    predict_later: Callable[[], None] | None = None
    # A free slot and nobody waiting: no order to decide, so it goes now and is predicted while the
    # backend works (in time for its headers, metrics and the learner).
    if shared.at_once and dispatcher.dispatch_at_once(ticket):
        charged_s = ticket.predicted_s  # the default its tenant was charged at dispatch

        def predict_later() -> None:  # run once (``ScheduledHooks.predicted``)
            _predict(shared, parsed, ticket)
            dispatcher.predicted_at_once(ticket, charged_s)

    else:
        prediction = _predict(shared, parsed, ticket)
        dispatcher.submit(ticket)
        refiner = shared.refiner
        if refiner is not None and not (settings.allow_oracle and "output_tokens" in parsed.proxy_options):
            loop = asyncio.get_running_loop()
            if dispatcher.cluster.side is None:
                loop.call_soon(_refine_if_waiting, refiner, ticket, prediction, parsed.prompt.instruction)
            else:  # with replicas a free slot's grant takes a round trip to Redis: one not worth refining
                loop.call_later(
                    CLUSTER_GRANT_WAIT_S, _refine_if_waiting, refiner, ticket, prediction, parsed.prompt.instruction
                )
    upstream_request = UpstreamRequest(
        "POST", arrival.target, [*arrival.headers, ("x-request-id", ticket.request_id)], forward_body,
        arrival.endpoint.dialect, close_connection=parsed.stream, authorization=arrival.authorization,
        model=ticket.model, wait_s=settings.backend_wait_s, retry_unavailable=True,
    )  # fmt: skip
    hooks = ScheduledHooks(shared, ticket, arrival.body, parsed.stream, predict_later)
    request = ScheduledRequest(shared, ticket, upstream_request, hooks, out)
    supersede_key = arrival.own.get(SUPERSEDE)
    if supersede_key:
        request.supersede_key = (arrival.tenant, supersede_key[:256])
        shared.supersede.replace(request.supersede_key, request)
        if dispatcher.cluster.side is not None:  # with replicas: the older one may wait on another replica
            dispatcher.cluster.side.supersede_key(ticket, arrival.tenant, supersede_key[:256])
    return request


class ScheduledHooks(RelayHooks):
    """A scheduled request's ``RelayHooks``. It holds neither the relay nor the ``ScheduledRequest``:
    no reference cycle to break by hand."""

    __slots__ = ("shared", "pool", "ticket", "body", "stream", "_predict_later")

    reads_usage = True

    def __init__(
        self,
        shared: Scheduling,
        ticket: Ticket,
        body: bytes,  # the client's body, for the learner once answered
        stream: bool,  # the client asked for a stream (decides ``auto``)
        predict_later: Callable[[], None] | None = None,  # dispatched at once: its prediction, still to make
    ) -> None:
        self.shared = shared
        self.pool = shared.pool
        self.ticket = ticket
        self.body = body
        self.stream = stream
        self._predict_later = predict_later

    def move(self, status: RequestStatus) -> bool:
        return self.shared.dispatcher.move(self.ticket, status)

    @property
    def prediction_pending(self) -> bool:
        """Dispatched at once, its prediction still to make."""
        return self._predict_later is not None

    def predicted(self) -> None:
        """Make the prediction, if it is still to make."""
        predict, self._predict_later = self._predict_later, None
        if predict is not None:
            predict()

    def own_headers(self) -> list[tuple[bytes, bytes]]:
        """The request id, backend, wait and prediction (made now if it is still to make)."""
        self.predicted()
        ticket = self.ticket
        prediction = ticket.prediction
        assert prediction is not None
        placement = ticket.placement  # None: refused while it waited
        backend = self.shared.pool.members[0 if placement is None else placement.backend or 0].upstream
        headers = [
            (b"x-request-id", ticket.request_id.encode()),
            (b"x-clairvoyant-backend", backend.name.encode("latin-1")),
            (
                b"x-clairvoyant-queue-wait-ms",
                b"" if placement is None else b"%.1f" % ((placement.dispatched_s - ticket.arrival_s) * 1000),
            ),
            (b"x-clairvoyant-predicted-tokens", b"%.0f" % prediction.predicted_tokens),
            (b"x-clairvoyant-predicted-class", prediction.predicted_class.encode()),
            (b"x-clairvoyant-predicted-s", b"%.3f" % ticket.predicted_s),
        ]
        if prediction.probabilities is not None:  # class models only
            headers.append((b"x-clairvoyant-p-long", b"%.4f" % prediction.probabilities[2]))
        if placement is not None:
            headers.append((b"x-clairvoyant-queue-position", b"%d" % placement.queue_position))
        return headers

    def first_byte(self, at_s: float) -> None:
        ticket = self.ticket
        shared = self.shared
        shared.metrics.requests.ttft[ticket.predicted_class].observe(at_s - ticket.arrival_s)
        # After a model switch: the load this answer paid.
        shared.dispatcher.first_byte(ticket, streamed=self.stream, at_s=at_s)

    def progress(self, tokens: int) -> None:
        placement = self.ticket.placement
        if placement is not None:
            placement.live_tokens = tokens  # the queue's ETAs follow the answer's own pace

    def usage(self, usage: Usage) -> None:
        ticket = self.ticket
        shared = self.shared
        tokens = usage.output_tokens
        if tokens is not None and usage.observed:
            # Counted in a task: on Redis a write, and this hook runs inside the relay.
            shared.dispatcher.run_detached(shared.limits.add_tokens(ticket.tenant, tokens), "limits-tokens")
            shared.metrics.tenants.tokens[shared.metrics.tenants.label(ticket.tenant)].inc(tokens)
        on_usage = shared.on_usage
        if on_usage is not None:
            try:
                on_usage(ticket, usage, self.body)
            except Exception:  # the answer is relayed already: a failing observer must not break it
                logger.exception("request_id=%s: recording usage failed", ticket.request_id)

    async def failover(self, relay: Relay) -> bool:
        """Wait first in line for another healthy backend (the client sees nothing of it), or False
        when there is none. Waiting again, a client that leaves cancels the task: the lease withdraws it."""
        shared = self.shared
        shared.pool.refused(relay.upstream)
        if not shared.dispatcher.reroute(self.ticket):
            return False
        await shared.dispatcher.regranted(self.ticket)
        self.bind(relay)
        return True

    def bind(self, relay: Relay) -> None:
        """Send to the granted backend; a vLLM one (``vllm_priority``) gets the request's priority in
        its body: the client's class, then the predicted tokens (lower = sooner, as vLLM reads it)."""
        shared = self.shared
        ticket = self.ticket
        placement = ticket.placement
        backend = 0 if placement is None or placement.backend is None else placement.backend
        relay.upstream = shared.pool.members[backend].upstream
        field = shared.pool.members[backend].kind.priority_field
        if shared.settings.vllm_priority and field is not None:
            tokens = min(VLLM_CLASS_STRIDE - 1, max(0, round(ticket.predicted_tokens)))
            priority = ticket.priority * VLLM_CLASS_STRIDE + tokens
            relay.request = replace(relay.request, body=with_upstream_fields(relay.request.body, {field: priority}))


class ScheduledRequest:
    """A scheduled request from its queueing to its slot's release; its state is ``ticket.status``."""

    def __init__(
        self, shared: Scheduling, ticket: Ticket, request: UpstreamRequest, hooks: ScheduledHooks, out: Responder
    ) -> None:
        self.shared = shared
        self.ticket = ticket
        self.hooks = hooks
        self.out = out
        self.task: asyncio.Task[Any] | None = None  # the one that runs ``serve``
        self.supersede_key: tuple[str, str] | None = None  # (tenant, X-Clairvoyant-Supersede), if it has one
        self.relay = Relay(shared.pool.first, request, shared.metrics, ticket, hooks, now=shared.dispatcher.clock.now)

    @property
    def mode(self) -> Literal["auto", "drain", "abort"]:
        """What the client's leaving does while its answer is relayed (module docstring)."""
        mode = self.shared.settings.disconnect_mode
        return "abort" if mode == "auto" and self.hooks.stream else mode

    async def serve(self, receive: Receive) -> None:
        """Wait for the slot, relay, give the slot back (once, whatever happens), log."""
        self.task = asyncio.current_task()
        watch = asyncio.create_task(self._watch(receive))
        predicting: asyncio.TimerHandle | None = None
        if self.hooks.prediction_pending:
            predicting = asyncio.get_running_loop().call_later(PREDICT_AFTER_S, self.hooks.predicted)
        try:
            await self._lease_and_relay()
        finally:
            watch.cancel()
            if predicting is not None:
                predicting.cancel()
            self.hooks.predicted()
            if self.supersede_key is not None:
                self.shared.supersede.done(self.supersede_key, self)
            self._log()

    async def _watch(self, receive: Receive) -> None:
        await disconnected(receive)
        self._client_left()

    async def _lease_and_relay(self) -> None:
        ticket = self.ticket
        relay = self.relay
        shared = self.shared
        limit_s = shared.settings.max_generation_s
        clock = shared.dispatcher.clock
        timer: asyncio.TimerHandle | None = None
        try:
            async with shared.dispatcher.lease(ticket) as lease:
                placement = ticket.placement
                assert placement is not None  # granted
                placement.interrupt = self._interrupt
                wait_s = ticket.queue_wait_s()
                if wait_s is not None:
                    shared.metrics.tenants.wait[shared.metrics.tenants.label(ticket.tenant)].observe(wait_s)
                if limit_s is not None:
                    timer = asyncio.get_running_loop().call_later(limit_s, self._generation_over, limit_s)
                self.hooks.bind(relay)
                await relay.run(self.out)
                if ticket.status is RequestStatus.HOLDING:
                    await self._hold_until_backend_idle()
                    self.hooks.move(RequestStatus.CLIENT_LEFT_WATCHING)
                finished = ticket.status in (RequestStatus.COMPLETED, RequestStatus.CLIENT_LEFT_STREAMING)
                if finished:
                    shared.metrics.requests.end_to_end[ticket.predicted_class].observe(clock.now() - ticket.arrival_s)
                # Only whole successful answers teach the service-time model.
                lease.completed = finished and relay.status is not None and relay.status < 400
                lease.usage = relay.usage
        except RequestError as error:  # refused while it waited (shutting down, its queue deadline)
            await relay.send_error(self.out, error)
        except asyncio.CancelledError:
            # Withdrawn (the lease's exit), never sent: its client left, or a newer request replaced it.
            if not relay.interrupted():
                raise
            await relay.end_interrupted(self.out)
        except Exception:  # a bug: logged, the client answered or cut, the slot given back by the lease
            logger.exception("request_id=%s: unexpected error", ticket.request_id)
            self.hooks.move(RequestStatus.INTERNAL_ERROR)
            await relay.send_error(self.out, RequestError("internal error in the proxy"))
        finally:
            if ticket.placement is not None:
                ticket.placement.interrupt = None
            if timer is not None:
                timer.cancel()

    def superseded(self, abort_running: bool) -> None:
        """A newer request with its supersede key arrived: waiting, it is withdrawn and answered 409;
        running (with ``abort_running``), its answer is ended with the dialect's error."""
        work = self.task
        if work is None or not self.ticket.status.in_progress or not (abort_running or self._unsent):
            return
        error = Superseded.by_newer()
        self.relay.interrupt(work, RequestStatus.SUPERSEDED, error)

    @property
    def _unsent(self) -> bool:
        """It waits (rerouted too), or was granted a slot in this instant (its task has not resumed:
        ``interrupt`` is set once it has)."""
        placement = self.ticket.placement
        return self.ticket.status is RequestStatus.WAITING or placement is None or placement.interrupt is None

    def _generation_over(self, limit_s: float) -> None:
        """``max_generation_s`` after its grant: an answer still running ends with the dialect's error."""
        if self.task is not None and self.ticket.status in (RequestStatus.DISPATCHED, RequestStatus.STREAMING):
            error = GenerationTimeLimit(f"the answer ran longer than the proxy's max_generation_s ({limit_s:g} s)")
            self.relay.interrupt(self.task, RequestStatus.GENERATION_LIMIT, error)

    def _client_left(self) -> None:
        """The client is gone: ``serve``'s task is interrupted where it waits."""
        self.out.client_gone = True
        relay = self.relay
        work = self.task
        status = self.ticket.status
        if work is None or not status.in_progress:
            return  # holding already, or answered in full
        if self._unsent:
            # The lease withdraws it (or gives back a slot granted in this instant).
            relay.interrupt(work, RequestStatus.CLIENT_LEFT_QUEUED)
            return
        self.shared.metrics.requests.disconnects["streaming"].inc()
        if self.mode == "auto":
            relay.interrupt(work, RequestStatus.HOLDING)  # closes it; the slot waits for /slots
        elif self.mode == "abort":
            relay.interrupt(work, RequestStatus.CLIENT_LEFT_STREAMING)  # closes the backend connection
        # drain: the relay reads the backend's answer to its end, so the slot is freed when the backend is

    def _interrupt(self, status: RequestStatus, error: RequestError) -> bool:
        """End the answer (or the hold): the shutdown's grace is over, or its slot's lease was lost."""
        now = self.ticket.status
        if self.task is None or not (now.in_progress or now is RequestStatus.HOLDING):
            return False
        self.relay.interrupt(self.task, status, error)
        return True

    async def _hold_until_backend_idle(self) -> None:
        """Keep the slot until /slots shows no more busy slots than our other requests in flight,
        polled every SLOTS_POLL_S (more often, llama.cpp's 1 s disconnect check would not notice),
        for at most HOLD_MAX_S. A backend without /slots releases at once."""
        placement = self.ticket.placement
        assert placement is not None and placement.backend is not None
        deadline_s = time.monotonic() + HOLD_MAX_S
        try:
            while time.monotonic() < deadline_s:
                await asyncio.sleep(SLOTS_POLL_S)
                busy = await self.relay.upstream.busy_slots()
                if busy is None or busy <= self.shared.dispatcher.in_flight_on(placement.backend) - 1:
                    return
        except asyncio.CancelledError:
            if not self.relay.interrupted():
                raise
            await self.relay.end_interrupted(self.out)

    def _log(self) -> None:
        ticket = self.ticket
        relay = self.relay
        status = str(relay.status) if relay.status is not None else "client_closed"
        metrics = self.shared.metrics
        metrics.requests.answered[ticket.endpoint, ticket.dialect, status].inc()
        if not REQUEST_LOG.isEnabledFor(logging.INFO):
            return
        wait_s = ticket.queue_wait_s()
        clock = self.shared.dispatcher.clock
        placement = ticket.placement
        service_s = None if placement is None else clock.now() - placement.dispatched_s
        usage = relay.usage
        log_request({
            "request_id": ticket.request_id, "endpoint": ticket.endpoint, "tenant": ticket.tenant or "-",
            "backend": "-" if placement is None or placement.backend is None else relay.upstream.name,
            "priority": ticket.priority, "predicted_class": ticket.predicted_class,
            "predicted_tokens": "-" if ticket.prediction is None else f"{ticket.prediction.predicted_tokens:.0f}",
            "predicted_s": f"{ticket.predicted_s:.3f}",
            "queue_wait_ms": "-" if wait_s is None else f"{wait_s * 1000:.1f}",
            "service_ms": "-" if service_s is None else f"{service_s * 1000:.1f}",
            "status": relay.status if relay.status is not None else "-", "outcome": ticket.status.outcome,
            "output_tokens": "-" if usage is None or usage.output_tokens is None else usage.output_tokens,
            "usage_source": "-" if usage is None else usage.source,
        })  # fmt: skip


class SupersedeKeys:
    """The latest request per (tenant, ``X-Clairvoyant-Supersede`` key): editor completion sends
    one per keystroke, and only the latest matters."""

    def __init__(self, abort_running: bool) -> None:
        self.abort_running = abort_running  # supersede_running: a running request is replaced too
        self._latest: dict[tuple[str, str], ScheduledRequest] = {}

    def replace(self, key: tuple[str, str], request: ScheduledRequest) -> None:
        older = self._latest.get(key)
        self._latest[key] = request
        if older is not None:
            older.superseded(self.abort_running)

    def retained(self) -> dict[str, int]:
        return {"supersede_keys": len(self._latest)}

    def done(self, key: tuple[str, str], request: ScheduledRequest) -> None:
        if self._latest.get(key) is request:
            del self._latest[key]
