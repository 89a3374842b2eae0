"""Routing: which backend of the pool serves a request, decided at dispatch from the freshest state.

The dispatcher keeps one ``Backend`` record per backend (the proxy's health checks keep it current)
and calls ``choose`` when a request's turn comes. The rule, in order:

1. backends that serve the request's model (an empty model list serves any) and have a free slot;
2. healthy ones; an unhealthy one only when no backend serving the model is healthy (the request
   then waits there for it, up to ``backend_wait_s``). A healthy backend that is merely busy is
   worth waiting for: ``choose`` returns None;
3. one that has the model loaded (Ollama ``/api/ps``), holds it (the model it served last), or
   loads it at no cost (learned load under ``FREE_LOAD_S``), to avoid a reload stall; a backend
   of which nothing is known yet is not held against;
4. the earliest predicted finish: the predicted seconds of work left per slot (each in-flight
   request's ``dispatcher.remainder_s``, never 0 while it runs, so an overrun request still
   occupies its backend) plus the request's own, scaled by the backend's measured slowness
   (``observe_service``), so a laptop beside a GPU box gets a request only when it would finish
   it sooner;
5. the earlier backend in the configuration.

No I/O here: the records are plain data, so the rule is tested with explicit states.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clairvoyant.scheduling.service_time import FREE_LOAD_S

__all__ = ["Backend", "Load", "ModelsHeld", "choose", "same_model"]

SLOWNESS_WEIGHT = 0.1  # of each new sample in a backend's moving slowness, in log space (about the last 10 requests)
SLOWNESS_MAX = 10.0  # the slowness stays within 1/10 and 10
SLOWNESS_STEP = 2.0  # one sample counts at most 2x above (or below) the current slowness: an outlier moves it by 7%


def same_model(a: str, b: str) -> bool:
    """Model names as backends spell them: Ollama's ``llama3.2`` is ``llama3.2:latest``."""
    return a == b or a.removesuffix(":latest") == b.removesuffix(":latest")


class Load(enum.IntEnum):
    """What a request sent to a backend found there: whether it pays a model load first."""

    HELD = 0  # the backend held its model: no load
    SWITCH = 1  # the backend held another model: it loads this one first (a switch)
    UNKNOWN = 2  # nothing was known of what the backend held (its first request): a load, maybe


@dataclass(slots=True, eq=False)
class ModelsHeld:
    """What one backend holds: the models it reports loaded and the model it was last sent."""

    tracks_loaded: bool = False  # it loads models on demand (Ollama): a model sent to it counts as loaded
    loaded: tuple[str, ...] = ()  # models loaded now (Ollama /api/ps); empty = unknown or none
    reported: bool = False  # ``loaded`` is its own report (/api/ps) and no switch was sent since
    last_model: str | None = None  # the model of the last request sent here (any kind of backend)
    switched_s: float = -math.inf  # clock seconds when it was last sent a model it did not hold

    def has_loaded(self, model: str | None) -> bool:
        return model is not None and any(same_model(model, m) for m in self.loaded)

    def holds(self, model: str | None) -> bool:
        """It holds ``model`` now, with nothing to load: the model it served last, or one its own
        report lists if no switch was sent since (a switch may have evicted the others)."""
        last = self.last_model
        if last is not None and (last == model or (model is not None and same_model(model, last))):
            return True
        return self.reported and self.has_loaded(model)

    def report(self, loaded: Sequence[str]) -> None:  # its own list of the models loaded now (/api/ps)
        self.loaded = tuple(loaded)
        self.reported = True

    def dispatched(self, model: str | None, now: float) -> Load:
        """A request for ``model`` is sent here at ``now`` (clock seconds): what it finds (a model
        not held makes ``now`` the last switch)."""
        if self.holds(model):
            found = Load.HELD
        else:
            known = self.last_model is not None or (self.reported and bool(self.loaded))
            found = Load.SWITCH if known else Load.UNKNOWN
            self.switched_s = now
            self.reported = False
        self.last_model = model
        self.sent(model)
        return found

    def sent(self, model: str | None) -> None:
        """A backend that loads on demand has a model sent to it loaded from now on, until its next
        /api/ps says otherwise (so the next request for it follows)."""
        if self.tracks_loaded and model is not None and not self.has_loaded(model):
            self.loaded = (*self.loaded, model)


