"""This replica's side of the shared queue: it sends its waiting requests' entries to the store,
takes the grants the store pushes, renews the leases it holds, and falls back to local
scheduling on a share of the slots while the store is gone.

- SHARED: the store grants every slot. The dispatcher's free lists stay empty, so it never
  grants one itself; a grant from the store takes its ticket out of the local queue
  (``Dispatcher.grant_shared``), and a freed slot goes back to the store (``release``).
- LOCAL (the store is unreachable): this replica grants from its own queue, on the slots that fall
  to it. Slot k of the pool (counted over the backends in order) is its when k mod n is its rank
  among the n replicas last seen: never more than the pool has. A slot of its share that it does
  not hold becomes usable one lease period after the store was lost (by then a replica that held
  it has stopped, unable to renew); a slot it holds outside its share is given up when its lease
  would have run out (that answer ends with ``LeaseLost``). That point is kept in SHARED mode too,
  by a timer each renewal re-arms: a call to a store cut off without a reset fails only by its
  timeouts, which can outlast a short lease.
- Rejoin (the store answers again): its leases are renewed (re-taken where the store lost them;
  an answer whose slot went to another replica meanwhile is ended), its waiting entries replace
  what the store had of it, and the free lists are emptied again.

The fallback assumes the store is gone for every replica. A replica cut off alone from a store the
others still reach takes its share one lease period after it lost the store, while the store may
have given those slots to others: the overlap lasts until it rejoins (its renewal reports the
conflict and ends the answer). docs/operations.md ("Several replicas") says so.

Calls to the store go through one worker, in order: a cancel never overtakes its enqueue.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from clairvoyant.errors import LeaseLost, Superseded
from clairvoyant.scheduling.cluster.shared import (
    BackendSpec,
    Entry,
    HeldLease,
    Message,
    MessageKind,
    RenewReply,
    StoreUnavailable,
)
from clairvoyant.scheduling.queue_view import (
    ClusterLeaseView,
    ClusterPartView,
    ClusterWaitingView,
    ReplicaHealthView,
)
from clairvoyant.scheduling.request import RequestStatus, Ticket

if TYPE_CHECKING:
    from clairvoyant.scheduling.cluster.store import RedisSlotStore
    from clairvoyant.scheduling.dispatcher import Dispatcher

__all__ = ["ClusterLink", "ClusterOptions", "Mode", "supersede_digest"]

logger = logging.getLogger(__name__)

ViewT = TypeVar("ViewT", bound=BaseModel)

# The heartbeat: it renews the leases held and, in the same script, reclaims a silent replica's
# expired leases, so a dead replica's slots are back within a second of their lease's end.
RENEW_EVERY_S = 1.0
REJOIN_EVERY_S = 0.5  # while the store is gone: how often it is tried again
RETRY_MESSAGES_S = 0.5  # after the grant listener lost its connection


class Mode(enum.Enum):
    SHARED = "shared"
    LOCAL = "local"


def _view(kind: type[ViewT], record: object) -> ViewT:
    """The store's record as a /queue row: the view's fields, read off the record (trusted: not validated)."""
    return kind.model_construct(**{name: getattr(record, name) for name in kind.model_fields})


def supersede_digest(tenant: str, key: str) -> str:
    """What the store keeps of an X-Clairvoyant-Supersede key: a digest, never the header."""
    return hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()[:32]


@dataclass(slots=True)
class _LastRenewal:
    """The last renewal the store took, and the timer that gives up the slots held outside the
    share unless a later one is taken (SHARED mode; LOCAL mode has its own timers)."""

    sent_s: float  # monotonic seconds it was sent: the leases it extended last lease_s from then
    overdue: asyncio.TimerHandle | None = None


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    """The settings a replica's side of the shared queue runs by."""

    cluster_name: str
    lease_s: float  # seconds a lease lives unrenewed
    fair_share: bool = True  # off: every entry is one tenant's ("" to the store)
    supersede_running: bool = False  # a supersede that reaches a running request aborts it


