"""``RedisSlotStore``: the shared queue and slots in Redis, every decision one Lua script.

Each call (join, enqueue, cancel, release, renew, resync, leave) is one ``EVALSHA`` of
grant.lua, which reads Redis's clock (``TIME``), changes what the call changes, reclaims expired
leases, drops replicas that stopped beating, and ends with the grant step: while a backend has a
free slot (slots minus live leases) and an entry it serves waits, the policy's next entry gets the
slot. The grant goes onto the owning replica's list (``grant <id> <backend> <slot>``), where
``messages()`` waits in ``BLPOP`` on a connection of its own: no polling, no pub/sub (which drops
what is sent during a reconnect). Python never reads, changes and writes back.

The policy (the in-process ``build_queue``'s sjf + ``StarvationGuard`` + ``FairShareQueue``):

- Strict priority bands: a lower ``Entry.priority`` goes first.
- Fair share between tenants: start-time fair queuing on ``predicted_s / weight``. A tenant is
  active while it has an entry waiting or granted; one that becomes active starts at the virtual
  time (the start tag of the last grant), so idling banks no credit. A release with ``service_s``
  charges the measured seconds instead of the predicted ones. Among the tenants' heads: the best
  band, then the least start tag, then fewer entries waiting, then arrival. Send ``tenant=""`` for
  every entry when fair share is off: one tenant is exactly the inner order.
- Inside a tenant: the lowest ``score`` first, ties by arrival.
- The starvation guard: an entry that has waited longer than its ``guard_s`` is overdue. A
  tenant's oldest overdue entry goes before its policy head when it arrived earlier, and an overdue
  head joins the best band waiting anywhere (fair share still decides between tenants), as in
  ``FairShareQueue``. The one simplification: the guard runs on the wall clock (Redis's), not on
  the in-process share clock (wall seconds / tenants waiting). With k tenants waiting an entry
  therefore becomes overdue up to k times sooner than in-process; the bound (once overdue, no
  entry of its tenant that arrived after it goes before it) is the same. Same-instant arrivals do
  not exist here (each call has its own ``TIME``), so overdue entries go strictly oldest first.
- Routing: an entry goes to a free backend that serves its model (``BackendSpec.models``; () =
  any), preferring one that holds it (the model of its last grant), then by name. A tenant's
  head that no free backend serves is passed over for its next entry that one does (among the
  first 256 of each band): the grant step is work-conserving.
- An entry past its ``deadline_s`` is never granted: the grant step drops it silently (its replica
  answers the client on its own timer).

``enqueue`` returns ``Placed``: the entries of every better band, the overdue ones, and in its own
band every tenant's entries with a score at most its own. Fair share inside the band is not
replayed there, so with several tenants ``ahead`` counts entries a fair turn would put after it.
Its seconds add what the running requests have left of their predicted seconds (a grant stamps
its time): the entry waits, so every slot it may take is busy.

Leases and faults:

- A grant records a lease on (backend, slot) scored by its expiry (Redis time + ``lease_s``).
  ``renew`` (the heartbeat; every ``lease_s / 3`` is the intent) extends this replica's leases; a
  lease not renewed in time is reclaimed by the next call of any replica, whose owner gets
  ``lease_lost <id>``.
- Every call is a heartbeat (``renew`` is the one a replica makes when it has nothing else to
  say). A replica silent for ``lease_s`` is dropped: its waiting entries leave the queue at once,
  its leases at their expiry. When it calls again, its next ``renew`` answers ``reset=True`` (send
  the waiting entries again with ``resync``); so does the first ``renew`` after the store lost its
  state. ``join`` registers afresh (nothing to resend).
- The meta key holds an epoch. When it is missing (Redis restarted empty, or this cluster is new)
  the first call re-creates it and nothing is granted for a while, so every replica can
  re-register its leases with ``renew`` first: ``lease_s`` when the caller knew the old epoch, 3 s
  when the caller is a replica's first ``join`` (it knew no state: a new cluster starts at once,
  and a live replica that held leases renews them within its next heartbeat, every second). A
  lease is re-taken only if that (backend, slot) is free, so no slot is granted twice; ``renew``
  reports the others in ``lost``. The store has no timer of its own: the first grant after the quiet period, and a lease's reclaim,
  come with the next call of any replica (a heartbeat at the latest).
- Supersede: a newer entry with the same ``supersede_key`` (a digest, never the raw header)
  replaces a waiting one (its replica gets ``superseded <id>``) or asks for a running one's abort
  (``abort <id>``; the replica decides).
- Connection failures raise ``StoreUnavailable``. ``messages()`` logs and reconnects.
- ``leave`` withdraws this replica's waiting entries; its leases still expire on their own (a call
  that runs on after leave never exceeds the slots).

Keys, all under ``cv:{cluster}:`` (the braces are a Redis Cluster hash tag: one slot per cluster):
``meta`` (epoch, quiet_until, vt: the virtual time), ``seq``, ``e:<id>`` (an entry's hash),
``q:<tenant>:<band>`` (score order), ``bands:<tenant>``, ``due:<tenant>`` (by guard deadline),
``over:<tenant>`` (overdue, by arrival), ``act``/``ten``/``tw``/``tf``/``twt`` (waiting tenants;
tags, waiting and granted counts, weights), ``bk``/``bm``/``holds`` (backends' slots, models and
held model), ``lease:<backend>`` (slot -> expiry), ``lid:<backend>`` (slot -> id), ``rep``
(replica -> last call), ``gone`` (replicas to tell reset), ``rw:``/``rr:<replica>`` (its waiting and granted ids), ``sk``
(supersede key -> id), ``m:<replica>`` (its messages). The script declares only the meta key;
the others are derived from it. A standalone Redis accepts that; on Redis Cluster the hash tag
keeps them in the meta key's slot (not tested here).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from clairvoyant.scheduling.cluster.shared import (
    BackendSpec,
    ClusterView,
    Entry,
    HeldLease,
    LeaseView,
    Message,
    MessageKind,
    Placed,
    RenewReply,
    ReplicaView,
    StoreUnavailable,
    WaitingView,
)

__all__ = ["ClusterView", "LeaseView", "RedisSlotStore", "ReplicaView", "WaitingView", "dispatch_order"]

log = logging.getLogger(__name__)

_SCRIPT = resources.files("clairvoyant.scheduling.cluster").joinpath("grant.lua").read_text(encoding="utf-8")
TIMEOUT_S = 1.0  # connecting, or a call: slower, and the store is unavailable
_INF = "1e300"  # what Lua reads as "never" (it cannot parse "inf" portably)


def _num(x: float) -> str:
    if math.isnan(x):
        raise ValueError("a number sent to the store must not be NaN")
    if math.isinf(x):
        return _INF if x > 0 else "-" + _INF
    return repr(float(x))


def _token(value: str, what: str) -> str:
    """Ids and names travel space-separated in messages and newline-joined in lists."""
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"{what} must be non-empty without whitespace: {value!r}")
    return value


def _entry_args(entry: Entry) -> list[str]:
    return [
        _token(entry.request_id, "request_id"),
        entry.tenant,
        _num(entry.weight),
        str(int(entry.priority)),
        entry.model,
        _num(entry.score),
        _num(entry.predicted_s),
        _num(entry.guard_s),
        _num(entry.deadline_s),
        entry.supersede_key,
    ]


def _recancel() -> None:
    """Raise the cancellation a redis-py call swallowed. A task cancelled while redis-py closes
    the call's connection can come back from the call as if nothing happened (seen with redis-py
    8.1 on Python 3.11: the task stays "cancelling" and loops on); a loop around our calls would
    then never end."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _message(raw: str) -> Message:
    kind_name, _, rest = raw.partition(" ")
    kind = MessageKind(kind_name)
    if kind is not MessageKind.GRANT:
        return Message(kind, rest)
    request_id, _, place = rest.partition(" ")
    backend, _, slot = place.rpartition(" ")
    return Message(kind, request_id, backend, int(slot))


