"""Replicas share what completed requests teach (scheduling/cluster/observations.py), on a real
redis-server started on a free loopback port: each replica applies the others' service-time and
learner observations and skips its own; nothing but numbers, ids and names reaches Redis; a Redis
restart neither raises into the caller nor stops the sharing."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from manual_clock import ManualClock
from polling import until
from redis_server import RedisServer, running_redis_server

from clairvoyant.metrics import Metrics
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.learner import PriorIdentity, usable_observation
from clairvoyant.prediction.predictor import OnnxPredictor, Prediction
from clairvoyant.scheduling.cluster.observations import SharedObservations, stream_key
from clairvoyant.scheduling.cluster.shared import ServiceObservation
from clairvoyant.scheduling.dispatcher import Backend, Dispatcher, Ticket
from clairvoyant.scheduling.policy import build_queue, make_policy
from clairvoyant.scheduling.service_time import ServiceTimeModel

LOGGER = "clairvoyant.scheduling.cluster.observations"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A server of this test's own (stopped, paused or restarted empty), with small stream nodes, so
    that an approximate MAXLEN trims within the few entries a test writes."""
    with running_redis_server(["--stream-node-max-entries", "4"]) as server:
        yield server


_clusters = itertools.count()


_made: list[SharedObservations] = []  # stopped by ``run`` (a failed test leaves no connection open)


def run(scenario: Coroutine[Any, Any, None]) -> None:
    async def stopping_every_replica() -> None:
        try:
            await scenario
        finally:
            while _made:
                await _made.pop().stop()

    asyncio.run(stopping_every_replica())


def replica(server: RedisServer, name: str, cluster: str, **kwargs: Any) -> SharedObservations:
    made = SharedObservations(server.url, cluster=cluster, replica=name, service_time=ServiceTimeModel(), **kwargs)
    _made.append(made)
    return made


def observation(rng: random.Random, model: str | None = "m") -> ServiceObservation:
    """A request on a backend whose true cost is 0.2 s + 0.5 ms per prompt token + 25 ms per output token."""
    prompt_tokens, output_tokens = rng.randint(10, 2000), rng.randint(5, 600)
    service_s = (0.2 + 0.0005 * prompt_tokens + 0.025 * output_tokens) * rng.uniform(0.8, 1.25)
    return ServiceObservation(model, "gpu", prompt_tokens, output_tokens, service_s, service_s * 1.1)


def learn_here(shared: SharedObservations, seen: ServiceObservation) -> None:
    """What the dispatcher does with its own observation: learn it, then publish it."""
    shared.service_time.observe(seen.model, seen.prompt_tokens, seen.output_tokens, seen.service_s)
    shared.publish_service(seen)


async def started(*replicas: SharedObservations) -> None:
    """Start the replicas and wait until each reader stands at the stream's end (a fresh replica
    takes only what is published after it started)."""
    for r in replicas:
        r.start()
    await until(lambda: all(r._reader.last_id not in (None, b"$") for r in replicas), what="the readers to stand")


