"""proxy/limits.py's contract, one suite over both storages: the process's memory and a real
redis-server (started on a free loopback port). Then what only Redis does: the counts shared by
replicas, concurrent admissions on two replicas, a dead replica's counts, clusters kept apart,
what reaches Redis, and Redis lost and back.

The window follows the ``limits`` package's clock (``time.time``; neither storage takes another),
so the window's tests use a window a few seconds long and real time, polled; the UTC day follows
the injected wall clock."""

from __future__ import annotations

import asyncio
import calendar
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from polling import until
from redis_server import RedisServer

from clairvoyant.config import Limits
from clairvoyant.errors import LimitExceeded
from clairvoyant.proxy.limits import TenantLimits

NOON_S = float(calendar.timegm((2026, 11, 27, 12, 0, 0)))  # a UTC noon, in wall seconds


class Wall:
    def __init__(self, now_s: float = NOON_S) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class Limiters:
    """Makes started ``TenantLimits`` on one storage; ``run`` closes them on the scenario's loop."""

    def __init__(self, redis_url: str | None) -> None:
        self.redis_url = redis_url
        self.cluster = uuid.uuid4().hex[:8]  # each test its own cluster: nothing left by another
        self.made: list[TenantLimits] = []

    async def new(self, limits: dict[str, Limits], **options: Any) -> TenantLimits:
        if self.redis_url is not None:
            options = {"redis_url": self.redis_url, "cluster": self.cluster, **options}
        made = TenantLimits(limits, **options)
        self.made.append(made)
        await made.start()
        return made

    def run(self, scenario: Callable[[], Awaitable[None]]) -> None:
        async def main() -> None:
            try:
                await scenario()
            finally:
                for made in self.made:
                    await made.aclose()
                self.made.clear()

        asyncio.run(main())


@pytest.fixture(params=["memory", "redis"])
def limiters(request: pytest.FixtureRequest) -> Limiters:
    if request.param == "memory":
        return Limiters(None)
    return Limiters(request.getfixturevalue("redis_server").url)


@pytest.fixture
def on_redis(redis_server: RedisServer) -> Limiters:
    return Limiters(redis_server.url)


async def refusal(limits: TenantLimits, tenant: str, free_in_s: float = 1.0) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as refused:
        await limits.admit(tenant, lambda: free_in_s)
    return refused.value


# -- the contract: both storages ---------------------------------------------------------------
def test_max_concurrent_counts_in_flight_plus_waiting_until_released(limiters: Limiters) -> None:
    async def scenario() -> None:
        limits = await limiters.new({"a": Limits(max_concurrent=2)}, wall=Wall())
        await limits.admit("a", lambda: 7.2)
        await limits.admit("a", lambda: 7.2)
        refused = await refusal(limits, "a", 7.2)
        assert refused.status_code == 429 and refused.code == "concurrency_limited"
        assert refused.headers == {"Retry-After": "8"} and refused.limit == "max_concurrent"
        await limits.admit("b", lambda: 1.0)  # another tenant is not affected
        await limits.release("a")
        await limits.admit("a", lambda: 7.2)
        assert (await limits.snapshot())["a"]["in_system"] == 2
        await refusal(limits, "a")

    limiters.run(scenario)


