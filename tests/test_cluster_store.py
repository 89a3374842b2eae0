"""``RedisSlotStore`` on a real redis-server: races, leases, silent replicas, an empty restart,
supersede across replicas, routing, deadlines, and Redis unreachable.

The queue's order itself is in test_queue_store_contract.py (the same scenarios as in-process).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from polling import INTERVAL_S, until
from redis_server import RedisServer, free_port

from clairvoyant.scheduling.cluster.shared import (
    BackendSpec,
    Entry,
    HeldLease,
    Message,
    MessageKind,
    RenewReply,
    StoreUnavailable,
)
from clairvoyant.scheduling.cluster.store import ClusterView, RedisSlotStore

_clusters = itertools.count()


def new_cluster() -> str:
    return f"store{next(_clusters)}"


class Replica:
    """One replica's side: its store, the messages it got, the leases it holds, its heartbeat."""

    def __init__(self, url: str, cluster: str, name: str, lease_s: float = 1.0) -> None:
        self.store = RedisSlotStore(url, cluster, name, lease_s=lease_s, poll_s=0.2)
        self.messages: list[Message] = []
        self.held: dict[str, HeldLease] = {}
        self.renewals: list[RenewReply] = []
        self.renew_held = True  # False: beat, but leave the leases out (they are not renewed)
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, backends: list[BackendSpec], beat: bool = True) -> None:
        await self.store.join(backends)
        self.tasks.append(asyncio.create_task(self._consume()))
        if beat:
            self.tasks.append(asyncio.create_task(self._beat()))

    async def _consume(self) -> None:
        async for msg in self.store.messages():
            self.messages.append(msg)
            if msg.kind is MessageKind.GRANT:
                self.held[msg.request_id] = HeldLease(msg.request_id, msg.backend, msg.slot)
            elif msg.kind is MessageKind.LEASE_LOST:
                self.held.pop(msg.request_id, None)

    async def _beat(self) -> None:
        while True:
            try:
                reply = await self.store.renew(list(self.held.values()) if self.renew_held else [])
                self.renewals.append(reply)
            except StoreUnavailable:
                pass  # Redis restarting: beat again
            await asyncio.sleep(self.store.lease_s / 5)

    def got(self, kind: MessageKind) -> list[str]:
        return [m.request_id for m in self.messages if m.kind is kind]

    async def release(self, request_id: str, service_s: float | None = None) -> None:
        self.held.pop(request_id, None)
        await self.store.release(request_id, service_s)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        try:
            await self.store.leave()
        except StoreUnavailable:
            pass
        await self.store.aclose()


