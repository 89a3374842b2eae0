"""The tenants' counts shared by every replica of a cluster through Redis (``redis_url``).
Imported only when a Redis URL is set: a proxy without replicas never loads redis-py.

The windows are the ``limits`` package's Redis scripts. ``max_concurrent`` is a hash per tenant
with one field per replica, checked and changed by one script (so concurrent admissions on
different replicas never pass the limit together), whose fields a replica's death can drop
(``drop_replica``). Keys expire with their windows, and carry the cluster and the tenant's name:
only tenants with limits, which the configuration names, are counted here (so no name is hashed:
a header value without a ``[[tenants]]`` entry never leaves the process). If Redis fails, requests
are admitted on this replica's counts (``degraded``) until it answers again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis
from limits import RateLimitItem, aio
from limits.util import WindowStats
from redis.exceptions import RedisError

__all__ = ["SharedCounts"]

logger = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 1.0  # a Redis call slower than this fails, and the request is admitted on local counts
REDIS_RETRY_S = 1.0  # after a failure, Redis is tried again this long after (requests meanwhile count locally)

_T = TypeVar("_T")

# One replica's requests of one tenant, in that tenant's hash (replica -> requests), written only
# if the sum over every replica stays within the limit (-1: none).
# KEYS: the tenant's hash, the replica's set of tenants; ARGV: replica, its new count, limit, tenant.
_ADMIT_LUA = """
local others = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] ~= ARGV[1] then others = others + tonumber(fields[i + 1]) end
end
local mine = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
if limit >= 0 and others + mine > limit then
  return {0, others + tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or 0)}
end
redis.call('HSET', KEYS[1], ARGV[1], mine)
redis.call('SADD', KEYS[2], ARGV[4])
return {1, others + mine}
"""
# The replica's count as it is now (after a release, or again after Redis lost its state).
_PUT_LUA = """
if tonumber(ARGV[2]) > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('SADD', KEYS[2], ARGV[3])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('SREM', KEYS[2], ARGV[3])
end
return 1
"""
# Every count of one replica (gone): KEYS: its set of tenants; ARGV: replica, the hashes' key prefix.
_DROP_LUA = """
local dropped = 0
for _, tenant in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[2] .. tenant
  dropped = dropped + tonumber(redis.call('HGET', key, ARGV[1]) or 0)
  redis.call('HDEL', key, ARGV[1])
end
redis.call('DEL', KEYS[1])
return dropped
"""


class SharedCounts:
    """The tenants' windows, day counters and this replica's share of ``max_concurrent``, in Redis
    under ``clairvoyant:<cluster>:limits``. ``replica``: this replica's field in each tenant's hash."""

    def __init__(self, url: str, cluster: str, replica: str) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"a Redis URL starts with redis://, rediss:// or unix://, not {url.split(':')[0]!r}")
        self.replica = replica
        self.degraded = False  # Redis failed on the last call: counting on this replica only
        self._retry_at_s = 0.0  # monotonic seconds: while degraded, Redis is not tried before then
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
        )
        self._prefix = f"clairvoyant:{cluster}:limits"
        self._admit = self._redis.register_script(_ADMIT_LUA)
        self._put = self._redis.register_script(_PUT_LUA)
        self._drop = self._redis.register_script(_DROP_LUA)
        # One pool for the package's scripts and ours (its docs name ``connection_pool``; its
        # annotation of ``**options`` does not). It names a socket's scheme its own way; it only
        # parses the URL.
        self.storage = aio.storage.RedisStorage(
            "async+" + ("redis+unix://" + url.removeprefix("unix://") if url.startswith("unix://") else url),
            implementation="redispy", key_prefix=self._prefix,
            connection_pool=self._redis.connection_pool,  # type: ignore[arg-type]
        )  # fmt: skip
        self._window = aio.strategies.MovingWindowRateLimiter(self.storage)
        self._counter = aio.strategies.FixedWindowRateLimiter(self.storage)

    async def start(self) -> None:
        """Check that Redis answers (raises ``RedisError`` or ``OSError`` when it does not), and drop
        this replica's counts left by an earlier run under the same id."""
        await self._redis.ping()
        await self.drop_replica(self.replica)

    async def aclose(self) -> None:
        await self._redis.aclose()

    # -- the windows (``limits._Windows``) ------------------------------------------------------
    async def hit(self, item: RateLimitItem, tenant: str, cost: int = 1) -> bool:
        return await self._window.hit(item, tenant, cost=cost)

    async def window(self, item: RateLimitItem, tenant: str) -> WindowStats:
        return await self._window.get_window_stats(item, tenant)

    async def under(self, item: RateLimitItem, tenant: str, day: str) -> bool:
        return await self._counter.test(item, tenant, day)

    async def add(self, item: RateLimitItem, tenant: str, day: str, amount: int) -> None:
        await self._counter.hit(item, tenant, day, cost=amount)

    async def count(self, item: RateLimitItem, tenant: str, day: str) -> int:
        return await self.storage.get(item.key_for(tenant, day))

    def entries(self) -> int:
        return 0  # in Redis, expiring with their windows

    # -- this replica's share of max_concurrent --------------------------------------------------
    def _keys(self, tenant: str) -> list[str]:
        return [f"{self._prefix}:concurrent:{tenant}", f"{self._prefix}:replica:{self.replica}"]

    async def admit(self, tenant: str, count: int, limit: int) -> tuple[bool, int] | None:
        """Set this replica's count of ``tenant`` to ``count`` if the cluster's stays within
        ``limit`` (-1: none): whether it did, and the cluster's count. None when Redis failed."""
        reply = await self.fail_open(
            self._admit(keys=self._keys(tenant), args=[self.replica, count, limit, tenant]), None
        )
        return None if reply is None else (bool(reply[0]), int(reply[1]))

    async def put(self, tenant: str, count: int) -> bool:
        """Write this replica's count of ``tenant``: False when Redis failed."""
        written = await self.fail_open(self._put(keys=self._keys(tenant), args=[self.replica, count, tenant]), 0)
        return bool(written)

    async def in_system(self, tenant: str) -> int:
        """The cluster's count of ``tenant``'s requests."""
        return sum(int(n) for n in await self._redis.hvals(self._keys(tenant)[0]))

    async def drop_replica(self, replica: str) -> int:
        """Drop a replica's concurrency counts: the requests dropped. Raises ``RedisError`` or ``OSError``."""
        keys, args = [f"{self._prefix}:replica:{replica}"], [replica, f"{self._prefix}:concurrent:"]
        return int(await self._drop(keys=keys, args=args))

    # -- failing open ------------------------------------------------------------------------------
    async def fail_open(self, call: Coroutine[Any, Any, _T], fallback: _T) -> _T:
        """``call``'s result, or ``fallback`` when Redis fails (the request is admitted on this
        replica's counts rather than refused for the store's fault). While a failure is recent,
        Redis is not tried: each request would otherwise wait for the timeout again."""
        if self.degraded and time.monotonic() < self._retry_at_s:
            call.close()  # never awaited
            return fallback
        try:
            result = await call
        except (RedisError, OSError) as exc:
            self._retry_at_s = time.monotonic() + REDIS_RETRY_S
            if not self.degraded:
                logger.warning("tenant limits: Redis failed (%s); counting on this replica only until it answers", exc)
                self.degraded = True
            return fallback
        if self.degraded:
            logger.info("tenant limits: Redis answers again; counting across replicas")
            self.degraded = False
        return result
