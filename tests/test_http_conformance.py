"""The proxy's HTTP/1.1 conformance, judged from outside: every vector of benchmarks/harness/http_vectors.py
sent over a raw socket to the real proxy (``python -m clairvoyant serve``, a child process), and
every request that reached the recording backend behind it meanwhile.

Each vector is one case, named by its id; its message says what the client got, what reached the
backend, and which public test it follows. Two proxies run for the module: "open" (as deployed on
loopback: no keys) and "keyed" (an API key, an allowlist, one slot and a queue of one, for the
admission rules of ``Expect: 100-continue``). benchmarks/bench_http_conformance.py runs the same
vectors beside nginx, and the ported Http11Probe suite.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from polling import wait_until

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from harness import http_vectors as hv  # noqa: E402
from harness.proxy_process import ProxyProcess  # noqa: E402
from harness.raw_client import exchange  # noqa: E402
from harness.recording_backend import RecordingBackend  # noqa: E402

pytestmark = pytest.mark.e2e  # the real proxy process, judged from outside

# Off only to start faster (the encoder's model load): neither touches the HTTP path.
QUICK_START = {"encoder": "false", "online_learning": "false"}


@pytest.fixture(scope="module")
def backend() -> Iterator[RecordingBackend]:
    recorder = RecordingBackend(hold_s=2.0).start()
    yield recorder
    recorder.stop()


@pytest.fixture(scope="module")
def proxies(backend: RecordingBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ProxyProcess]]:
    logs = tmp_path_factory.mktemp("conformance-logs")
    started = {
        "open": ProxyProcess("open", backend.base_url, logs, **QUICK_START),
        "keyed": ProxyProcess(
            "keyed", backend.base_url, logs, slots=1, max_queue=1, **QUICK_START, **hv.keyed_settings()
        ),  # fmt: skip
    }
    try:
        with ThreadPoolExecutor(len(started)) as pool:  # both start at once; each waits for its /healthz
            for future in [pool.submit(p.start) for p in started.values()]:
                future.result()
        yield started
    finally:
        for proxy in started.values():
            proxy.stop()


@pytest.mark.parametrize("vector", hv.VECTORS, ids=lambda v: v.name)
def test_vector(vector: hv.Vector, backend: RecordingBackend, proxies: dict[str, ProxyProcess]) -> None:
    verdict = hv.run_vector(vector, proxies[vector.proxy].port, backend)
    if not verdict.ok:
        pytest.fail(
            f"{vector.name} [{vector.source}]: client got {verdict.exchange.outcome()}, backend got "
            f"{verdict.deliveries_text()}; expected {' | '.join(c.describe() for c in vector.cases)}: "
            + "; ".join(verdict.problems),
            pytrace=False,
        )


def test_expect_100_continue_waits_for_room_in_the_queue(
    backend: RecordingBackend, proxies: dict[str, ProxyProcess]
) -> None:
    """The keyed proxy has one slot and a queue of one: with one request in flight (the backend
    holds it 2 s) and one waiting, a third sent with ``Expect: 100-continue`` must get its 503
    without a 100 first (its body is never asked for), and never reach the backend."""
    proxy = proxies["keyed"]
    headers = {"Authorization": f"Bearer {hv.KEY}", "Content-Type": "application/json"}
    statuses: dict[str, int] = {}

    def held(tag: str) -> threading.Thread:
        def send() -> None:
            response = httpx.post(f"{proxy.url}{hv.CHAT}", content=hv.chat(tag, model="hold"), headers=headers,
                                  timeout=30)  # fmt: skip
            statuses[tag] = response.status_code

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        return thread

    mark, started_s = backend.mark(), time.monotonic()
    senders = [held("held-1")]
    assert len(backend.wait_for(mark, 1, timeout_s=10)) == 1, "the first request never reached the backend"
    senders.append(held("held-2"))
    wait_until(
        lambda: httpx.get(f"{proxy.url}/queue", timeout=5).json().get("waiting_count", 0) >= 1,
        timeout_s=10,
        what="the second request queued",
    )
    body = hv.chat("queue-full")
    ex = exchange(proxy.port, hv.expect_continue([f"Authorization: Bearer {hv.KEY}"], body), wait_s=3.0)
    for sender in senders:
        sender.join(15)
    delivered = [r for r in backend.settle(mark, since_s=started_s) if b"queue-full" in r.body]
    assert statuses == {"held-1": 200, "held-2": 200}
    assert ex.finals and ex.finals[0].status == 503, f"got {ex.outcome()}, expected 503"
    assert ex.interim_before_first_final() == [], f"got {ex.outcome()}: a 100 came before the 503"
    assert delivered == [], "the refused request reached the backend"
