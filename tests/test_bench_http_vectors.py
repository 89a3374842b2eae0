"""The conformance harness itself (benchmarks/harness/recording_backend.py, raw_client.py,
http_vectors.py, http11probe.py): the recorder splits what it receives into requests, the checks
catch what they are meant to catch, the suite port scores as the suite does, and a real server
(nginx) passes the Host and ``GET *`` vectors. tests/test_http_conformance.py runs the vectors
against the proxy."""

from __future__ import annotations

import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from harness import http11probe as probe  # noqa: E402
from harness import http_vectors as hv  # noqa: E402
from harness.raw_client import Exchange, Response, exchange, parse_responses  # noqa: E402
from harness.recording_backend import Received, RecordingBackend, framing_problems  # noqa: E402


@pytest.fixture(scope="module")
def backend() -> Iterator[RecordingBackend]:
    recorder = RecordingBackend().start()
    yield recorder
    recorder.stop()


def _send(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_recorder_keeps_a_request_hidden_in_a_body_as_a_request_of_its_own(backend: RecordingBackend) -> None:
    mark = backend.mark()
    _send(backend.port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello" + hv.SMUGGLED_GET)
    got = backend.wait_for(mark, 2, timeout_s=5)
    assert [(r.method, r.target, r.body) for r in got] == [("POST", "/", b"hello"), ("GET", hv.SMUGGLED, b"")]
    assert got[0].raw == b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    assert [r.nth_on_connection for r in got] == [1, 2] and got[0].connection == got[1].connection
    problems = hv.Backend(1, target="/").problems(got)
    assert any("smuggled" in p for p in problems) and any("got 2 requests" in p for p in problems)


def test_recorder_decodes_chunked_and_keeps_unframed_bytes(backend: RecordingBackend) -> None:
    mark = backend.mark()
    answer = _send(backend.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + hv.chunked(b"hello world", 5) + b"GARBAGE")  # fmt: skip
    got = backend.wait_for(mark, 2, timeout_s=5)
    assert (got[0].body, got[0].framing) == (b"hello world", "chunked")
    assert got[1].framing == "incomplete" and got[1].raw == b"GARBAGE"
    assert b"Transfer-Encoding: chunked\n" in answer  # /echo: the header lines as received


def test_framing_problems_name_what_a_proxy_must_not_forward() -> None:
    def received(head: bytes, body: bytes = b"", framing: str = "length") -> Received:
        lines = head.split(b"\r\n")[1:]
        headers = [(k.decode(), v.decode().strip()) for k, _, v in (ln.partition(b":") for ln in lines)]
        return Received(head + b"\r\n\r\n" + body, "POST", "/", "HTTP/1.1", headers, body, framing, 1, 1, 0.0)

    good = received(b"POST / HTTP/1.1\r\nHost: b\r\nContent-Length: 5", b"hello")
    assert framing_problems(good) == []
    assert framing_problems(received(b"POST / HTTP/1.1\r\nHost: b\r\nTransfer-Encoding: chunked", b"hello",
                                     "chunked")) == ["framing chunked", "Transfer-Encoding forwarded",
                                                     "Content-Length [] for a 5-byte body"]  # fmt: skip
    assert framing_problems(received(b"POST / HTTP/1.1\r\nHost: b\r\nExpect: 100-continue")) == ["Expect forwarded"]
    assert framing_problems(received(b"POST / HTTP/1.1\r\nHost: a\r\nHost: b")) == ["2 Host headers"]
    assert framing_problems(received(b"POST / HTTP/1.1\r\nHost: b\r\nX-A: 1\r\n folded"))[0].startswith("malformed")
    assert framing_problems(received(b"POST / HTTP/1.1\r\nHost: b\nX-A: 1")) == ["a bare CR or LF in the head"]


def test_parse_responses_reads_interim_chunked_and_close_delimited_answers() -> None:
    data = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 400 Bad\r\nConnection: close\r\n\r\ntail")  # fmt: skip
    got, used = parse_responses(data)
    assert [(r.status, r.body) for r in got] == [(100, b""), (200, b"abc")] and data[used:].startswith(b"HTTP/1.1 400")
    got, used = parse_responses(data, eof=True)
    assert [(r.status, r.body) for r in got] == [(100, b""), (200, b"abc"), (400, b"tail")] and used == len(data)
    assert parse_responses(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK", head=True)[0][0].body == b""
    assert [r.head_end for r in parse_responses(data)[0]] == [25, data.index(b"3\r\nabc")]


def _exchange(*statuses: int, closed: bool = False, headers: list[tuple[str, str]] | None = None) -> Exchange:
    responses = [Response(s, "", headers or [], b"", 0.1) for s in statuses]
    return Exchange(responses, closed, False, b"", 0.2, 1)


def test_client_checks_catch_what_they_are_meant_to() -> None:
    no_interim = hv.Client(frozenset({401}), interim=frozenset())
    assert no_interim.problems(_exchange(401)) == []
    assert no_interim.problems(_exchange(100, 401)) == ["interim [100] before the 401"]
    assert hv.Client(frozenset({200}), need_interim=100).problems(_exchange(200)) == ["no 100 before the 200"]
    assert hv.Client(frozenset({200}), must_close=True).problems(_exchange(200)) == ["connection left open"]
    assert hv.Client(frozenset({400}), closed_ok=True).problems(_exchange(closed=True)) == []
    assert hv.Client(frozenset({400})).problems(_exchange(closed=True)) == ["client got closed, expected 400"]
    scheduled = hv.Client(frozenset({200}), scheduled=True)
    assert scheduled.problems(_exchange(200)) == ["answered, but not scheduled"]
    assert scheduled.problems(_exchange(200), scheduler=False) == []
    assert scheduled.problems(_exchange(200, headers=[(hv.SCHEDULED_MARK, "0")])) == []
    late = Exchange([Response(204, "", [("allow", "GET")], b"", 3.5)], False, False, b"", 3.6, 1)
    assert hv.Client(frozenset({204}), headers=("allow",), within_s=3.0).problems(late) == ["answered after 3.5 s"]


def test_judge_takes_the_first_case_that_holds() -> None:
    vector = next(v for v in hv.VECTORS if v.name == "cl-te-both")
    body = hv.chat("framing")  # what the vector sends, chunked
    head = b"POST %s HTTP/1.1\r\nHost: b\r\nContent-Length: %d\r\n\r\n" % (hv.CHAT.encode(), len(body))
    delivered = [Received(head + body, "POST", hv.CHAT, "HTTP/1.1", [("Host", "b"), ("Content-Length", str(len(body)))],
                          body, "length", 1, 1, 0.0)]  # fmt: skip
    assert hv.judge(vector, _exchange(400, closed=True), []).ok
    assert not hv.judge(vector, _exchange(400, closed=True), delivered).ok  # refused, yet relayed
    served = hv.judge(vector, _exchange(200), delivered)  # served by Transfer-Encoding: must close, right body
    assert not served.ok and served.problems == ["connection left open"]
    assert hv.judge(vector, _exchange(200, closed=True), delivered).ok
    ceiling = next(v for v in hv.VECTORS if v.name == "options-asterisk")
    allow = [("allow", "OPTIONS, GET")]
    assert hv.judge(ceiling, _exchange(204, headers=allow), delivered * 5).ok
    assert not hv.judge(ceiling, _exchange(204, headers=allow), delivered * 6).ok
    forwarded = Received(b"OPTIONS * HTTP/1.1\r\nHost: b\r\n\r\n", "OPTIONS", "*", "HTTP/1.1", [("Host", "b")], b"",
                         "none", 1, 1, 0.0)  # fmt: skip
    assert hv.judge(ceiling, _exchange(204, headers=allow), [forwarded]).problems == ["OPTIONS * reached the backend"]


def test_probe_scoring_follows_the_suite() -> None:
    ok = probe.ProbeResponse(200, {"content-type": "text/plain"}, "OK", "HTTP/1.1 200 OK\r\n\r\nOK")
    bad = probe.ProbeResponse(400, {}, None, "HTTP/1.1 400 Bad Request\r\n\r\n")
    assert probe.EXACT_400(bad, probe.CLOSED) == probe.PASS
    assert probe.EXACT_400(None, probe.CLOSED) == probe.FAIL  # no AllowConnectionClose: a close is no 400
    assert probe.EXACT_400_OR_CLOSE(None, probe.TIMED_OUT) == probe.PASS  # as Evaluate: no answer passes
    assert probe.REJECT_OR_WARN(ok, probe.OPEN) == probe.WARN
    assert probe.REJECT_OR_WARN(None, probe.TIMED_OUT) == probe.FAIL
    assert probe.echo("hello")(ok, probe.OPEN) == probe.PASS  # the static OK
    assert probe.only_400_or_silence(None, probe.TIMED_OUT) == probe.PASS
    echoed = probe.ProbeResponse(200, {}, "Host: h\nContent-Length: 99\n", "")
    preserved = probe.ProbeResponse(200, {}, "Host: h\nContent_Length: 99\n", "")
    judge = probe.normalization("Content-Length", "Content_Length", "99")
    assert (judge(echoed, probe.OPEN), judge(preserved, probe.OPEN), judge(ok, probe.OPEN)) == (
        probe.FAIL, probe.WARN, probe.PASS)  # fmt: skip
    two = probe.Step(True, probe.parse_first(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n"))
    assert probe._no_second_answer([two]) == probe.FAIL
    assert probe._must_close_after([probe.Step(True, ok, probe.OPEN), probe.Step(True, ok)]) == probe.FAIL
    assert probe._must_close_after([probe.Step(True, ok, probe.CLOSED), probe.Step(False)]) == probe.PASS
    assert len(probe.cases("localhost:1")) == 159


def _nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


@pytest.mark.bench
@pytest.mark.skipif(_nginx_binary() is None, reason="nginx is not installed (make bench-tools)")
def test_nginx_passes_the_host_and_asterisk_vectors(backend: RecordingBackend) -> None:
    """The vectors are within reach of a real server: nginx passes the Host and ``GET *`` vectors,
    and the harness sees its pipelined and chunked requests framed."""
    from harness import servers
    from harness.proxy_process import free_port
    from harness.request_path import nginx_proxy_conf

    names = {"host-missing", "host-duplicate", "host-duplicate-same", "host-comma", "host-with-path", "host-empty",
             "get-asterisk", "pipelined-two", "chunked-upload", "cl-te-smuggled-get"}  # fmt: skip
    port = free_port()
    with servers.nginx(lambda prefix: nginx_proxy_conf(prefix, port, backend.base_url), port):
        failed = {
            v.name: hv.run_vector(v, port, backend, scheduler=False).problems for v in hv.VECTORS if v.name in names
        }
        plain = exchange(port, (b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",))
    assert {name: problems for name, problems in failed.items() if problems} == {}
    assert plain.finals[0].body == b"OK"