def test_requests_per_minute_is_a_moving_window(limiters: Limiters) -> None:
    window_s = 4

    async def scenario() -> None:
        limits = await limiters.new({"a": Limits(requests_per_minute=2)}, window_s=window_s)
        first_s = time.time()
        await limits.admit("a", lambda: 1.0)
        first_done_s = time.time()  # the first admission is stamped within [first_s, first_done_s]
        await until(lambda: time.time() > first_done_s + 1, what="a second after the first admission")
        second_s = time.time()
        await limits.admit("a", lambda: 1.0)
        before_s = time.time()
        refused = await refusal(limits, "a")
        after_s = time.time()
        assert refused.code == "rate_limited" and refused.limit == "requests_per_minute"
        # Retry-After: until the first admission leaves the window
        retry_after_s = int(refused.headers["Retry-After"])
        assert max(1, math.ceil(first_s + window_s - after_s)) <= retry_after_s
        assert retry_after_s <= math.ceil(first_done_s + window_s - before_s)
        while True:  # refused while the first is in the window, admitted once it has left
            before_s = time.time()
            try:
                await limits.admit("a", lambda: 1.0)
                break
            except LimitExceeded:
                assert before_s <= first_done_s + window_s, "refused after the first admission left the window"
                await asyncio.sleep(0.02)
        assert time.time() >= first_s + window_s, "admitted while the first admission was in the window"
        # A moving window: the second admission still counts, a fixed one would have started afresh.
        before_s = time.time()
        try:
            await limits.admit("a", lambda: 1.0)
            assert before_s >= second_s + window_s, "admitted a third while the second was in the window"
        except LimitExceeded:
            pass
        use = await limits.snapshot()
        assert use["a"]["requests_last_minute"] == 2 or time.time() >= second_s + window_s

    limiters.run(scenario)


def test_tokens_per_day_refuses_once_reached_until_utc_midnight(limiters: Limiters) -> None:
    wall = Wall()

    async def scenario() -> None:
        limits = await limiters.new({"a": Limits(tokens_per_day=100)}, wall=wall)
        await limits.admit("a", lambda: 1.0)
        await limits.add_tokens("a", 60)
        await limits.admit("a", lambda: 1.0)  # under the limit: admitted, even if its answer will cross it
        await limits.add_tokens("a", 60)  # crosses it: counted whole
        refused = await refusal(limits, "a")
        assert refused.code == "rate_limited" and refused.limit == "tokens_per_day"
        assert refused.headers == {"Retry-After": str(12 * 3600)}
        assert (await limits.snapshot())["a"]["tokens_today"] == 120
        wall.now_s += 12 * 3600  # UTC midnight: a new day
        await limits.admit("a", lambda: 1.0)
        assert (await limits.snapshot())["a"]["tokens_today"] == 0

    limiters.run(scenario)


def test_a_refused_request_counts_nothing(limiters: Limiters) -> None:
    async def scenario() -> None:
        limits = await limiters.new({"a": Limits(max_concurrent=1, requests_per_minute=2, tokens_per_day=10)})
        await limits.admit("a", lambda: 1.0)
        assert (await refusal(limits, "a")).limit == "max_concurrent"
        assert (await limits.snapshot())["a"]["requests_last_minute"] == 1  # the refused one is not in the window
        await limits.release("a")
        await limits.admit("a", lambda: 1.0)
        await limits.release("a")
        assert (await refusal(limits, "a")).limit == "requests_per_minute"
        assert (await limits.snapshot())["a"]["in_system"] == 0  # nor in the system
        limits.reload({"a": Limits(max_concurrent=1, tokens_per_day=10)})
        await limits.add_tokens("a", 10)
        assert (await refusal(limits, "a")).limit == "tokens_per_day"
        use = (await limits.snapshot())["a"]
        assert use["in_system"] == 0 and use["requests_last_minute"] == 2

    limiters.run(scenario)


def test_a_reload_changes_the_limits_and_keeps_the_counts(limiters: Limiters) -> None:
    async def scenario() -> None:
        limits = await limiters.new({"a": Limits(max_concurrent=5, requests_per_minute=5)})
        for _ in range(2):
            await limits.admit("a", lambda: 1.0)
        limits.reload({"a": Limits(max_concurrent=2, requests_per_minute=5)})
        assert (await refusal(limits, "a")).limit == "max_concurrent"
        await limits.release("a")
        limits.reload({"a": Limits(requests_per_minute=2)})
        assert (await refusal(limits, "a")).limit == "requests_per_minute"

    limiters.run(scenario)


