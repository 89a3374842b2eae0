"""Per-tenant limits on the scheduled endpoints: requests at once, requests a minute, tokens a day.

A tenant is an API key's (``[[api_keys]]``) or the tenant header's (``[[tenants]]``). Each limit
is checked when a scheduled request arrives, before its body is read; one beyond a limit gets 429
with Retry-After in the client's dialect, and is never queued. Nothing else counts: the proxy's own
endpoints, the live page and pass-through paths are never refused for a tenant's use.

- ``max_concurrent``: requests in flight plus waiting. Retry-After: the predicted seconds until
  one of them ends (the caller's estimate).
- ``requests_per_minute``: admissions in a moving 60 s window. Retry-After: until the oldest
  leaves it.
- ``tokens_per_day``: completion tokens per UTC day, as the backend reported them (usage,
  Ollama's eval_count). A request is refused once the day's count has reached the limit (the one
  that crosses it is not cut short). Retry-After: until UTC midnight.

The windows are the ``limits`` package's strategies (a moving window a minute long, and a counter
keyed by the tenant and the UTC date), over one of two storages:

- in the process (the default): ``_LazyMemoryStorage``, synchronous (the API is async in both
  modes, but here nothing suspends). The window's count and the day's tokens survive a restart in
  a state file (``learner_state_path``'s stem + ``.limits.json``) when the learner's state is
  kept; on restart the window's admissions are counted again from the restart (the strategies
  stamp their own entries), so a tenant at its limit may wait up to a minute longer, never less.
- Redis (``redis_url``): every replica naming the same Redis and ``cluster`` shares the counts
  (``proxy/shared_limits.py``, loaded only then).

Counts are kept by tenant name, so they survive a reload of the keys too. A tenant header can
name any tenant: tenants without limits are counted in this process only, and of those only the
``MAX_UNLIMITED_TENANTS`` seen last are kept (those with requests in the system always), so a
stream of new names cannot grow the process, nor ever reach Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from limits import RateLimitItemPerSecond, storage, strategies
from limits.limits import safe_string
from limits.util import WindowStats

from clairvoyant.config import Limits
from clairvoyant.errors import LimitExceeded
from clairvoyant.state_file import atomic_writer

if TYPE_CHECKING:
    from clairvoyant.proxy.shared_limits import SharedCounts

__all__ = ["TenantLimits"]

logger = logging.getLogger(__name__)

WINDOW_S = 60  # requests_per_minute's moving window
DAY_S = 86_400
MAX_UNLIMITED_TENANTS = 1024  # tenants without limits whose counts are kept, at most (the ones seen last)
# A tenant with limits but no requests_per_minute: its last minute is still counted (for /queue),
# up to this many entries.
UNBOUNDED_WINDOW_COUNT = 10_000

_T = TypeVar("_T")


def _utc_day(wall_s: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(wall_s))


class _TenantLimit(RateLimitItemPerSecond):
    """A limit over ``multiples`` seconds whose storage key names what it counts, not its amount:
    a reload that changes a tenant's limit keeps the tenant's count."""

    __slots__ = ()

    def key_for(self, *identifiers: bytes | str | int | float) -> str:
        return "/".join([self.namespace, *map(safe_string, identifiers)])


class _Windows(Protocol):
    """A tenant's window and day counter, on one storage."""

    async def hit(self, item: _TenantLimit, tenant: str, cost: int = 1) -> bool: ...
    async def window(self, item: _TenantLimit, tenant: str) -> WindowStats: ...
    async def under(self, item: _TenantLimit, tenant: str, day: str) -> bool: ...
    async def add(self, item: _TenantLimit, tenant: str, day: str, amount: int) -> None: ...
    async def count(self, item: _TenantLimit, tenant: str, day: str) -> int: ...
    def entries(self) -> int: ...


