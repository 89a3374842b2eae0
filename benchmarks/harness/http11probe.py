"""MDA2AV/Http11Probe's scored tests, ported: the same requests, read the way its client reads them,
judged by its rules, so that failure counts compare with the suite's own.

The suite (github.com/MDA2AV/Http11Probe, C#) sends each test's bytes on a fresh connection and
reads as ``RawTcpClient.ReadResponseAsync`` does: until the first ``\\r\\n\\r\\n`` (or a close, or
the read timeout, 5 s by default), then 100 ms more, then whatever is already readable; 50 ms later
it looks once more whether the server has closed. Only the first answer is parsed
(``ResponseParser``): its status, its headers and everything after the head as the body. A sequence
test does that once per step on one connection; a step after a close is "not executed". A test's
verdict is Pass, Warn or Fail (Error when the request could not be sent); the score counts Pass and
Fail over the scored tests (``Scored`` true), Warn apart.

Scoring rules ported: ``ExpectedBehavior.Evaluate`` (a custom validator first; with
``AllowConnectionClose`` no answer passes whether the connection closed or timed out; otherwise the
status must be in the expected range) and each test's own validator.

Ported: the scored tests of ComplianceSuite (65), SmugglingSuite (50 single-request and 17
sequence tests), MalformedInputSuite (23) and NormalizationSuite (4) -- 159 tests. Payloads and
validators follow the suite's source (Compliance, Smuggling, Normalization: the stored version of
each suite file; MalformedInput: its 18 tests in the source, plus MAL-CL-EMPTY, MAL-URL-OVERLONG-UTF8,
MAL-POST-CL-HUGE-NO-BODY, MAL-URL-PERCENT-NULL, MAL-URL-PERCENT-CRLF and MAL-CHUNK-EXT-64K from their
documentation pages: request and expected outcome as documented). Differences:

- MAL-BINARY-GARBAGE sends 256 bytes of Python's ``random.Random(42)``, not .NET's ``Random(42)``
  (the bytes differ; any garbage passes the same way).
- MAL-CHUNK-EXTENSION-LONG (100 KB) is not ported: the suite replaced it by MAL-CHUNK-EXT-64K.
- The behavioural notes (which framing a server used) are not ported: they never change a verdict.

Not ported: the unscored tests (they never count: COMP-ABSOLUTE-FORM, COMP-GET-WITH-CL-BODY,
COMP-METHOD-TRACE, COMP-HTTP10-NO-HOST, COMP-HTTP12-VERSION, COMP-TRACE-WITH-BODY, COMP-DATE-FORMAT,
COMP-TRACE-SENSITIVE, COMP-RANGE-INVALID, COMP-ACCEPT-NONSENSE, COMP-POST-UNSUPPORTED-CT, the
SMUG-TRAILER-*, SMUG-CL-COMMA-SAME/-TRIPLE, SMUG-TRANSFER_ENCODING, SMUG-CHUNKED-WITH-PARAMS,
SMUG-EXPECT-100-CL(-DESYNC), SMUG-HEAD/OPTIONS-CL-BODY(-DESYNC), SMUG-TE-TAB-BEFORE-VALUE,
SMUG-ABSOLUTE-URI-HOST-MISMATCH, SMUG-GET-CL-*, SMUG-CL0-BODY-POISON, SMUG-PIPELINE-SAFE,
MAL-CL-TAB-BEFORE-VALUE, MAL-RANGE-OVERLAPPING, MAL-URL-BACKSLASH, NORM-CASE-TE), the Cookie and
Capabilities suites (not scored, or not run by the suite's command line), and the few Compliance
tests the suite's documentation lists (76 in all) that are not in the stored source.

The backend behind the server under test answers ``OK`` to the suite's ``/`` requests (what the
suite calls a static response: its echo tests accept it) and echoes the request's header lines on
``/echo`` (the Normalization tests read them): ``recording_backend.RecordingBackend``.
"""

from __future__ import annotations

import random
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PASS, WARN, FAIL, ERROR = "pass", "warn", "fail", "error"
OPEN, CLOSED, TIMED_OUT = "open", "closed", "timed_out"


@dataclass
class ProbeResponse:
    """The first answer, as the suite's ResponseParser reads it."""

    status: int
    headers: dict[str, str]  # names lower-cased; a repeated header's values joined with ", "
    body: str | None  # everything after the first head (up to 4,096 characters), None if nothing
    raw: str

    def has(self, name: str) -> bool:
        return name.lower() in self.headers


@dataclass
class Step:
    executed: bool
    response: ProbeResponse | None = None
    state: str = OPEN


Single = Callable[[ProbeResponse | None, str], str]
Sequence = Callable[[list[Step]], str]


@dataclass(frozen=True)
class ProbeCase:
    id: str
    category: str  # Compliance, Smuggling, MalformedInput, Normalization
    steps: tuple[bytes, ...]  # one payload, or one per step of a sequence test
    judge: Single | Sequence
    sequence: bool = False


@dataclass
class ProbeResult:
    case: ProbeCase
    verdict: str
    got: str  # the first answer's status, or the connection's state
    seconds: float


# --------------------------------------------------------------------------------------------
# The suite's client
# --------------------------------------------------------------------------------------------


def parse_first(data: bytes) -> ProbeResponse | None:
    if not data:
        return None
    text = data.decode("latin-1")
    line_end = text.find("\n")
    if line_end < 0:
        return None
    words = text[:line_end].rstrip("\r").split(" ", 2)
    if len(words) < 2:
        return None
    try:
        status = int(words[1])
    except ValueError:
        return None
    headers: dict[str, str] = {}
    for line in text[line_end + 1 :].split("\n"):
        line = line.rstrip("\r")
        if not line:
            break
        name, colon, value = line.partition(":")
        if colon and name.strip():
            key = name.strip().lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    head_end = text.find("\r\n\r\n")
    body = text[head_end + 4 : head_end + 4 + 4096] if 0 <= head_end < len(text) - 4 else None
    return ProbeResponse(status, headers, body or None, text[:8192])


