"""The dispatcher's lease and capacity, with a manual clock (no backend, no sleeps for ordering)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

import pytest
from ending import end
from manual_clock import ManualClock
from polling import settle, until

from clairvoyant.errors import QueueFull
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.predictor import Prediction
from clairvoyant.scheduling.dispatcher import ID_PREFIX, OVERRUN_GROWTH, Dispatcher, RequestStatus, ShuttingDown, Ticket
from clairvoyant.scheduling.policy import build_queue, make_policy
from clairvoyant.scheduling.queue_view import queue_view
from clairvoyant.scheduling.request import Placement


def make(slots: int = 1, max_queue: int = 10, policy: str = "fcfs") -> tuple[Dispatcher, ManualClock]:
    clock = ManualClock()
    pol = make_policy(policy)
    d = Dispatcher(build_queue(pol), pol, slots=slots, clock=clock, metrics=Metrics(), max_queue=max_queue)
    return d, clock


def submit(d: Dispatcher, name: str, arrival_s: float, predicted_s: float) -> Ticket:
    return submit_for(d, name, None, predicted_s, arrival_s)


def test_lease_releases_exactly_once_and_withdraws_a_cancelled_waiter() -> None:
    async def scenario() -> None:
        d, clock = make()
        await d.start()
        first, second, third = submit(d, "a", 0.0, 5.0), submit(d, "b", 0.0, 3.0), submit(d, "c", 0.0, 2.0)
        assert [j.payload.request_id for j, _ in d.etas(0.0)[0]] == ["a", "b", "c"]
        order: list[str] = []

        async def use(t: Ticket, hold: asyncio.Event) -> None:
            async with d.lease(t) as lease:
                order.append(t.request_id)
                await hold.wait()
                lease.completed = True

        holds = {n: asyncio.Event() for n in "abc"}
        tasks = {t.request_id: asyncio.create_task(use(t, holds[t.request_id])) for t in (first, second, third)}
        await settle()
        assert order == ["a"] and len(d.queue) == 2
        tasks["b"].cancel()  # b's client leaves while queued: withdrawn, never granted
        await settle()
        assert len(d.queue) == 1 and second.ended and second.placement is None
        clock.advance(4.0)
        holds["a"].set()
        await settle()
        assert order == ["a", "c"]  # c got a's slot; b never ran
        assert first.ended and d.in_flight == 1 and queue_view(d).model_dump()["in_flight"][0]["request_id"] == "c"
        d._end(first, None)  # idempotent: a second end changes nothing
        assert d.service_time.coefficients(None)["observations"] == 1  # a's 4 s taught the model once
        holds["c"].set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await d.stop()

    asyncio.run(scenario())


def test_queue_full_retry_after_is_the_tail_eta() -> None:
    async def scenario() -> None:
        d, clock = make(max_queue=2)
        await d.start()
        running = submit(d, "run", 0.0, 10.0)
        lease = d.lease(running)
        await lease.__aenter__()
        clock.advance(3.0)  # 7 s of predicted work left in flight
        submit(d, "w1", 3.0, 4.0)
        submit(d, "w2", 3.0, 6.0)
        etas = [round(eta, 6) for _, eta in d.etas(clock.now())[0]]
        assert etas == [7.0, 11.0]  # in-flight remainder, then w1's predicted seconds
        with pytest.raises(QueueFull) as info:
            submit(d, "w3", 3.0, 1.0)
        assert info.value.headers == {"Retry-After": str(math.ceil(11.0))}
        assert d.where(d.waiting_ticket("w2")) == (1, pytest.approx(11.0))  # type: ignore[arg-type]
        await lease.__aexit__(None, None, None)
        await d.stop()

    asyncio.run(scenario())


def test_a_made_request_id_is_read_from_the_seq_and_found_while_it_waits() -> None:
    """A ticket without a client id holds no id string: ``cv-<start>-<seq>`` is made when read, and
    /queue/{id} finds it by its seq (a scan: no index); a client's id is found as given, even one
    shaped like ours."""

    async def scenario() -> None:
        d, _ = make(max_queue=5)
        await d.start()
        running = submit(d, "run", 0.0, 10.0)
        lease = d.lease(running)
        await lease.__aenter__()
        made = submit(d, "", 1.0, 1.0)
        assert made.request_id == f"{ID_PREFIX}{made.seq}"
        mimic = submit(d, f"{ID_PREFIX}{made.seq + 10_000}", 1.0, 2.0)  # a client's id in our form
        assert d.waiting_ticket(made.request_id) is made
        assert d.waiting_ticket(mimic.request_id) is mimic
        assert d.waiting_ticket(f"{ID_PREFIX}{running.seq}") is None  # not waiting
        assert d.waiting_ticket(f"{ID_PREFIX}{made.seq}x") is None
        assert d.waiting_ticket(f"cv-0-{made.seq}") is None  # another process's id
        end(d, made)  # withdrawn
        assert d.waiting_ticket(made.request_id) is None
        await lease.__aexit__(None, None, None)
        await d.stop()

    asyncio.run(scenario())


def test_a_request_waiting_behind_an_overrun_one_never_has_an_eta_of_0() -> None:
    # Seen under load: the holder ran past its predicted seconds and the first waiter's ETA read 0.0
    # while the holder still held the only slot.
    async def scenario() -> None:
        d, clock = make()
        await d.start()
        running = submit(d, "run", 0.0, 10.0)
        lease = d.lease(running)
        await lease.__aenter__()
        clock.advance(12.0)  # 2 s past its prediction, still running
        submit(d, "w1", 12.0, 4.0)
        submit(d, "w2", 12.0, 6.0)
        etas = [round(eta, 6) for _, eta in d.etas(clock.now())[0]]
        assert OVERRUN_GROWTH == 0.5 and etas == [6.0, 10.0]  # half of its 12 s so far, then w1's 4 s
        assert queue_view(d).model_dump()["waiting"][0]["eta_s"] > 0
        await lease.__aexit__(None, None, None)
        await d.stop()

    asyncio.run(scenario())


def test_stop_refuses_the_waiting_with_shutting_down() -> None:
    async def scenario() -> None:
        d, _ = make()
        await d.start()
        holder, waiter = submit(d, "h", 0.0, 1.0), submit(d, "w", 0.0, 1.0)
        held = d.lease(holder)
        await held.__aenter__()
        stopping = asyncio.create_task(d.stop(timeout_s=0.2))
        await settle()
        with pytest.raises(ShuttingDown):
            async with d.lease(waiter):
                pass
        await held.__aexit__(None, None, None)
        await stopping
        with pytest.raises(ShuttingDown):
            submit(d, "late", 1.0, 1.0)

    asyncio.run(scenario())


def test_stop_waits_for_a_state_save_but_not_for_a_periodic_loop() -> None:
    async def scenario() -> None:
        d, _ = make()
        await d.start()
        saved = asyncio.Event()

        async def save() -> None:
            await asyncio.sleep(0.05)
            saved.set()

        loop_task = d.run_detached(asyncio.sleep(3600), "every-minute", cancel_at_stop=True)
        d.run_detached(save(), "state-save")
        started = time.monotonic()
        await d.stop(timeout_s=5.0)
        assert saved.is_set()  # the one-shot save finished within the grace period
        assert loop_task.cancelled()
        assert time.monotonic() - started < 2.0  # not the 5 s grace: the loop was not waited for

    asyncio.run(scenario())


def test_queue_position_counts_the_requests_dispatched_ahead_while_waiting() -> None:
    async def scenario() -> None:
        d, clock = make(policy="sjf")
        await d.start()
        running = submit(d, "run", 0.0, 10.0)
        holder = d.lease(running)
        await holder.__aenter__()
        # arrive in this order; sjf dispatches by score, and these share one score: arrival decides
        late = [submit(d, n, 1.0 + i, 1.0) for i, n in enumerate("xyz")]
        await holder.__aexit__(None, None, None)
        for t in late:
            async with d.lease(t):
                pass
        assert running.placement.queue_position == 0  # found the slot free
        assert [t.placement.queue_position for t in late] == [0, 1, 2]
        await d.stop()

    asyncio.run(scenario())


def test_the_service_time_state_is_written_every_50_completions_in_a_worker_thread(tmp_path) -> None:
    import json

    from clairvoyant.scheduling.service_time import ServiceTimeModel

    async def scenario() -> None:
        clock = ManualClock()
        pol = make_policy("fcfs")
        path = tmp_path / "st.json"
        d = Dispatcher(
            build_queue(pol),
            pol,
            slots=1,
            clock=clock,
            metrics=Metrics(),
            max_queue=10,
            service_time=ServiceTimeModel(path=path),
        )
        await d.start()
        for i in range(50):
            t = submit(d, f"r{i}", clock.now(), 1.0)
            async with d.lease(t) as lease:
                clock.advance(1.0)
                lease.completed = True
            assert not path.exists() or i == 49
        await until(path.exists, what="the service-time file")  # written by a worker thread
        assert json.loads(path.read_text())["models"][""]["n"] == 50
        await d.stop()

    asyncio.run(scenario())


# --- a pool of backends -------------------------------------------------------------------------

from clairvoyant.scheduling.dispatcher import Backend, ModelNotServed  # noqa: E402


def gauge(d: Dispatcher, predicted_class: str) -> float | None:
    return d.metrics.registry.get_sample_value("clairvoyant_queue_depth", {"predicted_class": predicted_class})


def make_pool(*backends: Backend, policy: str = "fcfs") -> tuple[Dispatcher, ManualClock]:
    clock = ManualClock()
    pol = make_policy(policy)
    d = Dispatcher(build_queue(pol), pol, backends=list(backends), clock=clock, metrics=Metrics(), max_queue=50)
    return d, clock


def submit_for(d: Dispatcher, name: str, model: str | None, predicted_s: float = 1.0, arrival_s: float = 0.0) -> Ticket:
    t = Ticket(
        name,
        "/v1/chat/completions",
        "openai",
        model,
        Prediction.from_probabilities(0.5, 0.3, 0.2),
        10,
        arrival_s,
        predicted_s=predicted_s,
        predicted_tokens=50.0,
    )
    d.submit(t)
    return t


def test_a_pool_sends_each_request_to_the_backend_with_the_least_predicted_work() -> None:
    async def scenario() -> None:
        d, _ = make_pool(Backend("a", 1), Backend("b", 2))
        await d.start()
        long = submit_for(d, "long", None, predicted_s=30.0)
        await settle()
        assert long.placement.backend == 0  # all idle: the first backend
        first, second = submit_for(d, "s1", None, 2.0), submit_for(d, "s2", None, 2.0)
        await settle()
        assert (first.placement.backend, second.placement.backend) == (1, 1)  # a is busy; b has two slots
        assert queue_view(d).model_dump()["backends"][1]["in_flight"] == 2 and d.in_flight_on(0) == 1
        third = submit_for(d, "s3", None, 2.0)
        await settle()
        assert not third.granted.done()  # every slot of the pool is held
        async with d.lease(first):
            pass
        await settle()
        assert third.placement.backend == 1 and third.placement.slot == first.placement.slot
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_a_request_for_a_busy_backends_model_does_not_block_another_models_request() -> None:
    async def scenario() -> None:
        d, _ = make_pool(Backend("a", 1, models=("llama3",)), Backend("b", 1, models=("qwen",)))
        await d.start()
        running = submit_for(d, "l1", "llama3")
        await settle()
        waiting = submit_for(d, "l2", "llama3")  # first in line, but only for a
        other = submit_for(d, "q1", "qwen")
        await settle()
        assert running.placement.backend == 0 and other.placement.backend == 1 and not waiting.granted.done()
        assert waiting.held_back and d.waiting == 1
        assert [w["request_id"] for w in queue_view(d).model_dump()["waiting"]] == ["l2"]
        with pytest.raises(ModelNotServed):
            submit_for(d, "m1", "mistral")
        async with d.lease(running):
            pass
        await settle()
        assert waiting.placement.backend == 0 and not waiting.held_back
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_a_refused_connection_reroutes_the_request_first_in_line_to_a_healthy_backend() -> None:
    async def scenario() -> None:
        d, clock = make_pool(Backend("a", 1), Backend("b", 1))
        await d.start()
        first, second = submit_for(d, "r1", None), submit_for(d, "r2", None)
        await settle()
        assert (first.placement.backend, second.placement.backend) == (0, 1)
        queued = submit_for(d, "r3", None)
        lease = d.lease(first)
        await lease.__aenter__()
        assert d.reroute(first)  # a refused: r1 gives its slot back and waits first in line
        assert not d.backends[0].healthy and first.held_back
        await settle()
        assert not queued.granted.done()  # a's free slot is not used while b is healthy
        clock.advance(2.0)
        async with d.lease(second):
            pass
        await d.regranted(first)
        assert first.placement.backend == 1 and not queued.granted.done()  # the rerouted one before r3
        assert first.placement.queue_position == 0  # its queue position is from its first grant
        assert first.queue_wait_s() == 2.0  # its wait for b is queue wait, not service time
        d.set_health(0, True)
        await settle()
        assert queued.placement.backend == 0
        await lease.__aexit__(None, None, None)
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_a_reroute_with_no_other_healthy_backend_keeps_the_slot() -> None:
    async def scenario() -> None:
        d, _ = make_pool(Backend("a", 1), Backend("b", 1, models=("other",)))
        await d.start()
        t = submit_for(d, "r1", "m")
        await settle()
        assert not d.reroute(t)  # b does not serve m: r1 waits for a where it is
        assert t.placement.backend == 0 and d.in_flight_on(0) == 1 and not d.backends[0].healthy
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_a_client_leaving_while_held_back_or_rerouted_is_withdrawn_and_its_slot_reused() -> None:
    async def scenario() -> None:
        d, _ = make_pool(Backend("a", 1, models=("m",)))
        await d.start()
        holder = submit_for(d, "h", "m")
        await settle()
        held = submit_for(d, "w", "m")
        await settle()
        task = asyncio.create_task(_hold(d, held))
        await settle()
        task.cancel()
        await settle()
        assert held.ended and not held.held_back and d.waiting == 0
        assert queue_view(d).model_dump()["recent"][0]["outcome"] == "left_queued"
        async with d.lease(holder):
            pass
        assert d.in_flight == 0
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


async def _hold(d: Dispatcher, t: Ticket) -> None:
    async with d.lease(t):
        await asyncio.Event().wait()  # a client that stays until it is cancelled


def test_shutdown_refuses_held_back_and_rerouted_tickets_with_shutting_down() -> None:
    async def scenario() -> None:
        d, _ = make_pool(Backend("a", 1, models=("m",)), Backend("b", 1, models=("n",)))
        await d.start()
        running = submit_for(d, "run", "m")
        await settle()
        held = submit_for(d, "held", "m")  # a is busy: held back
        rerouted = submit_for(d, "moved", "n")
        await settle()
        assert held.held_back and rerouted.placement.backend == 1
        lease = d.lease(rerouted)
        await lease.__aenter__()
        assert d.reroute(rerouted) is False  # b refused and a does not serve n: it keeps its slot
        d.begin_shutdown(0.01)
        with pytest.raises(ShuttingDown):
            async with d.lease(held):
                pass
        assert held.ended and d.waiting == 0
        await lease.__aexit__(None, None, None)
        async with d.lease(running):
            pass
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_the_pool_learns_a_backends_slowness_and_routes_around_it() -> None:
    async def scenario() -> None:
        d, clock = make_pool(Backend("slow", 1), Backend("fast", 1))
        await d.start()
        first = submit_for(d, "s0", None, predicted_s=1.0)
        await settle()
        assert first.placement.backend == 0  # both idle and alike so far: the first
        async with d.lease(first) as lease:
            clock.advance(4.0)  # it took 4 s for a predicted 1 s
            lease.completed = True
        # 4x counts as at most 2x the slowness (an outlier's bound), a tenth of the way in log space
        assert d.backends[0].slowness == pytest.approx(2.0**0.1) and d.backends[1].slowness == 1.0
        nxt = submit_for(d, "s1", None, predicted_s=1.0)
        await settle()
        assert nxt.placement.backend == 1  # both idle: the one that will finish it sooner
        assert queue_view(d).model_dump()["backends"][0]["slowness"] == round(2.0**0.1, 3)
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_a_backend_whose_request_overran_its_prediction_is_not_routed_to_as_if_idle() -> None:
    """An in-flight request past its predicted seconds still occupies its backend: routing counts
    half of what it has run as still to come (as the ETAs do), so an idle backend is preferred to it."""

    async def scenario() -> None:
        d, clock = make_pool(Backend("a", 2), Backend("b", 2))
        await d.start()
        long = submit_for(d, "long", None, predicted_s=10.0)
        await settle()
        assert long.placement.backend == 0  # both idle: the first
        lease = d.lease(long)
        await lease.__aenter__()
        clock.advance(30.0)  # it runs on, 20 s past its prediction
        assert d.remaining_s(d.backends[0]) == pytest.approx(OVERRUN_GROWTH * 30.0)
        nxt = submit_for(d, "next", None, predicted_s=1.0)
        await settle()
        assert nxt.placement.backend == 1  # a's generation still runs; b is idle
        await lease.__aexit__(None, None, None)
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())


def test_repredicted_reorders_a_waiting_ticket_and_moves_its_class_gauge() -> None:
    """The encoder's second opinion: a waiting ticket takes its new prediction and the queue puts it
    where the new score says; a ticket already running is left alone."""

    async def scenario() -> None:
        d, _ = make(policy="sjf")
        await d.start()
        running = submit(d, "run", 0.0, 1.0)
        held = d.lease(running)
        await held.__aenter__()
        waiting = {}
        for name, p_long in (("x", 0.2), ("y", 0.5), ("z", 0.9)):
            prediction = Prediction.from_probabilities(0.6, 0.2, p_long)
            t = Ticket(
                name, "/v1/chat/completions", "openai", None, prediction, 10, 1.0, score=p_long, predicted_tokens=50.0
            )
            d.submit(t)
            waiting[name] = t
        assert [j.payload.request_id for j in d.queue.ordered(1.0)] == ["x", "y", "z"]
        depth = d.metrics.queue.depth
        before = {c: gauge(d, c) for c in depth}
        short = Prediction.from_probabilities(0.9, 0.1, 0.0)  # P(Long) 0: first in line, class Short
        assert d.repredicted(waiting["z"], short)
        assert [j.payload.request_id for j in d.queue.ordered(1.0)] == ["z", "x", "y"]
        assert waiting["z"].prediction is short and waiting["z"].score == 0.0
        assert waiting["z"].predicted_tokens == short.predicted_tokens
        assert (before["long"], before["short"]) == (1, 1)  # z counted Long while it waited; x Short
        assert (gauge(d, "long"), gauge(d, "short")) == (0, 2)
        assert not d.repredicted(running, short)  # running: not waiting, nothing changes
        assert running.prediction is not short
        await held.__aexit__(None, None, None)
        await d.stop()

    asyncio.run(scenario())


def _pool(*backends: Backend) -> tuple[Dispatcher, ManualClock]:
    clock = ManualClock()
    pol = make_policy("fcfs")
    d = Dispatcher(build_queue(pol), pol, backends=backends, clock=clock, metrics=Metrics(), max_queue=10)
    return d, clock


def _modelled(d: Dispatcher, name: str, predicted_s: float, model: str | None) -> Ticket:
    return submit_for(d, name, model, predicted_s)


def test_pool_etas_play_each_backend_at_its_own_speed() -> None:
    # A GPU box (as predicted) and a laptop measured 3x slower, one slot each, both busy with 4 s
    # predicted: the GPU frees at 4 s, the laptop at 12 s (3 x 4). Played forward, each 2 s waiter
    # takes the first slot to free: the GPU at 4, 6, 8, 10, then the GPU or the laptop at 12. With
    # the slots taken alike (before), the laptop read free at 4 and the ETAs 4, 4, 6, 6, 8.
    async def scenario() -> None:
        gpu, laptop = Backend("gpu", 1), Backend("laptop", 1, slowness=3.0)
        d, clock = _pool(gpu, laptop)
        await d.start()
        leases = []
        for name in ("run-a", "run-b"):
            lease = d.lease(_modelled(d, name, 4.0, None))
            await lease.__aenter__()
            leases.append(lease)
        assert {t.placement.backend for t in (*gpu.running.values(), *laptop.running.values())} == {0, 1}
        for name in ("w1", "w2", "w3", "w4", "w5"):
            _modelled(d, name, 2.0, None)
        etas = [round(eta, 6) for _, eta in d.etas(clock.now())[0]]
        assert etas == [4.0, 6.0, 8.0, 10.0, 12.0]  # the laptop's slot (3 x 4 s) frees at 12
        assert d.etas(clock.now())[1] == pytest.approx(12.0)
        for lease in leases:
            await lease.__aexit__(None, None, None)
        await d.stop()

    asyncio.run(scenario())


def test_pool_etas_wait_for_the_backends_that_serve_the_model() -> None:
    # Only the big box serves "big"; the small box is idle. A "big" request waits for the big box.
    async def scenario() -> None:
        small, big = Backend("small", 1, models=("small",)), Backend("big", 1, models=("big",))
        d, clock = _pool(small, big)
        await d.start()
        lease = d.lease(_modelled(d, "run", 5.0, "big"))
        await lease.__aenter__()
        _modelled(d, "w-big", 3.0, "big")
        _modelled(d, "w-small", 3.0, "small")
        _modelled(d, "w-big2", 1.0, "big")
        by_name = {j.payload.request_id: round(eta, 6) for j, eta in d.etas(clock.now())[0]}
        assert by_name == {"w-big": 5.0, "w-small": 0.0, "w-big2": 8.0}
        big.healthy = False  # a model whose only backend is down still waits for it, not for "small"
        by_name = {j.payload.request_id: round(eta, 6) for j, eta in d.etas(clock.now())[0]}
        assert by_name["w-big"] == 5.0 and by_name["w-small"] == 0.0
        await lease.__aexit__(None, None, None)
        await d.stop()

    asyncio.run(scenario())


def test_resize_frees_new_slots_at_once_and_never_reuses_a_removed_busy_one() -> None:
    async def scenario() -> None:
        backend = Backend("b", 2)
        d, _ = _pool(backend)
        await d.start()
        leases = [d.lease(_modelled(d, name, 1.0, None)) for name in ("r0", "r1")]
        for lease in leases:
            await lease.__aenter__()
        waiting = _modelled(d, "w", 1.0, None)
        await settle()
        assert waiting.placement is None and sorted(backend.running) == [0, 1]
        d.resize(0, 3)  # slot 2 appears: the waiting request gets it
        await settle()
        assert waiting.placement.slot == 2 and d.slots == 3
        waited = d.lease(waiting)
        await waited.__aenter__()  # granted already: returns at once
        d.resize(0, 1)  # slots 1 and 2 go; their requests run on
        await leases[1].__aexit__(None, None, None)  # r1 ends on slot 1: not freed for reuse
        await waited.__aexit__(None, None, None)  # w ends on slot 2: nor that
        assert backend.free == [] and backend.slots == 1
        await leases[0].__aexit__(None, None, None)  # r0 ends on slot 0: free again
        assert backend.free == [0] and d.slots == 1
        with pytest.raises(ValueError):
            d.resize(0, 0)
        await d.stop()

    asyncio.run(scenario())


def test_the_unhealthy_log_line_says_where_requests_go(caplog: pytest.LogCaptureFixture) -> None:
    single, _ = make()
    pool, _ = make_pool(Backend("a", 1), Backend("b", 1))
    with caplog.at_level(logging.WARNING, logger="clairvoyant.scheduling.dispatcher"):
        single.set_health(0, False)
        pool.set_health(0, False)
    assert [r.getMessage() for r in caplog.records] == [
        "backend default is unhealthy: its requests wait for it",
        "backend a is unhealthy: skipped while another backend serves its requests",
    ]


def test_a_streaming_request_is_re_estimated_from_its_own_pace() -> None:
    from clairvoyant.scheduling.dispatcher import remainder_s

    t = Ticket("s", "/v1/chat/completions", "openai", None, None, 10, 0.0, predicted_tokens=100, predicted_s=3.0)
    placement = t.placement = Placement(0, 0, dispatched_s=0.0, queue_position=0)
    assert remainder_s(t, now=1.0) == pytest.approx(2.0)  # no tokens yet: its prediction
    placement.live_tokens = 50  # half-way at 10 tokens a second: slower than predicted
    assert remainder_s(t, now=5.0) == pytest.approx(50 * 0.1)
    placement.live_tokens = 150  # past its predicted tokens: half again of what it produced, at its pace
    assert remainder_s(t, now=15.0) == pytest.approx(75 * 0.1)
    placement.live_tokens = 0
    assert remainder_s(t, now=8.0) == pytest.approx(OVERRUN_GROWTH * 8.0)  # not streamed: from time alone


def test_the_snapshot_is_plain_json_with_the_starvation_guard_off() -> None:
    d, _ = make()  # starvation_timeout_s = inf: no guard
    submit(d, "a", 0.0, 1.0)
    snapshot = json.loads(json.dumps(queue_view(d).model_dump(), allow_nan=False))  # as /queue renders it
    assert snapshot["starvation_timeout_s"] is None and snapshot["waiting"][0]["request_id"] == "a"


def _wait_count(d: Dispatcher, predicted_class: str) -> float | None:
    return d.metrics.registry.get_sample_value(
        "clairvoyant_queue_wait_seconds_count", {"predicted_class": predicted_class}
    )


def test_a_request_finding_a_free_slot_and_nobody_waiting_is_granted_before_its_prediction() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        pol = make_policy("sjf")
        d = Dispatcher(build_queue(pol, fair_share=True), pol, slots=1, clock=clock, metrics=Metrics(), max_queue=10)
        assert not d.dispatch_at_once(Ticket("before-start", "/v1/chat/completions", "openai", None, None, 10))
        await d.start()
        early = Ticket("early", "/v1/chat/completions", "openai", None, None, 10, 0.0, tenant="t1")
        clock.advance(0.5)
        assert d.dispatch_at_once(early)
        assert early.granted.done() and early.granted.result() == 0  # no loop turn, no queue
        assert d.in_flight == 1 and d.waiting == 0 and early.placement.queue_position == 0
        assert early.placement.dispatched_s == 0.5
        # The depth gauge never counted it, and its wait waits for its class.
        assert all(gauge(d, c) == 0 for c in ("short", "medium", "long"))
        assert _wait_count(d, "long") == 0

        # The slot is taken: the next request is predicted and queued.
        late = Ticket("late", "/v1/chat/completions", "openai", None, None, 10, 0.5, tenant="t2")
        assert not d.dispatch_at_once(late)
        late.prediction = Prediction.from_probabilities(0.9, 0.08, 0.02)
        d.submit(late)
        assert d.waiting == 1 and gauge(d, "short") == 1
        # Something waits: even with a slot free, a newcomer queues behind it (the policy decides).
        d.resize(0, 2)
        third = Ticket("third", "/v1/chat/completions", "openai", None, None, 10, 0.5, tenant="t3")
        assert not d.dispatch_at_once(third)

        # Its prediction arrives: its tenant is charged the predicted seconds instead of the default
        # 1 s, and its wait is observed under its class.
        charged = d.queue.tenants["t1"]
        early.prediction = Prediction.from_probabilities(0.02, 0.08, 0.9)
        early.predicted_s = 7.0
        d.predicted_at_once(early, 1.0)
        assert d.queue.tenants["t1"] == pytest.approx(charged + 6.0)
        assert _wait_count(d, "long") == 1
        end(d, early, completed=True)
        await d.stop()

    asyncio.run(scenario())


def test_a_first_answer_40_s_late_does_not_make_the_backend_serve_essays_first() -> None:
    """The reported case, under the default order (sjf, the starvation guard at tau 1 s and
    slowdown 2.56): one slot at 0.02 s a token; the first answer (predicted 20 tokens) comes 40 s
    late, then three quick 8-token answers (predicted 40). Then 6 one-word questions (18 predicted
    tokens) and 6 essays (450) wait behind a 10 s blocker. With main's fit every essay was
    predicted at 0.01 s and every question at 6.8 s: the essays were overdue first and ran first."""

    async def scenario() -> None:
        clock = ManualClock()
        pol = make_policy("sjf")
        queue = build_queue(pol, starvation_timeout_s=1.0, starvation_slowdown=2.56)
        d = Dispatcher(queue, pol, slots=1, clock=clock, metrics=Metrics(), max_queue=50)
        await d.start()

        def request(name: str, predicted_tokens: float, score: float) -> Ticket:
            ticket = Ticket(
                name, "/v1/chat/completions", "openai", "smollm2", Prediction.from_probabilities(0.5, 0.3, 0.2), 20,
                clock.now(), score=score, predicted_tokens=predicted_tokens,
                predicted_s=d.predicted_s("smollm2", 20, predicted_tokens),
            )  # fmt: skip
            d.submit(ticket)
            return ticket

        async def serve(ticket: Ticket, seconds: float) -> None:
            async with d.lease(ticket) as lease:
                clock.advance(seconds)
                lease.completed = True

        await serve(request("first", 20, 0.2), 40.0)
        for i in range(3):
            await serve(request(f"quick{i}", 40, 0.3), 8 * 0.02)
        blocker = request("blocker", 100, 0.5)
        await settle()
        assert blocker.status == RequestStatus.DISPATCHED  # granted: the burst waits behind it
        burst = [request(f"{kind}{i}", tokens, score) for i in range(6) for kind, tokens, score in
                 (("essay", 450, 0.9), ("hi", 18, 0.1))]  # fmt: skip
        snapshot = queue_view(d).model_dump()
        predicted = {w["request_id"]: w["predicted_s"] for w in snapshot["waiting"]}
        inverted = [(s, e) for s in predicted if s.startswith("hi") for e in predicted if e.startswith("essay")
                    if predicted[s] >= predicted[e]]  # fmt: skip
        assert inverted == []
        assert snapshot["service_time"]["smollm2"]["c_decode_s"] > 0

        served: list[str] = []
        clock.advance(10.0)  # the blocker runs 10 s: every question is overdue by now
        end(d, blocker, completed=True)
        for _ in burst:
            await settle()
            [running] = d.running()
            served.append(running.request_id)
            clock.advance(running.predicted_s)
            end(d, running, completed=True)
        assert served[:6] == [f"hi{i}" for i in range(6)]
        await d.stop(timeout_s=0.01)

    asyncio.run(scenario())
