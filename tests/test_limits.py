"""proxy/limits.py: a tenant's requests at once, requests a minute and tokens a day, with time as data."""

from __future__ import annotations

import calendar
import json
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


def test_concurrency_counts_in_flight_plus_waiting_until_released() -> None:
    limits = TenantLimits({"a": Limits(max_concurrent=2)}, wall=Wall())
    limits.admit("a", lambda: 7.2)
    limits.admit("a", lambda: 7.2)
    with pytest.raises(LimitExceeded) as refused:
        limits.admit("a", lambda: 7.2)
    assert refused.value.status_code == 429 and refused.value.code == "concurrency_limited"
    assert refused.value.headers == {"Retry-After": "8"} and refused.value.limit == "max_concurrent"
    limits.admit("b", lambda: 1.0)  # another tenant is not affected
    limits.release("a")
    limits.admit("a", lambda: 7.2)
    assert limits.snapshot()["a"]["in_system"] == 2


def test_requests_per_minute_is_a_sliding_window() -> None:
    wall = Wall()
    limits = TenantLimits({"a": Limits(requests_per_minute=2)}, wall=wall)
    limits.admit("a", lambda: 1.0)
    wall.now_s += 20
    limits.admit("a", lambda: 1.0)
    wall.now_s += 10
    with pytest.raises(LimitExceeded) as refused:
        limits.admit("a", lambda: 1.0)
    assert refused.value.code == "rate_limited" and refused.value.headers == {
        "Retry-After": "30"
    }  # until the first leaves
    wall.now_s += 30  # the first admission is 60 s old now: out of the window
    limits.admit("a", lambda: 1.0)
    assert limits.snapshot()["a"]["requests_last_minute"] == 2


def test_tokens_per_day_refuses_once_reached_until_utc_midnight() -> None:
    wall = Wall()
    limits = TenantLimits({"a": Limits(tokens_per_day=100)}, wall=wall)
    limits.admit("a", lambda: 1.0)
    limits.add_tokens("a", 60)
    limits.admit("a", lambda: 1.0)  # under the limit: admitted, even if its answer will cross it
    limits.add_tokens("a", 60)
    with pytest.raises(LimitExceeded) as refused:
        limits.admit("a", lambda: 1.0)
    assert refused.value.limit == "tokens_per_day" and refused.value.headers == {"Retry-After": str(12 * 3600)}
    assert limits.snapshot()["a"]["tokens_today"] == 120
    wall.now_s += 12 * 3600  # UTC midnight: a new day
    limits.admit("a", lambda: 1.0)
    assert limits.snapshot()["a"]["tokens_today"] == 0


def test_the_counts_survive_a_restart_and_a_reload(tmp_path: Path) -> None:
    wall = Wall()
    path = tmp_path / "learner.limits.json"
    first = TenantLimits({"a": Limits(requests_per_minute=2, tokens_per_day=50)}, state_path=path, wall=wall)
    first.admit("a", lambda: 1.0)
    first.add_tokens("a", 40)
    first.save()
    wall.now_s += 5
    second = TenantLimits({"a": Limits(requests_per_minute=2, tokens_per_day=50)}, state_path=path, wall=wall)
    second.load()
    assert second.snapshot()["a"] == {
        "limits": {"requests_per_minute": 2, "tokens_per_day": 50}, "in_system": 0, "requests_last_minute": 1,
        "tokens_today": 40,
    }  # fmt: skip
    second.reload({"a": Limits(requests_per_minute=1)})  # new limits, the same counts
    with pytest.raises(LimitExceeded):
        second.admit("a", lambda: 1.0)
    path.write_text("{not json")
    third = TenantLimits({}, state_path=path, wall=wall)
    third.load()  # an unreadable file: logged, counting starts afresh
    assert third.snapshot() == {}
    assert json.loads(json.dumps(second.state()))["day"] == "2026-11-27"


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
    limits = TenantLimits({"limited": Limits(requests_per_minute=10_000)}, wall=Wall())
    limits.admit("limited", lambda: 1.0)
    limits.release("limited")
    limits.admit("busy", lambda: 1.0)  # in the system throughout
    limits.add_tokens("recent", 5)
    for i in range(5 * MAX_UNLIMITED_TENANTS):
        limits.admit(f"once-{i}", lambda: 1.0)
        limits.add_tokens(f"once-{i}", 3)
        limits.release(f"once-{i}")
        if i == MAX_UNLIMITED_TENANTS // 2:
            limits.admit("recent", lambda: 1.0)  # seen again: it moves to the last seen
            limits.release("recent")
    kept = limits.snapshot()
    assert limits.retained()["limit_tenants"] <= MAX_UNLIMITED_TENANTS + 1
    assert kept["limited"]["requests_last_minute"] == 1
    assert kept["busy"]["in_system"] == 1
    assert "once-0" not in kept and f"once-{5 * MAX_UNLIMITED_TENANTS - 1}" in kept