class _Client:
    def __init__(self, port: int, timeout_s: float) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout_s = timeout_s

    def send(self, payload: bytes) -> None:
        self.sock.settimeout(self.timeout_s)
        self.sock.sendall(payload)

    def read_response(self) -> tuple[bytes, str]:
        """``ReadResponseAsync``: the head (or a close / the timeout), then 100 ms, then a drain."""
        data = b""
        deadline = time.monotonic() + self.timeout_s
        try:
            while b"\r\n\r\n" not in data:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([self.sock], [], [], remaining)[0]:
                    return data, TIMED_OUT
                chunk = self.sock.recv(131072)
                if not chunk:
                    return data, CLOSED
                data += chunk
            time.sleep(0.1)
            while select.select([self.sock], [], [], 0)[0]:
                chunk = self.sock.recv(131072)
                if not chunk:
                    break
                data += chunk
        except OSError:
            return data, CLOSED
        return data, OPEN

    def check_state(self) -> str:
        """``CheckConnectionState``: readable and a peek reads nothing = closed."""
        try:
            if select.select([self.sock], [], [], 0)[0]:
                return CLOSED if not self.sock.recv(1, socket.MSG_PEEK) else OPEN
        except OSError:
            return CLOSED
        return OPEN

    def read_step(self) -> tuple[ProbeResponse | None, str]:
        data, state = self.read_response()
        if state == OPEN:
            time.sleep(0.05)
            state = self.check_state()
        return parse_first(data), state

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def run_case(case: ProbeCase, port: int, timeout_s: float = 5.0) -> ProbeResult:
    started = time.monotonic()
    try:
        client = _Client(port, timeout_s)
    except OSError as exc:
        return ProbeResult(case, ERROR, f"connect: {exc}", time.monotonic() - started)
    try:
        if not case.sequence:
            try:
                client.send(case.steps[0])
            except OSError as exc:  # the suite's runner: an exception is an Error verdict
                return ProbeResult(case, ERROR, f"send: {type(exc).__name__}", time.monotonic() - started)
            response, state = client.read_step()
            verdict = case.judge(response, state)  # type: ignore[call-arg]
            got = str(response.status) if response else state
            return ProbeResult(case, verdict, got + ("+close" if response and state == CLOSED else ""),
                               time.monotonic() - started)  # fmt: skip
        steps: list[Step] = []
        state = OPEN
        for payload in case.steps:
            if state != OPEN:
                steps.append(Step(False, state=state))
                continue
            try:
                client.send(payload)
            except OSError:
                steps.append(Step(True, state=CLOSED))
                state = CLOSED
                continue
            response, state = client.read_step()
            steps.append(Step(True, response, state))
        verdict = case.judge(steps)  # type: ignore[call-arg,arg-type]
        got = "/".join((str(s.response.status) if s.response else s.state) if s.executed else "-" for s in steps)
        return ProbeResult(case, verdict, got, time.monotonic() - started)
    finally:
        client.close()


@dataclass
class Score:
    passed: int = 0
    warned: int = 0
    failed: int = 0
    errors: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, result: ProbeResult) -> None:
        if result.verdict == PASS:
            self.passed += 1
        elif result.verdict == WARN:
            self.warned += 1
        elif result.verdict == FAIL:
            self.failed += 1
            self.failures.append(result.case.id)
        else:
            self.errors += 1


# --------------------------------------------------------------------------------------------
# Validators (the suite's ExpectedBehavior and the custom validators it repeats)
# --------------------------------------------------------------------------------------------


def expect(statuses: set[int] | range, *, allow_close: bool = False) -> Single:
    """``ExpectedBehavior { ExpectedStatus, AllowConnectionClose }.Evaluate``."""

    def judge(r: ProbeResponse | None, state: str) -> str:
        if r is None:
            return PASS if allow_close else FAIL
        return PASS if r.status in statuses else FAIL

    return judge


OK2XX = range(200, 300)
EXACT_400 = expect({400})
EXACT_400_OR_CLOSE = expect({400}, allow_close=True)


def pass_or_warn_2xx(passing: set[int] = frozenset({400})) -> Single:  # type: ignore[assignment]
    """No answer: pass if closed; a status in ``passing``: pass; 2xx: warn; else fail."""

    def judge(r: ProbeResponse | None, state: str) -> str:
        if r is None:
            return PASS if state == CLOSED else FAIL
        if r.status in passing:
            return PASS
        return WARN if 200 <= r.status < 300 else FAIL

    return judge


REJECT_OR_WARN = pass_or_warn_2xx()


def statuses_or_close(passing: set[int]) -> Single:
    def judge(r: ProbeResponse | None, state: str) -> str:
        if r is None:
            return PASS if state == CLOSED else FAIL
        return PASS if r.status in passing else FAIL

    return judge


def reject_or_close_after_2xx(passing: set[int]) -> Single:
    """SMUG-TE-TRAILING-SPACE, SMUG-TE-OBS-FOLD: a 2xx is a warning only if the connection then closed."""

    def judge(r: ProbeResponse | None, state: str) -> str:
        if r is None:
            return PASS if state == CLOSED else FAIL
        if r.status in passing:
            return PASS
        if 200 <= r.status < 300:
            return WARN if state == CLOSED else FAIL
        return FAIL

    return judge


def only_400_or_silence(r: ProbeResponse | None, state: str) -> str:
    """An incomplete request: an answer must be 400; no answer (close or timeout) passes."""
    if r is not None:
        return PASS if r.status == 400 else FAIL
    return PASS if state in (TIMED_OUT, CLOSED) else FAIL


