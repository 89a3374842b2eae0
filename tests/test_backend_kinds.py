"""The registry of backend kinds, and one contract every kind keeps: a backend that answers as
that kind's server does is found to be of it, with its slots, its health path, its busy-slots
probe and its loaded-models listing used as the kind says (respx answers as the real servers do;
real llama.cpp servers are in test_pool_e2e.py)."""

from __future__ import annotations

import asyncio
from typing import Any, get_args

import httpx
import pytest
import respx
from proxy_harness import mock_transport

from clairvoyant.config import BackendKindName, Settings
from clairvoyant.proxy.backend_kinds import KINDS, backend_kind
from clairvoyant.proxy.pool import BackendPool

URL = "http://backend.test"
# What each kind's server answers (every other path: 404). ``auto`` is a backend never reached.
ANSWERS: dict[str, dict[str, Any]] = {
    "llamacpp": {
        "/props": {"total_slots": 3, "default_generation_settings": {}},
        "/health": {"status": "ok"},
        "/slots": [{"is_processing": True}, {"is_processing": False}, {"is_processing": True}],
    },
    "ollama": {"/api/version": {"version": "0.13.5"}, "/api/ps": {"models": [{"name": "llama3:latest"}]}},
    "vllm": {"/version": {"version": "0.11.0"}, "/health": {}},
    "openai": {"/health": {}},
    "auto": {},
}


def test_every_kind_name_the_settings_accept_has_one_kind() -> None:
    assert set(get_args(BackendKindName)) == set(KINDS) == set(ANSWERS)
    assert all(backend_kind(name).name == name for name in KINDS)


def test_an_unknown_kind_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown backend kind 'tgi': one of auto, llamacpp, ollama"):
        backend_kind("tgi")


def _router(name: str) -> respx.MockRouter:
    router = respx.MockRouter(assert_all_called=False)
    for path, body in ANSWERS[name].items():
        router.get(URL + path, name=path).respond(200, json=body)
    if name == "auto":
        router.route().mock(side_effect=httpx.ConnectError("refused"))
    else:
        router.route().respond(404)
    return router


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_backend_answering_as_a_kind_is_found_and_used_as_that_kind(name: str) -> None:
    kind, router = backend_kind(name), _router(name)

    async def scenario() -> tuple[BackendPool, str | None, int | None]:
        pool = BackendPool(Settings(backends=[{"url": URL}], slots=1), transport=mock_transport(router))
        try:
            await pool.discover()
            upstream = pool.first
            return pool, await upstream.probe(), await upstream.busy_slots()
        finally:
            await pool.aclose()

    pool, not_ready, busy = asyncio.run(scenario())
    member, record = pool.members[0], pool.scheduling_backends()[0]
    assert member.kind is kind and record.info["kind"] == name
    assert member.slots == (3 if kind.slots_key is not None else 1)
    assert member.slots_known is kind.known  # an unreached backend is asked again
    assert (not_ready is None) is kind.known
    if kind.known:  # its health check asked its health path
        assert any(call.request.url.path == kind.health_path for call in router.calls)
    assert busy == (2 if kind.busy_slots_path is not None and kind.known else None)
    assert (f"{URL}/slots" in {str(c.request.url) for c in router.calls}) is (kind.busy_slots_path is not None)
    assert record.held.tracks_loaded is (kind.loaded_models_path is not None)


@pytest.mark.parametrize("name", sorted(n for n in KINDS if n != "auto"))
def test_a_configured_kind_is_asked_only_for_the_slots_it_may_report(name: str) -> None:
    kind, router = backend_kind(name), _router(name)

    async def scenario() -> BackendPool:
        pool = BackendPool(Settings(backends=[{"url": URL, "kind": name}], slots=1), transport=mock_transport(router))
        await pool.discover()
        await pool.aclose()
        return pool

    pool = asyncio.run(scenario())
    asked = [call.request.url.path for call in router.calls]
    assert asked == ([kind.identify_path] if kind.slots_key is not None else [])
    assert pool.members[0].kind is kind and pool.members[0].slots_known
