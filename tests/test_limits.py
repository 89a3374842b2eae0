"""proxy/limits.py in the process: the state file, the settings, the bound on tenants without limits.
Each limit's refusals, on both storages, are tests/test_limits_contract.py's."""

from __future__ import annotations

import asyncio
import calendar
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clairvoyant.config import Limits, Settings
from clairvoyant.errors import LimitExceeded
from clairvoyant.proxy.limits import MAX_UNLIMITED_TENANTS, TenantLimits

NOON_S = float(calendar.timegm((2026, 11, 27, 12, 0, 0)))  # a UTC noon, in wall seconds


class Wall:
    def __init__(self, now_s: float = NOON_S) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def test_the_counts_survive_a_restart_and_a_reload(tmp_path: Path) -> None:
    wall = Wall()
    path = tmp_path / "learner.limits.json"

    async def scenario() -> None:
        first = TenantLimits({"a": Limits(requests_per_minute=2, tokens_per_day=50)}, state_path=path, wall=wall)
        await first.admit("a", lambda: 1.0)
        await first.add_tokens("a", 40)
        await first.add_tokens("unlimited", 7)
        first.save(await first.state())
        wall.now_s += 5
        second = TenantLimits({"a": Limits(requests_per_minute=2, tokens_per_day=50)}, state_path=path, wall=wall)
        await second.start()
        assert (await second.snapshot())["a"] == {
            "limits": {"requests_per_minute": 2, "tokens_per_day": 50}, "in_system": 0, "requests_last_minute": 1,
            "tokens_today": 40,
        }  # fmt: skip
        assert (await second.snapshot())["unlimited"]["tokens_today"] == 7
        second.reload({"a": Limits(requests_per_minute=1)})  # new limits, the same counts
        with pytest.raises(LimitExceeded):
            await second.admit("a", lambda: 1.0)
        path.write_text("{not json")
        third = TenantLimits({}, state_path=path, wall=wall)
        await third.start()  # an unreadable file: logged, counting starts afresh
        assert await third.snapshot() == {}
        assert json.loads(json.dumps(await second.state()))["day"] == "2026-11-27"

    asyncio.run(scenario())


def test_a_state_file_of_another_day_keeps_the_window_only(tmp_path: Path) -> None:
    wall = Wall()
    path = tmp_path / "learner.limits.json"

    async def scenario() -> None:
        first = TenantLimits({"a": Limits(requests_per_minute=1, tokens_per_day=50)}, state_path=path, wall=wall)
        await first.admit("a", lambda: 1.0)
        await first.add_tokens("a", 50)
        first.save(await first.state())
        wall.now_s += 12 * 3600  # UTC midnight passed during the restart
        second = TenantLimits({"a": Limits(requests_per_minute=1, tokens_per_day=50)}, state_path=path, wall=wall)
        await second.start()
        assert (await second.snapshot())["a"]["tokens_today"] == 0
        with pytest.raises(LimitExceeded) as refused:
            await second.admit("a", lambda: 1.0)
        assert refused.value.limit == "requests_per_minute"

    asyncio.run(scenario())


def test_the_state_file_written_before_the_limits_package_is_read(tmp_path: Path) -> None:
    # That format kept each admission's wall time: those still in the window are counted again.
    path = tmp_path / "learner.limits.json"
    now_s = time.time()
    state = {"day": time.strftime("%Y-%m-%d", time.gmtime(now_s)), "tokens_today": {"a": 30},
             "admitted_s": {"a": [now_s - 90, now_s - 10, now_s - 5]}}  # fmt: skip
    path.write_text(json.dumps(state))

    async def scenario() -> None:
        limits = TenantLimits({"a": Limits(requests_per_minute=3, tokens_per_day=50)}, state_path=path)
        await limits.start()
        use = (await limits.snapshot())["a"]
        assert use["requests_last_minute"] == 2 and use["tokens_today"] == 30

    asyncio.run(scenario())


def test_settings_give_each_tenant_its_keys_or_its_entrys_limits() -> None:
    key = {"hash": "sha256:" + "a" * 64, "tenant": "team", "max_concurrent": 2}
    settings = Settings(api_keys=[key], tenants=[{"name": "batch", "requests_per_minute": 30, "weight": 0.5}])
    assert settings.tenant_limits == {"team": Limits(max_concurrent=2), "batch": Limits(requests_per_minute=30)}
    assert settings.tenant_weights == {"batch": 0.5, "team": 1.0}
    with pytest.raises(ValueError, match="two different sets of limits"):
        Settings(api_keys=[key], tenants=[{"name": "team", "max_concurrent": 3}])