def silence_or(passing: set[int]) -> Single:
    """Garbage: a close or a timeout passes whatever came; else the answer must be in ``passing``."""

    def judge(r: ProbeResponse | None, state: str) -> str:
        if state in (TIMED_OUT, CLOSED):
            return PASS
        return PASS if r is not None and r.status in passing else FAIL

    return judge


def not_101(r: ProbeResponse | None, state: str) -> str:
    if r is None:
        return PASS if state == CLOSED else FAIL
    return FAIL if r.status == 101 else PASS


def effective_body(r: ProbeResponse) -> str:
    raw = r.body or ""
    if "chunked" in r.headers.get("transfer-encoding", "").lower():
        out, pos = "", 0
        while pos < len(raw):
            eol = raw.find("\r\n", pos)
            if eol < 0:
                return raw.rstrip("\r\n")
            try:
                size = int(raw[pos:eol].split(";", 1)[0].strip(), 16)
            except ValueError:
                return raw.rstrip("\r\n")
            if size == 0:
                return out
            out += raw[eol + 2 : eol + 2 + size]
            pos = eol + 2 + size
            pos += 2 if raw[pos : pos + 2] == "\r\n" else 1
        return out
    return raw.rstrip("\r\n")


def echo(expected: str) -> Single:
    """``EchoValidator``: a 2xx echoing the body, or the static ``OK``."""

    def judge(r: ProbeResponse | None, state: str) -> str:
        if r is None or not 200 <= r.status < 300:
            return FAIL
        return PASS if effective_body(r) in (expected, "OK") else FAIL

    return judge


def _chunked_extension(r: ProbeResponse | None, state: str) -> str:
    if r is None:
        return WARN if state == CLOSED else FAIL
    if r.status == 400:
        return WARN
    if 200 <= r.status < 300:
        return PASS if effective_body(r) in ("hello", "OK") else FAIL
    return FAIL


def _upgrade_invalid_version(r: ProbeResponse | None, state: str) -> str:
    if r is None:
        return PASS if state == CLOSED else FAIL
    if r.status == 101:
        return FAIL
    if r.status == 426:
        return PASS
    return WARN if 200 <= r.status < 300 else PASS


def _connection_close(warn_if_open: bool) -> Single:
    def judge(r: ProbeResponse | None, state: str) -> str:
        if r is None or not 200 <= r.status < 300:
            return FAIL
        return PASS if state == CLOSED else (WARN if warn_if_open else FAIL)

    return judge


def _range_post(r: ProbeResponse | None, state: str) -> str:
    return PASS if r is not None and r.status != 206 and 200 <= r.status < 300 else FAIL


def _head_no_body(r: ProbeResponse | None, state: str) -> str:
    return PASS if r is not None and 200 <= r.status < 300 and not r.body else FAIL


def _allow_on_405(r: ProbeResponse | None, state: str) -> str:
    if r is None:
        return FAIL
    if r.status == 405:
        return PASS if r.has("allow") else FAIL
    return WARN


def _header_on_2xx(name: str, missing: str) -> Single:
    def judge(r: ProbeResponse | None, state: str) -> str:
        if r is None or not 200 <= r.status < 300:
            return FAIL
        return PASS if r.has(name) else missing

    return judge


def _no_1xx(r: ProbeResponse | None, state: str) -> str:
    if r is None:
        return PASS if state in (CLOSED, TIMED_OUT) else FAIL
    return FAIL if 100 <= r.status < 200 else PASS


def _no_cl_in_204(r: ProbeResponse | None, state: str) -> str:
    if r is None:
        return FAIL
    if r.status == 204:
        return FAIL if r.has("content-length") else PASS
    return WARN


def _long_url_ok(r: ProbeResponse | None, state: str) -> str:
    if r is None:
        return WARN if state == CLOSED else FAIL
    return FAIL if r.status == 414 else PASS


def _expect_unknown(r: ProbeResponse | None, state: str) -> str:
    if r is None:
        return PASS if state == CLOSED else FAIL
    if r.status == 417:
        return PASS
    return WARN if 200 <= r.status < 300 else FAIL


def _pipeline_conflict(r: ProbeResponse | None, state: str) -> str:
    """SMUG-CLTE-PIPELINE / SMUG-TECL-PIPELINE: 400 or a close; a 2xx warns."""
    if r is not None and r.status == 400:
        return PASS
    if state == CLOSED:
        return PASS
    return WARN if r is not None and 200 <= r.status < 300 else FAIL


def _percent_encoded(r: ProbeResponse | None, state: str) -> str:
    """MAL-URL-PERCENT-NULL / -CRLF (as documented): 400 passes; 2xx or 404 warns."""
    if r is None:
        return PASS if state == CLOSED else FAIL
    if r.status == 400:
        return PASS
    return WARN if 200 <= r.status < 300 or r.status == 404 else FAIL


def _huge_no_body(r: ProbeResponse | None, state: str) -> str:
    """MAL-POST-CL-HUGE-NO-BODY (as documented): 400, 413, a close or the timeout."""
    if r is not None:
        return PASS if r.status in (400, 413) else FAIL
    return PASS


def _echo_headers(r: ProbeResponse) -> list[tuple[str, str]]:
    out = []
    for line in (r.body or "").split("\n"):
        name, colon, value = line.partition(":")
        if colon and name:
            out.append((name, value.lstrip().rstrip("\r")))
    return out