def test_a_replica_converges_to_the_same_fit_as_the_one_that_served(redis_server: RedisServer) -> None:
    """Replica A serves 300 requests through its dispatcher (the on_observed hook publishes each);
    B, which served none, ends with the same coefficients, to 1e-12 relative: the same
    observations in the same order, the floats round-tripped exactly."""

    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        a, b = replica(server, "a", cluster), replica(server, "b", cluster)
        clock = ManualClock()
        policy = make_policy("fcfs")
        dispatcher = Dispatcher(
            build_queue(policy),
            policy,
            backends=[Backend("gpu", 1)],
            clock=clock,
            metrics=Metrics(),
            max_queue=10,
            service_time=a.service_time,
        )
        dispatcher.cluster.on_observed = a.publish_service
        await dispatcher.start()
        await started(a, b)
        rng = random.Random(7)
        for i in range(300):
            prompt_tokens, output_tokens = rng.randint(10, 2000), rng.randint(5, 600)
            ticket = Ticket(
                f"r{i}", "/v1/chat/completions", "openai", "m", Prediction(0.5, float(output_tokens)), prompt_tokens,
                clock.now(), predicted_s=1.0, predicted_tokens=float(output_tokens),
            )  # fmt: skip
            dispatcher.submit(ticket)
            async with dispatcher.lease(ticket) as lease:
                clock.advance((0.2 + 0.0005 * prompt_tokens + 0.025 * output_tokens) * rng.uniform(0.8, 1.25))
                lease.completed = True
        await until(lambda: b.counts.applied == 300, what="B to apply A's 300 observations")
        fit_a, fit_b = a.service_time.coefficients("m"), b.service_time.coefficients("m")
        assert fit_a["observations"] == fit_b["observations"] == 300
        for name in ("c0_s", "c_prompt_s", "c_decode_s", "outlier_factor"):
            assert fit_b[name] == pytest.approx(fit_a[name], rel=1e-12), name
        assert fit_b["c_decode_s"] == pytest.approx(0.025, rel=0.1)  # and it is the backend's cost
        assert a.counts.applied == 0  # A skipped its own
        await dispatcher.stop()
        await a.stop()
        await b.stop()

    run(scenario(redis_server))


def test_each_replica_learns_every_answer_once_and_skips_its_own(redis_server: RedisServer) -> None:
    """A and B both serve, in turn: each applies the other's observations and skips its own, so
    both learn the same 120 observations in the same order and end with the same fit (1e-12
    relative). (Answers that complete on two replicas within the stream's lag are learned in
    another order: measured, with 50 answers completing between two turns of the loop, the
    10-token request's prediction differs by up to 25%, where the fit is least certain (c0), the
    300-token one's by under 1%; see benchmarks/bench_shared_observations.py.)"""

    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        a, b = replica(server, "a", cluster), replica(server, "b", cluster)
        await started(a, b)
        rng = random.Random(11)
        for i in range(120):
            server_replica, other = (a, b) if i % 3 else (b, a)
            expected = other.counts.applied + 1
            learn_here(server_replica, observation(rng))
            await until(
                lambda r=other, n=expected: r.counts.applied == n, what=f"observation {i} to reach the other replica"
            )
        assert (a.counts.applied, b.counts.applied) == (
            40,
            80,
        )  # B served the 40 of i % 3 == 0; each applied the other's only
        fit_a, fit_b = a.service_time.coefficients("m"), b.service_time.coefficients("m")
        assert fit_a["observations"] == fit_b["observations"] == 120
        for name in ("c0_s", "c_prompt_s", "c_decode_s"):
            assert fit_b[name] == pytest.approx(fit_a[name], rel=1e-12), name
        await a.stop()
        await b.stop()

    run(scenario(redis_server))


def test_loads_and_backend_slowness_reach_the_other_replica(redis_server: RedisServer) -> None:
    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        gpu_b = Backend("gpu", 1)
        a = replica(server, "a", cluster)
        b = replica(server, "b", cluster, backends=[gpu_b])
        await started(a, b)
        a.publish_service(ServiceObservation("big", "gpu", 100, 50, 2.0, 1.0, load_s=12.0))
        a.publish_service(ServiceObservation(None, "gpu", 100, 50, -1.0, 1.0, load_s=30.0))  # all load: no service
        await until(lambda: b.counts.applied == 2, what="B to apply both")
        reference = ServiceTimeModel()
        reference.observe_load("gpu", "big", 12.0)
        reference.observe_load("gpu", None, 30.0)
        assert b.service_time.load_s("gpu", "big") == pytest.approx(reference.load_s("gpu", "big"), rel=1e-12)
        assert b.service_time.load_s("gpu", None) == pytest.approx(reference.load_s("gpu", None), rel=1e-12)
        assert b.service_time.coefficients("big")["observations"] == 1  # the second taught no service seconds
        assert b.service_time.coefficients(None)["observations"] == 0
        assert gpu_b.slowness > 1.0  # 2 s measured against 1 s predicted
        await a.stop()
        await b.stop()

    run(scenario(redis_server))