class _LazyMemoryStorage(storage.Storage, storage.MovingWindowSupport):
    """The package's storage interface (what its moving window and fixed window strategies call),
    in this process, expiring lazily. The package's own ``MemoryStorage`` starts a thread to expire
    entries after every 10 ms of use (its ``limits.aio`` twin hands each key to a thread after every
    call): about 0.4 ms of CPU a request at 100 requests a second on this project's machine
    (benchmarks/bench_limits_cost.py), where the request's whole check used to cost a few µs.

    A window is a deque of admission times, oldest first, trimmed when read; a counter expires when
    read, and expired counters are dropped whenever a new one starts (once a tenant a day)."""

    STORAGE_SCHEME = ["clairvoyant+memory"]

    def __init__(self) -> None:
        super().__init__()
        self.windows: dict[str, deque[float]] = {}
        self.counters: dict[str, int] = {}
        self._expires_s: dict[str, float] = {}

    @property
    def base_exceptions(self) -> type[Exception]:
        return ValueError  # nothing here fails

    def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        now_s = time.time()
        if self._expires_s.get(key, 0.0) <= now_s:
            self._drop_expired(now_s)
            self.counters[key] = 0
            self._expires_s[key] = now_s + expiry
        self.counters[key] += amount
        return self.counters[key]

    def get(self, key: str) -> int:
        if self._expires_s.get(key, 0.0) <= time.time():
            return 0
        return self.counters[key]

    def get_expiry(self, key: str) -> float:
        return self._expires_s.get(key, time.time())

    def check(self) -> bool:
        return True

    def reset(self) -> int | None:
        count = len(self.counters) + len(self.windows)
        self.counters.clear()
        self._expires_s.clear()
        self.windows.clear()
        return count

    def clear(self, key: str) -> None:
        self.counters.pop(key, None)
        self._expires_s.pop(key, None)
        self.windows.pop(key, None)

    def _drop_expired(self, now_s: float) -> None:
        for key in [k for k, expires_s in self._expires_s.items() if expires_s <= now_s]:
            self.clear(key)

    def _window(self, key: str, expiry: int, now_s: float) -> deque[float]:
        window = self.windows.get(key)
        if window is None:
            window = self.windows[key] = deque()
        while window and window[0] < now_s - expiry:  # in the window while ``now - expiry <= t``
            window.popleft()
        return window

    def acquire_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        now_s = time.time()
        window = self._window(key, expiry, now_s)
        if len(window) + amount > limit:
            return False
        window.extend([now_s] * amount)
        return True

    def get_moving_window(self, key: str, limit: int, expiry: int) -> tuple[float, int]:
        now_s = time.time()
        window = self._window(key, expiry, now_s)
        return (window[0], len(window)) if window else (now_s, 0)


class _InProcessWindows:
    """The package's moving window and day counter, in this process. Synchronous: nothing here
    waits, so the awaits below never suspend."""

    def __init__(self, storage_: _LazyMemoryStorage | storage.MemoryStorage | None = None) -> None:
        self.storage = _LazyMemoryStorage() if storage_ is None else storage_  # the package's: for the benchmark
        self._window = strategies.MovingWindowRateLimiter(self.storage)
        self._counter = strategies.FixedWindowRateLimiter(self.storage)

    async def hit(self, item: _TenantLimit, tenant: str, cost: int = 1) -> bool:
        return self._window.hit(item, tenant, cost=cost)

    async def window(self, item: _TenantLimit, tenant: str) -> WindowStats:
        return self._window.get_window_stats(item, tenant)

    async def under(self, item: _TenantLimit, tenant: str, day: str) -> bool:
        return self._counter.test(item, tenant, day)

    async def add(self, item: _TenantLimit, tenant: str, day: str, amount: int) -> None:
        self._counter.hit(item, tenant, day, cost=amount)

    async def count(self, item: _TenantLimit, tenant: str, day: str) -> int:
        return self.storage.get(item.key_for(tenant, day))

    def entries(self) -> int:
        if not isinstance(self.storage, _LazyMemoryStorage):
            return 0
        return sum(map(len, self.storage.windows.values())) + len(self.storage.counters)