def dispatch_order(
    waiting: Sequence[WaitingView], tags: dict[str, float], weights: dict[str, float]
) -> list[WaitingView]:
    """Replay the grant step's choice (grant.lua's ``choose``) on a snapshot, one grant at a time,
    at the snapshot's instant. ``tags``: each active tenant's start tag; ``weights``: its weight."""
    by_tenant: dict[str, list[WaitingView]] = {}
    for w in waiting:
        by_tenant.setdefault(w.tenant, []).append(w)
    queues = {t: sorted(ws, key=lambda w: (w.priority, w.score, w.seq)) for t, ws in by_tenant.items()}
    overdue = {t: sorted((w for w in ws if w.overdue), key=lambda w: -w.waited_s) for t, ws in by_tenant.items()}
    tags = dict(tags)
    out: list[WaitingView] = []
    while any(queues.values()):
        best = min(q[0].priority for q in queues.values() if q)
        pick: tuple[tuple[float, float, int, int], str, WaitingView] | None = None
        for tenant, queue in queues.items():
            if not queue:
                continue
            head, late = queue[0], False
            if overdue[tenant] and overdue[tenant][0].waited_s > head.waited_s:
                head, late = overdue[tenant][0], True
            band = best if late or head.overdue else head.priority
            key = (float(band), tags.get(tenant, 0.0), len(queue), head.seq)
            if pick is None or key < pick[0]:
                pick = (key, tenant, head)
        assert pick is not None
        _, tenant, head = pick
        queues[tenant].remove(head)
        if head in overdue[tenant]:
            overdue[tenant].remove(head)
        tags[tenant] = tags.get(tenant, 0.0) + head.predicted_s / weights.get(tenant, 1.0)
        out.append(head)
    return out