def test_a_stream_of_new_tenant_names_keeps_only_the_last_ones_seen() -> None:
    # A tenant header can name any tenant: each new name once must not grow the counts forever.
    # Tenants with limits, and tenants with a request in the system, are always kept.
    async def scenario() -> None:
        limits = TenantLimits({"limited": Limits(requests_per_minute=10_000)}, wall=Wall())
        await limits.admit("limited", lambda: 1.0)
        await limits.release("limited")
        await limits.admit("busy", lambda: 1.0)  # in the system throughout
        await limits.add_tokens("recent", 5)
        for i in range(5 * MAX_UNLIMITED_TENANTS):
            await limits.admit(f"once-{i}", lambda: 1.0)
            await limits.add_tokens(f"once-{i}", 3)
            await limits.release(f"once-{i}")
            if i == MAX_UNLIMITED_TENANTS // 2:
                await limits.admit("recent", lambda: 1.0)  # seen again: it moves to the last seen
                await limits.release("recent")
        kept = await limits.snapshot()
        assert limits.retained()["limit_tenants"] <= MAX_UNLIMITED_TENANTS + 1
        assert kept["limited"]["requests_last_minute"] == 1
        assert kept["busy"]["in_system"] == 1
        assert "once-0" not in kept and f"once-{5 * MAX_UNLIMITED_TENANTS - 1}" in kept

    asyncio.run(scenario())


def test_the_in_process_storage_answers_as_the_packages_memory_storage() -> None:
    # proxy/limits.py keeps its in-process counts in a storage of its own (the package's starts a
    # thread every 10 ms of use): the package's strategies must get the same answers from both.
    from limits import RateLimitItemPerMinute
    from limits.storage import MemoryStorage
    from limits.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

    from clairvoyant.proxy.limits import _LazyMemoryStorage

    rng = random.Random(7)
    theirs, ours = MemoryStorage(), _LazyMemoryStorage()
    try:
        window = [MovingWindowRateLimiter(s) for s in (theirs, ours)]
        counter = [FixedWindowRateLimiter(s) for s in (theirs, ours)]
        answers: list[tuple[object, ...]] = []
        for _ in range(2_000):
            item = RateLimitItemPerMinute(rng.randint(1, 30))
            key, cost = rng.choice("abc"), rng.choice([1, 1, 1, 2, 5, 40])
            match rng.randint(0, 4):
                case 0:
                    answers.append((window[0].hit(item, key, cost=cost), window[1].hit(item, key, cost=cost)))
                case 1:
                    answers.append((window[0].test(item, key, cost=cost), window[1].test(item, key, cost=cost)))
                case 2:
                    stats = [w.get_window_stats(item, key) for w in window]
                    assert abs(stats[0].reset_time - stats[1].reset_time) < 1.0  # both stamp time.time()
                    answers.append((stats[0].remaining, stats[1].remaining))
                case 3:
                    answers.append((counter[0].hit(item, key, cost=cost), counter[1].hit(item, key, cost=cost)))
                case _:
                    answers.append((counter[0].test(item, key), counter[1].test(item, key)))
        assert all(a == b for a, b in answers)
        assert {a for a, _ in answers} >= {True, False}  # both kinds of answer came up
    finally:
        theirs.timer.cancel()


def test_a_redis_url_is_checked_and_excludes_a_state_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="redis://, rediss:// or unix://, not 'http'"):
        TenantLimits({}, redis_url="http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="with Redis the counts live there"):
        TenantLimits({}, redis_url="redis://127.0.0.1:6379/0", state_path=tmp_path / "x.limits.json")


def test_the_in_process_counts_start_no_thread() -> None:
    # Why the in-process storage is not the package's MemoryStorage: that one starts a thread
    # after every 10 ms of use (benchmarks/bench_limits_cost.py measures what it costs).
    before = {t.ident for t in threading.enumerate()}

    async def scenario() -> None:
        limits = TenantLimits({"a": Limits(max_concurrent=5, requests_per_minute=1_000, tokens_per_day=10**6)})
        for _ in range(50):
            await limits.admit("a", lambda: 1.0)
            await limits.add_tokens("a", 3)
            await limits.release("a")
            await asyncio.sleep(0.001)
        assert (await limits.snapshot())["a"]["requests_last_minute"] == 50

    asyncio.run(scenario())
    assert {t.ident for t in threading.enumerate()} <= before


@pytest.mark.parametrize("redis_url", [None, "redis://127.0.0.1:1"])
def test_redis_py_is_loaded_only_with_a_redis_url(redis_url: str | None) -> None:
    # Loading redis-py costs a proxy's start-up time (about 0.4 s); one without replicas never needs it.
    script = f"""
import asyncio, sys
import clairvoyant.proxy.app
from clairvoyant.config import Limits
from clairvoyant.proxy.limits import TenantLimits

limits = TenantLimits({{"a": Limits(max_concurrent=1)}}, redis_url={redis_url!r})
if {redis_url!r} is None:
    asyncio.run(limits.start())
print("redis" in sys.modules)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == str(redis_url is not None)