async def until_view(store: RedisSlotStore, predicate: Callable[[ClusterView], bool], what: str) -> ClusterView:
    deadline = time.monotonic() + 10.0
    while True:
        view = await store.view()
        if predicate(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last view: {view}")
        await asyncio.sleep(INTERVAL_S)


async def started(
    url: str, backends: list[BackendSpec], names: list[str], lease_s: float = 1.0, beat: bool = True
) -> list[Replica]:
    """Replicas joined to a new cluster, past its first quiet period."""
    cluster = new_cluster()
    replicas = [Replica(url, cluster, name, lease_s) for name in names]
    for replica in replicas:
        await replica.start(backends, beat)
    await until_view(replicas[0].store, lambda v: v.quiet_s == 0, "the new cluster's quiet period to end")
    return replicas


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


GPU = [BackendSpec("gpu", 1)]


def test_racing_replicas_never_hold_more_leases_than_slots(redis_server: RedisServer) -> None:
    backends = [BackendSpec("a", 2), BackendSpec("b", 1)]
    slots = {b.name: b.slots for b in backends}
    per_replica = 40

    async def test() -> None:
        cluster = new_cluster()
        stores = [RedisSlotStore(redis_server.url, cluster, f"r{i}", lease_s=1.0, poll_s=0.2) for i in range(3)]
        for store in stores:
            await store.join(backends)
        await until_view(stores[0], lambda v: v.quiet_s == 0, "the new cluster's quiet period to end")
        busy: set[tuple[str, int]] = set()
        most = dict.fromkeys(slots, 0)
        violations: list[str] = []
        granted: list[str] = []
        rng = random.Random(3)

        async def serve(store: RedisSlotStore) -> None:
            async for msg in store.messages():
                place = (msg.backend, msg.slot)
                if place in busy or not 0 <= msg.slot < slots[msg.backend]:
                    violations.append(f"{msg.request_id} got {place}, already busy")
                busy.add(place)
                most[msg.backend] = max(most[msg.backend], sum(1 for b, _ in busy if b == msg.backend))
                granted.append(msg.request_id)
                await asyncio.sleep(rng.uniform(0, 0.003))
                busy.discard(place)
                await store.release(msg.request_id, None)

        servers = [asyncio.create_task(serve(store)) for store in stores]
        await asyncio.gather(
            *(
                store.enqueue(Entry(f"{store.replica}-{i}", tenant=f"t{i % 3}", priority=i % 2, score=rng.random()))
                for i in range(per_replica)
                for store in stores
            )
        )
        await until(lambda: len(granted) >= 3 * per_replica, timeout_s=60, what="every entry granted")
        view = await until_view(stores[0], lambda v: not v.leases, "every lease released")
        for task in servers:
            task.cancel()
        await asyncio.gather(*servers, return_exceptions=True)
        for store in stores:
            await store.leave()
            await store.aclose()
        assert violations == []
        assert sorted(granted) == sorted(f"r{r}-{i}" for r in range(3) for i in range(per_replica))
        assert all(most[b] <= slots[b] for b in slots), most
        assert view.waiting == ()

    run(test)


def test_a_lease_not_renewed_comes_back_to_the_next_in_line(redis_server: RedisServer) -> None:
    async def test() -> None:
        a, b = await started(redis_server.url, GPU, ["a", "b"])
        a.renew_held = False  # a beats (it stays in the cluster) but never renews its lease
        await a.store.enqueue(Entry("x"))
        await until(lambda: a.got(MessageKind.GRANT) == ["x"], what="x granted")
        await b.store.enqueue(Entry("y"))
        await until(lambda: b.got(MessageKind.GRANT) == ["y"], what="y granted after x's lease expired")
        await until(lambda: a.got(MessageKind.LEASE_LOST) == ["x"], what="a told its lease is lost")
        view = await a.store.view()
        assert [(lv.backend, lv.slot, lv.request_id, lv.replica) for lv in view.leases] == [("gpu", 0, "y", "b")]
        await a.stop()
        await b.stop()

    run(test)


def test_renew_extends_a_held_lease(redis_server: RedisServer) -> None:
    async def test() -> None:
        (a,) = await started(redis_server.url, GPU, ["a"], lease_s=1.0, beat=False)
        await a.store.enqueue(Entry("x"))
        await until(lambda: "x" in a.held, what="x granted")
        first = (await a.store.view()).leases[0].expires_in_s
        await until_view(a.store, lambda v: v.leases[0].expires_in_s < first - 0.05, "time to pass")
        reply = await a.store.renew([a.held["x"]])
        assert reply.lost == () and reply.replicas == ("a",) and not reply.reset
        assert (await a.store.view()).leases[0].expires_in_s > first - 0.05
        await a.stop()

    run(test)


def test_a_replica_that_stops_beating_loses_its_waiting_entries(redis_server: RedisServer) -> None:
    async def test() -> None:
        b, a = await started(redis_server.url, GPU, ["b", "a"])
        await b.store.enqueue(Entry("b-running"))
        await until(lambda: "b-running" in b.held, what="b's entry granted")
        for task in a.tasks[1:]:  # a's heartbeat stops (a paused or cut off)
            task.cancel()
        await a.store.enqueue(Entry("a1"))
        await a.store.enqueue(Entry("a2"))
        await b.store.enqueue(Entry("b-waiting"))
        view = await until_view(
            b.store, lambda v: [r.replica for r in v.replicas] == ["b"], "a dropped from the cluster"
        )
        assert [w.request_id for w in view.waiting] == ["b-waiting"]
        assert [lv.request_id for lv in view.leases] == ["b-running"]
        reply = await a.store.renew([])
        assert reply.reset, "a replica dropped must send its waiting entries again"
        assert await a.store.cancel("a1"), "a dropped entry is not granted"
        await a.stop()
        await b.stop()

    run(test)


def test_empty_restart_waits_for_leases_to_be_retaken(own_redis_server: RedisServer) -> None:
    async def test() -> None:
        a, b = await started(own_redis_server.url, GPU, ["a", "b"], lease_s=1.0)
        await a.store.enqueue(Entry("x"))
        await until(lambda: "x" in a.held, what="x granted")
        own_redis_server.restart_empty()
        await b.store.join(GPU)  # b re-registers first: the store starts a quiet period
        await b.store.enqueue(Entry("y"))
        view = await until_view(b.store, lambda v: [lv.request_id for lv in v.leases] == ["x"], "x's lease re-taken")
        assert view.quiet_s > 0
        await until(lambda: any(r.reset for r in a.renewals), what="a told to resync")
        await until_view(b.store, lambda v: v.quiet_s == 0, "the quiet period to end")
        await b.store._call("tick")  # reclaim, drop, grant: what every call does first
        view = await b.store.view()
        assert [lv.request_id for lv in view.leases] == ["x"], "the slot x holds was granted again"
        assert [w.request_id for w in view.waiting] == ["y"]
        assert b.got(MessageKind.GRANT) == []
        await a.release("x")
        await until(lambda: b.got(MessageKind.GRANT) == ["y"], what="y granted once x left")
        reply = await a.store.renew([HeldLease("ghost", "gpu", 0)])
        assert reply.lost == ("ghost",), "a slot someone holds is never re-taken"
        await a.store.enqueue(Entry("z"))  # a's message loop reconnected after the restart
        await b.release("y")
        await until(lambda: "z" in a.held, what="z granted to a")
        await a.stop()
        await b.stop()

    run(test)


def test_a_new_cluster_pauses_a_few_heartbeats_and_a_lost_state_one_lease(own_redis_server: RedisServer) -> None:
    """A replica's first join into an empty store cannot have held anything there: the pause is
    3 s, not the lease. A replica that knew the store's state and finds it gone: one lease."""

    async def test() -> None:
        first = RedisSlotStore(own_redis_server.url, new_cluster(), "a", lease_s=20.0)
        await first.join(GPU)
        assert 0 < (await first.view()).quiet_s <= 3.0
        own_redis_server.restart_empty()
        await first.join(GPU)  # it knew the old epoch
        assert (await first.view()).quiet_s > 15.0
        await first.aclose()

    run(test)


def test_supersede_across_replicas(redis_server: RedisServer) -> None:
    async def test() -> None:
        a, b = await started(redis_server.url, GPU, ["a", "b"])
        await a.store.enqueue(Entry("run1", supersede_key="k1"))
        await until(lambda: "run1" in a.held, what="run1 granted")
        await a.store.enqueue(Entry("wait1", supersede_key="k2"))
        await b.store.enqueue(Entry("wait2", supersede_key="k2"))
        await until(lambda: a.got(MessageKind.SUPERSEDED) == ["wait1"], what="wait1 superseded")
        await b.store.enqueue(Entry("run2", supersede_key="k1"))
        await until(lambda: a.got(MessageKind.ABORT) == ["run1"], what="run1 asked to abort")
        view = await a.store.view()
        assert [w.request_id for w in view.waiting] == ["wait2", "run2"]
        assert [lv.request_id for lv in view.leases] == ["run1"], "an abort is a request: the lease stays"
        await a.stop()
        await b.stop()

    run(test)


def test_an_entry_past_its_deadline_is_never_granted(redis_server: RedisServer) -> None:
    async def test() -> None:
        (a,) = await started(redis_server.url, GPU, ["a"])
        await a.store.enqueue(Entry("x"))
        await until(lambda: "x" in a.held, what="x granted")
        await a.store.enqueue(Entry("late", score=0.0, deadline_s=0.2))
        await a.store.enqueue(Entry("later", score=5.0))
        await until_view(a.store, lambda v: v.waiting[0].expires_in_s < 0, "late's deadline to pass")
        await a.release("x")
        await until(lambda: "later" in a.held, what="later granted")
        assert a.got(MessageKind.GRANT) == ["x", "later"]
        assert (await a.store.view()).waiting == ()
        await a.stop()

    run(test)


def test_routing_by_model_prefers_the_backend_that_holds_it(redis_server: RedisServer) -> None:
    backends = [BackendSpec("a", 1, ("m1",)), BackendSpec("b", 1), BackendSpec("c", 1)]

    async def test() -> None:
        (r,) = await started(redis_server.url, backends, ["r"])
        await r.store.enqueue(Entry("p", model="m2"))  # a does not serve m2: b, first by name
        await r.store.enqueue(Entry("q", model="m3"))
        await until(lambda: len(r.held) == 2, what="p and q granted")
        assert (r.held["p"].backend, r.held["q"].backend) == ("b", "c")
        await r.release("p")
        await r.release("q")
        await r.store.enqueue(Entry("s", model="m3"))  # c holds m3: c, although b comes first
        await r.store.enqueue(Entry("t", model="m1"))
        await until(lambda: len(r.held) == 2, what="s and t granted")
        assert (r.held["s"].backend, r.held["t"].backend) == ("c", "a")
        await r.stop()

    run(test)


def test_redis_unreachable_raises_store_unavailable(own_redis_server: RedisServer) -> None:
    async def test() -> None:
        nobody = RedisSlotStore(f"redis://127.0.0.1:{free_port()}/0", new_cluster(), "r")
        with pytest.raises(StoreUnavailable):
            await nobody.join(GPU)
        await nobody.aclose()
        store = RedisSlotStore(own_redis_server.url, new_cluster(), "r")
        await store.join(GPU)
        own_redis_server.stop()
        with pytest.raises(StoreUnavailable):
            await store.enqueue(Entry("x"))
        await store.aclose()

    run(test)


def test_enqueue_places_the_entry_in_the_whole_queue(redis_server: RedisServer) -> None:
    """``Placed``: the entries ahead, and their predicted seconds plus what the running request
    has left of its 100 (stated tolerance: the test's own seconds since that grant, under 5)."""

    async def test() -> None:
        a, b = await started(redis_server.url, GPU, ["a", "b"])
        await a.store.enqueue(Entry("running", predicted_s=100.0))
        await until(lambda: "running" in a.held, what="the slot taken")

        async def placed(store: RedisSlotStore, entry: Entry, ahead: int, ahead_s: float) -> None:
            got = await store.enqueue(entry)
            assert got.ahead == ahead
            assert ahead_s + 95.0 <= got.ahead_s <= ahead_s + 100.0, got

        await placed(a.store, Entry("s1", score=1.0, predicted_s=2.0), 0, 0.0)
        await placed(b.store, Entry("s3", score=3.0, predicted_s=5.0), 1, 2.0)
        await placed(a.store, Entry("s2", score=2.0, predicted_s=1.0), 1, 2.0)
        await placed(b.store, Entry("low", priority=1, score=0.0), 3, 8.0)
        await placed(a.store, Entry("top", priority=-1, score=9.0), 0, 0.0)
        view = await a.store.view()
        assert [w.request_id for w in view.waiting] == ["top", "s1", "s2", "s3", "low"]
        assert [w.replica for w in view.waiting] == ["a", "a", "a", "b", "b"]
        await a.stop()
        await b.stop()

    run(test)


def test_resync_replaces_the_waiting_entries_and_leave_withdraws_them(redis_server: RedisServer) -> None:
    async def test() -> None:
        a, b = await started(redis_server.url, GPU, ["a", "b"])
        await b.store.enqueue(Entry("b-running"))
        await until(lambda: "b-running" in b.held, what="the slot taken")
        await a.store.enqueue(Entry("w1", score=1.0))
        await a.store.enqueue(Entry("w2", score=2.0))
        await b.store.enqueue(Entry("b-waiting", score=1.5))
        await a.store.resync([Entry("w3", score=0.5), Entry("w2", score=2.0)])
        view = await a.store.view()
        assert [w.request_id for w in view.waiting] == ["w3", "b-waiting", "w2"]
        await a.stop()  # its heartbeat ends, then it leaves
        view = await b.store.view()
        assert [w.request_id for w in view.waiting] == ["b-waiting"]
        assert [r.replica for r in view.replicas] == ["b"]
        await b.stop()

    run(test)


def test_a_message_taken_by_a_connection_that_died_comes_again(redis_server: RedisServer) -> None:
    """A message Redis moved to a replica's pending list for a connection that then died (its
    BLMOVE's reply lost) is yielded after the reconnect, then removed from the list."""
    import redis.asyncio as aioredis

    async def test() -> None:
        store = RedisSlotStore(redis_server.url, new_cluster(), "a", lease_s=5.0, poll_s=0.2)
        await store.join(GPU)
        raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        pending = store.prefix + "mp:a"
        await raw.rpush(pending, "superseded lost-on-the-way")  # as BLMOVE left it for the dead connection
        await raw.rpush(store.prefix + "m:a", "superseded next")
        messages = store.messages()
        first = await asyncio.wait_for(anext(messages), 10)
        second = await asyncio.wait_for(anext(messages), 10)
        assert [first.request_id, second.request_id] == ["lost-on-the-way", "next"]
        assert await raw.lrange(pending, 0, -1) == ["superseded next"]  # the first handled, the second in hand
        await store.leave()
        assert not await raw.exists(pending)
        await raw.aclose()
        await store.aclose()

    run(test)


def test_resync_takes_back_a_grant_the_replica_never_took(redis_server: RedisServer) -> None:
    """A grant the replica could not trust (read while it had lost Redis) is not held; when the
    replica sends that request again as waiting, the store gives the slot back and queues it."""

    async def test() -> None:
        (a,) = await started(redis_server.url, GPU, ["a"])
        await a.store.enqueue(Entry("x"))
        await until(lambda: "x" in a.held, what="x granted")
        a.held.pop("x")  # not taken: it still waits on the replica
        a.messages.clear()
        await a.store.resync([Entry("x")])
        await until(lambda: a.got(MessageKind.GRANT) == ["x"], what="x granted again")
        view = await a.store.view()
        assert [lv.request_id for lv in view.leases] == ["x"]  # one lease, not two
        await a.stop()

    run(test)


def test_renew_is_the_truth_about_a_replicas_own_slots(redis_server: RedisServer) -> None:
    """While Redis was gone a replica's request x ended and y took its slot; a late enqueue also
    got y a second slot. The renewal saying y runs on x's slot ends x's lease and y's other one:
    one lease, on the slot y runs on, and the other slot free for the next in line."""

    async def test() -> None:
        two = [BackendSpec("gpu", 2)]
        (a,) = await started(redis_server.url, two, ["a"], lease_s=5.0)  # no lease runs out meanwhile
        a.renew_held = False  # the test says what is held
        await a.store.enqueue(Entry("x"))
        await a.store.enqueue(Entry("y"))
        await until(lambda: {"x", "y"} <= set(a.held), what="x and y granted")
        x_slot, y_slot = a.held["x"].slot, a.held["y"].slot
        reply = await a.store.renew([HeldLease("y", "gpu", x_slot)])
        assert reply.lost == ()
        view = await a.store.view()
        assert [(lv.request_id, lv.slot) for lv in view.leases] == [("y", x_slot)]
        await a.store.enqueue(Entry("z"))
        await until(lambda: "z" in a.held, what="z granted the freed slot")
        assert a.held["z"].slot == y_slot
        await a.stop()

    run(test)