class RedisSlotStore:
    """The shared queue and slots (see the module's docstring). ``url``: a redis:// URL; ``cluster``:
    the deployment's name (two deployments may share one Redis); ``replica``: this process's id,
    unique in the cluster; ``lease_s``: seconds a lease lives unrenewed (and a replica unbeating);
    ``poll_s``: the ``BLPOP`` timeout, how soon ``messages()`` notices ``leave``."""

    def __init__(
        self,
        url: str,
        cluster: str,
        replica: str,
        lease_s: float = 15.0,
        *,
        poll_s: float = 1.0,
        switch_bound_s: float = 0.0,
    ) -> None:
        if not lease_s > 0:
            raise ValueError("lease_s must be > 0")
        if "{" in cluster or "}" in cluster:
            raise ValueError("cluster must not contain braces (they delimit its hash tag)")
        self.replica = _token(replica, "replica")
        self.cluster = cluster
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.switch_bound_s = switch_bound_s  # the model switch bound, seconds (0 = off), sent at join
        self.prefix = f"cv:{{{cluster}}}:"
        # One retry: every script is safe to run twice (an id already granted is not queued again,
        # a release or cancel of a gone entry does nothing), and a pooled connection the server
        # closed (a restart) fails once before the pool notices.
        common: dict[str, Any] = {
            "decode_responses": True,
            "socket_connect_timeout": TIMEOUT_S,
            "retry": Retry(NoBackoff(), 1),
        }
        self._redis = aioredis.Redis.from_url(url, socket_timeout=TIMEOUT_S, **common)
        # BLPOP holds its connection: a client of its own (its calls follow one another, so its pool
        # keeps one connection), with a read timeout beyond poll_s. Not ``single_connection_client``:
        # a BLPOP cancelled there could leave the task hanging in its reconnect.
        self._blocking = aioredis.Redis.from_url(url, socket_timeout=poll_s + TIMEOUT_S, **common)
        self._script = self._redis.register_script(_SCRIPT)
        self._epoch: str | None = None
        self._reset_pending = False
        self._closed = False

    async def _call(self, cmd: str, *args: str) -> list[str]:
        try:
            reply = await self._script(keys=[self.prefix + "meta"], args=[cmd, self.replica, _num(self.lease_s), *args])
        except RedisError as exc:
            raise StoreUnavailable(f"shared store at {self.cluster!r}: {exc}") from exc
        finally:
            _recancel()
        if cmd == "view":
            return [str(reply)]
        out = [str(x) for x in reply]
        self._note_epoch(out[0])
        return out[1:]

    def _note_epoch(self, epoch: str) -> None:
        if self._epoch is not None and epoch != self._epoch:
            self._reset_pending = True  # the store lost its state since we last looked
        self._epoch = epoch

    async def join(self, backends: Sequence[BackendSpec]) -> None:
        """Register this replica and the pool (again: the pool changed, or the store lost its state)."""
        args = [str(len(backends))]
        for b in backends:
            if b.slots < 0:
                raise ValueError(f"backend {b.name!r}: slots must be >= 0")
            args += [_token(b.name, "backend name"), str(b.slots), "\n".join(_token(m, "model") for m in b.models)]
        args.append(_num(self.switch_bound_s))
        args.append("fresh" if self._epoch is None else "known")  # (how long a new store's pause lasts)
        self._closed = False
        await self._call("join", *args)

    async def enqueue(self, entry: Entry) -> Placed:
        ahead, ahead_s = await self._call("enqueue", *_entry_args(entry))
        return Placed(int(ahead), float(ahead_s))

    async def cancel(self, request_id: str) -> bool:
        """Withdraw a waiting entry: False if it was granted already (its grant is on its way)."""
        (withdrawn,) = await self._call("cancel", request_id)
        return withdrawn == "1"

    async def release(self, request_id: str, service_s: float | None) -> None:
        """Give a granted slot back; ``service_s``: the measured seconds (fair share's correction)."""
        await self._call("release", request_id, "" if service_s is None else _num(service_s))

    async def renew(self, held: Sequence[HeldLease]) -> RenewReply:
        """Heartbeat: extend every held lease (re-take one the store lost while its slot is free)."""
        args = [str(len(held))]
        for lease in held:
            args += [lease.request_id, lease.backend, str(lease.slot)]
        reply = await self._call("renew", *args)
        dropped, n = reply[0] == "1", int(reply[1])
        replicas, lost = tuple(reply[2 : 2 + n]), tuple(reply[2 + n :])
        reset = self._reset_pending or dropped
        self._reset_pending = False
        return RenewReply(lost=lost, replicas=replicas, reset=reset)

    async def resync(self, waiting: Sequence[Entry]) -> None:
        """Replace this replica's waiting entries by ``waiting`` (after the store lost its state)."""
        args = [str(len(waiting))]
        for entry in waiting:
            args += _entry_args(entry)
        await self._call("resync", *args)

    async def leave(self) -> None:
        self._closed = True
        await self._call("leave")

    async def aclose(self) -> None:
        """Close both connections (after ``leave``; a ``messages()`` loop still running ends)."""
        self._closed = True
        await self._blocking.aclose()
        await self._redis.aclose()

    async def messages(self) -> AsyncIterator[Message]:
        """This replica's messages, in order. Each is moved atomically into this replica's pending
        list as it is taken (``BLMOVE``) and removed from it once handled: a message Redis gave to a
        connection that died on the way (a timeout, a paused server) stays pending and comes again
        after the reconnect, so a grant is never lost. A message may so come twice; every kind is
        safe to handle twice (a grant of a slot already held is ignored)."""
        key = self.prefix + "m:" + self.replica
        pending = self.prefix + "mp:" + self.replica
        failing, recover = False, True
        # Redis takes a fractional timeout; redis-py's annotation says int.
        timeout: Any = self.poll_s
        while not self._closed:
            try:
                got: list[Any] = await self._blocking.lrange(pending, 0, 0) if recover else []
                if not got:
                    recover = False
                    got = [await self._blocking.blmove(key, pending, timeout, "LEFT", "RIGHT")]
            except RedisError as exc:
                _recancel()
                if self._closed:
                    return
                if not failing:
                    log.warning("shared store: waiting for grants failed (%s); retrying", type(exc).__name__)
                failing, recover = True, True
                await asyncio.sleep(min(self.poll_s, 0.2))
                continue
            _recancel()
            if failing:
                log.info("shared store: waiting for grants again")
                failing = False
            raw = got[0]
            if raw is None:
                continue
            message = str(raw)  # (decode_responses: a str already)
            yield _message(message)
            try:
                await self._blocking.lrem(pending, 1, message)
            except RedisError:
                _recancel()
                recover = True  # comes again: handled twice, harmlessly

    async def view(self) -> ClusterView:
        """The whole cluster, read in one script (nothing changes, no clock-driven step runs)."""
        (raw,) = await self._call("view")
        data = json.loads(raw)
        waiting = [
            WaitingView(
                request_id=e[0],
                replica=e[1],
                tenant=e[2],
                priority=int(e[3]),
                model=e[4],
                score=float(e[5]),
                predicted_s=float(e[6]),
                waited_s=float(e[7]),
                overdue=e[9] == "1",
                expires_in_s=float(e[10]),
                seq=int(e[8]),
            )
            for e in data["entries"]
        ]
        tags = {t[0]: float(t[1]) for t in data["tenants"]}
        weights = {t[0]: float(t[2]) for t in data["tenants"]}
        leases = tuple(
            sorted(
                (LeaseView(lease[0], int(lease[1]), lease[2], lease[3], float(lease[4])) for lease in data["leases"]),
                key=lambda lv: (lv.backend, lv.slot),
            )
        )
        replicas = tuple(sorted((ReplicaView(r[0], float(r[1])) for r in data["replicas"]), key=lambda r: r.replica))
        return ClusterView(tuple(dispatch_order(waiting, tags, weights)), leases, replicas, float(data["quiet_s"]))
