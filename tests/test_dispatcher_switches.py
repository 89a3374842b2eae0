"""The dispatcher with backends that load models on demand, and with queue deadlines: a manual
clock, time as data (explicit arrivals and service seconds in, order and learned loads out)."""

from __future__ import annotations

import asyncio
import math

import pytest
from ending import end
from manual_clock import ManualClock
from polling import settle, until

from clairvoyant.errors import QueueDeadline
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.predictor import Prediction
from clairvoyant.prediction.usage import Usage
from clairvoyant.scheduling.dispatcher import OVERRUN_GROWTH, Backend, Dispatcher, RequestStatus, Ticket
from clairvoyant.scheduling.policy import build_queue, make_policy
from clairvoyant.scheduling.queue_view import queue_view
from clairvoyant.scheduling.routing import Load, ModelsHeld
from clairvoyant.scheduling.service_time import ServiceTimeDefaults, ServiceTimeModel

GUARD = {"starvation_timeout_s": 1.0, "starvation_slowdown": 3.2}


def make(
    *backends: Backend, bound_s: float = 30.0, policy: str = "sjf", load_s: float = 3.0
) -> tuple[Dispatcher, ManualClock]:
    clock = ManualClock()
    pol = make_policy(policy)
    queue = build_queue(pol, **GUARD, fair_share=True, model_switch_bound_s=bound_s)
    d = Dispatcher(
        queue, pol, backends=list(backends) or [Backend("ollama", 1)], clock=clock, metrics=Metrics(), max_queue=100,
        service_time=ServiceTimeModel(defaults=ServiceTimeDefaults(load_s=load_s)), **GUARD,
    )  # fmt: skip
    return d, clock


def switches(d: Dispatcher, backend: str = "ollama") -> float | None:
    return d.metrics.registry.get_sample_value("clairvoyant_model_switches_total", {"backend": backend})


def ticket(
    name: str, model: str | None, arrival_s: float, predicted_s: float, *, expires_s: float = math.inf
) -> Ticket:
    return Ticket(
        name, "/v1/chat/completions", "openai", model, Prediction.from_probabilities(0.5, 0.3, 0.2), 10, arrival_s,
        predicted_s=predicted_s, predicted_tokens=50.0, score=predicted_s, expires_s=expires_s,
    )  # fmt: skip


def running(d: Dispatcher) -> Ticket:
    (only,) = d.running()
    return only


def test_a_burst_for_two_models_is_served_in_groups_and_each_switch_is_counted() -> None:
    async def scenario() -> list[tuple[str, Load, float]]:
        d, clock = make(bound_s=30.0, load_s=3.0)
        await d.start()
        for i in range(8):
            for k, model in enumerate("ab"):
                d.submit(ticket(f"{model}{i}", model, (2 * i + k) * 0.001, 5.0))
        clock.set(0.016)
        out = []
        for _ in range(16):  # the backend: a load of 3 s when its model changes, then 5 s each
            await settle()
            t = running(d)
            out.append((t.request_id, t.placement.load, t.placement.switch_load_s))
            clock.advance((3.0 if t.placement.load != Load.HELD else 0.0) + 5.0)
            end(d, t, completed=True)
        await d.stop(timeout_s=0.01)
        assert switches(d) == 3  # a -> b -> a -> b
        return out

    order = asyncio.run(scenario())
    # a is loaded first (nothing was known: a load, not a switch); b, waiting since 1 ms, is due at
    # 30.001 s: the slot frees at 33.016 s (3 + 6 x 5): b; a is then due at 63.016 s, the slot frees
    # at 66.016 (33 + 3 + 6 x 5); b again at 66 + 3 + 2 x 5.
    assert "".join(name[0] for name, _, _ in order) == "a" * 6 + "b" * 6 + "a" * 2 + "b" * 2
    assert [load for _, load, _ in order if load != Load.HELD] == [Load.UNKNOWN, Load.SWITCH, Load.SWITCH, Load.SWITCH]
    # each switch is charged the backend's learned load: the 3 s prior, until measured
    assert all(charged == 3.0 for _, load, charged in order if load == Load.SWITCH)
    assert all(charged == 0.0 for _, load, charged in order if load != Load.SWITCH)


