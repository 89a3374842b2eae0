"""Several replicas on one real Redis (tests/redis_server.py), each a real proxy on its own server,
in front of one fake backend that counts the requests it runs at once: the slots, the order,
supersede and deadlines hold across replicas, and a lost Redis degrades to a share of the slots."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from fake_backend import FakeBackend
from polling import wait_until
from proxy_harness import LOOPBACK, MarkerPredictor, running_proxy

from clairvoyant.config import Settings

_names = itertools.count()


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True, **extra}


def cluster_settings(redis_url: str, upstream: str, cluster: str, replica: str, **overrides: Any) -> Settings:
    defaults: dict[str, Any] = {
        "slots": 1,
        "lease_s": 1.0,  # a new cluster's quiet period: one lease
        "online_learning": False,
        "log_level": "warning",
    }
    return Settings(
        upstream_url=upstream,
        redis_url=redis_url,
        cluster_name=cluster,
        replica_id=replica,
        **{**defaults, **overrides},
    )


@contextmanager
def replicas(n: int, redis_url: str, upstream: str, **overrides: Any) -> Iterator[list[str]]:
    cluster = f"test{next(_names)}"
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                running_proxy(
                    cluster_settings(redis_url, upstream, cluster, f"r{i}", **overrides), predictor=MarkerPredictor()
                )
            )
            for i in range(n)
        ]


async def post_all(bodies: list[tuple[str, dict[str, Any], dict[str, str]]]) -> list[tuple[int, str]]:
    """POST each (base URL, body, headers) at once; (status, text) in the same order."""
    async with httpx.AsyncClient(timeout=60.0) as client:

        async def one(base: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, str]:
            response = await client.post(f"{base}/v1/chat/completions", json=body, headers=headers)
            return response.status_code, response.text

        return await asyncio.gather(*(one(*b) for b in bodies))


def cluster_view(base: str) -> dict[str, Any]:
    return LOOPBACK.get(f"{base}/queue").json()["cluster"]


def test_three_replicas_never_run_more_than_the_backends_slot(redis_server: Any) -> None:
    with FakeBackend(lambda path, n: ("stream", 4, 0.02)) as backend:
        with replicas(3, redis_server.url, backend.url) as bases:
            requests = [(bases[i % 3], chat(f"[short] q{i}"), {}) for i in range(18)]
            answers = asyncio.run(post_all(requests))
            metrics = LOOPBACK.get(f"{bases[1]}/metrics").text
        assert 'clairvoyant_in_flight_requests{replica="r1"} 0.0' in metrics  # every series: its replica
        assert [status for status, _ in answers] == [200] * 18
        assert all("[DONE]" in text for _, text in answers)
        assert backend.posts("/v1/chat/completions") == 18  # each sent once
        assert backend.max_in_progress == 1


def test_shortest_first_holds_across_replicas(redis_server: Any) -> None:
    """A long request holds the slot; then long and short ones arrive on different replicas: every
    short one goes before every long one that waited."""
    order: list[str] = []
    lock = threading.Lock()

    def script(path: str, n: int) -> Any:
        return ("stream", 10 if n == 0 else 2, 0.03)

    with FakeBackend(script) as backend:
        with replicas(3, redis_server.url, backend.url) as bases:

            async def run() -> None:
                async with httpx.AsyncClient(timeout=60.0) as client:

                    async def one(base: str, label: str) -> None:
                        response = await client.post(f"{base}/v1/chat/completions", json=chat(label))
                        assert response.status_code == 200
                        with lock:
                            order.append(label.split()[1])

                    first = asyncio.create_task(one(bases[0], "[long] hold"))
                    await asyncio.to_thread(wait_until, lambda: backend.in_progress == 1, 10.0, "the first request")
                    rest = [one(bases[i % 3], f"[long] L{i}" if i % 2 else f"[short] S{i}") for i in range(8)]
                    tasks = [asyncio.create_task(r) for r in rest]
                    # every one waits in the shared queue before the slot frees
                    await asyncio.to_thread(
                        wait_until, lambda: len(cluster_view(bases[0])["waiting"]) == 8, 10.0, "8 waiting"
                    )
                    await asyncio.gather(first, *tasks)

            asyncio.run(run())
    served = order[1:]
    assert [x[0] for x in served] == ["S"] * 4 + ["L"] * 4, served


def test_supersede_reaches_a_request_waiting_on_another_replica(redis_server: Any) -> None:
    with FakeBackend(lambda path, n: ("stream", 20 if n == 0 else 1, 0.03)) as backend:
        with replicas(2, redis_server.url, backend.url) as (a, b):

            async def run() -> tuple[int, int]:
                async with httpx.AsyncClient(timeout=60.0) as client:
                    hold = asyncio.create_task(client.post(f"{a}/v1/chat/completions", json=chat("[long] hold")))
                    await asyncio.to_thread(wait_until, lambda: backend.in_progress == 1, 10.0, "the holder")
                    key = {"X-Clairvoyant-Supersede": "doc-1"}
                    older = asyncio.create_task(
                        client.post(f"{a}/v1/chat/completions", json=chat("[short] v1"), headers=key)
                    )
                    await asyncio.to_thread(
                        wait_until, lambda: len(cluster_view(b)["waiting"]) == 1, 10.0, "the older one waiting"
                    )
                    newer = await client.post(f"{b}/v1/chat/completions", json=chat("[short] v2"), headers=key)
                    replaced = await older
                    await hold
                    return replaced.status_code, newer.status_code

            replaced, newer = asyncio.run(run())
        assert replaced == 409
        assert newer == 200
        bodies = [json.loads(body) for _, body in backend.delivered]
        assert [m["messages"][0]["content"] for m in bodies] == ["[long] hold", "[short] v2"]  # v1 never sent


def test_a_deadline_counts_the_whole_clusters_queue(redis_server: Any) -> None:
    """Long requests wait on replica A; a request on replica B whose deadline is shorter than
    their predicted seconds is refused at once (503 queue_deadline), never sent."""
    with FakeBackend(lambda path, n: ("stream", 30 if n == 0 else 1, 0.03)) as backend:
        with replicas(2, redis_server.url, backend.url) as (a, b):

            async def run() -> tuple[int, str]:
                async with httpx.AsyncClient(timeout=60.0) as client:
                    hold = asyncio.create_task(client.post(f"{a}/v1/chat/completions", json=chat("[long] hold")))
                    await asyncio.to_thread(wait_until, lambda: backend.in_progress == 1, 10.0, "the holder")
                    # [p=0.3] sorts before [long]: the deadline must count what is ahead of it anyway (the
                    # running one and the waiting ones of a better band are none; tie on score: the longs
                    # go first as earlier arrivals of the same key).
                    waiting = [
                        asyncio.create_task(client.post(f"{a}/v1/chat/completions", json=chat(f"[long] w{i}")))
                        for i in range(6)
                    ]
                    await asyncio.to_thread(
                        wait_until, lambda: len(cluster_view(b)["waiting"]) == 6, 10.0, "6 waiting on A"
                    )
                    late = await client.post(
                        f"{b}/v1/chat/completions",
                        json=chat("[long] late"),
                        headers={"X-Clairvoyant-Deadline": "0.5"},
                    )
                    await asyncio.gather(hold, *waiting)
                    return late.status_code, late.text

            status, text = asyncio.run(run())
        assert status == 503
        assert "queue_deadline" in text
        sent = [json.loads(body)["messages"][0]["content"] for _, body in backend.delivered]
        assert "[long] late" not in sent


def test_redis_unreachable_at_start_exits_2_unless_fallback_is_chosen(free_port: int) -> None:
    from redis_server import free_port as another_port

    dead = f"redis://127.0.0.1:{another_port()}/0"
    command = [
        sys.executable,
        "-m",
        "clairvoyant.cli",
        "serve",
        "--upstream",
        "http://127.0.0.1:9",
        "--port",
        str(free_port),
        "--redis",
        dead,
        "--log-level",
        "warning",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot reach redis" in done.stderr
    assert dead.split("//")[1].split("/")[0] in done.stderr or "redis" in done.stderr


def test_with_fallback_a_start_without_redis_serves_degraded(free_port: int) -> None:
    from redis_server import free_port as another_port

    with FakeBackend(lambda path, n: ("stream", 2, 0.01)) as backend:
        settings = cluster_settings(
            f"redis://127.0.0.1:{another_port()}/0", backend.url, "fallback", "r0", redis_fallback=True
        )
        with running_proxy(settings, predictor=MarkerPredictor()) as base:
            ready = LOOPBACK.get(f"{base}/readyz")
            assert ready.status_code == 200
            assert ready.json()["status"] == "degraded"
            assert ready.json()["cluster"] == "local"
            answer = LOOPBACK.post(f"{base}/v1/chat/completions", json=chat("[short] hi"), timeout=30)
            assert answer.status_code == 200


def test_redis_lost_and_back_degrades_then_rejoins_without_oversubscription(own_redis_server: Any) -> None:
    redis = own_redis_server
    with FakeBackend(lambda path, n: ("stream", 3, 0.02)) as backend:
        with replicas(2, redis.url, backend.url) as (a, b):
            first = asyncio.run(post_all([(a, chat("[short] 1"), {}), (b, chat("[short] 2"), {})]))
            assert [s for s, _ in first] == [200, 200]
            redis.stop()
            wait_until(lambda: LOOPBACK.get(f"{a}/readyz").json()["status"] == "degraded", 10.0, "A degraded")
            wait_until(lambda: LOOPBACK.get(f"{b}/readyz").json()["status"] == "degraded", 10.0, "B degraded")
            # One slot, two replicas: the slot falls to r0 (A) alone, which serves its own requests;
            # B's wait until Redis answers again.
            during = asyncio.run(post_all([(a, chat(f"[short] a{i}"), {}) for i in range(3)]))
            waiting_on_b = threading.Thread(
                target=lambda: during.extend(asyncio.run(post_all([(b, chat(f"[short] b{i}"), {}) for i in range(3)])))
            )
            waiting_on_b.start()
            wait_until(lambda: LOOPBACK.get(f"{b}/queue").json()["waiting_count"] == 3, 10.0, "B's 3 waiting")
            assert backend.posts("/v1/chat/completions") == 5  # B sent nothing on A's share
            redis.start()
            wait_until(lambda: LOOPBACK.get(f"{a}/readyz").json()["status"] == "ready", 10.0, "A shared again")
            wait_until(lambda: LOOPBACK.get(f"{b}/readyz").json()["status"] == "ready", 10.0, "B shared again")
            waiting_on_b.join(timeout=60)
            after = asyncio.run(post_all([(base, chat(f"[short] c{i}"), {}) for i, base in enumerate([a, b] * 3)]))
        statuses = [s for s, _ in first + during + after]
        assert statuses == [200] * len(statuses)
        assert backend.max_in_progress == 1


def test_a_tenants_max_concurrent_counts_across_replicas(redis_server: Any) -> None:
    """max_concurrent 2, six requests at once through three replicas: two admitted, four refused
    with 429 and Retry-After (each replica alone would admit two)."""
    with FakeBackend(lambda path, n: ("stream", 10, 0.03)) as backend:
        tenants = [{"name": "team", "max_concurrent": 2}]
        with replicas(3, redis_server.url, backend.url, tenants=tenants) as bases:

            async def run() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=60.0) as client:
                    return await asyncio.gather(
                        *(
                            client.post(
                                f"{bases[i % 3]}/v1/chat/completions",
                                json=chat(f"[short] {i}"),
                                headers={"X-Clairvoyant-Tenant": "team"},
                            )
                            for i in range(6)
                        )
                    )

            answers = asyncio.run(run())
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200, 200, 429, 429, 429, 429]
    assert all(int(r.headers["retry-after"]) >= 1 for r in answers if r.status_code == 429)
    assert backend.posts("/v1/chat/completions") == 2


@pytest.mark.parametrize("silently", [False, True], ids=["reset", "silent"])
def test_a_replica_cut_off_alone_ends_its_answer_before_its_lease_runs_out(redis_server: Any, silently: bool) -> None:
    """r1 reaches Redis through a relay, holds the only slot, and is cut off: it cannot renew, so
    it ends its answer (the dialect's error, ``slot_lease_lost``) before the store hands the slot
    to r0's waiting request. The backend never runs two at once. Cut silently, r1's calls fail only
    by their timeouts, later than the lease runs out: it must not wait for them."""
    from tcp_relay import TcpRelay

    relay = TcpRelay(redis_server.port)
    cluster = f"test{next(_names)}"
    with FakeBackend(lambda path, n: ("stream", 200 if n == 0 else 2, 0.02)) as backend, ExitStack() as stack:
        r0 = stack.enter_context(
            running_proxy(cluster_settings(redis_server.url, backend.url, cluster, "r0"), predictor=MarkerPredictor())
        )
        r1_url = f"redis://127.0.0.1:{relay.port}/0"
        r1 = stack.enter_context(
            running_proxy(cluster_settings(r1_url, backend.url, cluster, "r1"), predictor=MarkerPredictor())
        )

        async def run() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=60.0) as client:
                held = asyncio.create_task(client.post(f"{r1}/v1/chat/completions", json=chat("[long] held")))
                await asyncio.to_thread(wait_until, lambda: backend.in_progress == 1, 10.0, "r1's request running")
                waiting = asyncio.create_task(client.post(f"{r0}/v1/chat/completions", json=chat("[short] next")))
                await asyncio.to_thread(
                    wait_until, lambda: len(cluster_view(r0)["waiting"]) == 1, 10.0, "r0's request waiting"
                )
                relay.cut(silently=silently)
                return await held, await waiting

        try:
            held, waiting = asyncio.run(run())
        finally:
            relay.close()
    assert held.status_code == 200  # its stream had begun: the error ends the stream
    assert "slot_lease_lost" in held.text
    assert "[DONE]" not in held.text
    assert waiting.status_code == 200 and "[DONE]" in waiting.text
    assert backend.max_in_progress == 1
