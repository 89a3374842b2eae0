"""benchmarks/harness: what the benchmarks share. The raw-answer readers and the verdict table
(verdicts.py), the fake backend (fake_backend.py), the proxy process's stated settings
(proxy_process.py) and where results go (results.py)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from harness.fake_backend import FakeBackend  # noqa: E402
from harness.proxy_process import ProxyProcess  # noqa: E402
from harness.results import add_json_option, write_json  # noqa: E402
from harness.verdicts import Row, answer_complete, header_value, percentile, sse_outcome, status_of  # noqa: E402


def _chat(tag: str, *, model: str = "fast", stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "user": tag, "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Say OK."}]}  # fmt: skip


def test_status_of_reads_the_status_line_only() -> None:
    assert status_of(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 2\r\n\r\n{}") == 408
    assert status_of(b"HTTP/1.0 503 Service Unavailable\r\n") == 503
    assert status_of(b"") is None
    assert status_of(b'{"status":"ok"}') is None  # the rest of an earlier answer is no status


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN


def test_sse_outcome() -> None:
    done = 'data: {"choices": []}\n\ndata: [DONE]\n\n'
    error = 'data: {"choices": []}\n\ndata: {"error": {"message": "shutting down"}}\n\n'
    assert sse_outcome(done) == "done"
    assert sse_outcome(error) == "error"
    assert sse_outcome('data: {"choices": []}\n\n') == "cut"
    assert sse_outcome("") == "cut"


def test_fake_backend_counts_deliveries_and_streams() -> None:
    """The fake backend the verdicts rely on: one delivery per request, complete SSE streams."""
    backend = FakeBackend().start()
    try:
        url = f"{backend.base_url}/v1/chat/completions"
        with httpx.Client(timeout=10) as client:
            plain = client.post(url, json=_chat("t-plain"))
            streamed = client.post(url, json=_chat("t-stream", stream=True, max_tokens=3))
            with pytest.raises(httpx.RemoteProtocolError):
                client.post(url, json=_chat("t-close", model="close-after-read"))
        assert plain.json()["choices"][0]["message"]["content"] == "ok t-plain"
        assert sse_outcome(streamed.text) == "done"
        assert streamed.text.count("chat.completion.chunk") == 3
        assert backend.tags("t-") == Counter({"t-plain": 1, "t-stream": 1, "t-close": 1})
        assert [d.nth_on_connection for d in backend.deliveries] == [1, 2, 3]  # one kept-alive connection
    finally:
        backend.stop()


def test_header_value_and_answer_complete_read_a_raw_answer() -> None:
    refused = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\ncontent-length: 2\r\n\r\n{}"
    assert header_value(refused, "retry-after") == "1"
    assert header_value(refused, "x-none") is None
    assert answer_complete(refused)
    assert not answer_complete(refused[:-1])
    assert not answer_complete(b"HTTP/1.1 200 OK\r\ncontent-length: 2")  # the head is not over
    assert not answer_complete(b"HTTP/1.1 200 OK\r\n\r\nabc")  # no Content-Length: never known whole


def test_rows_state_the_settings_but_never_the_backend_url(tmp_path: Path) -> None:
    proxy = ProxyProcess("t", "http://user:secret@127.0.0.1:1", tmp_path, slots=8, client_timeout_s=5)
    stated = proxy.stated()
    assert "slots=8" in stated and "client_timeout_s=5" in stated and "(others default)" in stated
    assert "secret" not in stated and "port=" not in stated
    row = Row("1a", "target", "measured", True, {}, stated)
    assert row.as_json()["settings"] == stated and row.as_json()["verdict"] == "PASS"


def test_results_default_to_the_temporary_directory_and_a_given_path_wins(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_json_option(parser, "probe")
    default = parser.parse_args([]).json
    assert default == Path(tempfile.gettempdir()) / "clairvoyant-bench" / "probe.json"
    assert not default.is_relative_to(BENCHMARKS.parent)  # never into the checkout
    given = tmp_path / "deep" / "here.json"
    assert parser.parse_args(["--json", str(given)]).json == given
    write_json(given, {"rps": 1.5, "when": Path("x")})
    assert json.loads(given.read_text()) == {"rps": 1.5, "when": "x"}
