"""The live page's memory: the last 15 minutes of the queue, sampled from its view (``QueueView``).

/queue shows the present; /history what led to it, for the live page's charts, even when the page
was opened a moment ago. ``record_periodically`` samples the view every ``SAMPLE_INTERVAL_S`` and
keeps, in bounded memory, for ``WINDOW_S``: the waiting count and the requests in flight, a point a
sample; each finished request's wait (queued until dispatch, or until it left or expired), by
predicted class and by tenant, in ``BUCKET_S`` buckets by when the wait ended, for their P50 and P95
(nearest rank; past ``WAITS_PER_BUCKET``, of an even sample); the last ``ANSWERS`` answers, predicted
against actual output tokens; and each tenant's use against its limits (the ``MAX_TENANTS`` first
seen by name, the others summed as ``OTHER_TENANTS``).

Finished requests come from the view's ``recent`` list (the dispatcher's last 100), each recorded
once, known by request id, outcome, wait and service time (fixed once it ended, where its end, as
seconds ago, moves with the clock). Sampling every 2 s keeps the record whole up to 50 finished
requests a second; past that, the charts see the last 100 of each interval. Nothing here runs on a
request's path. Times are the dispatcher's clock; /history gives them as seconds ago, and what
cannot be computed (the P95 of no waits) as null, never NaN.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from clairvoyant.prediction.length_classes import CLASS_NAMES
from clairvoyant.proxy.limits import TenantLimits
from clairvoyant.scheduling.dispatcher import Dispatcher
from clairvoyant.scheduling.queue_view import FinishedView, QueueView, queue_view

__all__ = ["History", "history_now", "live_view", "record_periodically"]

SAMPLE_INTERVAL_S = 2.0
MAX_LOOP_SHARE = 0.02  # sampling takes at most this share of the event loop (a long queue's ETAs cost ms)
WINDOW_S = 900.0  # 15 minutes
BUCKET_S = 30.0  # the waits' percentiles are per bucket of this many seconds
ANSWERS = 200
MAX_TENANTS = 8
WAITS_PER_BUCKET = 256  # per class or tenant and bucket; beyond, an even sample (reservoir)
OTHER_TENANTS = "(other)"


@dataclass(slots=True)
class _Waits:
    """The waits of one class or tenant in one bucket: all of them up to ``WAITS_PER_BUCKET``,
    then an even sample (each wait seen is kept with the same probability)."""

    seen: int = 0
    kept: list[float] = field(default_factory=list)

    def add(self, wait_s: float, rng: random.Random) -> None:
        self.seen += 1
        if len(self.kept) < WAITS_PER_BUCKET:
            self.kept.append(wait_s)
            return
        slot = rng.randrange(self.seen)
        if slot < WAITS_PER_BUCKET:
            self.kept[slot] = wait_s


@dataclass(frozen=True, slots=True)
class _Point:
    at_s: float  # dispatcher clock seconds
    waiting: int
    in_flight: int
    tenants: dict[str, tuple[int, int]]  # charted tenant -> (in system, requests in the last minute)


@dataclass(frozen=True, slots=True)
class _Answer:
    end_s: float  # dispatcher clock seconds
    model: str
    predicted_class: str
    predicted_tokens: float
    output_tokens: int


def percentile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _identity(entry: FinishedView) -> tuple[Any, ...]:
    """What tells a finished request from the others, the same in every view that lists it."""
    return (entry.request_id, entry.outcome, entry.waited_s, entry.service_s)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class History:
    """The rings described in the module docstring. ``sample`` and ``observe`` take a view
    and the dispatcher clock's reading it was taken at; ``view`` is /history's body."""

    def __init__(self) -> None:
        # Bounded by time (pruned to WINDOW_S) and by count (a burst of samples cannot grow it).
        self._points: deque[_Point] = deque(maxlen=math.ceil(WINDOW_S / SAMPLE_INTERVAL_S) + 1)
        self._answers: deque[_Answer] = deque(maxlen=ANSWERS)
        # bucket index (floor(end of wait / BUCKET_S)) -> ("class" or "tenant", name) -> its waits
        self._waits: dict[int, dict[tuple[str, str], _Waits]] = {}
        self._last_recent: set[tuple[Any, ...]] = set()  # the last snapshot's finished requests (_identity)
        self._charted: list[str] = []  # tenants with their own series, in the order first seen
        self._tenants: Mapping[str, Any] = {}  # the last snapshot's "tenants": limits and use
        self._first_s: float | None = None
        self._rng = random.Random(0)

    def retained(self) -> dict[str, int]:
        """Entries held, by ring (each bounded by the window or a fixed size)."""
        return {
            "history_points": len(self._points),
            "history_answers": len(self._answers),
            "history_wait_series": sum(len(bucket) for bucket in self._waits.values()),
            "history_recent_seen": len(self._last_recent),
            "history_tenants": len(self._charted),
        }

    # -- recording ---------------------------------------------------------------------------
    def sample(self, snapshot: QueueView, now_s: float) -> None:
        """Record the snapshot's finished requests (``observe``) and one point of the series."""
        self.observe(snapshot, now_s)
        self._points.append(self._point(snapshot, now_s))

    def observe(self, snapshot: QueueView, now_s: float) -> None:
        """Record the finished requests of the snapshot's ``recent`` list not recorded yet (the
        list is the dispatcher's last ones: one recorded before is in the previous snapshot's
        list), and keep its tenants' limits and use."""
        if self._first_s is None:
            self._first_s = now_s
        tenants = self._tenants = snapshot.tenants
        # Tenants with limits get their own series first (the view lists them from the start).
        for name in sorted(tenants, key=lambda t: not tenants[t].get("limits")):
            self._chart(name)
        seen = self._last_recent
        current = set()
        for entry in reversed(snapshot.recent):  # oldest first
            identity = _identity(entry)
            current.add(identity)
            if identity not in seen:
                self._record(entry, now_s - (entry.ended_ago_s or 0.0))
        self._last_recent = current
        self._prune(now_s)

    def _record(self, entry: FinishedView, end_s: float) -> None:
        waited_s = _finite(entry.waited_s)
        if waited_s is not None:
            wait_end_s = end_s - (_finite(entry.service_s) or 0.0)
            if self._first_s is None or wait_end_s < self._first_s:  # the record reaches back to it
                self._first_s = wait_end_s
            bucket = self._waits.setdefault(math.floor(wait_end_s / BUCKET_S), {})
            for key in (("class", str(entry.predicted_class)), ("tenant", self._chart(entry.tenant or ""))):
                bucket.setdefault(key, _Waits()).add(waited_s, self._rng)
        output_tokens = entry.output_tokens
        predicted_tokens = _finite(entry.predicted_tokens)
        if entry.outcome == "completed" and output_tokens is not None and predicted_tokens is not None:
            self._answers.append(
                _Answer(end_s, entry.model or "", str(entry.predicted_class), predicted_tokens, output_tokens)
            )

    def _chart(self, tenant: str) -> str:
        """The series ``tenant`` is counted in: its own while there is room, else ``OTHER_TENANTS``."""
        if tenant in self._charted:
            return tenant
        if len(self._charted) < MAX_TENANTS:
            self._charted.append(tenant)
            return tenant
        return OTHER_TENANTS

    def _point(self, snapshot: QueueView, now_s: float) -> _Point:
        tenants: dict[str, tuple[int, int]] = {}
        for name, use in snapshot.tenants.items():
            key = self._chart(name)
            in_system, last_minute = tenants.get(key, (0, 0))
            tenants[key] = (
                in_system + int(use.get("in_system", 0)),
                last_minute + int(use.get("requests_last_minute", 0)),
            )
        return _Point(now_s, snapshot.waiting_count, len(snapshot.in_flight), tenants)

    def _prune(self, now_s: float) -> None:
        cutoff_s = now_s - WINDOW_S
        while self._points and self._points[0].at_s < cutoff_s:
            self._points.popleft()
        for index in [i for i in self._waits if (i + 1) * BUCKET_S <= cutoff_s]:
            del self._waits[index]

    # -- the view ----------------------------------------------------------------------------
    def view(self, now_s: float, live: QueueView | None = None) -> dict[str, Any]:
        """/history's body at ``now_s``: everything within the window, as seconds ago, oldest
        first; ``live`` (a snapshot taken now) adds the present as the series' last point."""
        self._prune(now_s)
        points = list(self._points)
        if live is not None:
            points.append(self._point(live, now_s))
        first_s = now_s if self._first_s is None else max(self._first_s, now_s - WINDOW_S)
        buckets = list(range(math.floor(first_s / BUCKET_S), math.floor(now_s / BUCKET_S) + 1))
        classes = list(CLASS_NAMES) + sorted(
            {name for b in self._waits.values() for kind, name in b if kind == "class"} - set(CLASS_NAMES)
        )
        tenants = self._charted + ([OTHER_TENANTS] if self._uses_other(points) else [])
        current = live.tenants if live is not None else None
        return {
            "window_s": WINDOW_S,
            "interval_s": SAMPLE_INTERVAL_S,
            "bucket_s": BUCKET_S,
            "covered_s": round(now_s - first_s, 3),  # how far back the record goes (at most window_s)
            "series": {
                "ago_s": [round(now_s - p.at_s, 3) for p in points],
                "waiting": [p.waiting for p in points],
                "in_flight": [p.in_flight for p in points],
            },
            "waits": {
                "ago_s": [round(max(0.0, now_s - (i + 1) * BUCKET_S), 3) for i in buckets],  # each bucket's end
                "by_class": {name: self._wait_series(buckets, ("class", name)) for name in classes},
            },
            "answers": [
                {
                    "ago_s": round(now_s - a.end_s, 3),
                    "model": a.model,
                    "predicted_class": a.predicted_class,
                    "predicted_tokens": round(a.predicted_tokens, 1),
                    "output_tokens": a.output_tokens,
                }
                for a in self._answers
            ],
            "tenants": {
                name: self._tenant_view(name, points, buckets, self._tenants if current is None else current)
                for name in tenants
            },
        }

    def _uses_other(self, points: list[_Point]) -> bool:
        return any(OTHER_TENANTS in p.tenants for p in points) or any(
            ("tenant", OTHER_TENANTS) in b for b in self._waits.values()
        )

    def _wait_series(self, buckets: list[int], key: tuple[str, str]) -> dict[str, list[Any]]:
        found = [self._waits.get(i, {}).get(key) for i in buckets]
        return {
            "p50": [None if w is None else _ms(percentile(w.kept, 0.5)) for w in found],
            "p95": [None if w is None else _ms(percentile(w.kept, 0.95)) for w in found],
            "count": [0 if w is None else w.seen for w in found],
        }

    def _tenant_view(
        self, name: str, points: list[_Point], buckets: list[int], tenants: Mapping[str, Any]
    ) -> dict[str, Any]:
        key = ("tenant", name)
        kept = [v for b in self._waits.values() if key in b for v in b[key].kept]
        if name == OTHER_TENANTS:  # summed over the tenants without a series of their own
            uses = [use for t, use in tenants.items() if t not in self._charted]
            limits: Mapping[str, Any] = {}
        else:
            uses = [tenants.get(name, {})]
            limits = uses[0].get("limits", {})
        return {
            "limits": dict(limits),
            **{f: sum(int(u.get(f, 0)) for u in uses) for f in ("in_system", "requests_last_minute", "tokens_today")},
            "series": {
                "in_system": [p.tenants[name][0] if name in p.tenants else None for p in points],
                "requests_last_minute": [p.tenants[name][1] if name in p.tenants else None for p in points],
            },
            "waits": self._wait_series(buckets, key),
            "wait_p50_s": _ms(percentile(kept, 0.5)),  # over the window
            "wait_p95_s": _ms(percentile(kept, 0.95)),
            "waits_counted": sum(b[key].seen for b in self._waits.values() if key in b),
        }