def test_fcfs_alternates_models_whatever_the_bound() -> None:
    async def scenario() -> list[str]:
        d, clock = make(bound_s=30.0, policy="fcfs")
        await d.start()
        for i in range(3):
            for k, model in enumerate("ab"):
                d.submit(ticket(f"{model}{i}", model, (2 * i + k) * 0.001, 5.0))
        out = []
        for _ in range(6):
            await settle()
            t = running(d)
            out.append(t.request_id)
            clock.advance(5.0)
            end(d, t, completed=True)
        await d.stop(timeout_s=0.01)
        assert switches(d) == 5
        return out

    assert asyncio.run(scenario()) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_ollamas_load_duration_teaches_the_load_and_comes_off_the_service_seconds() -> None:
    async def scenario() -> None:
        d, clock = make(Backend("ollama", 1, held=ModelsHeld(tracks_loaded=True)), load_s=5.0)
        await d.start()
        d.submit(ticket("a", "llama3.2:3b", 0.0, 2.0))
        await settle()
        first = running(d)
        clock.advance(2.0)  # the model was loaded already: Ollama says 20 ms
        end(d, first, completed=True, usage=_usage(load_s=0.02))
        assert d.service_time.loads() == {}  # a load of nothing, on an unknown backend: not a sample
        d.submit(ticket("b", "qwen2.5:7b", 2.0, 2.0))
        await settle()
        second = running(d)
        assert second.placement.load == Load.SWITCH and second.placement.switch_load_s == 5.0  # charged the prior
        assert queue_view(d).model_dump()["backends"][0]["holds"] == "qwen2.5:7b"
        clock.advance(4.2 + 2.0)  # it took 4.2 s to load, then 2 s to answer
        end(d, second, completed=True, usage=_usage(load_s=4.2))
        assert d.service_time.load_s("ollama", "qwen2.5:7b") == pytest.approx((5.0 + 4.2) / 2)
        # what the service-time model learned: the answer's 2 s, not the 6.2 s the slot was held
        assert d.service_time.coefficients("qwen2.5:7b")["observations"] == 1
        assert d.service_time.predict_s("qwen2.5:7b", 10, 50) < 2.5
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def _usage(load_s: float | None) -> Usage:
    return Usage(50, 10, None, None, 0.0, None, "ollama_eval_count", 50, load_s)