IDENTITY = PriorIdentity("rich_v3", ("prompt_token_len", "word_count", "turns"), "sha-a", ("c0", "c1"))
EMBEDDING_FLOATS = 8


def learner_prediction(rng: random.Random, model: str | None = "m") -> Prediction:
    row = np.array([rng.uniform(0, 100) for _ in range(5 + EMBEDDING_FLOATS)], dtype=np.float32)
    return Prediction(0.3, rng.uniform(5, 500), None, rng.uniform(1, 6), row.tobytes(), model, rng.choice([None, 256]))


def test_the_learner_feed_gets_the_other_replicas_observations_without_the_embedding(redis_server: RedisServer) -> None:
    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        a, b = replica(server, "a", cluster), replica(server, "b", cluster)
        other = replica(server, "c", cluster)  # another prior: skips them
        fed: dict[str, list[tuple[Prediction, int]]] = {"a": [], "b": [], "c": []}
        a.share_learner(IDENTITY, lambda p, n: fed["a"].append((p, n)))
        b.share_learner(IDENTITY, lambda p, n: fed["b"].append((p, n)))
        other.share_learner(
            PriorIdentity("rich_v3", IDENTITY.feature_names, "sha-other", IDENTITY.component_names),
            lambda p, n: fed["c"].append((p, n)),
        )
        await started(a, b, other)
        rng = random.Random(3)
        sent = [(learner_prediction(rng), rng.randint(0, 900)) for _ in range(20)]
        for prediction, tokens in sent:
            a.publish_learner(prediction, tokens)
        await until(lambda: len(fed["b"]) == 20 and other.counts.foreign == 20, what="B to be fed and C to skip")
        assert fed["a"] == [] and fed["c"] == []
        for (got, got_tokens), (prediction, tokens) in zip(fed["b"], sent, strict=True):
            assert got_tokens == tokens
            assert got.feature_row == prediction.feature_row[: 4 * 5]  # the columns, not the embedding
            assert usable_observation(got, got_tokens, n_counts=3, n_features=5)  # a row the learner takes
            assert (got.model, got.cap_tokens) == (prediction.model, prediction.cap_tokens)
            assert got.prior_log_tokens == prediction.prior_log_tokens  # exact: repr round-trips a float
            assert got.predicted_tokens == prediction.predicted_tokens
        await a.stop()
        await b.stop()
        await other.stop()

    run(scenario(redis_server))


def test_no_prompt_text_reaches_redis(redis_server: RedisServer) -> None:
    """A real prediction of a real prompt is published with its service observation: every key and
    every value Redis holds is then scanned for the prompt's words."""
    prompt = "Summarize the quarterly zanzibarian revenue memorandum for the pelican committee"
    predictor = OnnxPredictor()
    prediction = predictor.predict(Prompt(prompt))
    identity = PriorIdentity.of(predictor)
    assert len(prediction.feature_row) == 4 * len(identity.feature_names)

    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        a, b = replica(server, "a", cluster), replica(server, "b", cluster)
        fed: list[int] = []
        a.share_learner(identity, lambda p, n: None)
        n_counts = len(identity.feature_names)
        b.share_learner(identity, lambda p, n: fed.append(n) if usable_observation(p, n, n_counts, n_counts) else None)
        await started(a, b)
        a.publish_learner(prediction, 321)
        a.publish_service(ServiceObservation("smollm2", "gpu", 17, round(prediction.predicted_tokens), 1.5, 1.2))
        await until(lambda: b.counts.applied == 2, what="B to apply both")
        assert fed == [321]
        await a.stop()
        await b.stop()

        client = redis.Redis(port=server.port)
        keys = list(client.scan_iter(count=1000))
        assert keys == [stream_key(cluster).encode()]
        stored = [key for key in keys]
        for key in keys:
            assert client.type(key) == b"stream"
            for _id, fields in client.xrange(key):
                stored += [*fields.keys(), *fields.values()]
        words = [w.encode() for w in prompt.lower().split() if len(w) >= 5]
        for value in stored:
            for word in words:
                assert word not in value.lower(), (word, value)
        client.close()

    run(scenario(redis_server))


