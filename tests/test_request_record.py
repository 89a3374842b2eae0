"""A scheduled request's record (scheduling/request.py): its status changes in one place, and it
round-trips through a flat mapping (what a shared store keeps)."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
from ending import end
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import ManualClock
from polling import settle

from clairvoyant.errors import QueueDeadline
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.predictor import Prediction
from clairvoyant.scheduling.dispatcher import Dispatcher
from clairvoyant.scheduling.policy import build_queue, make_policy
from clairvoyant.scheduling.request import Placement, RequestStatus, Ticket, status_counts
from clairvoyant.scheduling.routing import Load

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)


@st.composite
def tickets(draw: st.DrawFn) -> Ticket:
    model, cap_tokens = draw(st.none() | text), draw(st.none() | st.integers(0, 10**6))
    prediction = draw(
        st.none()
        | st.builds(
            Prediction, finite, finite, st.none() | st.tuples(finite, finite, finite), finite, st.binary(max_size=16),
            st.just(model), st.just(cap_tokens),  # the request's own, as the proxy predicts it
        )
    )  # fmt: skip
    ticket = Ticket(
        draw(text), draw(st.sampled_from(["/v1/chat/completions", "/api/chat"])), draw(st.sampled_from(["openai", "ollama"])),
        model, prediction, draw(st.integers(0, 10**6)), draw(finite),
        score=draw(finite), predicted_tokens=draw(finite), predicted_s=draw(finite),
        priority=draw(st.integers(-5, 5)), tenant=draw(text),
        expires_s=draw(finite | st.just(math.inf)),
    )  # fmt: skip
    ticket.status = draw(st.sampled_from(RequestStatus))
    ticket.grants_before_arrival = draw(st.integers(0, 10**6))
    ticket.held_back, ticket.ended, ticket.waiting = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    if draw(st.booleans()):  # granted
        placement = ticket.placement = Placement(
            draw(st.none() | st.integers(0, 8)), draw(st.none() | st.integers(0, 8)), draw(finite),
            draw(st.integers(0, 1000)), draw(st.sampled_from(Load)), draw(finite),
        )  # fmt: skip
        placement.refused_by = tuple(draw(st.lists(st.integers(0, 8), max_size=3)))
        placement.live_tokens = draw(st.integers(0, 10**5))
    return ticket


@settings(max_examples=100, deadline=None)
@given(ticket=tickets())
def test_a_record_round_trips_through_a_flat_mapping_as_a_store_gives_it_back(ticket: Ticket) -> None:
    mapping = ticket.to_mapping()
    assert all(isinstance(k, str) and type(v) in (str, int, float) for k, v in mapping.items())
    as_stored = {k: str(v) for k, v in mapping.items()}  # a Redis hash gives every value back as a string
    for data in (mapping, as_stored):
        back = Ticket.from_mapping(data)
        assert back.to_mapping() == mapping
        assert back.request_id == ticket.request_id and back.status is ticket.status
        assert back.predicted_class == ticket.predicted_class
        assert (back.placement is None) == (ticket.placement is None)
        if ticket.placement is not None:
            assert back.placement is not None and back.placement.load is ticket.placement.load
            assert back.placement.refused_by == ticket.placement.refused_by
        if ticket.prediction is not None:
            assert back.prediction is not None
            assert back.prediction.probabilities == ticket.prediction.probabilities
            assert back.prediction.feature_row == ticket.prediction.feature_row


def test_every_status_change_is_made_by_the_dispatcher_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        metrics = Metrics()
        policy = make_policy("fcfs")
        d = Dispatcher(build_queue(policy), policy, slots=1, clock=ManualClock(), metrics=metrics, max_queue=10)
        await d.start()
        tickets = [
            Ticket(name, "/v1/chat/completions", "openai", None, Prediction.from_probabilities(0.5, 0.3, 0.2), 10)
            for name in ("first", "second", "third")
        ]
        for ticket in tickets:
            d.submit(ticket)
        await settle()
        first, second, third = tickets
        assert [t.status for t in tickets] == [RequestStatus.DISPATCHED, RequestStatus.WAITING, RequestStatus.WAITING]
        assert d.move(first, RequestStatus.STREAMING)
        assert d.move(first, RequestStatus.COMPLETED)
        assert not d.move(first, RequestStatus.SHUTDOWN)  # a finished request keeps its first ending
        assert first.status is RequestStatus.COMPLETED and first.status.is_finished
        end(d, first, completed=True)
        await settle()
        assert second.status is RequestStatus.DISPATCHED
        end(d, third)  # its client left while it waited: withdrawn, never sent
        assert third.status is RequestStatus.CLIENT_LEFT_QUEUED and third.ended and third.placement is None

        def count(status: RequestStatus) -> float:
            value = metrics.registry.get_sample_value(
                "clairvoyant_request_status_changes_total", {"status": status.name.lower()}
            )
            return 0.0 if value is None else value

        assert count(RequestStatus.DISPATCHED) == 2 and count(RequestStatus.STREAMING) == 1
        assert count(RequestStatus.COMPLETED) == 1 and count(RequestStatus.CLIENT_LEFT_QUEUED) == 1
        assert count(RequestStatus.SHUTDOWN) == 0
        await d.stop(0.1)

    with caplog.at_level(logging.DEBUG, logger="clairvoyant.scheduling.dispatcher"):
        asyncio.run(scenario())
    moves = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert moves[:3] == [
        "request_id=first WAITING -> DISPATCHED",
        "request_id=first DISPATCHED -> STREAMING",
        "request_id=first STREAMING -> COMPLETED",
    ]
    assert "request_id=third WAITING -> CLIENT_LEFT_QUEUED" in moves


def test_the_statuses_say_which_are_finished_and_how_the_log_names_them() -> None:
    finished = [s for s in RequestStatus if s.is_finished]
    assert finished[0] is RequestStatus.COMPLETED and RequestStatus.HOLDING not in finished
    assert [s for s in RequestStatus if s.in_progress] == [
        RequestStatus.WAITING, RequestStatus.DISPATCHED, RequestStatus.STREAMING,
    ]  # fmt: skip
    assert RequestStatus.STREAMING.outcome == "pending" and RequestStatus.EXPIRED.outcome == "refused"
    assert RequestStatus.CLIENT_LEFT_QUEUED.outcome == "client_left_queued"


def test_each_request_is_counted_once_in_each_status_it_enters_from_its_admission() -> None:
    async def scenario() -> None:
        metrics = Metrics()
        clock = ManualClock()
        policy = make_policy("fcfs")
        d = Dispatcher(build_queue(policy), policy, slots=1, clock=clock, metrics=metrics, max_queue=10)
        await d.start()

        def ticket(name: str, expires_s: float = math.inf) -> Ticket:
            prediction = Prediction.from_probabilities(0.5, 0.3, 0.2)
            return Ticket(
                name, "/v1/chat/completions", "openai", None, prediction, 10, predicted_s=10.0, expires_s=expires_s
            )

        running, waiting = ticket("running"), ticket("waiting")
        d.submit(running)
        d.submit(waiting)
        await settle()
        late = ticket("late", expires_s=clock.now() + 1.0)  # 20 s of work ahead of it: refused at once
        with pytest.raises(QueueDeadline):
            d.submit(late)
        assert late.status is RequestStatus.EXPIRED and late.ended
        counts = {s.name.lower(): n for s, n in zip(RequestStatus, status_counts(metrics), strict=True) if n}
        assert counts == {"waiting": 3, "dispatched": 1, "expired": 1}
        await d.stop(0.1)

    asyncio.run(scenario())