def normalization(standard: str, malformed: str, probe: str) -> Single:
    """NormalizationSuite ``MakeValidator``: rejected or dropped passes, passed on under the standard
    name fails, passed on as sent warns."""

    def judge(r: ProbeResponse | None, state: str) -> str:
        if r is None:
            return PASS if state == CLOSED else FAIL
        if r.status >= 400:
            return PASS
        if not 200 <= r.status < 300:
            return FAIL
        body = r.body or ""
        if not body.strip() or ":" not in body:
            return PASS
        headers = _echo_headers(r)
        for name, value in headers:
            if (
                value.lower() == probe.lower()
                and name.lower() == standard.lower()
                and name.lower() != malformed.lower()
            ):
                return FAIL
        for name, value in headers:
            if value.lower() == probe.lower() and name.lower() == malformed.lower():
                return WARN
        return PASS

    return judge


# -- sequence validators ---------------------------------------------------------------------------


def _must_close_after(steps: list[Step]) -> str:
    """CONN-CLOSE / DESYNC / OPTIONS-TE-OBS-FOLD / INVALID-SIZE-DESYNC: 400, or a close, or a 2xx
    after which the follow-up was never sent."""
    first, second = steps[0], steps[1]
    if first.response is not None and first.response.status == 400:
        return PASS
    if not first.executed or first.state == CLOSED:
        return PASS
    if first.response is not None and 200 <= first.response.status < 300:
        return PASS if not second.executed else FAIL
    return FAIL


def _status_lines(raw: str) -> int:
    count, idx = 0, 0
    while (idx := raw.find("HTTP/", idx)) >= 0:
        chunk = raw[idx : idx + 12]
        if len(chunk) == 12 and chunk[5].isdigit() and chunk[6] == "." and chunk[7].isdigit() and chunk[8] == " " \
                and chunk[9:12].isdigit():  # fmt: skip
            count += 1
        idx += 5
    return count


def _no_second_answer(steps: list[Step]) -> str:
    """SMUGGLED-GET family: two status lines in one read fail; 400 or a close pass."""
    first = steps[0]
    if _status_lines(first.response.raw if first.response else "") >= 2:
        return FAIL
    if first.response is not None and first.response.status == 400:
        return PASS
    if not first.executed or first.state == CLOSED:
        return PASS
    return FAIL


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------