def test_a_redis_restart_neither_raises_nor_stops_the_sharing(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis killed mid-stream and started again empty: publishing never raises; one WARNING; what
    was published while it was away goes out when it returns; B reads on from the new stream."""

    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        a, b = replica(server, "a", cluster), replica(server, "b", cluster)
        await started(a, b)
        rng = random.Random(5)
        for _ in range(30):
            learn_here(a, observation(rng))
        await until(lambda: b.counts.applied == 30, what="B to apply the first 30")
        server.stop()
        for _ in range(10):
            learn_here(a, observation(rng))  # never raises: they wait for Redis
        await until(lambda: {"publish", "read"} <= a._outage.lost, what="A to find Redis away")
        server.start()
        await until(lambda: b.counts.applied == 40, 10.0, what="B to apply what A kept while Redis was away")
        for _ in range(10):
            learn_here(a, observation(rng))
        await until(lambda: b.counts.applied == 50, what="B to apply what A published after")
        fit_a, fit_b = a.service_time.coefficients("m"), b.service_time.coefficients("m")
        for name in ("c0_s", "c_prompt_s", "c_decode_s"):
            assert fit_b[name] == pytest.approx(fit_a[name], rel=1e-12), name
        await a.stop()
        await b.stop()

    with caplog.at_level(logging.INFO, logger=LOGGER):
        run(scenario(redis_server))
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 2 and {"replica a's" in w for w in warnings} == {True, False}, warnings  # once each
    assert sum("reachable again" in r.getMessage() for r in caplog.records if r.name == LOGGER) == 2


def test_a_reader_goes_on_from_the_end_past_trimmed_entries_and_from_the_start_of_a_new_stream(
    redis_server: RedisServer,
) -> None:
    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        a = replica(server, "a", cluster, max_entries=8)
        b = replica(server, "b", cluster, max_entries=8)
        a.start()
        rng = random.Random(9)
        learn_here(a, observation(rng))
        await until(lambda: a.counts.published == 1, what="the first entry")
        client = redis.Redis(port=server.port)
        first = client.xrange(stream_key(cluster))[0][0]
        b._reader.last_id = first  # B read the first entry, then (say) stalled
        assert await b._reader.resume_from() == first  # nothing after it is gone yet
        for _ in range(40):
            learn_here(a, observation(rng))
        await until(lambda: a.counts.published == 41, what="the rest")
        assert client.xlen(stream_key(cluster)) < 41  # trimmed
        end = client.xinfo_stream(stream_key(cluster))["last-generated-id"]
        assert await b._reader.resume_from() == end and b.counts.skipped == 1
        await a.stop()
        server.stop()  # started again empty, and written to before B's reader is back
        server.start()
        client.xadd(stream_key(cluster), {"kind": "service", "session": "s", "seq": 1})
        try:
            resumed = await b._reader.resume_from()
        except redis.ConnectionError:  # B's connection to the old server, found closed: the next call reconnects
            resumed = await b._reader.resume_from()
        assert resumed == b"0-0"  # everything the new stream holds is new
        client.close()
        await b.stop()

    run(scenario(redis_server))


def test_publishing_is_bounded_while_redis_is_away(tmp_path: Path) -> None:
    async def scenario() -> None:
        server = RedisServer(tmp_path)  # never started: nothing listens there
        a = replica(server, "a", "gone", max_pending=16)
        a.start()
        rng = random.Random(1)
        for _ in range(100):
            learn_here(a, observation(rng))  # never raises
        await until(lambda: "publish" in a._outage.lost, what="A to find no Redis")
        assert len(a._publisher.pending) == 16 and a.counts.dropped == 84 and a.counts.published == 0
        assert a.service_time.coefficients("m")["observations"] == 100  # serving learned all the same
        await a.stop()

    run(scenario())


def test_an_entry_sent_twice_is_applied_once(redis_server: RedisServer) -> None:
    """A batch whose write failed is sent again, and part of it may have been written: each
    (session, sequence number) is applied once."""

    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        b = replica(server, "b", cluster)
        await started(b)
        client = redis.Redis(port=server.port)
        entry = {"kind": "service", "replica": "a", "model": "m", "backend": "gpu", "prompt_tokens": 10}
        entry |= {"output_tokens": 20, "service_s": 1.0, "predicted_s": 1.0, "session": "s1"}
        for seq in (1, 2, 2, 1, 3):
            client.xadd(stream_key(cluster), {**entry, "seq": seq})
        await until(lambda: b.counts.applied + b.counts.repeated == 5, what="B to read all five")
        assert (b.counts.applied, b.counts.repeated) == (3, 2)
        assert b.service_time.coefficients("m")["observations"] == 3
        client.close()
        await b.stop()

    run(scenario(redis_server))


def test_a_replica_that_catches_up_applies_what_the_stream_holds(redis_server: RedisServer) -> None:
    """A replica starting with nothing learned may take the stream's history (``catch_up``); one
    that starts with its own state takes only what comes after it."""

    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        a = replica(server, "a", cluster)
        await started(a)
        rng = random.Random(2)
        for _ in range(5):
            learn_here(a, observation(rng))
        await until(lambda: a.counts.published == 5, what="A's first five")
        fresh = replica(server, "fresh", cluster, catch_up=True)
        known = replica(server, "known", cluster)
        await started(fresh, known)
        await until(lambda: fresh.counts.applied == 5, what="the fresh replica to catch up")
        learn_here(a, observation(rng))
        await until(lambda: fresh.counts.applied == 6 and known.counts.applied == 1, what="both to apply the sixth")

    run(scenario(redis_server))


def test_a_stalled_redis_delays_the_sharing_and_nothing_is_applied_twice(redis_server: RedisServer) -> None:
    """Redis paused (SIGSTOP): A's write times out and is sent again once Redis answers, while
    Redis, resumed, also runs the first copy: B applies each observation once."""

    async def scenario(server: RedisServer) -> None:
        cluster = f"c{next(_clusters)}"
        a, b = replica(server, "a", cluster), replica(server, "b", cluster)
        await started(a, b)
        rng = random.Random(4)
        learn_here(a, observation(rng))  # A's writer holds a connection: the next write is sent, unanswered
        await until(lambda: b.counts.applied == 1, what="B to apply the first")
        server.pause()
        try:
            for _ in range(4):
                learn_here(a, observation(rng))  # never blocks nor raises
            await until(lambda: "publish" in a._outage.lost, 10.0, what="A's write to time out")
        finally:
            server.resume()
        await until(lambda: a.counts.published == 5, 10.0, what="A to write them again")
        await until(lambda: b.counts.applied == 5, 10.0, what="B to apply them")
        learn_here(a, observation(rng))  # the last, after any copy: once it is in, every copy was read
        await until(lambda: b.counts.applied == 6, 10.0, what="B to apply the sixth")
        assert b.service_time.coefficients("m")["observations"] == 6
        client = redis.Redis(port=server.port)
        copies = len(client.xrange(stream_key(cluster))) - 6
        client.close()
        assert copies > 0  # Redis, resumed, ran the write that had timed out
        assert b.counts.repeated == copies  # each copy read, and skipped

    run(scenario(redis_server))