@dataclass
class _Use:
    in_system: int = 0  # this replica's requests in flight plus waiting (and being admitted)
    shared: int = 0  # of those, the ones counted in Redis's hash (Redis mode, tenants with limits)
    local: int = 0  # of those, the ones counted here only (in the process, no limits, or Redis failed)
    tokens_today: int = 0  # tenants without limits: this replica's completion tokens today
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one write of ``shared`` to Redis at a time
    unwritten: bool = False  # the last write of ``shared`` to Redis failed


@dataclass(frozen=True)
class _Items:
    """One tenant's limits as the package's items (their amounts the limits, or a cap when unset)."""

    window: _TenantLimit
    tokens: _TenantLimit


class TenantLimits:
    """The tenants' use against their limits, in this process (``redis_url`` None) or shared by every
    replica of ``cluster`` on ``redis_url``.

    ``wall``: the clock of the UTC day (and Retry-After until midnight); the window follows the
    storage's clock (``time.time`` here, or each replica's on Redis: keep them in step with NTP).
    ``replica``: this replica's id in Redis (default: a random one). ``window_s``: the window's
    length (a minute; shorter in tests)."""

    def __init__(
        self,
        limits: Mapping[str, Limits],
        *,
        state_path: Path | None = None,
        wall: Callable[[], float] = time.time,
        redis_url: str | None = None,
        cluster: str = "default",
        replica: str | None = None,
        window_s: int = WINDOW_S,
    ) -> None:
        if redis_url is not None and state_path is not None:
            raise ValueError("a state file keeps the in-process counts; with Redis the counts live there")
        self.limits = dict(limits)
        self.state_path = state_path
        self.replica = replica or uuid.uuid4().hex[:12]
        self.window_s = window_s
        self._wall = wall
        self._use: dict[str, _Use] = {}
        self._items: dict[str, _Items] = {}
        self._day = _utc_day(wall())
        self._day_starts_s = math.floor(wall() / DAY_S) * DAY_S  # wall seconds: UTC midnight, today
        self._shared: SharedCounts | None = None
        self._windows: _Windows
        if redis_url is None:
            self._windows = _InProcessWindows()
        else:
            from clairvoyant.proxy.shared_limits import SharedCounts  # redis-py: with replicas only

            self._windows = self._shared = SharedCounts(redis_url, cluster, self.replica)

    # -- life ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """In the process: restore the state file. On Redis: ``SharedCounts.start``."""
        await (self.load() if self._shared is None else self._shared.start())

    async def aclose(self) -> None:
        if self._shared is not None:
            await self._shared.aclose()

    @property
    def degraded(self) -> bool:
        """Redis failed on the last call: counting on this replica only."""
        return self._shared is not None and self._shared.degraded

    @degraded.setter
    def degraded(self, value: bool) -> None:
        if self._shared is not None:
            self._shared.degraded = value

    # -- the counts ---------------------------------------------------------------------------
    def _of(self, tenant: str) -> _Use:
        use = self._use.get(tenant)
        if use is None:
            use = self._use[tenant] = _Use()
            if len(self._use) > len(self.limits) + MAX_UNLIMITED_TENANTS:
                self._forget_idle()
        return use

    def _forget_idle(self) -> None:
        """Drop the counts of tenants without limits and with nothing in the system, the longest
        unseen first, down to 3/4 of the bound (so that dropping is rare: O(1) a request, amortised)."""
        keep = len(self.limits) + MAX_UNLIMITED_TENANTS * 3 // 4
        for tenant, use in list(self._use.items()):
            if len(self._use) <= keep:
                return
            if use.in_system == 0 and tenant not in self.limits:
                del self._use[tenant]

    def _roll(self) -> str:
        """Today's UTC date; a new day zeroes the local counts of tenants without limits."""
        wall_s = self._wall()
        if not self._day_starts_s <= wall_s < self._day_starts_s + DAY_S:
            self._day_starts_s = math.floor(wall_s / DAY_S) * DAY_S
            self._day = _utc_day(wall_s)
            for use in self._use.values():
                use.tokens_today = 0
        return self._day

    def _items_of(self, tenant: str, limits: Limits) -> _Items:
        items = self._items.get(tenant)
        if items is None:
            rate = limits.requests_per_minute or UNBOUNDED_WINDOW_COUNT
            items = self._items[tenant] = _Items(
                _TenantLimit(rate, self.window_s, namespace="window"),
                _TenantLimit(limits.tokens_per_day or 1, DAY_S, namespace="tokens"),
            )
        return items

    async def admit(self, tenant: str, free_in_s: Callable[[], float]) -> None:
        """Count a scheduled request of ``tenant`` in, or raise ``LimitExceeded`` (nothing counted).
        ``free_in_s``: predicted seconds until one of the tenant's requests ends (for Retry-After)."""
        limits = self.limits.get(tenant)
        use = self._of(tenant)
        use.in_system += 1  # before any wait: admissions on this loop see each other
        if limits is None:  # the last seen go last when counts are dropped (``_forget_idle``)
            self._use[tenant] = self._use.pop(tenant)
            use.local += 1
            return
        try:
            shared = await self._admit_limited(tenant, limits, use, free_in_s)
        except BaseException:
            use.in_system -= 1
            raise
        if not shared:
            use.local += 1

    async def _admit_limited(self, tenant: str, limits: Limits, use: _Use, free_in_s: Callable[[], float]) -> bool:
        """Check ``tenant``'s limits: True if counted in Redis's hash, False if here only. Refusals
        go max_concurrent, tokens_per_day, requests_per_minute: only the last counts something that
        cannot be taken back (the window's entry), so it goes once the others passed."""
        items = self._items_of(tenant, limits)
        day = self._roll()
        shared = False
        if self._shared is None:
            _check_local_concurrency(tenant, limits, use, free_in_s)
            under: bool | BaseException = limits.tokens_per_day is None or await self._windows.under(
                items.tokens, tenant, day
            )
        else:
            # One round trip for both: the concurrency script and the day's count at once.
            checks = await asyncio.gather(
                self._admit_shared(tenant, limits, use, free_in_s), self._under(items, tenant, limits, day),
                return_exceptions=True,
            )  # fmt: skip
            if isinstance(checks[0], BaseException):
                raise checks[0]
            shared, under = checks[0], checks[1]
        try:
            if isinstance(under, BaseException):
                raise under
            if not under:
                wall_s = self._wall()
                midnight_s = (math.floor(wall_s / DAY_S) + 1) * DAY_S
                raise LimitExceeded(
                    f"tenant {tenant!r} has used its {limits.tokens_per_day} completion tokens for today (UTC)",
                    code="rate_limited", limit="tokens_per_day", retry_after_s=_seconds(midnight_s - wall_s),
                )  # fmt: skip
            admitted = await self._fail_open(self._windows.hit(items.window, tenant), True)
            if not admitted and limits.requests_per_minute is not None:
                amount = items.window.amount
                stats = await self._fail_open(
                    self._windows.window(items.window, tenant), WindowStats(time.time() + self.window_s, 0)
                )
                raise LimitExceeded(
                    f"tenant {tenant!r} has made {amount - stats.remaining} requests in the last {self.window_s} s,"
                    " its limit",
                    code="rate_limited", limit="requests_per_minute",
                    retry_after_s=_seconds(stats.reset_time - time.time()),
                )  # fmt: skip
        except BaseException:
            if shared:
                use.shared -= 1
                await self._put(tenant, use)
            raise
        return shared

    async def _under(self, items: _Items, tenant: str, limits: Limits, day: str) -> bool:
        """Whether the day's tokens are under ``tokens_per_day`` (True when unset, or Redis failed)."""
        if limits.tokens_per_day is None:
            return True
        return await self._fail_open(self._windows.under(items.tokens, tenant, day), True)

    async def _admit_shared(self, tenant: str, limits: Limits, use: _Use, free_in_s: Callable[[], float]) -> bool:
        """``max_concurrent`` over every replica: True if counted in Redis, False if Redis failed
        (then this replica's own count is checked against the limit)."""
        assert self._shared is not None
        limit = -1 if limits.max_concurrent is None else limits.max_concurrent
        async with use.lock:
            reply = await self._shared.admit(tenant, use.shared + 1, limit)
            if reply is not None and reply[0]:
                use.shared += 1
        if reply is None:
            _check_local_concurrency(tenant, limits, use, free_in_s)
            return False
        if not reply[0]:
            raise _concurrency_limited(tenant, reply[1], free_in_s)
        return True

    async def release(self, tenant: str) -> None:
        """One of ``tenant``'s admitted requests has ended (answered, refused later, or left). The
        local count drops at once; Redis's follows (a failed write is redone by the next one, or
        by ``resync``)."""
        use = self._of(tenant)
        use.in_system -= 1
        if use.local > 0:
            use.local -= 1
        else:
            use.shared -= 1
            await self._put(tenant, use)

    async def add_tokens(self, tenant: str, tokens: int) -> None:
        """Completion tokens the backend reported for one of ``tenant``'s answers."""
        day = self._roll()
        limits = self.limits.get(tenant)
        if limits is None:
            self._of(tenant).tokens_today += tokens
            return
        item = self._items_of(tenant, limits).tokens
        await self._fail_open(self._windows.add(item, tenant, day, tokens), None)

    def reload(self, limits: Mapping[str, Limits]) -> None:
        """New limits (the keys were reloaded); the counts stay."""
        self.limits = dict(limits)
        self._items.clear()

    def retained(self) -> dict[str, int]:
        """Entries held: tenants counted, and (in the process) the window's and the days' entries."""
        return {"limit_tenants": len(self._use), "limit_window_entries": self._windows.entries()}

    async def snapshot(self) -> dict[str, dict[str, Any]]:
        """Each tenant seen, or bounded: its limits and its use against them (for /queue). On Redis,
        a tenant with limits shows the whole cluster's use."""
        day = self._roll()
        out = {}
        for tenant in sorted({*self._use, *self.limits}):
            use = self._of(tenant)
            limits = self.limits.get(tenant)
            row = {"in_system": use.in_system, "requests_last_minute": 0, "tokens_today": use.tokens_today}
            if limits is not None:
                row.update(await self._fail_open(self._shared_use(tenant, limits, day, use), {}))
            out[tenant] = {"limits": {} if limits is None else limits.model_dump(exclude_none=True), **row}
        return out

    async def _shared_use(self, tenant: str, limits: Limits, day: str, use: _Use) -> dict[str, int]:
        items = self._items_of(tenant, limits)
        stats = await self._windows.window(items.window, tenant)
        row = {
            "requests_last_minute": items.window.amount - stats.remaining,
            "tokens_today": await self._windows.count(items.tokens, tenant, day),
        }
        if self._shared is not None:
            row["in_system"] = use.in_system - use.shared + await self._shared.in_system(tenant)
        return row

    async def _put(self, tenant: str, use: _Use) -> None:
        """Write this replica's count of ``tenant`` as it is now; a failure is logged (the next
        write, or ``resync``, puts it right)."""
        if self._shared is not None:
            async with use.lock:
                use.unwritten = not await self._shared.put(tenant, max(0, use.shared))

    async def resync(self) -> None:
        """Write every count of this replica again (after failed writes, or Redis losing its state):
        for the replica's heartbeat."""
        for tenant, use in list(self._use.items()):
            if use.shared or use.unwritten:
                await self._put(tenant, use)

    async def drop_replica(self, replica: str) -> int:
        """Drop a replica's concurrency counts (it is gone: it will never release them). Returns
        the requests dropped. Raises ``RedisError`` or ``OSError``; nothing in the process mode."""
        return 0 if self._shared is None else await self._shared.drop_replica(replica)

    def _fail_open(self, call: Coroutine[Any, Any, _T], fallback: _T) -> Awaitable[_T]:
        """``call``'s result, or ``fallback`` when Redis fails (``SharedCounts.fail_open``)."""
        if self._shared is None:
            return call  # nothing to fail: no coroutine around it (a few µs a request)
        return self._shared.fail_open(call, fallback)

    # -- the state file (in the process) ---------------------------------------------------------
    async def state(self) -> dict[str, Any]:
        """What ``save`` writes: the window's count and the day's tokens of each tenant."""
        day = self._roll()
        tokens = {t: u.tokens_today for t, u in self._use.items() if u.tokens_today}
        window = {}
        for tenant, limits in self.limits.items():
            use = await self._shared_use(tenant, limits, day, self._of(tenant))
            if use["tokens_today"]:
                tokens[tenant] = use["tokens_today"]
            if use["requests_last_minute"]:
                window[tenant] = use["requests_last_minute"]
        return {"day": day, "saved_s": time.time(), "tokens_today": tokens, "requests_last_minute": window}

    def save(self, state: dict[str, Any]) -> None:
        """Write ``state`` (from ``state``); nothing when no state path is set. Raises OSError."""
        if self.state_path is None:
            return
        with atomic_writer(self.state_path) as out:
            json.dump(state, out)

    async def load(self) -> None:
        """Restore what ``save`` wrote, when it is still current: the day's tokens as they were, the
        window's admissions as if made now. A missing or unreadable file is logged and ignored
        (counting starts afresh)."""
        if self.state_path is None or not self.state_path.exists():
            return
        try:
            state = json.loads(self.state_path.read_text())
            day = self._roll()
            if state.get("day") == day:
                for tenant, tokens in state["tokens_today"].items():
                    await self.add_tokens(tenant, int(tokens))
            now_s = time.time()
            if "admitted_s" in state:  # the format before the ``limits`` package: each admission's time
                window = {t: sum(1 for s in stamps if float(s) > now_s - self.window_s) for t, stamps in state["admitted_s"].items()}  # fmt: skip
            elif float(state["saved_s"]) > now_s - self.window_s:
                window = {t: int(n) for t, n in state["requests_last_minute"].items()}
            else:
                window = {}
            for tenant, admitted in window.items():
                limits = self.limits.get(tenant)
                if limits is not None and admitted > 0:
                    item = self._items_of(tenant, limits).window
                    await self._windows.hit(item, tenant, cost=min(admitted, item.amount))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("tenant limits: cannot read %s (%s); counting starts afresh", self.state_path, exc)


def _check_local_concurrency(tenant: str, limits: Limits, use: _Use, free_in_s: Callable[[], float]) -> None:
    """``max_concurrent`` on this replica's count (in the process, or while Redis fails)."""
    in_system = use.in_system - 1  # (``use`` counts the request being admitted)
    if limits.max_concurrent is not None and in_system >= limits.max_concurrent:
        raise _concurrency_limited(tenant, in_system, free_in_s)


def _concurrency_limited(tenant: str, in_system: int, free_in_s: Callable[[], float]) -> LimitExceeded:
    return LimitExceeded(
        f"tenant {tenant!r} has {in_system} requests in flight or waiting, its limit",
        code="concurrency_limited", limit="max_concurrent", retry_after_s=_seconds(free_in_s()),
    )  # fmt: skip


def _seconds(value_s: float) -> int:
    """A Retry-After value: whole seconds, at least 1."""
    return max(1, min(DAY_S, math.ceil(value_s)))