async def live_view(dispatcher: Dispatcher, limits: TenantLimits, limit: int | None = 0) -> QueueView:
    """/queue's body: the queue's view with its tenants' limits and use. A sample reads it without
    the list of waiting requests (``limit`` 0: their count stays)."""
    view = queue_view(dispatcher, limit)
    view.tenants = await limits.snapshot()
    return view


async def history_now(history: History, dispatcher: Dispatcher, limits: TenantLimits) -> dict[str, Any]:
    """/history's body: the record so far, brought up to the present (its finished requests, and
    the present as the series' last point)."""
    now_s = dispatcher.clock.now()
    live = await live_view(dispatcher, limits)
    history.observe(live, now_s)
    return history.view(now_s, live)


async def record_periodically(history: History, dispatcher: Dispatcher, limits: TenantLimits) -> None:
    """Sample every ``SAMPLE_INTERVAL_S``, from now until cancelled (a tracked task of the dispatcher).
    A snapshot plays the whole queue forward for its ETAs (tens of ms for 10,000 waiting): when
    one takes longer than ``MAX_LOOP_SHARE`` of the interval, the next waits longer."""
    while True:
        started_s = time.perf_counter()
        history.sample(await live_view(dispatcher, limits), dispatcher.clock.now())
        took_s = time.perf_counter() - started_s
        await asyncio.sleep(max(SAMPLE_INTERVAL_S, took_s / MAX_LOOP_SHARE))