# -- Redis: replicas ---------------------------------------------------------------------------
def test_two_replicas_share_every_count(on_redis: Limiters) -> None:
    bounds = {"a": Limits(max_concurrent=2, requests_per_minute=3, tokens_per_day=100)}

    async def scenario() -> None:
        one, two = await on_redis.new(bounds), await on_redis.new(bounds)
        await one.admit("a", lambda: 1.0)
        await two.admit("a", lambda: 1.0)
        assert (await refusal(one, "a")).limit == "max_concurrent"
        assert (await one.snapshot())["a"]["in_system"] == 2
        await two.release("a")
        await one.admit("a", lambda: 1.0)  # the third of the minute
        await one.release("a")
        assert (await refusal(two, "a")).limit == "requests_per_minute"
        assert (await two.snapshot())["a"]["requests_last_minute"] == 3
        await one.add_tokens("a", 100)
        assert (await two.snapshot())["a"]["tokens_today"] == 100
        await one.release("a")
        two.reload({"a": Limits(tokens_per_day=100)})
        assert (await refusal(two, "a")).limit == "tokens_per_day"

    on_redis.run(scenario)


def test_concurrent_admissions_on_two_replicas_never_pass_max_concurrent(on_redis: Limiters) -> None:
    bounds = {"a": Limits(max_concurrent=3)}
    held = 0
    most_held = 0
    refused = 0

    async def one_request(limits: TenantLimits) -> None:
        nonlocal held, most_held, refused
        try:
            await limits.admit("a", lambda: 1.0)
        except LimitExceeded:
            refused += 1
            return
        held += 1
        most_held = max(most_held, held)
        await asyncio.sleep(0.001)
        held -= 1
        await limits.release("a")

    async def scenario() -> None:
        one, two = await on_redis.new(bounds), await on_redis.new(bounds)
        for _ in range(5):
            await asyncio.gather(*(one_request(replica) for _ in range(20) for replica in (one, two)))
        assert most_held == 3 and refused > 0
        assert (await one.snapshot())["a"]["in_system"] == 0

    on_redis.run(scenario)


