"""Two replicas (r0, r1) on a real Redis in front of one fake backend of one slot, with a queue held
across them: for the cluster's view in `clairvoyant status` and on the live page.

    with held_cluster(redis_server.url) as scene:
        scene.bases["r0"]           # each replica's URL
        scene.ids["w1"]             # a held request's id, by its label
        scene.dispatch_order        # the waiting labels in the order the cluster serves them

The holder (on r0) streams for minutes; leaving cancels every client request, so the replicas stop
at once rather than after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fake_backend import FakeBackend
from polling import wait_until
from proxy_harness import LOOPBACK, MarkerPredictor, running_proxy

from clairvoyant.config import Settings

_names = itertools.count()
HOLDER = ("r0", "[long] holder")
# (label, replica, text): sent one after another, so the arrival order is known and differs from
# the dispatch order (shortest predicted first): w2, w3, w1.
WAITING = [("w1", "r1", "[long] w1"), ("w2", "r0", "[short] w2"), ("w3", "r1", "[p=0.5] w3")]
DISPATCH_ORDER = ["w2", "w3", "w1"]


def replica_settings(redis_url: str, upstream: str, cluster: str, replica: str) -> Settings:
    return Settings(
        upstream_url=upstream,
        redis_url=redis_url,
        cluster_name=cluster,
        replica_id=replica,
        lease_s=1.0,
        slots=1,
        online_learning=False,
        log_level="warning",
    )


class Clients:
    """Streaming chat requests from an event loop in a thread of its own; ``close`` cancels the
    ones still open (the clients leave)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sent: list[concurrent.futures.Future[int]] = []

    def post(self, base: str, text: str) -> None:
        async def one() -> int:
            body = {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True}
            async with httpx.AsyncClient(timeout=300) as client:
                return (await client.post(f"{base}/v1/chat/completions", json=body)).status_code

        self.sent.append(asyncio.run_coroutine_threadsafe(one(), self.loop))

    def close(self) -> None:
        for future in self.sent:
            future.cancel()
        concurrent.futures.wait(self.sent, timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


def cluster_part(base: str) -> dict[str, Any]:
    return dict(LOOPBACK.get(f"{base}/queue").json()["cluster"])


@dataclass
class Scene:
    cluster: str
    bases: dict[str, str]  # replica id -> URL
    holder_id: str = ""
    ids: dict[str, str] = field(default_factory=dict)  # label -> request id
    dispatch_order: list[str] = field(default_factory=lambda: list(DISPATCH_ORDER))


@contextmanager
def replicas(redis_url: str, upstream: str) -> Iterator[Scene]:
    """Two replicas of a fresh cluster, both seen live by the shared store."""
    scene = Scene(f"status{next(_names)}", {})
    with ExitStack() as stack:
        for replica in ("r0", "r1"):
            settings = replica_settings(redis_url, upstream, scene.cluster, replica)
            scene.bases[replica] = stack.enter_context(running_proxy(settings, predictor=MarkerPredictor()))
        wait_until(lambda: len(cluster_part(scene.bases["r0"])["replicas"]) == 2, 10.0, "both replicas in the store")
        yield scene


@contextmanager
def held_cluster(redis_url: str) -> Iterator[Scene]:
    """The scene: the holder running on r0 (one slot), WAITING queued across r0 and r1."""
    with FakeBackend(lambda path, n: ("stream", 4000 if n == 0 else 2, 0.05)) as backend:
        with replicas(redis_url, backend.url) as scene:
            clients = Clients()
            try:
                clients.post(scene.bases[HOLDER[0]], HOLDER[1])
                wait_until(lambda: backend.in_progress == 1, 10.0, "the holder at the backend")
                (lease,) = cluster_part(scene.bases["r0"])["leases"]
                scene.holder_id = lease["request_id"]
                for count, (label, replica, text) in enumerate(WAITING, 1):
                    clients.post(scene.bases[replica], text)
                    wait_until(
                        lambda n=count: cluster_part(scene.bases["r0"])["waiting_count"] == n, 10.0, f"{label} waiting"
                    )
                    known = set(scene.ids.values())
                    (new,) = [w for w in cluster_part(scene.bases["r0"])["waiting"] if w["request_id"] not in known]
                    scene.ids[label] = new["request_id"]
                yield scene
            finally:
                clients.close()
