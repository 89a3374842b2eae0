"""The pool of backends: one ``Upstream`` each, what each backend is, and the health checks that
keep the dispatcher's routing records (scheduling/routing.py) current (docs/design.md, "The pool
of backends").

At start-up each backend of kind ``auto`` is asked what it is (the kinds' questions,
proxy/backend_kinds.py); llama.cpp's answer carries its slots. With more than one backend, a
monitor task each checks its health (with backoff while unhealthy) and, for Ollama, its loaded
models. A refused connection marks a backend unhealthy at once and wakes its monitor; any answer
marks it healthy. A llama.cpp backend without configured slots is asked again when it comes back
(it may have been restarted with another ``-np``). With one backend nothing is polled: a request
that finds it down waits for it (``backend_wait_s``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from clairvoyant.config import BackendConfig, Settings
from clairvoyant.proxy.backend_kinds import DISCOVERY_ORDER, OPENAI, BackendKind, backend_kind
from clairvoyant.proxy.transport import Transport
from clairvoyant.proxy.upstream import Upstream
from clairvoyant.scheduling.dispatcher import Dispatcher
from clairvoyant.scheduling.routing import Backend, ModelsHeld, same_model

__all__ = ["BackendPool", "PoolMember", "merge_model_lists"]

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 5.0  # between checks of a healthy backend
RETRY_START_S = 0.5  # first re-check of an unhealthy backend; doubles up to RETRY_MAX_S
RETRY_MAX_S = 10.0
DISCOVERY_TIMEOUT_S = 3.0  # per question asked of a backend at start-up
DISCOVERY_TOTAL_S = 5.0  # for all of them: start-up goes on without the answers missing by then


@dataclass(eq=False)
class PoolMember:
    config: BackendConfig
    name: str
    upstream: Upstream
    slots: int
    checked: asyncio.Event = field(default_factory=asyncio.Event)  # set to cut the monitor's sleep short
    slots_known: bool = False  # slots configured, or llama.cpp's total_slots read

    @property
    def kind(self) -> BackendKind:
        """Its upstream's, which probes by it (``auto`` while not reached yet)."""
        return self.upstream.kind


