"""HTTP/1.1 conformance vectors for the proxy, judged from outside: what a raw-socket client gets
(raw_client.py), and what reaches the backend (recording_backend.py).

Each ``Vector`` is a name, the raw bytes (one part, or parts sent one after another as a client
sending ``Expect: 100-continue`` does), the public suite and test id it is derived from, and the
outcomes that pass (``Case``: what the client gets, ``Client``; and what reaches the backend,
``Backend``). ``run_vector`` sends one and ``judge`` checks it: the client's answer against one of
the cases, and every request that reached the backend meanwhile against that case's count, target
and body; each must be framed by the proxy (``recording_backend.framing_problems``: one Host, a
Content-Length that matches the body, no Transfer-Encoding, no Expect, CRLF line ends, no folded or
malformed header line). A request hidden inside another one targets ``/smuggled``: it must never
reach the backend.

Sources: MDA2AV/Http11Probe (``SMUG-*``, ``MAL-*``, ``COMP-*``, ``RFC911x-*`` test ids: its
SmugglingSuite, MalformedInputSuite and ComplianceSuite) and aws/http-desync-guardian (its
tests/*.yaml files, named with the case's ``name``). The vectors are written here, aimed at the
proxy's own paths with a chat body where the suite sends ``POST /`` with ``hello``; ``source`` names
the test each follows. "clairvoyant" marks the proxy's own rules (paths, ``*``, Expect admission).

Vectors run against one of two configurations of the proxy (``Vector.proxy``): "open", as deployed
on loopback (no keys, every path passes through), and "keyed" (``keyed_settings``: one API key,
an allowlist).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .raw_client import Exchange, exchange
from .recording_backend import Received, RecordingBackend, framing_problems

CHAT = "/v1/chat/completions"
SCHEDULED_MARK = "x-clairvoyant-queue-wait-ms"  # a header only a scheduled answer carries
SMUGGLED = "/smuggled"  # the target of every request hidden inside another one

# --------------------------------------------------------------------------------------------
# The vectors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Client:
    """What the client must get. ``statuses``: the first final answer's status must be one of
    these; ``closed_ok``: no answer at all, the connection closed, passes too."""

    statuses: frozenset[int] = frozenset()
    closed_ok: bool = False
    finals: int = 1  # final answers expected (pipelined requests: one each)
    interim: frozenset[int] | None = None  # the 1xx statuses allowed before the first final (None: any)
    need_interim: int | None = None  # this 1xx must come before the first final
    must_close: bool = False  # the connection must be closed after the answer
    headers: tuple[str, ...] = ()  # headers the first final answer must carry
    scheduled: bool | None = None  # True: the answer must be a scheduled one (SCHEDULED_MARK)
    within_s: float | None = None  # the first final answer (or the close) within this many seconds

    def describe(self) -> str:
        words = []
        if self.statuses:
            words.append("/".join(str(s) for s in sorted(self.statuses)))
        if self.closed_ok:
            words.append("closed")
        text = " or ".join(words) or "nothing"
        if self.need_interim:
            text = f"{self.need_interim} then {text}"
        elif self.interim == frozenset():
            text += ", no 1xx first"
        if self.finals > 1:
            text += f" x{self.finals}"
        if self.must_close:
            text += " +close"
        if self.scheduled:
            text += " (scheduled)"
        if self.headers:
            text += " with " + ", ".join(self.headers)
        if self.within_s is not None:
            text += f" within {self.within_s:g} s"
        return text

    def problems(self, ex: Exchange, *, scheduler: bool = True) -> list[str]:
        """Why ``ex`` does not fit; ``scheduler`` False: the server is no scheduler (nginx), so
        ``scheduled`` is not asked of it."""
        finals = ex.finals
        if not finals:
            if ex.closed and self.closed_ok:
                return []
            return [f"client got {ex.outcome()}, expected {self.describe()}"]
        first = finals[0]
        out = []
        if first.status not in self.statuses:
            out.append(f"client got {ex.outcome()}, expected {self.describe()}")
        if len(finals) != self.finals:
            out.append(f"{len(finals)} final answers, expected {self.finals}")
        interim = ex.interim_before_first_final()
        if self.interim is not None and set(interim) - self.interim:
            out.append(f"interim {interim} before the {first.status}")
        if self.need_interim is not None and self.need_interim not in interim:
            out.append(f"no {self.need_interim} before the {first.status}")
        if self.must_close and not ex.closed:
            out.append("connection left open")
        out += [f"no {name} header" for name in self.headers if first.header(name) is None]
        if self.scheduled and scheduler and first.header(SCHEDULED_MARK) is None:
            out.append("answered, but not scheduled")
        if self.within_s is not None and first.at_s > self.within_s:
            out.append(f"answered after {first.at_s:.1f} s")
        return out


@dataclass(frozen=True)
class Backend:
    """What must reach the backend while the vector runs."""

    count: int = 0  # requests (counted whole, plus any bytes it could not frame)
    at_most: bool = False  # ``count`` is a ceiling (background traffic such as health checks counts)
    target: str | None = None  # each request's request-target
    bodies: tuple[bytes, ...] | None = None  # each request's body, in order
    forbidden: tuple[str, ...] = ()  # request lines ("METHOD target") no request may start with

    def describe(self) -> str:
        if self.at_most:
            return f"<= {self.count} requests"
        return f"{self.count} request{'s' * (self.count != 1)}"

    def problems(self, got: list[Received]) -> list[str]:
        out = []
        smuggled = [r for r in got if SMUGGLED in r.target or (not r.method and SMUGGLED.encode() in r.raw)]
        if smuggled:
            out.append(f"a smuggled request reached the backend: {smuggled[0].raw[:80]!r}")
        out += [f"{r.method} {r.target} reached the backend" for r in got
                if any(f"{r.method} {r.target}".startswith(line) for line in self.forbidden)]  # fmt: skip
        if (len(got) > self.count) if self.at_most else (len(got) != self.count):
            seen = ", ".join(f"{r.method} {r.target[:40]}" if r.method else r.framing for r in got[:4])
            out.append(f"backend got {len(got)} request{'s' * (len(got) != 1)} ({seen}), expected {self.describe()}")
            return out
        if self.at_most:
            return out
        for i, r in enumerate(got):
            if self.target is not None and r.target != self.target:
                out.append(f"backend target {r.target!r}, expected {self.target!r}")
            if self.bodies is not None and i < len(self.bodies) and r.body != self.bodies[i]:
                out.append(f"backend body {r.body[:40]!r}, expected {self.bodies[i][:40]!r}")
            out += framing_problems(r)  # each framed by the proxy
        return out


@dataclass(frozen=True)
class Case:
    client: Client
    backend: Backend

    def describe(self) -> str:
        return f"{self.client.describe()}; {self.backend.describe()}"


@dataclass(frozen=True)
class Vector:
    name: str  # a readable id
    parts: tuple[bytes, ...]  # sent in order; between parts the client waits for an answer (pause_s)
    source: str  # the public suite and test it follows
    cases: tuple[Case, ...]  # it passes when one of them holds
    proxy: str = "open"  # the configuration it runs against: "open" (no keys) or "keyed"
    wait_s: float = 3.0
    group: str = "framing"  # framing, host, path, target, expect

    @property
    def raw(self) -> bytes:
        return b"".join(self.parts)


@dataclass
class Verdict:
    vector: Vector
    exchange: Exchange
    delivered: list[Received]
    ok: bool
    problems: list[str] = field(default_factory=list)  # why the closest case does not hold

    def deliveries_text(self) -> str:
        if not self.delivered:
            return "0"
        return f"{len(self.delivered)}: " + ", ".join(
            f"{r.method} {r.target[:32]} ({r.framing}{f', body {len(r.body)} B' if r.body else ''})"
            if r.method
            else r.framing
            for r in self.delivered[:3]
        )


def judge(vector: Vector, ex: Exchange, delivered: list[Received], *, scheduler: bool = True) -> Verdict:
    """The vector's verdict: the first case that holds, else the problems of the case that came
    closest (fewest problems)."""
    best: list[str] | None = None
    for case in vector.cases:
        problems = case.client.problems(ex, scheduler=scheduler) + case.backend.problems(delivered)
        if not problems:
            return Verdict(vector, ex, delivered, True)
        if best is None or len(problems) < len(best):
            best = problems
    return Verdict(vector, ex, delivered, False, best or [])


def run_vector(vector: Vector, port: int, backend: RecordingBackend, *, scheduler: bool = True) -> Verdict:
    """Send one vector to ``port`` and judge what the client and ``backend`` saw (``scheduler``:
    see ``Client.problems``)."""
    mark, started_s = backend.mark(), time.monotonic()
    finals = max(c.client.finals for c in vector.cases)
    ex = exchange(port, vector.parts, finals=finals, wait_s=vector.wait_s)
    # the deliveries the client's answer implies (a case its answer fits): wait for those to land
    fitting = [c.backend.count for c in vector.cases
               if not c.backend.at_most and not c.client.problems(ex, scheduler=scheduler)]  # fmt: skip
    if max(fitting, default=0):
        backend.wait_for(mark, max(fitting), timeout_s=2.0)
    return judge(vector, ex, backend.settle(mark, since_s=started_s), scheduler=scheduler)


# -- building blocks -----------------------------------------------------------------------------

HOST = b"Host: proxy.test\r\n"


def chat(tag: str, *, model: str = "m", **extra: Any) -> bytes:
    """A small chat request body; ``tag`` goes in ``user`` (the backend's answer echoes it)."""
    return json.dumps(
        {"model": model, "user": tag, "max_tokens": 2, "messages": [{"role": "user", "content": "Say OK."}], **extra}
    ).encode()


def chunked(body: bytes, *pieces: int) -> bytes:
    """``body`` in chunked framing, cut at ``pieces`` (byte counts), then the last chunk."""
    out, pos = b"", 0
    for n in (*pieces, len(body)):
        piece = body[pos : pos + n] if n != len(body) else body[pos:]
        if piece:
            out += b"%x\r\n%s\r\n" % (len(piece), piece)
        pos += len(piece)
    return out + b"0\r\n\r\n"


def request(method: str, target: str, headers: Iterable[str] = (), body: bytes = b"", *, host: bool = True,
            version: str = "HTTP/1.1", length: bool = True) -> bytes:  # fmt: skip
    """A request: ``headers`` as lines (no CRLF), a Content-Length for ``body`` unless ``length`` is
    False or a line sets one already."""
    lines = [f"{method} {target} {version}"] + ([HOST.decode().strip()] if host else []) + list(headers)
    if length and body and not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def post_chat(headers: Iterable[str], body: bytes, *, target: str = CHAT, version: str = "HTTP/1.1") -> bytes:
    return request("POST", target, ["Content-Type: application/json", *headers], body, version=version, length=False)


def expect_continue(
    headers: Iterable[str], body: bytes, *, target: str = CHAT, version: str = "HTTP/1.1"
) -> tuple[bytes, ...]:
    """A chat POST with ``Expect: 100-continue`` in two parts: the head, then the body."""
    whole = post_chat([*headers, f"Content-Length: {len(body)}", "Expect: 100-continue"], body, target=target,
                      version=version)  # fmt: skip
    return (whole[: -len(body)], body)


SMUGGLED_GET = b"GET " + SMUGGLED.encode() + b" HTTP/1.1\r\nHost: proxy.test\r\n\r\n"


def rejected(*statuses: int, close: bool = True) -> Case:
    """Refused: one of ``statuses`` (or, with ``close``, the connection closed without an answer);
    nothing reaches the backend."""
    return Case(Client(frozenset(statuses), closed_ok=close), Backend(0))


def served(body: bytes, *, target: str = CHAT, must_close: bool = False, scheduled: bool | None = None) -> Case:
    """Answered 200: one request reaches the backend, framed by the proxy, with ``body``."""
    return Case(
        Client(frozenset({200}), must_close=must_close, scheduled=scheduled), Backend(1, target=target, bodies=(body,))
    )


BAD = (400,)  # what a malformed request must get
HP = "Http11Probe"  # MDA2AV/Http11Probe
DG = "http-desync-guardian"  # aws/http-desync-guardian tests/*.yaml


def _framing_vectors() -> list[Vector]:
    # A chunk line the server's parser reads leniently (RFC 9112 7.1.1 lets a recipient ignore
    # extensions it does not understand): the chunk's size is right, so the body is what the client
    # meant, and it reaches the backend as one request framed by the proxy. Refusing it passes too.
    b = chat("framing")
    lenient_chunk = served(b)
    ch = chunked(b, 20, 30)
    hidden = b"GET " + SMUGGLED.encode() + b" HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: 7\r\n\r\n"
    te_cl_body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(hidden), hidden)
    tcl = len(b"%x\r\n" % len(hidden))
    # served by Transfer-Encoding alone and then closed: RFC 9112 6.1 allows it (or a 400)
    by_te = served(b, must_close=True)
    return [
        Vector(
            "baseline-chat", (post_chat([f"Content-Length: {len(b)}"], b),), "clairvoyant", (served(b, scheduled=True),)
        ),
        Vector(
            "cl-te-both",
            (post_chat([f"Content-Length: {len(ch)}", "Transfer-Encoding: chunked"], ch),),
            f"{HP} SMUG-CL-TE-BOTH; {DG} ambiguous.yaml 'Both Transfer-Encoding:chunked and Content-Length'",
            (rejected(*BAD), by_te),
        ),
        Vector(
            "te-cl-both",
            (post_chat(["Transfer-Encoding: chunked", f"Content-Length: {len(ch)}"], ch),),
            f"{HP} SMUG-TECL-CONN-CLOSE",
            (rejected(*BAD), by_te),
        ),
        Vector(
            "cl-te-smuggled-get",
            (
                post_chat(
                    [f"Content-Length: {len(ch + SMUGGLED_GET)}", "Transfer-Encoding: chunked"], ch + SMUGGLED_GET
                ),
            ),
            f"{HP} SMUG-CLTE-SMUGGLED-GET",
            (rejected(*BAD), by_te),
        ),
        Vector(
            "te-cl-smuggled-get",
            (request("POST", "/", ["Transfer-Encoding: chunked", f"Content-Length: {tcl}"], te_cl_body, length=False),),
            f"{HP} SMUG-TECL-SMUGGLED-GET",
            (rejected(*BAD), served(hidden, target="/", must_close=True)),
        ),
        Vector(
            "cl-te-obs-fold",
            (post_chat(["Transfer-Encoding:", " chunked", f"Content-Length: {len(ch)}"], ch),),
            f"{HP} SMUG-TE-OBS-FOLD, SMUG-CLTE-SMUGGLED-GET-TE-OBS-FOLD",
            (rejected(*BAD), by_te),
        ),
        Vector(
            "duplicate-cl",
            (post_chat([f"Content-Length: {len(b)}", f"Content-Length: {len(b + SMUGGLED_GET)}"], b + SMUGGLED_GET),),
            f"{HP} SMUG-DUPLICATE-CL-SMUGGLED-GET; {DG} severe.yaml 'Multiple Content-Length'",
            (rejected(*BAD),),
        ),
        Vector(
            "duplicate-cl-same",
            (post_chat([f"Content-Length: {len(b)}"] * 2, b),),
            f"{DG} ambiguous.yaml 'Duplicate Content-Length'; {HP} SMUG-CL-COMMA-SAME",
            (rejected(*BAD), served(b)),
        ),
        Vector(
            "cl-comma-different",
            (post_chat([f"Content-Length: {len(b)}, {len(b) + 5}"], b + b"12345"),),
            f"{HP} SMUG-CL-COMMA-DIFFERENT; {DG} severe.yaml 'Bad Content-Length: 1000,1000'",
            (rejected(*BAD),),
        ),
        Vector(
            "cl-plus-sign",
            (post_chat([f"Content-Length: +{len(b)}"], b),),
            f"{HP} RFC9112-6.1-CL-PLUS-SIGN",
            (rejected(*BAD),),
        ),
        Vector("cl-negative", (post_chat(["Content-Length: -1"], b""),), f"{HP} SMUG-CL-NEGATIVE", (rejected(*BAD),)),
        Vector(
            "cl-hex", (post_chat([f"Content-Length: 0x{len(b):x}"], b),), f"{HP} SMUG-CL-HEX-PREFIX", (rejected(*BAD),)
        ),
        Vector(
            "cl-internal-space",
            (post_chat([f"Content-Length: {len(b) // 10} {len(b) % 10}"], b),),
            f"{HP} SMUG-CL-INTERNAL-SPACE; {DG} severe.yaml 'Bad Content-Length: 1000 1000'",
            (rejected(*BAD),),
        ),
        Vector(
            "cl-overflow",
            (post_chat(["Content-Length: 18446744073709551616"], b),),
            f"{HP} MAL-CL-OVERFLOW; {DG} severe.yaml 'Bad Content-Length (64-bits overflow)'",
            (rejected(400, 413),),
        ),
        Vector(
            "cl-name-trailing-space",
            (post_chat(["Content-Length : 5", f"Content-Length: {len(b)}"], b),),
            f"{DG} severe.yaml 'Content-Length[white-space] and Content-Length'; {HP} NORM-SP-BEFORE-COLON-CL",
            (rejected(*BAD),),
        ),
        Vector(
            "te-gzip-chunked",
            (post_chat(["Transfer-Encoding: gzip, chunked"], ch),),
            f"{HP} COMP-UNKNOWN-TE-501 (gzip before chunked)",
            (rejected(400, 501),),
        ),
        Vector(
            "te-chunked-gzip",
            (post_chat(["Transfer-Encoding: chunked, gzip"], ch),),
            f"{HP} SMUG-TE-NOT-FINAL-CHUNKED",
            (rejected(*BAD),),
        ),
        Vector(
            "te-xchunked",
            (post_chat(["Transfer-Encoding: xchunked", f"Content-Length: {len(b)}"], b),),
            f"{HP} SMUG-TE-XCHUNKED; {DG} severe.yaml 'Unknown Transfer-Encoding: xchunked'",
            (rejected(400, 501),),
        ),
        Vector(
            "te-double-chunked",
            (post_chat(["Transfer-Encoding: chunked, chunked"], ch),),
            f"{DG} severe.yaml 'Multiple Transfer-Encoding: chunked,chunked'; {HP} SMUG-TE-DOUBLE-CHUNKED",
            (rejected(400, 501),),
        ),
        Vector(
            "te-space-before-colon",
            (post_chat(["Transfer-Encoding : chunked", f"Content-Length: {len(b)}"], b),),
            f"{HP} SMUG-TE-SP-BEFORE-COLON; {DG} severe.yaml 'Transfer-Encoding[white-space] and Transfer-Encoding'",
            (rejected(*BAD),),
        ),
        Vector(
            "te-nul",
            (post_chat(["Transfer-Encoding: chunked\x00", f"Content-Length: {len(b)}"], b),),
            f"{HP} SMUG-TE-NULL; {DG} severe.yaml 'Bad character in Transfer-Encoding value'",
            (rejected(*BAD),),
        ),
        Vector(
            "te-http10",
            (post_chat(["Transfer-Encoding: chunked"], ch, version="HTTP/1.0"),),
            f"{HP} SMUG-TE-HTTP10; {DG} ambiguous.yaml 'Transfer-Encoding for HTTP/1.0'",
            (rejected(*BAD),),
        ),
        # chunk-size abuse
        Vector(
            "chunk-size-hex-prefix",
            (post_chat(["Transfer-Encoding: chunked"], b"0x%x\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-HEX-PREFIX",
            (rejected(*BAD),),
        ),
        Vector(
            "chunk-size-plus",
            (post_chat(["Transfer-Encoding: chunked"], b"+%x\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-SIZE-PLUS",
            (rejected(*BAD),),
        ),
        Vector(
            "chunk-size-negative",
            (post_chat(["Transfer-Encoding: chunked"], b"-1\r\n%s\r\n0\r\n\r\n" % b),),
            f"{HP} SMUG-CHUNK-NEGATIVE",
            (rejected(*BAD),),
        ),
        Vector(
            "chunk-size-underscore",
            (post_chat(["Transfer-Encoding: chunked"], b"1_0\r\n%s\r\n0\r\n\r\n" % b[:16]),),
            f"{HP} SMUG-CHUNK-UNDERSCORE",
            (rejected(*BAD),),
        ),
        Vector(
            "chunk-size-leading-space",
            (post_chat(["Transfer-Encoding: chunked"], b" %x\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-LEADING-SP",
            (rejected(*BAD),),
        ),
        Vector(
            "chunk-size-trailing-space",
            (post_chat(["Transfer-Encoding: chunked"], b"%x \r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-SIZE-TRAILING-OWS",
            (rejected(*BAD), lenient_chunk),
        ),
        Vector(
            "chunk-size-overflow",
            (post_chat(["Transfer-Encoding: chunked"], b"FFFFFFFFFFFFFFFF%x\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} MAL-CHUNK-SIZE-OVERFLOW",
            (rejected(400, 413),),
        ),
        Vector(
            "chunk-spill",
            (post_chat(["Transfer-Encoding: chunked"], b"%x\r\n%s!!\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-SPILL",
            (rejected(*BAD),),
        ),
        Vector(
            "chunk-missing-crlf",
            (post_chat(["Transfer-Encoding: chunked"], b"%x\r\n%s0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-MISSING-TRAILING-CRLF",
            (rejected(*BAD),),
        ),
        Vector(
            "chunk-size-bare-cr",
            (post_chat(["Transfer-Encoding: chunked"], b"%x\r%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-BARE-CR-TERM",
            (rejected(*BAD),),
        ),
        # chunk-extension abuse
        Vector(
            "chunk-ext-valid",
            (post_chat(["Transfer-Encoding: chunked"], b"%x;ext=value\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} COMP-CHUNKED-EXTENSION",
            (served(b),),
        ),
        Vector(
            "chunk-ext-bare-semicolon",
            (post_chat(["Transfer-Encoding: chunked"], b"%x;\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-BARE-SEMICOLON",
            (rejected(*BAD), lenient_chunk),
        ),
        Vector(
            "chunk-ext-invalid-token",
            (post_chat(["Transfer-Encoding: chunked"], b"%x;bad[=x\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-EXT-INVALID-TOKEN",
            (rejected(*BAD), lenient_chunk),
        ),
        Vector(
            "chunk-ext-nul",
            (post_chat(["Transfer-Encoding: chunked"], b"%x;\x00ext\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-EXT-CTRL",
            (rejected(*BAD), lenient_chunk),
        ),
        Vector(
            "chunk-ext-bare-cr",
            (post_chat(["Transfer-Encoding: chunked"], b"%x;a\rX\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-EXT-CR",
            (rejected(*BAD),),
        ),
        Vector(
            "chunk-ext-64k",
            (post_chat(["Transfer-Encoding: chunked"], b"%x;ext=%s\r\n%s\r\n0\r\n\r\n" % (len(b), b"a" * 65536, b)),),
            f"{HP} MAL-CHUNK-EXT-64K",
            (rejected(400, 413, 431),),
        ),
        # line ends, folding, header syntax
        Vector(
            "bare-lf-request-line",
            (
                b"POST "
                + CHAT.encode()
                + b" HTTP/1.1\n"
                + post_chat([f"Content-Length: {len(b)}"], b).split(b"\r\n", 1)[1],
            ),
            f"{HP} RFC9112-2.2-BARE-LF-REQUEST-LINE",
            (rejected(*BAD), served(b)),
        ),
        Vector(
            "bare-lf-header",
            (post_chat([f"Content-Length: {len(b)}\nX-Test: value"], b),),
            f"{HP} RFC9112-2.2-BARE-LF-HEADER; {DG} severe.yaml 'Multiline headers are deprecated (with \\n only)'",
            (rejected(*BAD), served(b)),
        ),
        Vector(
            "bare-lf-chunk",
            (post_chat(["Transfer-Encoding: chunked"], b"%x\r\n%s\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} SMUG-CHUNK-LF-TERM",
            (rejected(*BAD), served(b)),
        ),
        Vector(
            "bare-cr-header-value",
            (post_chat([f"Content-Length: {len(b)}", "X-Test: val\rue"], b),),
            f"{HP} SMUG-BARE-CR-HEADER-VALUE; {DG} severe.yaml '\\r in value is bad'",
            (rejected(*BAD),),
        ),
        Vector(
            "cr-only-line-ending",
            (
                b"POST "
                + CHAT.encode()
                + b" HTTP/1.1\r"
                + post_chat([f"Content-Length: {len(b)}"], b).split(b"\r\n", 1)[1],
            ),
            f"{HP} RFC9112-3-CR-ONLY-LINE-ENDING",
            (rejected(*BAD),),
        ),
        Vector(
            "obs-fold",
            (post_chat([f"Content-Length: {len(b)}", "X-Test: value", " continued"], b),),
            f"{HP} RFC9112-5.1-OBS-FOLD; {DG} severe.yaml 'Multiline headers are deprecated'",
            (rejected(*BAD), served(b)),
        ),
        Vector(
            "space-before-colon",
            (post_chat([f"Content-Length: {len(b)}", "X-Test : value"], b),),
            f"{HP} RFC9110-5.6.2-SP-BEFORE-COLON",
            (rejected(400, close=False),),
        ),
        Vector(
            "header-nul-value",
            (post_chat([f"Content-Length: {len(b)}", "X-Test: val\x00ue"], b),),
            f"{HP} MAL-NUL-IN-HEADER-VALUE; {DG} severe.yaml '\\0 in value is bad'",
            (rejected(*BAD),),
        ),
        # pipelining, chunked uploads
        Vector(
            "pipelined-two",
            (
                post_chat([f"Content-Length: {len(b)}"], b)
                + post_chat([f"Content-Length: {len(chat('two'))}"], chat("two")),
            ),
            f"{HP} SMUG-PIPELINE-SAFE",
            (Case(Client(frozenset({200}), finals=2), Backend(2, target=CHAT, bodies=(b, chat("two")))),),
        ),
        Vector(
            "chunked-upload", (post_chat(["Transfer-Encoding: chunked"], ch),), f"{HP} COMP-CHUNKED-MULTI", (served(b),)
        ),
        Vector(
            "chunked-upload-trailer",
            (post_chat(["Transfer-Encoding: chunked"], ch[:-2] + b"X-Checksum: abc\r\n\r\n"),),
            f"{HP} COMP-CHUNKED-TRAILER-VALID",
            (served(b),),
        ),
        Vector(
            "chunked-upload-uppercase-hex",
            (post_chat(["Transfer-Encoding: chunked"], b"%X\r\n%s\r\n0\r\n\r\n" % (len(b), b)),),
            f"{HP} COMP-CHUNKED-HEX-UPPERCASE",
            (served(b),),
        ),
    ]


def _host_vectors() -> list[Vector]:
    b = chat("host")

    def with_host(*hosts: str, version: str = "HTTP/1.1") -> bytes:
        return request("POST", CHAT, [*(f"Host: {h}" for h in hosts), "Content-Type: application/json"], b,
                       host=False, version=version)  # fmt: skip

    must_400 = (Case(Client(frozenset({400})), Backend(0)),)
    return [
        Vector("host-missing", (with_host(),), f"{HP} RFC9112-7.1-MISSING-HOST", must_400, group="host"),
        Vector(
            "host-duplicate",
            (with_host("proxy.test", "other.example"),),
            f"{HP} RFC9110-5.4-DUPLICATE-HOST",
            must_400,
            group="host",
        ),
        Vector(
            "host-duplicate-same",
            (with_host("proxy.test", "proxy.test"),),
            f"{HP} COMP-DUPLICATE-HOST-SAME",
            must_400,
            group="host",
        ),
        Vector(
            "host-comma",
            (with_host("proxy.test, other.example"),),
            f"{HP} SMUG-MULTIPLE-HOST-COMMA",
            must_400,
            group="host",
        ),
        Vector(
            "host-userinfo", (with_host("user@proxy.test"),), f"{HP} COMP-HOST-WITH-USERINFO", must_400, group="host"
        ),
        Vector("host-with-path", (with_host("proxy.test/path"),), f"{HP} COMP-HOST-WITH-PATH", must_400, group="host"),
        Vector("host-empty", (with_host(""),), f"{HP} COMP-HOST-EMPTY-VALUE", must_400, group="host"),
        Vector(
            "host-missing-http10",
            (with_host(version="HTTP/1.0"),),
            f"{HP} COMP-HTTP10-NO-HOST",
            (served(b),),  # HTTP/1.0 may leave Host out: old tools and health checkers do
            group="host",
        ),
    ]


def _path_vectors() -> list[Vector]:
    refused = (Case(Client(frozenset({400, 403})), Backend(0)),)
    b = chat("path")
    ollama = json.dumps({"model": "m", "prompt": "Say OK.", "stream": False}).encode()
    # an encoded "?" in a scheduled path: refused, or scheduled as that path; never relayed unscheduled
    refused_or_scheduled = (
        Case(Client(frozenset({400, 403, 404})), Backend(0)),
        Case(Client(frozenset({200}), scheduled=True), Backend(1)),
    )

    def get(target: str) -> tuple[bytes, ...]:
        return (request("GET", target),)

    double = "/v1/models/%252e%252e/%252e%252e/slots"
    return [
        Vector("path-dotdot-encoded", get("/v1/models/%2e%2e/%2e%2e/slots"), "clairvoyant", refused, group="path"),
        Vector(
            "path-dotdot-encoded-upper", get("/v1/models/%2E%2E/%2E%2E/slots"), "clairvoyant", refused, group="path"
        ),
        Vector("path-dotdot-encoded-slash", get("/v1/models/..%2f..%2fslots"), "clairvoyant", refused, group="path"),
        Vector("path-dotdot-plain", get("/v1/models/../../slots"), "clairvoyant", refused, group="path"),
        Vector("path-dot-segment", get("/v1/./models"), "clairvoyant", refused, group="path"),
        Vector("path-encoded-slash", get("/v1/models%2fx"), "clairvoyant", refused, group="path"),
        Vector("path-encoded-hash", get("/v1/models%23x"), "clairvoyant", refused, group="path"),
        Vector(
            "path-encoded-query-chat",
            (post_chat([f"Content-Length: {len(b)}"], b, target=CHAT + "%3Fx=1"),),
            "clairvoyant",
            refused_or_scheduled,
            group="path",
        ),
        Vector(
            "path-encoded-query-generate",
            (request("POST", "/api/generate%3F", ["Content-Type: application/json"], ollama),),
            "clairvoyant",
            refused_or_scheduled,
            group="path",
        ),
        Vector(
            "path-double-encoded-dot",
            get(double),
            "clairvoyant",
            (*refused, Case(Client(frozenset({200})), Backend(1, target=double))),
            group="path",
        ),
    ]


def _target_vectors() -> list[Vector]:
    b = chat("absolute")
    # any backend traffic meanwhile (health checks included), and never the request itself
    options_ceiling = Backend(5, at_most=True, forbidden=("OPTIONS ", "GET *"))
    get_ceiling = Backend(5, at_most=True, forbidden=("GET *",))
    return [
        Vector(
            "options-asterisk",
            (request("OPTIONS", "*"),),
            f"{HP} COMP-OPTIONS-STAR",
            (Case(Client(frozenset({204}), headers=("allow",), within_s=3.0), options_ceiling),),
            group="target",
        ),
        Vector(
            "get-asterisk",
            (request("GET", "*"),),
            f"{HP} COMP-ASTERISK-WITH-GET",
            (Case(Client(frozenset({400}), within_s=3.0), get_ceiling),),
            group="target",
        ),
        Vector(
            "absolute-form-chat",
            (post_chat([f"Content-Length: {len(b)}"], b, target="http://proxy.test" + CHAT),),
            f"{HP} COMP-ABSOLUTE-FORM",
            (served(b, scheduled=True),),
            group="target",
        ),
    ]


KEY = "cv-conformance-key"  # the key the "keyed" proxy accepts


def _expect_vectors() -> list[Vector]:
    b = chat("expect")

    continued = Case(Client(frozenset({200}), need_interim=100), Backend(1, target=CHAT, bodies=(b,)))
    no_interim = Client(frozenset({200}), interim=frozenset())
    return [
        Vector(
            "expect-100-continue",
            expect_continue([], b),
            f"{HP} SMUG-EXPECT-100-CL (head, then body)",
            (continued,),
            group="expect",
        ),
        Vector(
            "expect-100-body-at-once",
            (b"".join(expect_continue([], b)),),
            f"{HP} SMUG-EXPECT-100-CL",
            (served(b),),
            group="expect",
        ),
        Vector(
            "expect-100-http10",
            expect_continue([], b, version="HTTP/1.0"),
            f"{HP} COMP-NO-1XX-HTTP10",
            (Case(no_interim, Backend(1, target=CHAT, bodies=(b,))),),
            group="expect",
        ),
        Vector(
            "expect-100-valid-key",
            expect_continue([f"Authorization: Bearer {KEY}"], b),
            "clairvoyant",
            (continued,),
            proxy="keyed",
            group="expect",
        ),
        Vector(
            "expect-100-unknown-key",
            expect_continue(["Authorization: Bearer wrong"], b),
            "clairvoyant",
            (Case(Client(frozenset({401}), interim=frozenset()), Backend(0)),),
            proxy="keyed",
            group="expect",
        ),
        Vector(
            "expect-100-not-allowed",
            expect_continue([f"Authorization: Bearer {KEY}"], b, target="/api/pull"),
            "clairvoyant",
            (Case(Client(frozenset({403}), interim=frozenset()), Backend(0)),),
            proxy="keyed",
            group="expect",
        ),
    ]


VECTORS: list[Vector] = [*_framing_vectors(), *_host_vectors(), *_path_vectors(), *_target_vectors(),
                         *_expect_vectors()]  # fmt: skip
assert len({v.name for v in VECTORS}) == len(VECTORS), "vector names must be unique"


def keyed_settings() -> dict[str, str]:
    """CLAIRVOYANT_* settings of the "keyed" proxy: one API key (``KEY``) and the default allowlist."""
    from_key = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()
    allow = ["GET /v1/models", "GET /v1/models/*", "GET /health", "POST /v1/embeddings"]
    return {
        "api_keys": json.dumps([{"hash": from_key, "tenant": "conformance"}]),
        "passthrough_allow": json.dumps(allow),
    }