class ClusterLink:
    def __init__(
        self,
        store: RedisSlotStore,
        options: ClusterOptions,
        weights: Mapping[str, float],
        on_heartbeat: Callable[[tuple[str, ...]], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.options = options
        self.weights = weights  # fair-share weight by tenant (the app's dict: a reload updates it)
        self.on_heartbeat = on_heartbeat  # after each renewal the store took: the live replicas
        self.mode = Mode.SHARED
        self.replicas: tuple[str, ...] = (store.replica,)  # the live replicas last seen, in rank order
        self._tickets: dict[str, Ticket] = {}  # in the store: from enqueue until released
        self._supersede: dict[int, str] = {}  # id(ticket) -> its supersede digest, for its entry
        self._calls: asyncio.Queue[Callable[[], Awaitable[object]]] = asyncio.Queue()
        self.dispatcher: Dispatcher  # set by ``start``, before any call from it or the store
        self._renewal = _LastRenewal(time.monotonic())
        self._local_timers: list[asyncio.TimerHandle] = []  # LOCAL mode's: its share, and its give-up

    # -- start and stop ------------------------------------------------------------------------
    async def start(self, dispatcher: Dispatcher, *, fallback: bool) -> None:
        """Join the store with the dispatcher's pool, then run the worker, the grant listener and
        the renewals as the dispatcher's tasks. Raises ``StoreUnavailable`` when the store cannot be
        reached, unless ``fallback``: then it starts LOCAL, alone until it joins."""
        self.dispatcher = dispatcher
        dispatcher.cluster.side = self
        try:
            sent_s = time.monotonic()
            await self.store.join(self._pool())
            self._renewal.sent_s = sent_s
            self._arm_renewal_due()
            self._set_free_lists(shared=True)
        except StoreUnavailable as exc:
            if not fallback:
                raise
            logger.warning("redis is unreachable at start-up (%s): scheduling locally until it answers", exc)
            self._enter_local(time.monotonic())
        dispatcher.run_detached(self._work(), "cluster-calls", cancel_at_stop=True)
        dispatcher.run_detached(self._listen(), "cluster-grants", cancel_at_stop=True)
        dispatcher.run_detached(self._renew_periodically(), "cluster-renew", cancel_at_stop=True)

    async def leave(self) -> None:
        """Say goodbye: the store drops this replica's entries and leases at once."""
        if self._renewal.overdue is not None:
            self._renewal.overdue.cancel()
        try:
            await self.store.leave()
        except StoreUnavailable:
            pass

    @property
    def degraded(self) -> bool:
        return self.mode is Mode.LOCAL

    async def view(self, limit: int | None = None) -> ClusterPartView:
        """The whole cluster's queue, leases and replicas, for /queue (``limit``: list only the
        first waiting requests; the count covers them all)."""
        name, lease_s = self.options.cluster_name, self.options.lease_s
        part = ClusterPartView(name=name, replica=self.store.replica, mode=self.mode.value, lease_s=lease_s)
        try:
            seen = await self.store.view()
        except StoreUnavailable as exc:
            part.error = str(exc)
            return part
        waiting = seen.waiting if limit is None else seen.waiting[: max(0, limit)]
        part.quiet_s = seen.quiet_s
        part.replicas = [
            ReplicaHealthView.model_construct(replica=r.replica, beat_age_s=r.beat_age_s, live=r.beat_age_s <= lease_s)
            for r in seen.replicas
        ]
        part.waiting_count = len(seen.waiting)
        part.waiting = [_view(ClusterWaitingView, w) for w in waiting]
        part.leases = [_view(ClusterLeaseView, lease) for lease in seen.leases]
        return part

    # -- from the dispatcher (``ClusterSide``) --------------------------------------------------
    def supersede_key(self, ticket: Ticket, tenant: str, key: str) -> None:
        self._supersede[id(ticket)] = supersede_digest(tenant, key)

    def enqueued(self, ticket: Ticket, deadline_in_s: float) -> None:
        if self.mode is not Mode.SHARED:
            return
        self._tickets[ticket.request_id] = ticket
        # The entry is made when sent: by then the proxy has given it its supersede key, if any.
        self._calls.put_nowait(lambda: self._enqueue(ticket, deadline_in_s))

    def rekeyed(self, ticket: Ticket) -> None:
        if self.mode is Mode.SHARED and ticket.request_id in self._tickets:
            deadline_in_s = ticket.expires_s - ticket.arrival_s  # (the store keeps its first deadline)
            self._calls.put_nowait(lambda: self._enqueue(ticket, deadline_in_s))

    def withdrawn(self, ticket: Ticket) -> None:
        self._supersede.pop(id(ticket), None)
        request_id = ticket.request_id
        if self._tickets.pop(request_id, None) is not None and self.mode is Mode.SHARED:
            self._calls.put_nowait(lambda: self.store.cancel(request_id))

    def pool_changed(self) -> None:
        specs = self._pool()
        self._calls.put_nowait(lambda: self.store.join(specs))

    def slot_freed(self, ticket: Ticket, now: float) -> bool:
        """LOCAL: True when the slot falls to this replica's share. SHARED: the store has it back."""
        self._supersede.pop(id(ticket), None)
        request_id = ticket.request_id
        known = self._tickets.pop(request_id, None) is not None
        placement = ticket.placement
        if self.mode is Mode.LOCAL:  # it held the slot: nobody else does; free again if it falls to it
            return placement is not None and self._owns(placement.backend, placement.slot)
        if known:
            service_s = None if placement is None else max(0.0, now - placement.dispatched_s)
            self._release(request_id, service_s)
        return False

    # -- the store's calls, in order -------------------------------------------------------------
    def _release(self, request_id: str, service_s: float | None) -> None:
        """A slot goes back at once, not behind the queued calls: the next grant waits on it (and a
        granted id has no enqueue or cancel left to overtake)."""
        if self.mode is Mode.SHARED:
            self.dispatcher.run_detached(self._released(request_id, service_s), "cluster-release")

    async def _released(self, request_id: str, service_s: float | None) -> None:
        try:
            await self.store.release(request_id, service_s)
        except StoreUnavailable as exc:
            self._lost(exc)

    async def _work(self) -> None:
        while True:
            make = await self._calls.get()
            if self.mode is not Mode.SHARED:
                continue  # the rejoin sends what is still waiting, and renews what is held
            try:
                await make()
            except StoreUnavailable as exc:
                self._lost(exc)
            except Exception:  # a bug: logged; the next call goes on
                logger.exception("cluster: a call to the store failed")

    async def _enqueue(self, ticket: Ticket, deadline_in_s: float) -> None:
        if ticket.ended:  # withdrawn before it was sent: its cancel follows, harmless
            return
        placed = await self.store.enqueue(self._entry(ticket, deadline_in_s))
        if ticket.ended or ticket.status is not RequestStatus.WAITING:
            return
        # Its queue deadline, against the whole cluster's queue (the local check saw this replica's).
        if not math.isinf(ticket.expires_s):
            eta_s = placed.ahead_s / max(1, self.dispatcher.slots)
            if self.dispatcher.clock.now() + eta_s >= ticket.expires_s:
                self.dispatcher.expire_waiting(ticket, eta_s)

    def _entry(self, ticket: Ticket, deadline_in_s: float) -> Entry:
        tenant = ticket.tenant if self.options.fair_share else ""
        # The store orders a band by score, ties by arrival: fcfs sends one score for all.
        score = 0.0 if self.dispatcher.policy.name == "fcfs" else ticket.score
        return Entry(
            ticket.request_id,
            tenant,
            self.weights.get(tenant, 1.0),
            ticket.priority,
            ticket.model or "",
            score,
            ticket.predicted_s,
            self.dispatcher.guard_s(ticket),
            deadline_in_s,
            self._supersede.get(id(ticket), ""),
        )

    # -- from the store --------------------------------------------------------------------------
    async def _listen(self) -> None:
        while True:
            try:
                async for message in self.store.messages():
                    self._on_message(message)
            except StoreUnavailable as exc:
                self._lost(exc)
            await asyncio.sleep(RETRY_MESSAGES_S)

    def _on_message(self, message: Message) -> None:
        ticket = self._tickets.get(message.request_id)
        if message.kind is MessageKind.GRANT:
            index = self.dispatcher.backend_index(message.backend)
            if ticket is not None and ticket.placement is not None and not ticket.ended:
                # It runs already: a grant read twice (after a reconnect), or one Redis made late
                # for a request this replica granted itself while Redis was gone. Its renewal
                # tells the store which slot it holds; releasing by id here would free that one.
                return
            # (A grant read while LOCAL was pushed before the store was lost: not trusted. The
            # rejoin sends the request's entry again.)
            if (
                self.mode is not Mode.SHARED
                or ticket is None
                or index is None
                or not self.dispatcher.grant_shared(ticket, index, message.slot)
            ):
                # ended in between (or unknown here): the slot goes straight back
                self._tickets.pop(message.request_id, None)
                self._release(message.request_id, None)
            return
        if ticket is None:
            return
        if message.kind is MessageKind.SUPERSEDED:
            self.dispatcher.refuse_waiting(ticket, RequestStatus.SUPERSEDED, Superseded.by_newer())
        elif message.kind is MessageKind.ABORT:
            interrupt = None if ticket.placement is None else ticket.placement.interrupt
            if self.options.supersede_running and interrupt is not None:
                interrupt(RequestStatus.SUPERSEDED, Superseded.by_newer())
        elif message.kind is MessageKind.LEASE_LOST:
            self._end_lost(ticket)

    def _end_lost(self, ticket: Ticket) -> None:
        interrupt = None if ticket.placement is None else ticket.placement.interrupt
        if interrupt is not None and interrupt(
            RequestStatus.LEASE_LOST, LeaseLost("the proxy lost its hold on the backend's slot; retry")
        ):
            logger.warning("request_id=%s: its slot's lease was lost; ended its answer", ticket.request_id)

    # -- renewals, loss and rejoin ---------------------------------------------------------------
    async def _renew_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._renew_every_s if self.mode is Mode.SHARED else REJOIN_EVERY_S)
            sent_s = time.monotonic()  # the store extends the leases after this: they last at least lease_s from it
            try:
                reply = await self.store.renew(self._held())
            except StoreUnavailable as exc:
                self._lost(exc)
                continue
            self._renewal.sent_s = sent_s
            self._arm_renewal_due()
            if self.mode is Mode.LOCAL:
                await self._rejoin(reply)
            else:
                self._renewed(reply)
            if self.on_heartbeat is not None:
                try:
                    await self.on_heartbeat(self.replicas)
                except Exception:  # the heartbeat goes on
                    logger.exception("cluster: the heartbeat's hook failed")

    @property
    def _renew_every_s(self) -> float:
        """Seconds between renewals; also the margin by which an answer ends before its lease would."""
        return min(RENEW_EVERY_S, self.options.lease_s / 3)

    def _give_up_at_s(self) -> float:
        """When (monotonic seconds) the slots held outside its share are given up, unless a later
        renewal is taken: a renewal's interval before the leases that renewal extended may run out."""
        return self._renewal.sent_s + self.options.lease_s - self._renew_every_s

    def _arm_renewal_due(self) -> None:
        """Give up the slots held outside its share at ``_give_up_at_s`` unless a renewal is taken
        first, whether or not a call has failed by then: a store cut off without a reset (packets
        dropped) makes a call wait for its timeouts, which can outlast a lease."""
        if self._renewal.overdue is not None:
            self._renewal.overdue.cancel()
        delay_s = max(0.0, self._give_up_at_s() - time.monotonic())
        self._renewal.overdue = asyncio.get_running_loop().call_later(delay_s, self._renewal_overdue)

    def _renewal_overdue(self) -> None:
        if self.mode is not Mode.SHARED:
            return  # LOCAL mode's own timer gives them up (at the same time)
        logger.warning(
            "no renewal taken by redis for %.1f s: ending the answers on slots outside this replica's share",
            time.monotonic() - self._renewal.sent_s,
        )
        self._end_outside_share()

    def _pool(self) -> list[BackendSpec]:
        """The dispatcher's backends as the store registers them."""
        return [BackendSpec(b.name, b.slots, b.models) for b in self.dispatcher.backends]

    def _held(self) -> list[HeldLease]:
        return [
            HeldLease(t.request_id, b.name, slot) for b in self.dispatcher.backends for slot, t in b.running.items()
        ]

    def _renewed(self, reply: RenewReply) -> None:
        if reply.replicas:
            self.replicas = reply.replicas
        for request_id in reply.lost:
            ticket = self._tickets.get(request_id) or self._running(request_id)
            if ticket is not None:
                self._end_lost(ticket)
        if reply.reset:
            logger.warning("redis lost its state: this replica's waiting requests are sent again")
            self._calls.put_nowait(self._resync)

    def _running(self, request_id: str) -> Ticket | None:
        return next(
            (t for b in self.dispatcher.backends for t in b.running.values() if t.request_id == request_id), None
        )

    async def _resync(self) -> None:
        """Register the pool again (a store that lost its state knows no backend) and replace
        this replica's waiting entries by those waiting here."""
        await self.store.join(self._pool())
        now = self.dispatcher.clock.now()
        waiting = self.dispatcher.waiting_tickets()
        self._tickets.update({t.request_id: t for t in waiting})
        await self.store.resync([self._entry(t, t.expires_s - now) for t in waiting])

    def _lost(self, exc: BaseException) -> None:
        if self.mode is Mode.LOCAL:
            return
        logger.warning(
            "redis is unreachable (%s): scheduling locally on %s of the slots until it answers",
            exc,
            f"1/{len(self.replicas)}" if len(self.replicas) > 1 else "all",
        )
        self._enter_local(time.monotonic())

    def _enter_local(self, now_s: float) -> None:
        self.mode = Mode.LOCAL
        self._set_free_lists(shared=False)
        loop = asyncio.get_running_loop()
        # A slot of its share it does not hold: usable once any other holder's lease has run out.
        self._local_timers.append(loop.call_later(self.options.lease_s, self._share_ready))
        # A slot it holds outside its share: given up before its lease runs out in the store (one
        # renewal's interval early: the store may hand the slot on the moment it does).
        remaining_s = max(0.0, self._give_up_at_s() - now_s)
        self._local_timers.append(loop.call_later(remaining_s, self._give_up_others))

    def _share_ready(self) -> None:
        if self.mode is Mode.LOCAL:
            self._set_free_lists(shared=False, share_ready=True)

    def _give_up_others(self) -> None:
        if self.mode is Mode.LOCAL:
            self._end_outside_share()

    def _end_outside_share(self) -> None:
        for index, backend in enumerate(self.dispatcher.backends):
            for slot, ticket in list(backend.running.items()):
                if not self._owns(index, slot):
                    self._end_lost(ticket)

    async def _rejoin(self, reply: RenewReply) -> None:
        """The store answers again: back to SHARED (the renewal just sent re-took the leases held)."""
        for timer in self._local_timers:
            timer.cancel()
        self._local_timers.clear()
        self.mode = Mode.SHARED
        self._set_free_lists(shared=True)
        for backend in self.dispatcher.backends:  # what it holds is the store's to release from now on
            for ticket in backend.running.values():
                self._tickets[ticket.request_id] = ticket
        self._renewed(RenewReply(reply.lost, reply.replicas, reset=False))
        try:
            await self._resync()
        except StoreUnavailable as exc:
            self._lost(exc)
            return
        logger.warning("redis answers again: scheduling is shared with %d replica(s)", len(self.replicas))

    # -- the share -------------------------------------------------------------------------------
    def _owns(self, backend: int | None, slot: int | None) -> bool:
        """Slot ``slot`` of backend ``backend`` falls to this replica in LOCAL mode."""
        if backend is None or slot is None:
            return False
        k = sum(b.slots for b in self.dispatcher.backends[:backend]) + slot
        replicas = self.replicas if self.store.replica in self.replicas else (self.store.replica,)
        return k % len(replicas) == replicas.index(self.store.replica)

    def _set_free_lists(self, *, shared: bool, share_ready: bool = False) -> None:
        """SHARED: no free slot is the dispatcher's own. LOCAL: the slots of its share it holds
        already (free as they end), and once ``share_ready`` the rest of its share."""
        for index, backend in enumerate(self.dispatcher.backends):
            if shared or not share_ready:
                backend.free = []
            else:
                backend.free = [
                    s for s in range(backend.slots - 1, -1, -1) if s not in backend.running and self._owns(index, s)
                ]
        if not shared:
            self.dispatcher.slots_changed()
