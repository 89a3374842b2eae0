"""Per-tenant limits on the scheduled endpoints: requests at once, requests a minute, tokens a day.

A tenant is an API key's (``[[api_keys]]``) or the tenant header's (``[[tenants]]``). Each limit
is checked when a scheduled request arrives, before its body is read; one beyond a limit gets 429
with Retry-After in the client's dialect, and is never queued. Nothing else counts: the proxy's own
endpoints, the live page and pass-through paths are never refused for a tenant's use.

- ``max_concurrent``: requests in flight plus waiting. Retry-After: the predicted seconds until
  one of them ends (the caller's estimate).
- ``requests_per_minute``: admissions in a sliding 60 s window. Retry-After: until the oldest
  leaves it.
- ``tokens_per_day``: completion tokens per UTC day, as the backend reported them (usage,
  Ollama's eval_count). A request is refused once the day's count has reached the limit (the one
  that crosses it is not cut short). Retry-After: until UTC midnight.

The window and the day's tokens survive a restart in a state file (``learner_state_path``'s
stem + ``.limits.json``) when the learner's state is kept; otherwise they live in memory only.
Counts are kept by tenant name, so they survive a reload of the keys too. A tenant header can
name any tenant: of the tenants without limits, only the ``MAX_UNLIMITED_TENANTS`` seen last are
kept (those with requests in the system always), so a stream of new names cannot grow the process.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clairvoyant.config import Limits
from clairvoyant.errors import LimitExceeded
from clairvoyant.state_file import atomic_writer

__all__ = ["TenantLimits"]

logger = logging.getLogger(__name__)

WINDOW_S = 60.0  # requests_per_minute's sliding window
MAX_UNLIMITED_TENANTS = 1024  # tenants without limits whose counts are kept, at most (the ones seen last)
DAY_S = 86_400


def _utc_day(wall_s: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(wall_s))


@dataclass
class _Use:
    in_system: int = 0  # requests in flight plus waiting
    admitted_s: deque[float] = field(default_factory=deque)  # wall seconds of admissions in the window
    tokens_today: int = 0


class TenantLimits:
    def __init__(
        self,
        limits: Mapping[str, Limits],
        *,
        state_path: Path | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.limits = dict(limits)
        self.state_path = state_path
        self._wall = wall
        self._use: dict[str, _Use] = {}
        self._day = _utc_day(wall())

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

    def _roll(self, now_s: float) -> None:
        day = _utc_day(now_s)
        if day != self._day:
            self._day = day
            for use in self._use.values():
                use.tokens_today = 0

    def admit(self, tenant: str, free_in_s: Callable[[], float]) -> None:
        """Count a scheduled request of ``tenant`` in, or raise ``LimitExceeded`` (nothing counted).
        ``free_in_s``: predicted seconds until one of the tenant's requests ends (for Retry-After)."""
        limits = self.limits.get(tenant)
        use = self._of(tenant)
        if limits is None:  # the last seen go last when counts are dropped (``_forget_idle``)
            self._use[tenant] = self._use.pop(tenant)
        now_s = self._wall()
        if limits is not None:
            self._roll(now_s)
            window = use.admitted_s
            while window and window[0] <= now_s - WINDOW_S:
                window.popleft()
            if limits.max_concurrent is not None and use.in_system >= limits.max_concurrent:
                raise LimitExceeded(
                    f"tenant {tenant!r} has {use.in_system} requests in flight or waiting, its limit",
                    code="concurrency_limited", limit="max_concurrent", retry_after_s=_seconds(free_in_s()),
                )  # fmt: skip
            if limits.requests_per_minute is not None and len(window) >= limits.requests_per_minute:
                raise LimitExceeded(
                    f"tenant {tenant!r} has made {len(window)} requests in the last minute, its limit",
                    code="rate_limited", limit="requests_per_minute", retry_after_s=_seconds(window[0] + WINDOW_S - now_s),
                )  # fmt: skip
            if limits.tokens_per_day is not None and use.tokens_today >= limits.tokens_per_day:
                midnight_s = (math.floor(now_s / DAY_S) + 1) * DAY_S
                raise LimitExceeded(
                    f"tenant {tenant!r} has used its {limits.tokens_per_day} completion tokens for today (UTC)",
                    code="rate_limited", limit="tokens_per_day", retry_after_s=_seconds(midnight_s - now_s),
                )  # fmt: skip
            window.append(now_s)
        use.in_system += 1

    def release(self, tenant: str) -> None:
        """One of ``tenant``'s admitted requests has ended (answered, refused later, or left)."""
        self._of(tenant).in_system -= 1

    def add_tokens(self, tenant: str, tokens: int) -> None:
        """Completion tokens the backend reported for one of ``tenant``'s answers."""
        self._roll(self._wall())
        self._of(tenant).tokens_today += tokens

    def reload(self, limits: Mapping[str, Limits]) -> None:
        """New limits (the keys were reloaded); the counts stay."""
        self.limits = dict(limits)

    def retained(self) -> dict[str, int]:
        """Entries held: tenants counted, and admissions kept in their windows."""
        return {
            "limit_tenants": len(self._use),
            "limit_window_entries": sum(len(use.admitted_s) for use in self._use.values()),
        }

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Each tenant seen, or bounded: its limits and its use against them (for /queue)."""
        now_s = self._wall()
        self._roll(now_s)
        out = {}
        for tenant in sorted({*self._use, *self.limits}):
            use = self._of(tenant)
            limits = self.limits.get(tenant)
            out[tenant] = {
                "limits": {} if limits is None else limits.model_dump(exclude_none=True),
                "in_system": use.in_system,
                "requests_last_minute": sum(1 for s in use.admitted_s if s > now_s - WINDOW_S),
                "tokens_today": use.tokens_today,
            }
        return out

    # -- the state file ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What ``save`` writes: the window and the day's tokens (a copy, safe to write elsewhere)."""
        now_s = self._wall()
        self._roll(now_s)
        return {
            "day": self._day,
            "tokens_today": {t: u.tokens_today for t, u in self._use.items() if u.tokens_today},
            "admitted_s": {t: [s for s in u.admitted_s if s > now_s - WINDOW_S] for t, u in self._use.items()},
        }

    def save(self, state: dict[str, Any] | None = None) -> None:
        """Write ``state`` (default: the current one); nothing when no state path is set. Raises OSError."""
        if self.state_path is None:
            return
        with atomic_writer(self.state_path) as out:
            json.dump(self.state() if state is None else state, out)

    def load(self) -> None:
        """Restore what ``save`` wrote, when it is still current; a missing or unreadable file is
        logged and ignored (counting starts afresh)."""
        if self.state_path is None or not self.state_path.exists():
            return
        try:
            state = json.loads(self.state_path.read_text())
            now_s = self._wall()
            if state.get("day") == _utc_day(now_s):
                for tenant, tokens in state["tokens_today"].items():
                    self._of(tenant).tokens_today = int(tokens)
            for tenant, stamps in state["admitted_s"].items():
                self._of(tenant).admitted_s.extend(float(s) for s in stamps if float(s) > now_s - WINDOW_S)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("tenant limits: cannot read %s (%s); counting starts afresh", self.state_path, exc)


def _seconds(value_s: float) -> int:
    """A Retry-After value: whole seconds, at least 1."""
    return max(1, min(DAY_S, math.ceil(value_s)))