@dataclass(slots=True, eq=False)
class Backend:
    """The dispatcher's view of one backend."""

    name: str  # as shown in /queue, metrics and the X-Clairvoyant-Backend header
    slots: int  # requests it runs at once
    models: tuple[str, ...] = ()  # the models it serves; empty = any
    healthy: bool = True  # its last health check (or connection) succeeded
    held: ModelsHeld = field(default_factory=ModelsHeld)
    slowness: float = 1.0  # measured / predicted service seconds here (moving average); 1 = as predicted
    info: dict[str, Any] = field(default_factory=dict)  # shown in /queue as is (url, kind)
    running: dict[int, Any] = field(default_factory=dict)  # slot -> the ticket holding it
    free: list[int] = field(default_factory=list)  # free slot numbers

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"backend {self.name}: slots must be >= 1")
        self.free = list(range(self.slots - 1, -1, -1))  # popped from the end: slot 0 first

    def serves(self, model: str | None) -> bool:
        return not self.models or model is None or any(same_model(model, m) for m in self.models)

    def pays_load(self, model: str | None, load_s: Callable[[str, str | None], float]) -> bool:
        """A request for ``model`` sent here now would wait for a load: it holds another model (or
        reported none loaded), and ``load_s(name, model)`` (its learned load) is not negligible."""
        held = self.held
        if held.holds(model) or held.has_loaded(model):
            return False
        known = held.last_model is not None or held.reported
        return known and load_s(self.name, model) >= FREE_LOAD_S

    def observe_service(self, predicted_s: float, measured_s: float) -> None:
        """A request served here took ``measured_s`` against ``predicted_s``. The slowness is a
        moving geometric mean of measured / predicted, each sample counted as at most
        ``SLOWNESS_STEP`` times above or below it: one outlier (a request that waited on a model
        load or a busy CPU) moves it by at most ``SLOWNESS_STEP ** SLOWNESS_WEIGHT``, while a really
        slower backend is followed within tens of requests. Always positive and finite: it scales
        every prediction on this backend alike, so it cannot reorder them."""
        if predicted_s > 0 and measured_s > 0 and math.isfinite(predicted_s) and math.isfinite(measured_s):
            current = self.slowness
            sample = min(current * SLOWNESS_STEP, max(current / SLOWNESS_STEP, measured_s / predicted_s))
            moved = current * (sample / current) ** SLOWNESS_WEIGHT
            self.slowness = min(SLOWNESS_MAX, max(1 / SLOWNESS_MAX, moved))


def choose(
    backends: Sequence[Backend],
    model: str | None,
    remaining_s: Callable[[Backend], float],
    avoid: Sequence[int] = (),
    own_s: float = 0.0,
    load_s: Callable[[str, str | None], float] | None = None,
) -> int | None:
    """The backend to dispatch a request for ``model`` to now, or None to wait (the module's rule).
    ``avoid``: backends that refused this request already, left out while another serves the model
    (one that answers its health check but refuses requests must not bounce it forever).
    ``load_s``: learned load seconds (None: only Ollama's report of loaded models counts)."""
    if len(backends) == 1:  # the common deployment, on every request: the rule below comes to this
        only = backends[0]
        return 0 if only.free and only.serves(model) else None
    serving = [i for i, b in enumerate(backends) if b.serves(model)]
    if avoid:
        serving = [i for i in serving if i not in avoid] or serving
    if not serving:
        return None
    any_healthy = any(backends[i].healthy for i in serving)
    candidates = [i for i in serving if backends[i].free and (backends[i].healthy or not any_healthy)]
    if len(candidates) < 2:
        return candidates[0] if candidates else None  # (one backend: no work summed per request)
    return min(
        candidates,
        key=lambda i: (
            not backends[i].held.has_loaded(model) if load_s is None else backends[i].pays_load(model, load_s),
            remaining_s(backends[i]) / backends[i].slots + own_s * backends[i].slowness,
            i,
        ),
    )