def test_admissions_from_two_threads_pass_exactly_max_concurrent(on_redis: Limiters) -> None:
    # Two replicas, each on its own event loop and connections: only the script decides.
    bounds = {"a": Limits(max_concurrent=7)}
    admitted: list[int] = []
    start = threading.Barrier(2)

    def replica() -> None:
        async def admit_many() -> None:
            limits = TenantLimits(bounds, redis_url=on_redis.redis_url, cluster=on_redis.cluster)
            await limits.start()
            start.wait()

            async def one() -> int:
                try:
                    await limits.admit("a", lambda: 1.0)
                    return 1
                except LimitExceeded:
                    return 0

            admitted.append(sum(await asyncio.gather(*(one() for _ in range(25)))))
            await limits.aclose()

        asyncio.run(admit_many())

    threads = [threading.Thread(target=replica) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(admitted) == 2 and sum(admitted) == 7


def test_a_dead_replicas_requests_are_dropped(on_redis: Limiters) -> None:
    bounds = {"a": Limits(max_concurrent=2), "b": Limits(max_concurrent=1)}

    async def scenario() -> None:
        dead = await on_redis.new(bounds)
        await dead.admit("a", lambda: 1.0)
        await dead.admit("a", lambda: 1.0)
        await dead.admit("b", lambda: 1.0)
        await dead.aclose()  # gone, with nothing released
        alive = await on_redis.new(bounds)
        assert (await refusal(alive, "a")).limit == "max_concurrent"
        assert await alive.drop_replica(dead.replica) == 3
        await alive.admit("a", lambda: 1.0)
        await alive.admit("a", lambda: 1.0)
        await alive.admit("b", lambda: 1.0)
        # A replica restarted under its old id drops what its earlier run left.
        await alive.aclose()
        again = await on_redis.new(bounds, replica=alive.replica)
        await again.admit("b", lambda: 1.0)
        assert (await again.snapshot())["a"]["in_system"] == 0

    on_redis.run(scenario)


def test_a_cluster_name_keeps_two_deployments_apart(redis_server: RedisServer) -> None:
    bounds = {"a": Limits(max_concurrent=1, requests_per_minute=1)}

    async def scenario() -> None:
        blue = "blue-" + uuid.uuid4().hex[:6]
        first = TenantLimits(bounds, redis_url=redis_server.url, cluster=blue)
        second = TenantLimits(bounds, redis_url=redis_server.url, cluster="green-" + uuid.uuid4().hex[:6])
        same = TenantLimits(bounds, redis_url=redis_server.url, cluster=blue)
        try:
            for limits in (first, second, same):
                await limits.start()
            await first.admit("a", lambda: 1.0)
            await second.admit("a", lambda: 1.0)  # another cluster: its own counts
            assert (await refusal(same, "a")).limit == "max_concurrent"
            await first.release("a")
            assert (await refusal(same, "a")).limit == "requests_per_minute"
        finally:
            for limits in (first, second, same):
                await limits.aclose()

    asyncio.run(scenario())


def test_only_tenants_with_limits_reach_redis_by_name(on_redis: Limiters) -> None:
    # A tenant header can carry anything: a name without limits never leaves the process.
    async def scenario() -> None:
        limits = await on_redis.new({"team": Limits(max_concurrent=2, requests_per_minute=9, tokens_per_day=99)})
        header_tenant = "sk-live-0123456789abcdef"
        await limits.admit(header_tenant, lambda: 1.0)
        await limits.add_tokens(header_tenant, 5)
        await limits.admit("team", lambda: 1.0)
        await limits.add_tokens("team", 5)
        assert (await limits.snapshot())[header_tenant]["tokens_today"] == 5
        client = aioredis.Redis.from_url(on_redis.redis_url)
        try:
            keys = sorted(k.decode() for k in await client.keys(f"*{on_redis.cluster}*"))
            everything = [k.decode() for k in await client.keys("*")]
        finally:
            await client.aclose()
        prefix = f"clairvoyant:{on_redis.cluster}:limits:"
        assert keys and all(k.startswith(prefix) for k in keys)
        assert not any(header_tenant in k for k in everything)
        assert {k.removeprefix(prefix).split("/")[0].split(":")[0] for k in keys} == {
            "window", "tokens", "concurrent", "replica"
        }  # fmt: skip

    on_redis.run(scenario)


def test_redis_lost_counts_on_this_replica_and_rejoins_when_back(own_redis_server: RedisServer) -> None:
    server = own_redis_server
    bounds = {"a": Limits(max_concurrent=2)}

    async def scenario() -> None:
        limits = TenantLimits(bounds, redis_url=server.url, cluster="lost")
        other = TenantLimits(bounds, redis_url=server.url, cluster="lost")
        try:
            await limits.start()
            await limits.admit("a", lambda: 1.0)
            server.stop()
            await limits.admit("a", lambda: 1.0)  # admitted on this replica's count
            assert limits.degraded
            assert (await refusal(limits, "a")).limit == "max_concurrent"  # which still bounds it
            await limits.release("a")
            server.start()  # back, empty

            async def rejoined() -> bool:
                await limits.resync()
                return not limits.degraded

            deadline_s = time.monotonic() + 10
            while not await rejoined():
                assert time.monotonic() < deadline_s, "never rejoined Redis"
                await asyncio.sleep(0.05)
            await other.start()
            await other.admit("a", lambda: 1.0)  # this replica's one request was written again
            assert (await refusal(other, "a")).limit == "max_concurrent"
        finally:
            await limits.aclose()
            await other.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_release_redis_missed_is_written_by_the_next_resync(on_redis: Limiters) -> None:
    # Redis keeps its state but takes no write for a while (CLIENT PAUSE): the release times out.
    bounds = {"a": Limits(max_concurrent=1)}

    async def scenario() -> None:
        one, two = await on_redis.new(bounds), await on_redis.new(bounds)
        await one.admit("a", lambda: 1.0)
        client = aioredis.Redis.from_url(on_redis.redis_url)
        try:
            await client.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
            await one.release("a")  # its write waits past the timeout, and fails
            assert one.degraded
            await client.execute_command("CLIENT", "UNPAUSE")
        finally:
            await client.aclose()
        assert (await refusal(two, "a")).limit == "max_concurrent"  # Redis still counts it

        deadline_s = time.monotonic() + 10
        while True:
            await one.resync()
            if not one.degraded:
                break
            assert time.monotonic() < deadline_s, "the missed release was never written"
            await asyncio.sleep(0.05)
        await two.admit("a", lambda: 1.0)

    on_redis.run(scenario)