def test_the_first_byte_after_a_switch_teaches_the_load_of_a_backend_that_does_not_report_it() -> None:
    async def scenario() -> None:
        d, clock = make(Backend("llama-swap", 1), load_s=5.0)
        await d.start()
        for name, model, load_s in [("a0", "a", 9.0), ("a1", "a", 0.0), ("a2", "a", 0.0), ("b0", "b", 12.0)]:
            d.submit(ticket(name, model, clock.now(), 1.0))
            await settle()
            t = running(d)
            clock.advance(load_s + 0.5)  # the load, then its first token half a second later
            d.first_byte(t, streamed=True)
            clock.advance(1.0)
            end(d, t, completed=True)
        # a0 was the backend's first request (unknown): no sample; a1, a2 set the usual delay (0.5 s);
        # b0 followed a switch: 12.5 - 0.5 s, averaged with the 5 s prior.
        loads = d.service_time.loads()["llama-swap"]
        assert loads["b"] == {"load_s": pytest.approx((5.0 + 12.0) / 2), "observations": 1.0}
        assert loads["a"]["observations"] == 0.0
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_the_first_bytes_arrival_time_is_what_teaches_not_when_the_relay_reports_it() -> None:
    async def scenario() -> None:
        d, clock = make(Backend("llama-swap", 1), load_s=5.0)
        await d.start()
        for name, model, load_s, reported_after_s in [
            ("a0", "a", 0.0, 0.0),
            ("a1", "a", 0.0, 0.0),
            ("b0", "b", 12.0, 3.0),
        ]:
            d.submit(ticket(name, model, clock.now(), 1.0))
            await settle()
            t = running(d)
            clock.advance(load_s + 0.5)
            arrived_s = clock.now()
            clock.advance(reported_after_s)  # b0: its bytes went on to a slow client before they were reported
            d.first_byte(t, streamed=True, at_s=arrived_s)
            end(d, t, completed=True)
        # From the arrival times: 12.5 s after a switch less the usual 0.5 s. Counted when reported,
        # b0's delay would be 15.5 s, and its load 15 s.
        loads = d.service_time.loads()["llama-swap"]
        assert loads["b"] == {"load_s": pytest.approx((5.0 + 12.0) / 2), "observations": 1.0}
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_a_non_streamed_answers_first_byte_teaches_nothing() -> None:
    async def scenario() -> None:
        d, clock = make(Backend("llama-swap", 1))
        await d.start()
        d.submit(ticket("a0", "a", 0.0, 1.0))
        await settle()
        end(d, running(d), completed=True)
        d.submit(ticket("b0", "b", 0.0, 1.0))
        await settle()
        t = running(d)
        clock.advance(30.0)
        d.first_byte(t, streamed=False)  # the whole answer came with the first byte
        assert d.service_time.loads() == {}
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_queue_shows_the_bound_what_each_backend_holds_and_when_a_switch_is_due() -> None:
    async def scenario() -> None:
        d, clock = make(bound_s=30.0)
        await d.start()
        d.submit(ticket("a0", "a", 0.0, 5.0))
        d.submit(ticket("a1", "a", 0.0, 5.0))
        d.submit(ticket("b0", "b", 1.0, 5.0))
        await settle()
        assert running(d).request_id == "a0"
        clock.set(10.0)
        snap = queue_view(d).model_dump()
        assert snap["model_switch"]["bound_s"] == 30.0 and snap["model_switch"]["load_prior_s"] == 3.0
        assert snap["model_switch"]["waiting_by_model"] == {"a": 1, "b": 1}
        assert snap["backends"][0]["holds"] == "a" and snap["backends"][0]["switched_ago_s"] == 10.0
        waiting = {w["request_id"]: w for w in snap["waiting"]}
        assert "switch_due_in_s" not in waiting["a1"]  # its model is held
        assert waiting["b0"]["switch_due_in_s"] == pytest.approx(1.0 + 30.0 - 10.0)
        # ETAs: a0's 5 s (held), a1 next (held), then b0 after its load (3 s, the prior)
        assert [w["request_id"] for w in snap["waiting"]] == ["a1", "b0"]
        assert waiting["b0"]["eta_s"] == pytest.approx(OVERRUN_GROWTH * 10.0 + 5.0)  # a0 overran: half again
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_a_request_is_never_sent_at_or_after_its_queue_deadline() -> None:
    async def scenario() -> None:
        d, clock = make()
        await d.start()
        d.submit(ticket("busy", "a", 0.0, 1.0))  # predicted to end in time; it overruns
        await settle()
        late = ticket("late", "a", 0.0, 1.0, expires_s=5.0)
        patient = ticket("patient", "a", 0.0, 1.0, expires_s=50.0)
        d.submit(late)
        d.submit(patient)
        clock.set(4.999)
        assert d.expire() == 0 and late.status != RequestStatus.EXPIRED
        clock.set(5.0)
        assert d.expire() == 1
        assert late.status == RequestStatus.EXPIRED and isinstance(late.refusal, QueueDeadline) and late.ended
        assert late.placement is None and len(d.queue) == 1
        assert queue_view(d).model_dump()["recent"][0]["outcome"] == "expired"
        clock.set(10.0)
        end(d, running(d), completed=True)
        await settle()
        assert patient.status == RequestStatus.DISPATCHED  # before its deadline
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_the_dispatch_step_withdraws_what_expired_before_it_chooses() -> None:
    async def scenario() -> None:
        d, clock = make(policy="fcfs")
        await d.start()
        d.submit(ticket("busy", "a", 0.0, 1.0))  # predicted to end in time; it overruns
        await settle()
        first = ticket("first", "a", 0.0, 1.0, expires_s=9.0)
        second = ticket("second", "a", 0.0, 1.0)
        d.submit(first)
        d.submit(second)
        clock.set(9.0)  # the slot frees exactly at first's deadline: it is not sent, second is
        end(d, running(d), completed=True)
        await settle()
        assert first.status == RequestStatus.EXPIRED and second.status == RequestStatus.DISPATCHED
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_a_timer_answers_an_expired_request_without_waiting_for_a_slot() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        pol = make_policy("sjf")
        d = Dispatcher(build_queue(pol), pol, clock=clock, metrics=Metrics(), max_queue=10)
        await d.start()
        d.submit(ticket("busy", None, 0.0, 0.01))  # predicted to end in time; it overruns
        await settle()
        t = ticket("t", None, 0.0, 1.0, expires_s=0.02)
        d.submit(t)
        clock.set(0.02)  # the timer fires on the event loop's clock; the deadline is on ours
        await until(lambda: t.status == RequestStatus.EXPIRED, what="the expiry timer")
        assert t.status == RequestStatus.EXPIRED and isinstance(t.refusal, QueueDeadline)
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_a_request_whose_eta_is_past_its_deadline_is_refused_at_once() -> None:
    async def scenario() -> None:
        d, clock = make(policy="fcfs")
        await d.start()
        d.submit(ticket("busy", "a", 0.0, 10.0))
        await settle()
        hopeless = ticket("hopeless", "a", 0.0, 1.0, expires_s=2.0)  # the slot frees in 10 s
        with pytest.raises(QueueDeadline) as refused:
            d.submit(hopeless)
        assert refused.value.headers == {"Retry-After": "10"} and "deadline of 2 s" in refused.value.message
        assert len(d.queue) == 0 and d.waiting == 0
        hopeful = ticket("hopeful", "a", 0.0, 1.0, expires_s=11.0)
        d.submit(hopeful)  # its ETA (10 s) is within its deadline: it waits
        assert d.waiting == 1
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())
