"""benchmarks/bench_body_budget.py: the bodies its clients send, how it reads the proxy's answers,
and its holding backend (the benchmark itself is run by hand)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import bench_body_budget as bench  # noqa: E402


def test_body_slices_make_one_json_body_of_the_exact_size() -> None:
    size = 100_003
    body = b"".join(bench.body_slices("bb-07", size, 4096))
    assert len(body) == size
    data = json.loads(body)
    assert data["model"] == "hold" and data["user"] == "bb-07"
    assert data["messages"][0]["content"].startswith("the lighthouse keeper")
    assert max(len(piece) for piece in bench.body_slices("bb-07", size, 4096)) == 4096


@pytest.mark.parametrize(("start", "stop"), [(0, 10), (5, 200), (150, 99_000), (99_990, 100_003)])
def test_body_slices_cover_any_range(start: int, stop: int) -> None:
    whole = b"".join(bench.body_slices("bb-01", 100_003, 1 << 20))
    assert b"".join(bench.body_slices("bb-01", 100_003, 777, start=start, stop=stop)) == whole[start:stop]


def test_filler_is_one_text_at_any_offset() -> None:
    text = bench.filler(0, 1000)
    assert bench.filler(123, 456) == text[123:456]
    assert bench.filler(52, 52) == b""


def test_a_body_too_small_for_its_fields_is_refused() -> None:
    with pytest.raises(ValueError):
        bench.body_parts("bb-00", 20)


def test_holder_kinds() -> None:
    meant = 1000
    held = bench.Holder("a", sent_bytes=meant)
    assert held.kind(meant) == "held"
    assert bench.Holder("b", sent_bytes=10).kind(meant) == "stalled short"
    refused = bench.Holder("c", raw=b"HTTP/1.1 503 x\r\nRetry-After: 1\r\ncontent-length: 0\r\n\r\n")
    assert refused.kind(meant) == "503+retry-after"
    bare = bench.Holder("d", raw=b"HTTP/1.1 503 x\r\ncontent-length: 0\r\n\r\n")
    assert bare.kind(meant) == "status 503"  # a 503 without Retry-After does not count as refused right
    assert bench.Holder("e", error="ConnectionResetError").kind(meant) == "failed: ConnectionResetError"


def test_the_default_budget_admits_four_bodies() -> None:
    assert bench.max_admitted(bench.SETTINGS["body_budget_bytes"], bench.BODY_BYTES) == 4


def test_holding_backend_answers_hold_requests_only_once_released() -> None:
    backend = bench.HoldingBackend().start()
    url = f"{backend.base_url}/v1/chat/completions"

    async def scenario() -> tuple[int, bool, int]:
        async with httpx.AsyncClient(timeout=10) as client:
            fast = await client.post(url, json={"model": "fast", "user": "t-fast"})
            held = asyncio.ensure_future(client.post(url, json={"model": "hold", "user": "bb-held"}))
            deadline = asyncio.get_running_loop().time() + 5
            while "bb-held" not in backend.received:
                assert asyncio.get_running_loop().time() < deadline, "the backend never read the held request"
                await asyncio.sleep(0.01)
            answered_before_release = held.done()
            backend.release()
            return fast.status_code, answered_before_release, (await held).status_code

    try:
        fast, answered_before_release, held = asyncio.run(scenario())
    finally:
        backend.stop()
    assert fast == 200
    assert not answered_before_release
    assert held == 200
    assert backend.tags("bb-") == ["bb-held"]
