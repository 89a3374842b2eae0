"""Routing at dispatch (scheduling/routing.py), from explicit states: model, health, loaded model, load."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from clairvoyant.scheduling.routing import Backend, Load, ModelsHeld, choose, same_model


def pool(*backends: Backend) -> list[Backend]:
    return list(backends)


def busy(backend: Backend) -> Backend:
    backend.free.clear()
    return backend


def no_work(backend: Backend) -> float:
    return 0.0


def test_only_backends_that_serve_the_model_are_chosen() -> None:
    backends = pool(Backend("a", 1, models=("llama3",)), Backend("b", 1, models=("qwen",)), Backend("c", 1))
    assert choose(backends, "qwen", no_work) == 1
    assert choose(backends, "llama3", no_work) == 0
    assert choose(backends, "mistral", no_work) == 2  # c lists no models: it serves any
    assert choose(backends[:2], "mistral", no_work) is None
    assert choose(backends, None, no_work) == 0  # a request naming no model: any backend


def test_a_busy_backend_that_serves_the_model_is_waited_for_not_another_models_backend() -> None:
    backends = pool(busy(Backend("a", 1, models=("llama3",))), Backend("b", 1, models=("qwen",)))
    assert choose(backends, "llama3", no_work) is None


def test_an_unhealthy_backend_is_skipped_while_a_healthy_one_serves_the_model() -> None:
    backends = pool(Backend("a", 1, healthy=False), Backend("b", 1))
    assert choose(backends, "m", no_work) == 1
    busy(backends[1])
    assert choose(backends, "m", no_work) is None  # wait for the healthy one, not the dead one
    backends[1].healthy = False
    assert choose(backends, "m", no_work) == 0  # none healthy: it waits at a backend for it to come back


def test_a_backend_with_the_model_loaded_goes_first_then_the_least_work_per_slot() -> None:
    backends = pool(Backend("a", 1), Backend("b", 1, held=ModelsHeld(loaded=("llama3:latest",))), Backend("c", 4))
    work = {"a": 0.0, "b": 30.0, "c": 8.0}
    assert choose(backends, "llama3", lambda b: work[b.name]) == 1  # loaded wins over idle
    assert choose(backends, "qwen", lambda b: work[b.name]) == 0  # a has no work
    work["a"] = 3.0
    assert choose(backends, "qwen", lambda b: work[b.name]) == 2  # 8 s over 4 slots < 3 s on one
    work["c"] = 12.0
    assert choose(backends, "qwen", lambda b: work[b.name]) == 0  # ties on 3 s/slot: the earlier backend


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [("llama3", "llama3:latest", True), ("llama3:8b", "llama3", False), ("qwen", "qwen", True)],
)
def test_ollama_model_names_match_with_and_without_latest(a: str, b: str, same: bool) -> None:
    assert same_model(a, b) is same


def test_slots_are_granted_from_zero_and_zero_slots_is_refused() -> None:
    backend = Backend("a", 3)
    assert [backend.free.pop() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="slots"):
        Backend("z", 0)


def test_a_model_sent_to_an_on_demand_backend_counts_as_loaded_there_until_it_says_otherwise() -> None:
    backends = pool(
        Backend("a", 1, held=ModelsHeld(tracks_loaded=True)), Backend("b", 1, held=ModelsHeld(tracks_loaded=True))
    )
    backends[1].held.sent("llama3")
    assert choose(backends, "llama3", no_work) == 1  # follows the model, though a is first and idle
    assert choose(backends, "qwen", no_work) == 0
    plain = Backend("c", 1)  # llama.cpp serves the model it was started with: nothing to track
    plain.held.sent("llama3")
    assert plain.held.loaded == ()


def test_a_backend_that_refused_the_request_is_avoided_while_another_serves_its_model() -> None:
    backends = pool(Backend("a", 1, models=("m",)), Backend("b", 1, models=("m",)), Backend("c", 1, models=("other",)))
    busy(backends[1])
    assert choose(backends, "m", no_work, avoid=(0,)) is None  # wait for b rather than a again
    assert choose(backends, "m", no_work) == 0
    assert choose(backends, "other", no_work, avoid=(2,)) == 2  # nobody else serves it: c again


def test_a_slower_backend_gets_a_request_only_when_it_would_finish_it_sooner() -> None:
    gpu, laptop = Backend("gpu", 1, slowness=1.0), Backend("laptop", 1, slowness=4.0)
    work = {"gpu": 30.0, "laptop": 0.0}  # the gpu has 30 s of work in flight, the laptop none
    assert choose(pool(gpu, laptop), "m", lambda b: work[b.name], own_s=5.0) == 1  # 30 + 5 > 0 + 20
    assert choose(pool(gpu, laptop), "m", lambda b: work[b.name], own_s=20.0) == 0  # 30 + 20 < 0 + 80
    work["gpu"] = 0.0
    assert choose(pool(laptop, gpu), "m", lambda b: work[b.name], own_s=1.0) == 1  # idle both: the faster


def test_a_backends_slowness_follows_its_measured_service_seconds_and_ignores_outliers() -> None:
    backend = Backend("laptop", 1)
    for _ in range(40):
        backend.observe_service(predicted_s=2.0, measured_s=8.0)
    assert backend.slowness == pytest.approx(4.0, rel=0.05)
    learned = backend.slowness
    backend.observe_service(predicted_s=1.0, measured_s=1000.0)  # one wild sample counts as 2x the slowness
    assert backend.slowness == pytest.approx(learned * 2.0**0.1, rel=1e-9)
    outlier = backend.slowness
    for predicted_s, measured_s in ((0.0, 3.0), (1.0, 0.0), (math.inf, 1.0), (1.0, math.nan)):
        backend.observe_service(predicted_s=predicted_s, measured_s=measured_s)  # nothing to learn from
    assert backend.slowness == outlier


@pytest.mark.parametrize("free", [True, False])
@pytest.mark.parametrize("healthy", [True, False])
@pytest.mark.parametrize("models", [(), ("llama3",), ("qwen",)])
@pytest.mark.parametrize("avoid", [(), (0,)])
def test_a_lone_backend_is_chosen_when_it_serves_the_model_and_has_a_free_slot_whatever_else(
    free: bool, healthy: bool, models: tuple[str, ...], avoid: tuple[int, ...]
) -> None:
    # One backend: unhealthy, the request waits there for it; one that refused it is still the only one.
    only = Backend("a", 2, models=models, healthy=healthy)
    if not free:
        busy(only)
    expected = 0 if free and models != ("qwen",) else None
    assert choose([only], "llama3", no_work, avoid, own_s=5.0) == expected
    # ... the same answer the pool's rule gives it beside a backend that serves no model of this request
    other = Backend("z", 1, models=("mistral",))
    assert choose([only, other], "llama3", no_work, avoid, own_s=5.0) == expected


def _learned(loads: dict[tuple[str, str | None], float]) -> Callable[[str, str | None], float]:
    return lambda backend, model: loads.get((backend, model), 5.0)


def test_a_backend_that_holds_the_model_is_preferred_to_one_that_would_load_it() -> None:
    # llama-swap backends report nothing: what each served last is what it holds.
    a, b = Backend("a", 1), Backend("b", 1)
    a.held.dispatched("qwen", 0.0)
    b.held.dispatched("llama3", 0.0)
    backends = pool(a, b)
    assert choose(backends, "llama3", no_work, load_s=_learned({})) == 1
    assert choose(backends, "llama3", no_work) == 0  # without load costs: configuration order
    # A load that costs nothing (learned) is no reason to prefer the holder.
    assert choose(backends, "llama3", no_work, load_s=_learned({("a", "llama3"): 0.1})) == 0


def test_a_backend_nothing_is_known_of_is_not_held_against() -> None:
    # A pool of llama.cpp servers: the one that served the model first does not keep the others idle.
    a, b = Backend("a", 2), Backend("b", 2)
    a.held.dispatched("m", 0.0)
    work = {"a": 5.0, "b": 0.0}
    assert choose(pool(a, b), "m", lambda x: work[x.name], own_s=1.0, load_s=_learned({})) == 1
    # An Ollama backend that reported nothing loaded would load the model: the one that has it goes first.
    c, d = Backend("c", 1, held=ModelsHeld(tracks_loaded=True)), Backend("d", 1, held=ModelsHeld(tracks_loaded=True))
    c.held.report([])
    d.held.report(["m"])
    assert choose(pool(c, d), "m", no_work, load_s=_learned({})) == 1


def test_what_a_request_finds_on_its_backend() -> None:
    backend = ModelsHeld()  # llama-swap
    assert backend.dispatched("a", 1.0) == Load.UNKNOWN and backend.switched_s == 1.0
    assert backend.dispatched("a", 2.0) == Load.HELD and backend.switched_s == 1.0
    assert backend.dispatched("b", 3.0) == Load.SWITCH and backend.switched_s == 3.0
    assert backend.holds("b") and not backend.holds("a")
    ollama = ModelsHeld(tracks_loaded=True)
    ollama.report(["a", "b"])  # both fit: neither is a switch
    assert ollama.dispatched("a:latest", 1.0) == Load.HELD and ollama.dispatched("b", 2.0) == Load.HELD
    assert ollama.dispatched("c", 3.0) == Load.SWITCH
    assert not ollama.holds("a")  # the report predates that switch: it may have evicted a