class BackendPool:
    def __init__(self, settings: Settings, *, transport: Transport | None = None) -> None:
        """``transport``: tests' injected one, shared by every backend; None: each gets aiohttp's."""
        self.settings = settings
        self.members: list[PoolMember] = []
        for config in settings.pool:
            name = config.name or "backend-1"  # settings.pool names every backend
            upstream = Upstream(
                config.url,
                connect_timeout_s=settings.connect_timeout_s,
                read_timeout_s=settings.read_timeout_s,
                first_byte_timeout_s=settings.first_byte_timeout_s,
                keepalive_s=settings.backend_keepalive_s,
                api_key=None if config.api_key is None else config.api_key.get_secret_value(),
                transport=transport,
                name=name,
                kind=backend_kind(config.kind),
            )
            member = PoolMember(config, name, upstream, config.slots or settings.slots)
            member.slots_known = config.slots is not None or not upstream.kind.may_report_slots
            self.members.append(member)
        self._index = {id(m.upstream): i for i, m in enumerate(self.members)}  # members live as long as the pool
        self.dispatcher: Dispatcher | None = None
        self._monitors: list[asyncio.Task[None]] = []

    def __len__(self) -> int:
        return len(self.members)

    @property
    def first(self) -> Upstream:
        return self.members[0].upstream

    async def discover(self) -> None:
        """Ask each backend what it is (kind, slots), all at once; one that does not answer keeps its
        configured slots and is asked again once it does."""
        if not self.settings.backends and not self.settings.vllm_priority:
            return  # the upstream_url shorthand: its slots are `slots`, and nothing to route
        try:  # a black-holed address must not hold start-up: unanswered ones are asked again later
            async with asyncio.timeout(DISCOVERY_TOTAL_S):
                await asyncio.gather(*(self._discover(m) for m in self.members))
        except TimeoutError:
            unknown = [m.name for m in self.members if not m.kind.known]
            logger.warning("backends %s did not say what they are within %.0f s", ", ".join(unknown), DISCOVERY_TOTAL_S)

    async def _discover(self, member: PoolMember) -> None:
        """Ask what it is and, for llama.cpp, its slots, unless both are known (resized if they differ)."""
        if member.kind.known and member.slots_known:
            return
        upstream = member.upstream
        for kind in DISCOVERY_ORDER if not member.kind.known else (member.kind,):
            path = kind.identify_path
            answer = await upstream.get_json(path, DISCOVERY_TIMEOUT_S) if path is not None else None
            if not kind.identifies(answer):
                continue
            upstream.kind = kind
            member.slots_known = True  # (a llama.cpp too old to say keeps ``slots``)
            total = answer.get(kind.slots_key) if kind.slots_key is not None else None
            if member.config.slots is None and isinstance(total, int) and total >= 1:
                if total != member.slots and self.dispatcher is not None:  # down at start-up, or restarted
                    self.dispatcher.resize(self.members.index(member), total)
                member.slots = total
            return
        if not member.kind.known and await upstream.probe(DISCOVERY_TIMEOUT_S) is None:
            upstream.kind = OPENAI
        # a llama.cpp whose /props did not answer, or one not reached, is asked again
        member.slots_known = not member.kind.may_report_slots

    def scheduling_backends(self) -> list[Backend]:
        """The dispatcher's routing records, one per member, in configuration order."""
        return [
            Backend(
                m.name,
                m.slots,
                models=tuple(m.config.models),
                held=ModelsHeld(tracks_loaded=m.kind.loaded_models_path is not None),
                info={"url": m.upstream.display_url, "kind": m.kind.name},
            )
            for m in self.members
        ]

    def start(self, dispatcher: Dispatcher) -> None:
        """Keep the dispatcher's records current: one monitor per backend (a pool only)."""
        self.dispatcher = dispatcher
        if len(self.members) < 2:
            return
        for index in range(len(self.members)):
            # Not the dispatcher's detached tasks (its drain waits for those): cancelled by aclose.
            task = asyncio.create_task(self._monitor(index), name=f"backend-monitor-{index}")
            task.add_done_callback(_log_failure)
            self._monitors.append(task)

    async def _monitor(self, index: int) -> None:
        member = self.members[index]
        retry_s = RETRY_START_S
        while True:
            healthy = await member.upstream.probe() is None
            loaded: list[str] | None = None
            if healthy:
                retry_s = RETRY_START_S
                if self._back_after_failure(index) and member.kind.may_report_slots and member.config.slots is None:
                    member.slots_known = False  # it may have been restarted with another -np: ask /props again
                if not member.kind.known or not member.slots_known:
                    await self._discover(member)
                if member.kind.loaded_models_path is not None:
                    loaded = await self._loaded_models(member, member.kind.loaded_models_path)
            self._set(index, healthy, loaded)
            member.checked.clear()
            wait_s = HEALTH_INTERVAL_S if healthy else retry_s
            if not healthy:
                retry_s = min(RETRY_MAX_S, retry_s * 2)
            try:
                await asyncio.wait_for(member.checked.wait(), wait_s)
            except TimeoutError:
                pass

    def _back_after_failure(self, index: int) -> bool:
        return self.dispatcher is not None and not self.dispatcher.backends[index].healthy

    @staticmethod
    async def _loaded_models(member: PoolMember, path: str) -> list[str] | None:
        ps = await member.upstream.get_json(path)
        if not isinstance(ps, dict) or not isinstance(ps.get("models"), list):
            return None
        return [str(m.get("name") or m.get("model")) for m in ps["models"] if isinstance(m, dict)]

    def _set(self, index: int, healthy: bool, loaded: list[str] | None = None) -> None:
        if self.dispatcher is not None:
            self.dispatcher.set_health(index, healthy, loaded)
            record = self.dispatcher.backends[index]
            kind = self.members[index].kind  # discovered late, if it was down at start-up
            record.info["kind"], record.held.tracks_loaded = kind.name, kind.loaded_models_path is not None

    def refused(self, upstream: Upstream) -> None:
        """A connection to this backend was refused: unhealthy now, its monitor woken."""
        index = self._index[id(upstream)]
        self._set(index, False)
        self.members[index].checked.set()

    def answered(self, upstream: Upstream) -> None:
        """This backend answered a request: healthy (cheap when it already was)."""
        if self.dispatcher is not None:
            index = self._index[id(upstream)]
            if not self.dispatcher.backends[index].healthy:
                self._set(index, True)

    def broken(self, upstream: Upstream) -> None:
        """An answer from this backend broke off (it may have died): in a pool it gets no more
        requests until its monitor finds it healthy (the broken request is never resent)."""
        if len(self.members) > 1:  # one backend: nowhere else to send the next request
            self.refused(upstream)

    def passthrough_order(self, model: str | None) -> list[Upstream]:
        """Where a pass-through request for ``model`` may go, best first: healthy backends that serve
        it, those with it loaded first, in configuration order; then the unhealthy ones."""
        backends = self.dispatcher.backends if self.dispatcher is not None else self.scheduling_backends()
        serving = [i for i, b in enumerate(backends) if b.serves(model)] or list(range(len(backends)))
        serving.sort(key=lambda i: (not backends[i].healthy, not backends[i].held.has_loaded(model), i))
        return [self.members[i].upstream for i in serving]

    async def aclose(self) -> None:
        for task in self._monitors:
            task.cancel()
        await asyncio.gather(*self._monitors, return_exceptions=True)
        await asyncio.gather(*(m.upstream.aclose() for m in self.members))


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("%s failed", task.get_name(), exc_info=task.exception())


def merge_model_lists(path: str, bodies: Iterable[Any]) -> bytes:
    """One model listing from the backends' own: Ollama ``/api/tags`` (``models``, by ``name``) or
    OpenAI ``/v1/models`` (``data``, by ``id``); the first backend's entry wins a duplicate."""
    ollama = path == "/api/tags"
    list_key, id_key = ("models", "name") if ollama else ("data", "id")
    merged: list[Any] = []
    seen: list[str] = []
    for body in bodies:
        entries = body.get(list_key) if isinstance(body, dict) else None
        for entry in entries if isinstance(entries, list) else []:
            ident = entry.get(id_key) if isinstance(entry, dict) else None
            if isinstance(ident, str) and not any(same_model(ident, s) for s in seen):
                seen.append(ident)
                merged.append(entry)
    out: dict[str, Any] = {"models": merged} if ollama else {"object": "list", "data": merged}
    return json.dumps(out).encode()
