"""One set of queue scenarios over both implementations of the scheduling order.

- ``local``: the in-process queue (``build_queue``: sjf, starvation guard, fair share) with a
  plain slot count, driven synchronously on a manual clock: what one Clairvoyant process runs.
- ``redis``: ``RedisSlotStore`` on a real redis-server, entries spread over two replicas' clients,
  grants read from each replica's message list.

Every scenario records the grant order; each asserts what the policy promises, and on Redis also
that the order is exactly the in-process one (the same scenario replayed locally).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from typing import Any, Protocol

import pytest
from polling import INTERVAL_S, until

from clairvoyant.scheduling.job_queue import Job, JobQueue
from clairvoyant.scheduling.policy import build_queue, make_policy

GUARD_TIMEOUT_S = 0.2  # the guard scenario's tau; its long entries' predicted seconds keep them far from it
_clusters = itertools.count()


class Harness(Protocol):
    granted: list[str]

    async def add(
        self, name: str, *, tenant: str = "", priority: int = 0, score: float = 0.0, predicted_s: float = 1.0
    ) -> None: ...

    async def finish(self, name: str, service_s: float | None = None) -> None: ...

    async def wait_granted(self, count: int) -> None: ...

    async def wait_overdue(self, name: str) -> None: ...


class LocalHarness:
    """``build_queue`` and ``slots`` slots: pop while a slot is free, as the dispatcher does."""

    def __init__(self, slots: int, timeout_s: float, slowdown: float, weights: dict[str, float]) -> None:
        self.queue: JobQueue[str] = build_queue(
            make_policy("sjf"),
            starvation_timeout_s=timeout_s,
            starvation_slowdown=slowdown,
            fair_share=True,
            tenant_weights=weights,
        )
        self.slots, self.timeout_s, self.slowdown = slots, timeout_s, slowdown
        self.now = 0.0
        self.granted: list[str] = []
        self.jobs: dict[str, Job[str]] = {}
        self.running: dict[str, Job[str]] = {}

    def _fill(self) -> None:
        while len(self.running) < self.slots:
            got = self.queue.pop(self.now)
            if got is None:
                return
            job = got[0]
            self.running[job.payload] = job
            self.granted.append(job.payload)

    async def add(
        self, name: str, *, tenant: str = "", priority: int = 0, score: float = 0.0, predicted_s: float = 1.0
    ) -> None:
        self.now += 0.001
        job = Job(name, self.now, score=score, predicted_s=predicted_s, priority=priority, tenant=tenant)
        self.jobs[name] = job
        self.queue.push(job)
        self._fill()

    async def finish(self, name: str, service_s: float | None = None) -> None:
        job = self.running.pop(name)
        if service_s is not None:  # the in-process correction: charge the measured seconds
            old, job.predicted_s = job.predicted_s, service_s
            self.queue.repriced(job, old)
        self.queue.done(job)
        self._fill()

    async def wait_granted(self, count: int) -> None:
        assert len(self.granted) >= count, f"only {self.granted} granted"

    async def wait_overdue(self, name: str) -> None:
        job = self.jobs[name]
        self.now = max(self.now, job.arrival_s + self.timeout_s + self.slowdown * job.predicted_s + 0.001)


class RedisHarness:
    """Two replicas' stores on one cluster of the session's redis-server; one backend of ``slots``."""

    def __init__(
        self, url: str, slots: int, timeout_s: float, slowdown: float, weights: dict[str, float], replicas: int = 2
    ) -> None:
        from clairvoyant.scheduling.cluster.store import RedisSlotStore

        cluster = f"contract{next(_clusters)}"
        # A lease long enough that none runs out under a loaded machine (the order would then be
        # the reclaims', not the policy's); a new cluster's pause is the lesser of it and 3 s.
        self.stores = [RedisSlotStore(url, cluster, f"r{i}", lease_s=2.0, poll_s=0.2) for i in range(replicas)]
        self.slots, self.timeout_s, self.slowdown, self.weights = slots, timeout_s, slowdown, weights
        self.granted: list[str] = []
        self.owner: dict[str, Any] = {}
        self.held: dict[str, Any] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.n_added = 0

    async def start(self) -> None:
        from clairvoyant.scheduling.cluster.shared import BackendSpec

        for store in self.stores:
            await store.join([BackendSpec("gpu", self.slots)])
            self.tasks.append(asyncio.create_task(self._consume(store)))
            self.tasks.append(asyncio.create_task(self._beat(store)))
        await self._until_view(lambda v: v.quiet_s == 0, "the new cluster's quiet period to end")

    async def _consume(self, store: Any) -> None:
        from clairvoyant.scheduling.cluster.shared import HeldLease, MessageKind

        async for msg in store.messages():
            assert msg.kind is MessageKind.GRANT, msg
            self.held[msg.request_id] = HeldLease(msg.request_id, msg.backend, msg.slot)
            self.granted.append(msg.request_id)

    async def _beat(self, store: Any) -> None:
        while True:
            mine = [h for name, h in self.held.items() if self.owner[name] is store]
            await store.renew(mine)
            await asyncio.sleep(0.1)

    async def _until_view(self, predicate: Any, what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(await self.stores[0].view()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            await asyncio.sleep(INTERVAL_S)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for store in self.stores:
            await store.leave()
            await store.aclose()

    async def add(
        self, name: str, *, tenant: str = "", priority: int = 0, score: float = 0.0, predicted_s: float = 1.0
    ) -> None:
        from clairvoyant.scheduling.cluster.shared import Entry

        store = self.stores[self.n_added % len(self.stores)]
        self.n_added += 1
        self.owner[name] = store
        guard_s = self.timeout_s + self.slowdown * predicted_s
        await store.enqueue(
            Entry(
                name,
                tenant=tenant,
                weight=self.weights.get(tenant, 1.0),
                priority=priority,
                score=score,
                predicted_s=predicted_s,
                guard_s=guard_s,
            )
        )

    async def finish(self, name: str, service_s: float | None = None) -> None:
        self.held.pop(name)
        await self.owner[name].release(name, service_s)

    async def wait_granted(self, count: int) -> None:
        await until(lambda: len(self.granted) >= count, timeout_s=10.0, what=f"{count} grants")

    async def wait_overdue(self, name: str) -> None:
        await self._until_view(lambda v: any(w.request_id == name and w.overdue for w in v.waiting), f"{name} overdue")


async def drain(h: Harness, count: int, service_s: dict[str, float] | None = None) -> None:
    """Finish the running entry and wait for the next grant, ``count`` times (one slot)."""
    for _ in range(count):
        running, n = h.granted[-1], len(h.granted)
        await h.finish(running, (service_s or {}).get(running))
        await h.wait_granted(n + 1)


def on_both(impl: str, request: pytest.FixtureRequest, scenario: Any, **setup: Any) -> list[str]:
    """Run ``scenario(harness)`` on ``impl``; on Redis also locally, and require the same order."""
    server = request.getfixturevalue("redis_server") if impl == "redis" else None
    return asyncio.run(_on_both(server, scenario, setup))


async def _on_both(server: Any, scenario: Any, setup: dict[str, Any]) -> list[str]:
    args = {"slots": 1, "timeout_s": math.inf, "slowdown": 0.0, "weights": {}, **setup}
    local = LocalHarness(**args)
    await scenario(local)
    if server is None:
        return local.granted
    remote = RedisHarness(server.url, **args)
    await remote.start()
    try:
        await scenario(remote)
    finally:
        await remote.stop()
    assert remote.granted == local.granted, "the shared store's order differs from the in-process queue's"
    return remote.granted


IMPLS = pytest.mark.parametrize("impl", ["local", "redis"])


@IMPLS
def test_bands_are_strict(impl: str, request: pytest.FixtureRequest) -> None:
    async def scenario(h: Harness) -> None:
        await h.add("blocker", score=0.0)
        await h.wait_granted(1)
        # Bands hold across tenants too: fair share would otherwise serve "low" and "mid" first.
        await h.add("low", tenant="t1", priority=2, score=0.0)
        await h.add("mid", tenant="t2", priority=1, score=1.0)
        await h.add("top-long", tenant="t3", priority=0, score=9.0)
        await h.add("top-short", tenant="t3", priority=0, score=2.0)
        await drain(h, 4)

    order = on_both(impl, request, scenario)
    assert order == ["blocker", "top-short", "top-long", "mid", "low"]


@IMPLS
def test_shortest_first_ties_by_arrival(impl: str, request: pytest.FixtureRequest) -> None:
    async def scenario(h: Harness) -> None:
        await h.add("blocker")
        await h.wait_granted(1)
        for name, score in [("a", 3.0), ("b", 1.0), ("c", 2.0), ("d", 1.0), ("e", 0.5)]:
            await h.add(name, score=score)
        await drain(h, 5)

    order = on_both(impl, request, scenario)
    assert order == ["blocker", "e", "b", "d", "c", "a"]


@IMPLS
def test_guard_promotes_the_overdue_entry(impl: str, request: pytest.FixtureRequest) -> None:
    # guard = tau + 1 x predicted_s: "old" (predicted 1 ms) becomes overdue at tau; the short ones
    # (predicted 100 s) never do during the test, so only the guard can put "old" before them.
    async def scenario(h: Harness) -> None:
        await h.add("blocker", score=0.0, predicted_s=100.0)
        await h.wait_granted(1)
        await h.add("old", score=50.0, predicted_s=0.001)
        for name, score in [("s3", 3.0), ("s1", 1.0), ("s2", 2.0)]:
            await h.add(name, score=score, predicted_s=100.0)
        await h.wait_overdue("old")
        await drain(h, 4)

    order = on_both(impl, request, scenario, timeout_s=GUARD_TIMEOUT_S, slowdown=1.0)
    assert order == ["blocker", "old", "s1", "s2", "s3"]


FAIR_TOLERANCE = 0.05  # B's share of the served seconds: 0.75 +- this


@IMPLS
def test_fair_share_by_weight_over_a_long_run(impl: str, request: pytest.FixtureRequest) -> None:
    """Tenants A (weight 1) and B (weight 3) both backlogged; A's requests take twice their predicted
    seconds, which the release corrects: B still gets 3/4 of the seconds actually served."""
    rng = random.Random(7)
    predicted = {f"{t}{i}": rng.uniform(0.5, 2.0) for i in range(120) for t in "AB"}
    measured = {name: p * (2.0 if name[0] == "A" else 1.0) for name, p in predicted.items()}
    grants = 120

    async def scenario(h: Harness) -> None:
        await h.add("blocker", tenant="X", predicted_s=1.0)
        await h.wait_granted(1)
        for name, p in predicted.items():
            await h.add(name, tenant=name[0], score=p, predicted_s=p)
        await drain(h, grants, measured)

    order = on_both(impl, request, scenario, weights={"A": 1.0, "B": 3.0})
    served = order[1:grants]  # finished ones (the last granted still runs)
    seconds = {t: sum(measured[n] for n in served if n[0] == t) for t in "AB"}
    share_b = seconds["B"] / (seconds["A"] + seconds["B"])
    assert abs(share_b - 0.75) <= FAIR_TOLERANCE, f"B got {share_b:.3f} of the served seconds"
    a_first = [n for n in served if n[0] == "A"]
    assert a_first == sorted(a_first, key=predicted.__getitem__), "inside a tenant: shortest first"