def cases(host: str) -> list[ProbeCase]:
    """The ported scored tests; ``host`` is the Host header value (the suite's ``host:port``)."""
    h = host

    def req(text: str) -> bytes:
        return text.replace("{H}", h).encode("latin-1")

    def c(id: str, payload: str | bytes, judge: Single, category: str = "Compliance") -> ProbeCase:
        raw = payload if isinstance(payload, bytes) else req(payload)
        return ProbeCase(id, category, (raw,), judge)

    def s(id: str, payload: str | bytes, judge: Single) -> ProbeCase:
        return c(id, payload, judge, "Smuggling")

    def m(id: str, payload: str | bytes, judge: Single) -> ProbeCase:
        return c(id, payload, judge, "MalformedInput")

    def seq(id: str, *steps: str, judge: Sequence = _must_close_after) -> ProbeCase:
        return ProbeCase(id, "Smuggling", tuple(req(t) for t in steps), judge, sequence=True)

    get = "GET / HTTP/1.1\r\nHost: {H}\r\n\r\n"
    post = "POST / HTTP/1.1\r\nHost: {H}\r\n"
    te_hello = post + "Transfer-Encoding: chunked\r\n\r\n"
    ws = "Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    chunked_body = "D\r\nhello-bananas\r\n0\r\n\r\n"
    smuggled = "GET / HTTP/1.1\r\nHost: {H}\r\n\r\n"
    embedded = "0\r\n\r\n" + smuggled
    emb_len = len(req(embedded))
    tecl_smuggled = "GET / HTTP/1.1\r\nHost: {H}\r\nContent-Length: 7\r\n\r\n"
    tecl_hex = f"{len(req(tecl_smuggled)):x}"
    garbage = bytes(random.Random(42).getrandbits(8) for _ in range(256))
    compliance = [
        c("COMP-BASELINE", get, expect(OK2XX)),
        c("RFC9112-2.2-BARE-LF-REQUEST-LINE", "GET / HTTP/1.1\nHost: {H}\r\n\r\n", REJECT_OR_WARN),
        c("RFC9112-2.2-BARE-LF-HEADER", "GET / HTTP/1.1\r\nHost: {H}\nX-Test: value\r\n\r\n", REJECT_OR_WARN),
        c("RFC9112-5.1-OBS-FOLD", "GET / HTTP/1.1\r\nHost: {H}\r\nX-Test: value\r\n continued\r\n\r\n", EXACT_400),
        c("RFC9110-5.6.2-SP-BEFORE-COLON", "GET / HTTP/1.1\r\nHost: {H}\r\nX-Test : value\r\n\r\n", EXACT_400),
        c("RFC9112-3-MULTI-SP-REQUEST-LINE", "GET  / HTTP/1.1\r\nHost: {H}\r\n\r\n", REJECT_OR_WARN),
        c("RFC9112-7.1-MISSING-HOST", "GET / HTTP/1.1\r\n\r\n", EXACT_400),
        c("RFC9112-2.3-INVALID-VERSION", "GET / HTTP/9.9\r\nHost: {H}\r\n\r\n", statuses_or_close({400, 505})),
        c("RFC9112-5-EMPTY-HEADER-NAME", "GET / HTTP/1.1\r\nHost: {H}\r\n: empty-name\r\n\r\n", EXACT_400_OR_CLOSE),
        c("RFC9112-3-CR-ONLY-LINE-ENDING", "GET / HTTP/1.1\rHost: {H}\r\n\r\n", EXACT_400),
        c("RFC9112-3-MISSING-TARGET", "GET HTTP/1.1\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        c("RFC9112-3.2-FRAGMENT-IN-TARGET", "GET /path#frag HTTP/1.1\r\nHost: {H}\r\n\r\n", REJECT_OR_WARN),
        c("RFC9112-2.3-HTTP09-REQUEST", "GET /\r\n", only_400_or_silence),
        c("RFC9112-5-INVALID-HEADER-NAME", "GET / HTTP/1.1\r\nHost: {H}\r\nBad[Name: value\r\n\r\n", EXACT_400_OR_CLOSE),
        c("RFC9112-5-HEADER-NO-COLON", "GET / HTTP/1.1\r\nHost: {H}\r\nNoColonHere\r\n\r\n", EXACT_400_OR_CLOSE),
        c("RFC9110-5.4-DUPLICATE-HOST", "GET / HTTP/1.1\r\nHost: {H}\r\nHost: other.example.com\r\n\r\n", EXACT_400),
        c("RFC9112-6.1-CL-NON-NUMERIC", post + "Content-Length: abc\r\n\r\n", EXACT_400_OR_CLOSE),
        c("RFC9112-6.1-CL-PLUS-SIGN", post + "Content-Length: +5\r\n\r\nhello", EXACT_400_OR_CLOSE),
        c("COMP-WHITESPACE-BEFORE-HEADERS", "GET / HTTP/1.1\r\n \r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-DUPLICATE-HOST-SAME", "GET / HTTP/1.1\r\nHost: {H}\r\nHost: {H}\r\n\r\n", EXACT_400),
        c("COMP-HOST-WITH-USERINFO", "GET / HTTP/1.1\r\nHost: user@{H}\r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-HOST-WITH-PATH", "GET / HTTP/1.1\r\nHost: {H}/path\r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-ASTERISK-WITH-GET", "GET * HTTP/1.1\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-OPTIONS-STAR", "OPTIONS * HTTP/1.1\r\nHost: {H}\r\n\r\n", expect(OK2XX)),
        c("COMP-UNKNOWN-TE-501", post + "Transfer-Encoding: gzip\r\n\r\n", statuses_or_close({400, 501})),
        c("COMP-LEADING-CRLF", "\r\n\r\nGET / HTTP/1.1\r\nHost: {H}\r\n\r\n", REJECT_OR_WARN),
        c("COMP-METHOD-CASE", "get / HTTP/1.1\r\nHost: {H}\r\n\r\n", pass_or_warn_2xx({400, 405, 501})),
        c("COMP-POST-CL-BODY", post + "Content-Length: 5\r\n\r\nhello", echo("hello")),
        c("COMP-POST-CL-ZERO", post + "Content-Length: 0\r\n\r\n", expect(OK2XX, allow_close=True)),
        c("COMP-POST-NO-CL-NO-TE", post + "\r\n", expect(OK2XX, allow_close=True)),
        c("COMP-POST-CL-UNDERSEND", post + "Content-Length: 10\r\n\r\nhello", only_400_or_silence),
        c("COMP-CHUNKED-BODY", te_hello + "5\r\nhello\r\n0\r\n\r\n", echo("hello")),
        c("COMP-CHUNKED-MULTI", te_hello + "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", echo("hello world")),
        c("COMP-CHUNKED-EMPTY", te_hello + "0\r\n\r\n", expect(OK2XX, allow_close=True)),
        c("COMP-CHUNKED-NO-FINAL", te_hello + "5\r\nhello\r\n", only_400_or_silence),
        c("COMP-UPGRADE-POST", post + "Connection: Upgrade\r\n" + ws + "Sec-WebSocket-Version: 13\r\n\r\n", not_101),
        c("COMP-UPGRADE-MISSING-CONN", "GET / HTTP/1.1\r\nHost: {H}\r\n" + ws + "Sec-WebSocket-Version: 13\r\n\r\n", not_101),
        c("COMP-UPGRADE-UNKNOWN", "GET / HTTP/1.1\r\nHost: {H}\r\nConnection: Upgrade\r\nUpgrade: totally-made-up/1.0\r\n\r\n", not_101),
        c("COMP-METHOD-CONNECT", "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", statuses_or_close({400, 405, 501})),
        c("COMP-EXPECT-UNKNOWN", "GET / HTTP/1.1\r\nHost: {H}\r\nExpect: 200-ok\r\n\r\n", _expect_unknown),
        c("COMP-CHUNKED-EXTENSION", te_hello + "5;ext=value\r\nhello\r\n0\r\n\r\n", _chunked_extension),
        c("COMP-UPGRADE-INVALID-VER", "GET / HTTP/1.1\r\nHost: {H}\r\nConnection: Upgrade\r\n" + ws + "Sec-WebSocket-Version: 99\r\n\r\n", _upgrade_invalid_version),
        c("COMP-HOST-EMPTY-VALUE", "GET / HTTP/1.1\r\nHost: \r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-REQUEST-LINE-TAB", "GET\t/ HTTP/1.1\r\nHost: {H}\r\n\r\n", REJECT_OR_WARN),
        c("COMP-VERSION-MISSING-MINOR", "GET / HTTP/1\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-VERSION-LEADING-ZEROS", "GET / HTTP/01.01\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-VERSION-WHITESPACE", "GET / HTTP/ 1.1\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-CONNECTION-CLOSE", "GET / HTTP/1.1\r\nHost: {H}\r\nConnection: close\r\n\r\n", _connection_close(False)),
        c("COMP-HTTP10-DEFAULT-CLOSE", "GET / HTTP/1.0\r\nHost: {H}\r\n\r\n", _connection_close(True)),
        c("COMP-CHUNKED-TRAILER-VALID", te_hello + "5\r\nhello\r\n0\r\nX-Checksum: abc\r\n\r\n", echo("hello")),
        c("COMP-CHUNKED-HEX-UPPERCASE", te_hello + "A\r\nhelloworld\r\n0\r\n\r\n", echo("helloworld")),
        c("COMP-RANGE-POST", post + "Content-Length: 5\r\nRange: bytes=0-10\r\n\r\nhello", _range_post),
        c("COMP-UPGRADE-HTTP10", "GET / HTTP/1.0\r\nHost: {H}\r\nConnection: Upgrade\r\n" + ws + "Sec-WebSocket-Version: 13\r\n\r\n", not_101),
        c("COMP-HEAD-NO-BODY", "HEAD / HTTP/1.1\r\nHost: {H}\r\n\r\n", _head_no_body),
        c("COMP-UNKNOWN-METHOD", "FOOBAR / HTTP/1.1\r\nHost: {H}\r\n\r\n", pass_or_warn_2xx({501, 405, 400})),
        c("COMP-405-ALLOW", "DELETE / HTTP/1.1\r\nHost: {H}\r\n\r\n", _allow_on_405),
        c("COMP-DATE-HEADER", get, _header_on_2xx("date", FAIL)),
        c("COMP-NO-1XX-HTTP10", "POST / HTTP/1.0\r\nHost: {H}\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello", _no_1xx),
        c("COMP-NO-CL-IN-204", "OPTIONS / HTTP/1.1\r\nHost: {H}\r\n\r\n", _no_cl_in_204),
        c("COMP-OPTIONS-ALLOW", "OPTIONS / HTTP/1.1\r\nHost: {H}\r\n\r\n", _header_on_2xx("allow", WARN)),
        c("COMP-CONTENT-TYPE", get, _header_on_2xx("content-type", WARN)),
        c("COMP-VERSION-CASE", "GET / http/1.1\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-LONG-URL-OK", "GET /" + "a" * 7900 + " HTTP/1.1\r\nHost: {H}\r\n\r\n", _long_url_ok),
        c("COMP-SPACE-IN-TARGET", "GET /pa th HTTP/1.1\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        c("COMP-DUPLICATE-CT", post + "Content-Length: 5\r\nContent-Type: text/plain\r\nContent-Type: text/html\r\n\r\nhello", REJECT_OR_WARN),
    ]  # fmt: skip
    te_cl5 = "Content-Length: 5\r\n\r\nhello"
    smuggling = [
        s("SMUG-CL-TE-BOTH", post + f"Content-Length: {len(chunked_body)}\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked_body, REJECT_OR_WARN),
        s("SMUG-DUPLICATE-CL", post + "Content-Length: 5\r\nContent-Length: 10\r\n\r\nhelloworld", EXACT_400_OR_CLOSE),
        s("SMUG-CL-LEADING-ZEROS", post + "Content-Length: 005\r\n\r\nhello", REJECT_OR_WARN),
        s("SMUG-TE-XCHUNKED", post + "Transfer-Encoding: xchunked\r\n" + te_cl5, statuses_or_close({400, 501})),
        s("SMUG-TE-TRAILING-SPACE", post + "Transfer-Encoding: chunked \r\n" + te_cl5, reject_or_close_after_2xx({400, 501})),
        s("SMUG-TE-SP-BEFORE-COLON", post + "Transfer-Encoding : chunked\r\n" + te_cl5, EXACT_400_OR_CLOSE),
        s("SMUG-CL-NEGATIVE", post + "Content-Length: -1\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CLTE-PIPELINE", post + "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", _pipeline_conflict),
        s("SMUG-TECL-PIPELINE", post + "Transfer-Encoding: chunked\r\nContent-Length: 30\r\n\r\n0\r\n\r\n", _pipeline_conflict),
        s("SMUG-CL-TRAILING-SPACE", post + "Content-Length: 5 \r\n\r\nhello", REJECT_OR_WARN),
        s("SMUG-TE-DOUBLE-CHUNKED", post + "Transfer-Encoding: chunked, chunked\r\n" + te_cl5, REJECT_OR_WARN),
        s("SMUG-CL-EXTRA-LEADING-SP", post + "Content-Length:  5\r\n\r\nhello", REJECT_OR_WARN),
        s("SMUG-TE-CASE-MISMATCH", post + "Transfer-Encoding: Chunked\r\n" + te_cl5, REJECT_OR_WARN),
        s("SMUG-CL-COMMA-DIFFERENT", post + "Content-Length: 5, 10\r\n\r\nhello", EXACT_400_OR_CLOSE),
        s("SMUG-TE-NOT-FINAL-CHUNKED", post + "Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-TE-HTTP10", "POST / HTTP/1.0\r\nHost: {H}\r\nTransfer-Encoding: chunked\r\n" + te_cl5, EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-BARE-SEMICOLON", te_hello + "5;\r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-EXT-INVALID-TOKEN", te_hello + "5;bad[=x\r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-BARE-CR-HEADER-VALUE", post + "Content-Length: 5\r\nX-Test: val\rue\r\n\r\nhello", EXACT_400_OR_CLOSE),
        s("SMUG-CL-OCTAL", post + "Content-Length: 0o5\r\n\r\nhello", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-UNDERSCORE", te_hello + "1_0\r\nhello world!!!!!\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-TE-EMPTY-VALUE", post + "Transfer-Encoding: \r\n" + te_cl5, EXACT_400_OR_CLOSE),
        s("SMUG-TE-LEADING-COMMA", post + "Transfer-Encoding: , chunked\r\n" + te_cl5, REJECT_OR_WARN),
        s("SMUG-TE-DUPLICATE-HEADERS", post + "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n" + te_cl5, EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-HEX-PREFIX", te_hello + "0x5\r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-SIZE-PLUS", te_hello + "+5\r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-SIZE-TRAILING-OWS", te_hello + "5 \r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CL-HEX-PREFIX", post + "Content-Length: 0x5\r\n\r\nhello", EXACT_400_OR_CLOSE),
        s("SMUG-CL-INTERNAL-SPACE", post + "Content-Length: 1 0\r\n\r\nhello12345", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-LEADING-SP", te_hello + " 5\r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-MISSING-TRAILING-CRLF", te_hello + "5\r\nhello0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-EXT-LF", te_hello + "5;\nhello\r\n0\r\n\r\n", REJECT_OR_WARN),
        s("SMUG-CHUNK-SPILL", te_hello + "5\r\nhello!!\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-LF-TERM", te_hello + "5\r\nhello\n0\r\n\r\n", REJECT_OR_WARN),
        s("SMUG-CHUNK-EXT-CTRL", te_hello + "5;\x00ext\r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-EXT-CR", te_hello + "5;a\rX\r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-TE-VTAB", post + "Transfer-Encoding: \x0bchunked\r\n" + te_cl5, EXACT_400_OR_CLOSE),
        s("SMUG-TE-FORMFEED", post + "Transfer-Encoding: \x0cchunked\r\n" + te_cl5, EXACT_400_OR_CLOSE),
        s("SMUG-TE-NULL", post + "Transfer-Encoding: chunked\x00\r\n" + te_cl5, EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-LF-TRAILER", te_hello + "5\r\nhello\r\n0\r\n\n", REJECT_OR_WARN),
        s("SMUG-TE-IDENTITY", post + "Transfer-Encoding: identity\r\n" + te_cl5, statuses_or_close({400, 501})),
        s("SMUG-CHUNK-NEGATIVE", te_hello + "-1\r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CL-UNDERSCORE", post + "Content-Length: 1_0\r\n\r\nhelloworld", EXACT_400_OR_CLOSE),
        s("SMUG-CL-NEGATIVE-ZERO", post + "Content-Length: -0\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CL-DOUBLE-ZERO", post + "Content-Length: 00\r\n\r\n", REJECT_OR_WARN),
        s("SMUG-CL-LEADING-ZEROS-OCTAL", post + "Content-Length: 0200\r\n\r\n" + "A" * 200, REJECT_OR_WARN),
        s("SMUG-TE-OBS-FOLD", post + "Transfer-Encoding:\r\n chunked\r\n" + te_cl5, reject_or_close_after_2xx({400})),
        s("SMUG-TE-TRAILING-COMMA", post + "Transfer-Encoding: chunked,\r\n" + te_cl5, REJECT_OR_WARN),
        s("SMUG-MULTIPLE-HOST-COMMA", "GET / HTTP/1.1\r\nHost: {H}, other.example.com\r\n\r\n", EXACT_400_OR_CLOSE),
        s("SMUG-CHUNK-BARE-CR-TERM", te_hello + "5\rhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
    ]  # fmt: skip
    follow = "GET / HTTP/1.1\r\nHost: {H}\r\n\r\n"

    def smuggle(id: str, headers: str, body: str = embedded) -> ProbeCase:
        return seq(id, post + headers + "\r\n" + body, judge=_no_second_answer)

    sequences = [
        seq("SMUG-CLTE-CONN-CLOSE", post + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", follow),
        seq("SMUG-TECL-CONN-CLOSE", post + "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n", follow),
        seq("SMUG-CLTE-DESYNC", post + "Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX", follow),
        smuggle("SMUG-CLTE-SMUGGLED-GET", f"Content-Length: {emb_len}\r\nTransfer-Encoding: chunked\r\n"),
        smuggle("SMUG-CLTE-SMUGGLED-GET-CL-PLUS", f"Content-Length: +{emb_len}\r\nTransfer-Encoding: chunked\r\n"),
        smuggle("SMUG-CLTE-SMUGGLED-GET-CL-NON-NUMERIC", f"Content-Length: {emb_len}x\r\nTransfer-Encoding: chunked\r\n"),
        smuggle("SMUG-CLTE-SMUGGLED-GET-TE-OBS-FOLD", f"Transfer-Encoding:\r\n chunked\r\nContent-Length: {emb_len}\r\n"),
        smuggle("SMUG-CLTE-SMUGGLED-HEAD", f"Content-Length: {len(req(embedded.replace('GET', 'HEAD')))}\r\nTransfer-Encoding: chunked\r\n",
                embedded.replace("GET", "HEAD")),
        smuggle("SMUG-CLTE-SMUGGLED-GET-TE-TRAILING-SPACE", f"Content-Length: {emb_len}\r\nTransfer-Encoding: chunked \r\n"),
        smuggle("SMUG-CLTE-SMUGGLED-GET-TE-LEADING-COMMA", f"Content-Length: {emb_len}\r\nTransfer-Encoding: , chunked\r\n"),
        smuggle("SMUG-CLTE-SMUGGLED-GET-TE-CASE-MISMATCH", f"Content-Length: {emb_len}\r\nTransfer-Encoding: Chunked\r\n"),
        smuggle("SMUG-TE-DUPLICATE-HEADERS-SMUGGLED-GET",
                f"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\nContent-Length: {emb_len}\r\n"),
        smuggle("SMUG-TECL-SMUGGLED-GET", f"Transfer-Encoding: chunked\r\nContent-Length: {len(tecl_hex) + 2}\r\n",
                f"{tecl_hex}\r\n{tecl_smuggled}\r\n0\r\n\r\n"),
        smuggle("SMUG-DUPLICATE-CL-SMUGGLED-GET", f"Content-Length: 4\r\nContent-Length: {len(req('PING' + smuggled))}\r\n",
                "PING" + smuggled),
        seq("SMUG-TECL-DESYNC", post + "Transfer-Encoding: chunked\r\nContent-Length: 30\r\n\r\n0\r\n\r\nX", follow),
        seq("SMUG-OPTIONS-TE-OBS-FOLD", "OPTIONS / HTTP/1.1\r\nHost: {H}\r\nTransfer-Encoding:\r\n chunked\r\n" + te_cl5, follow),
        seq("SMUG-CHUNK-INVALID-SIZE-DESYNC", te_hello + "+0\r\n\r\nX", follow),
    ]  # fmt: skip
    long_ = 100_000
    many = "".join(f"X-H-{i}: value\r\n" for i in range(10_000))
    malformed = [
        m("MAL-BINARY-GARBAGE", garbage, silence_or({400})),
        m("MAL-LONG-URL", "GET /" + "A" * long_ + " HTTP/1.1\r\nHost: {H}\r\n\r\n", statuses_or_close({400, 414, 431})),
        m("MAL-LONG-HEADER-VALUE", "GET / HTTP/1.1\r\nHost: {H}\r\nX-Big: " + "B" * long_ + "\r\n\r\n", statuses_or_close({400, 431})),
        m("MAL-MANY-HEADERS", "GET / HTTP/1.1\r\nHost: {H}\r\n" + many + "\r\n", statuses_or_close({400, 431})),
        m("MAL-NUL-IN-URL", "GET /\x00test HTTP/1.1\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        m("MAL-CONTROL-CHARS-HEADER", "GET / HTTP/1.1\r\nHost: {H}\r\nX-Test: abc\x07\x08\x0bdef\r\n\r\n", EXACT_400_OR_CLOSE),
        m("MAL-INCOMPLETE-REQUEST", "GET / HTTP/1.1\r\nHost: {H}\r\nX-Test: value", silence_or({400})),
        m("MAL-EMPTY-REQUEST", b"", silence_or({400})),
        m("MAL-LONG-HEADER-NAME", "GET / HTTP/1.1\r\nHost: {H}\r\n" + "A" * long_ + ": val\r\n\r\n", statuses_or_close({400, 431})),
        m("MAL-LONG-METHOD", "A" * long_ + " / HTTP/1.1\r\nHost: {H}\r\n\r\n", statuses_or_close({400})),
        m("MAL-NON-ASCII-HEADER-NAME", "GET / HTTP/1.1\r\nHost: {H}\r\nX-T\xc3\xabst: value\r\n\r\n", EXACT_400_OR_CLOSE),
        m("MAL-NON-ASCII-URL", "GET /caf\xc3\xa9 HTTP/1.1\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        m("MAL-CL-OVERFLOW", post + "Content-Length: 99999999999999999999\r\n\r\n", EXACT_400_OR_CLOSE),
        m("MAL-WHITESPACE-ONLY-LINE", "   \r\n\r\n", silence_or({400})),
        m("MAL-NUL-IN-HEADER-VALUE", "GET / HTTP/1.1\r\nHost: {H}\r\nX-Test: val\x00ue\r\n\r\n", EXACT_400_OR_CLOSE),
        m("MAL-CHUNK-SIZE-OVERFLOW", te_hello + "FFFFFFFFFFFFFFFF0\r\nhello\r\n0\r\n\r\n", EXACT_400_OR_CLOSE),
        m("MAL-H2-PREFACE", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", silence_or({400, 505})),
        m("MAL-CL-EMPTY", post + "Content-Length: \r\n\r\n", EXACT_400_OR_CLOSE),
        m("MAL-URL-OVERLONG-UTF8", "GET /\xc0\xaf HTTP/1.1\r\nHost: {H}\r\n\r\n", EXACT_400_OR_CLOSE),
        m("MAL-POST-CL-HUGE-NO-BODY", post + "Content-Length: 999999999\r\n\r\n", _huge_no_body),
        m("MAL-URL-PERCENT-NULL", "GET /path%00.html HTTP/1.1\r\nHost: {H}\r\n\r\n", _percent_encoded),
        m("MAL-URL-PERCENT-CRLF", "GET /path%0d%0aX-Injected:%20true HTTP/1.1\r\nHost: {H}\r\n\r\n", _percent_encoded),
        m("MAL-CHUNK-EXT-64K", te_hello + "5;ext=" + "a" * 65536 + "\r\nhello\r\n0\r\n\r\n", statuses_or_close({400, 431})),
    ]  # fmt: skip
    echo_post = "POST /echo HTTP/1.1\r\nHost: {H}\r\n"
    normalization_ = [
        ProbeCase("NORM-UNDERSCORE-CL", "Normalization", (req(echo_post + "Content-Length: 11\r\nContent_Length: 99\r\n\r\nhello world"),),
                  normalization("Content-Length", "Content_Length", "99")),
        ProbeCase("NORM-SP-BEFORE-COLON-CL", "Normalization", (req(echo_post + "Content-Length: 11\r\nContent-Length : 5\r\n\r\nhello world"),),
                  normalization("Content-Length", "Content-Length ", "5")),
        ProbeCase("NORM-TAB-IN-NAME", "Normalization", (req(echo_post + "Content-Length: 11\r\nContent\tLength: 99\r\n\r\nhello world"),),
                  normalization("Content-Length", "Content\tLength", "99")),
        ProbeCase("NORM-UNDERSCORE-TE", "Normalization", (req(echo_post + "Transfer_Encoding: chunked\r\n\r\nB\r\nhello world\r\n0\r\n\r\n"),),
                  normalization("Transfer-Encoding", "Transfer_Encoding", "chunked")),
    ]  # fmt: skip
    out = [*compliance, *smuggling, *sequences, *malformed, *normalization_]
    assert len({x.id for x in out}) == len(out), "test ids must be unique"
    return out


def run_suite(port: int, host: str | None = None, timeout_s: float = 5.0,
              on_result: Callable[[ProbeResult], None] | None = None) -> tuple[list[ProbeResult], Score]:  # fmt: skip
    """Every ported test against 127.0.0.1:``port``, one after another."""
    results, score = [], Score()
    for case in cases(host or f"localhost:{port}"):
        result = run_case(case, port, timeout_s)
        results.append(result)
        score.add(result)
        if on_result is not None:
            on_result(result)
    return results, score
