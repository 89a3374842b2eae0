"""The soak's parts: a fake backend that plays Ollama and fails on demand, the plan of requests
and faults, the clients that send them (plain, leaving mid-stream, stalled), what a proxy process
holds (read from /proc and its /metrics), and the tally of answers.

Every request carries ``X-Request-Id: soak-<index>``. The proxy forwards it to the backend, which
counts each id it reads (``SoakBackend.ledger``), so a request the backend saw twice shows as
duplicated. The answer's own ``X-Request-Id`` must be the request's.

A request's behaviour at the fake backend is asked for in the ``X-Soak`` header, which the proxy
forwards like any other: ``status:NNN`` (answer that status, in the dialect's error shape),
``slow:N`` (stream N events 50 ms apart), ``big:N`` (stream N events at once).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .proxy_process import REPO, free_port, rss_kib, wait_healthy
from .raw_client import parse_responses
from .recording_backend import OLLAMA_PATHS, Received, RecordingBackend
from .verdicts import sse_outcome, status_of

__all__ = [
    "FAULT_KINDS",
    "LlamaBackendProcess",
    "Outcome",
    "Plan",
    "ProcessFigures",
    "SoakBackend",
    "Tally",
    "api_keys_setting",
    "learner_pid",
    "make_plan",
    "open_fds",
    "process_figures",
    "send",
]

BEHAVIOUR_HEADER = "x-soak"
LEAVE_EVENTS = 20  # a stream the client leaves after its first event: 20 events 50 ms apart
STALL_EVENTS = 3000  # a stream a stalled client stops reading: ~300 KB, more than the socket buffers hold
STALL_S = 2.0  # seconds a stalled client reads nothing
FAULT_KINDS = ("backend_killed", "client_left", "client_stalled", "backend_4xx", "backend_5xx", "learner_killed")
TENANTS = ("a", "b", "c", "d")
OPENAI_CHAT = "/v1/chat/completions"
OPENAI_COMPLETIONS = "/v1/completions"
OLLAMA_CHAT = "/api/chat"
OLLAMA_GENERATE = "/api/generate"
MODELS = ("soak-a", "soak-b", "soak-c")


# -- the fake backend -------------------------------------------------------------------------------
class SoakBackend(RecordingBackend):
    """``RecordingBackend`` that plays Ollama (``/api/version``, ``/api/ps``, NDJSON streams),
    answers the ``X-Soak`` behaviours, and counts every request id it read in ``ledger`` (shared
    across restarts). It keeps only its last requests' bytes."""

    def __init__(self, ledger: Counter[str], port: int = 0) -> None:
        super().__init__(port=port, max_kept=64)
        self.ledger = ledger
        self.stream_delay_s = 0.05

    def kill(self) -> None:
        """Every connection aborted and the port closed at once (from another thread)."""
        self.stop()

    async def _respond(self, writer: asyncio.StreamWriter, received: Received, close: bool) -> None:
        path = received.target.split("?", 1)[0]
        if path == "/api/version":
            await self._answer(writer, 200, b'{"version":"0.0.0-soak"}', close=close, json_body=True)
            return
        if path == "/api/ps":
            await self._answer(writer, 200, b'{"models":[]}', close=close, json_body=True)
            return
        request_id = next(iter(received.header("x-request-id")), "")
        if received.method == "POST" and request_id:
            self.ledger[request_id] += 1
        behaviour = next(iter(received.header(BEHAVIOUR_HEADER)), "")
        kind, _, arg = behaviour.partition(":")
        if received.method != "POST" or not kind:
            await super()._respond(writer, received, close)
            return
        ollama = path in OLLAMA_PATHS
        if kind == "status":
            status = int(arg)
            body = b'{"error":"soak fault"}' if ollama else b'{"error":{"message":"soak fault","type":"soak"}}'
            await self._answer(writer, status, body, close=close, json_body=True)
            return
        events = int(arg)
        delay_s = self.stream_delay_s if kind == "slow" else 0.0
        if ollama:
            await self._ndjson(writer, path, events, delay_s)
        else:
            await self._stream(writer, request_id, events, delay_s > 0)
        if close:
            writer.close()

    async def _ndjson(self, writer: asyncio.StreamWriter, path: str, events: int, delay_s: float) -> None:
        """An Ollama stream: one JSON object a line, the last with ``done`` and the counts."""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
        text_field = "response" if path == OLLAMA_GENERATE else "message"

        def chunk(event: dict[str, Any]) -> bytes:
            data = json.dumps(event).encode() + b"\n"
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        for i in range(events):
            text = f"t{i} "
            value: Any = text if text_field == "response" else {"role": "assistant", "content": text}
            writer.write(chunk({"model": "m", text_field: value, "done": False}))
            await writer.drain()
            if delay_s:
                await asyncio.sleep(delay_s)
        writer.write(chunk({"model": "m", "done": True, "prompt_eval_count": 3, "eval_count": events}) + b"0\r\n\r\n")
        await writer.drain()


# -- the real llama.cpp, as its own process -----------------------------------------------------------
class LlamaBackendProcess:
    """``clairvoyant backend`` (llama.cpp + SmolLM2, 1 thread, 1 slot) as a child process that can
    be killed (SIGKILL) and started again on the same port."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = log_dir / "llama-backend.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> LlamaBackendProcess:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
        }
        argv = [sys.executable, "-m", "clairvoyant", "backend", "--port", str(self.port), "--threads", "1"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, cwd=REPO)
        wait_healthy(self.proc, f"{self.base_url}/health", timeout_s, "clairvoyant backend", self.log_path)
        return self

    def kill(self) -> None:
        """SIGKILL the llama.cpp server (``clairvoyant backend`` runs it in a child of its own),
        then ``clairvoyant backend`` itself."""
        if self.proc is not None and self.proc.poll() is None:
            for pid in children(self.proc.pid):
                os.kill(pid, signal.SIGKILL)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


# -- the plan -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Plan:
    """One request of the soak."""

    index: int
    backend: str  # "fake" or "llama": which proxy it goes through
    path: str
    stream: bool
    behaviour: str  # "plain", "leave", "stall", "status:NNN"
    tenant: str  # fake: its API key's tenant; llama: the tenant header
    priority: int
    deadline_s: float | None  # X-Clairvoyant-Deadline
    model: str

    @property
    def request_id(self) -> str:
        return f"soak-{self.index}"


FAKE_FAULTS = (("leave", 0.01), ("stall", 0.003), ("status:400", 0.01), ("status:404", 0.005),
               ("status:500", 0.01), ("status:503", 0.005))  # fmt: skip
FAKE_PATHS = (OPENAI_CHAT, OPENAI_COMPLETIONS, OLLAMA_CHAT, OLLAMA_GENERATE)


def make_plan(n: int, *, llama_share: float, seed: int = 0, unique_tenants: bool = True) -> list[Plan]:
    """``n`` requests in a seeded random order: ``llama_share`` of them through the llama.cpp proxy
    (OpenAI dialects; 5% left mid-stream; each tenant header new when ``unique_tenants``, so the
    proxy meets a stream of tenants it never sees again), the rest through the fake backend's
    (the four dialects, four keyed tenants, the faults of ``FAKE_FAULTS`` at their rates). The
    first of each fault kind comes within the first 50 requests, so a short run has them all."""
    rng = random.Random(seed)
    plans = []
    forced = [kind for kind, _ in FAKE_FAULTS]
    for index in range(n):
        priority = rng.choice((0, 0, 0, 1, 5, 10))
        deadline_s = rng.choice((None,) * 8 + (0.05, 30.0))
        if llama_share and rng.random() < llama_share:
            stream = rng.random() < 0.5
            behaviour = "leave" if stream and rng.random() < 0.1 else "plain"
            tenant = f"t{index}" if unique_tenants else rng.choice(TENANTS)
            path = rng.choice((OPENAI_CHAT, OPENAI_CHAT, OPENAI_COMPLETIONS))
            plans.append(Plan(index, "llama", path, stream, behaviour, tenant, priority, deadline_s, "smollm2"))
            continue
        behaviour = "plain"
        if forced and index % 7 == 3:
            behaviour = forced.pop(0)
        else:
            draw = rng.random()
            for kind, rate in FAKE_FAULTS:
                if draw < rate:
                    behaviour = kind
                    break
                draw -= rate
        stream = behaviour in ("leave", "stall") or rng.random() < 0.4
        path = rng.choice(FAKE_PATHS)
        model = rng.choice(MODELS)
        plans.append(Plan(index, "fake", path, stream, behaviour, rng.choice(TENANTS), priority, deadline_s, model))
    return plans


def api_keys_setting() -> tuple[str, dict[str, str]]:
    """The fake proxy's ``api_keys`` (JSON, as CLAIRVOYANT_API_KEYS) and each tenant's key text:
    tenant c may have 4 requests in the system, tenant d 3,000 a minute."""
    from clairvoyant.proxy.access import hash_key

    keys = {tenant: f"soak-key-{tenant}" for tenant in TENANTS}
    limits: dict[str, dict[str, int]] = {"c": {"max_concurrent": 4}, "d": {"requests_per_minute": 3000}}
    entries = [{"hash": hash_key(key), "tenant": t, "max_priority": 10, **limits.get(t, {})} for t, key in keys.items()]
    return json.dumps(entries), keys


# -- the clients -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Outcome:
    """What one client saw."""

    plan: Plan
    status: int | None  # None: no answer at all
    ended: str  # "whole", "error_event" (a stream ended by an error), "cut", "left" (the client left), "none"
    echoed_id: bool  # the answer's X-Request-Id is the request's (True when there is no answer to read)
    detail: str = ""

    @property
    def lost(self) -> bool:
        """No answer, or a stream that stopped without its end or an error (the client did not leave)."""
        return self.status is None or self.ended == "cut"


def _body(plan: Plan) -> dict[str, Any]:
    text = "Say OK." if plan.index % 2 else "Name three colours."
    body: dict[str, Any] = {"model": plan.model, "stream": plan.stream}
    if plan.path in (OPENAI_CHAT, OLLAMA_CHAT):
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if plan.backend == "llama":
        body.update({"max_tokens": 24 if plan.behaviour == "leave" else 6, "temperature": 0.0})
    elif plan.path in OLLAMA_PATHS:
        body["options"] = {"num_predict": 8}
    else:
        body["max_tokens"] = 8
    return body


def _headers(plan: Plan, keys: dict[str, str]) -> dict[str, str]:
    headers = {"content-type": "application/json", "x-request-id": plan.request_id,
               "x-clairvoyant-priority": str(plan.priority)}  # fmt: skip
    if plan.deadline_s is not None:
        headers["x-clairvoyant-deadline"] = f"{plan.deadline_s:g}"
    if plan.backend == "fake":
        headers["authorization"] = f"Bearer {keys[plan.tenant]}"
    else:
        headers["x-clairvoyant-tenant"] = plan.tenant
    behaviour = {"leave": f"slow:{LEAVE_EVENTS}", "stall": f"big:{STALL_EVENTS}"}.get(plan.behaviour, plan.behaviour)
    if plan.backend == "fake" and behaviour != "plain":
        headers[BEHAVIOUR_HEADER] = behaviour
    return headers


def stream_end(path: str, body: bytes) -> str:
    """How a streamed answer's body ended: "whole", "error_event" or "cut"."""
    text = body.decode("utf-8", "replace")
    if path not in OLLAMA_PATHS:
        return {"done": "whole", "error": "error_event"}.get(sse_outcome(text), "cut")
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        last = json.loads(lines[-1]) if lines else None
    except ValueError:
        return "cut"
    if isinstance(last, dict) and last.get("done") is True:
        return "whole"
    return "error_event" if isinstance(last, dict) and "error" in last else "cut"


async def _plain(client: httpx.AsyncClient, base_url: str, plan: Plan, keys: dict[str, str]) -> Outcome:
    try:
        async with client.stream(
            "POST", base_url + plan.path, content=json.dumps(_body(plan)).encode(), headers=_headers(plan, keys)
        ) as response:
            body = await response.aread()
            status = response.status_code
            echoed = (
                response.headers.get("x-request-id") in (plan.request_id, None)
                if status != 200
                else (response.headers.get("x-request-id") == plan.request_id)
            )
    except httpx.HTTPError as exc:
        return Outcome(plan, None, "none", True, f"{type(exc).__name__}: {exc}"[:200])
    ended = stream_end(plan.path, body) if plan.stream and status == 200 else "whole"
    return Outcome(plan, status, ended, echoed, "" if ended != "cut" else body[-200:].decode("latin-1"))


def _raw_request(plan: Plan, port: int, keys: dict[str, str]) -> bytes:
    body = json.dumps(_body(plan)).encode()
    headers = {
        **_headers(plan, keys),
        "host": f"127.0.0.1:{port}",
        "content-length": str(len(body)),
        "connection": "close",
    }
    head = f"POST {plan.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode() + body


async def _raw(plan: Plan, port: int, keys: dict[str, str], timeout_s: float) -> Outcome:
    """A client on a raw socket: ``leave`` reads the head and the first event, then goes (a reset
    or a close, by turns); ``stall`` reads nothing for ``STALL_S`` with a small receive buffer,
    then reads the rest in small pieces."""
    sock = socket.socket()
    if plan.behaviour == "stall":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    data = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, _raw_request(plan, port, keys))
        if plan.behaviour == "stall":
            await asyncio.sleep(STALL_S)
        while time.monotonic() < deadline:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 1024 if plan.behaviour == "stall" else 65536),
                                           deadline - time.monotonic())  # fmt: skip
            if not chunk:
                break
            data += chunk
            if (
                plan.behaviour == "leave"
                and b"\r\n\r\n" in data
                and (status_of(bytes(data)) != 200 or data.split(b"\r\n\r\n", 1)[1].count(b"\n") >= 3)
            ):
                if plan.index % 2:  # a reset, as a killed client's kernel sends
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                status = status_of(bytes(data))
                return Outcome(plan, status, "left" if status == 200 else "whole", _echo(data, plan))
            if plan.behaviour == "stall" and len(data) % 16384 < 1024:
                await asyncio.sleep(0.005)
    except (TimeoutError, ConnectionError, OSError) as exc:
        status = status_of(bytes(data))
        return Outcome(plan, status, "cut" if status else "none", _echo(data, plan), f"{type(exc).__name__}")
    finally:
        sock.close()
    answers, _ = parse_responses(bytes(data), eof=True)
    if not answers:
        return Outcome(plan, status_of(bytes(data)), "cut" if status_of(bytes(data)) else "none", False, "unparsed")
    answer = answers[0]
    ended = stream_end(plan.path, answer.body) if answer.status == 200 else "whole"
    return Outcome(plan, answer.status, ended, _echo(data, plan))


def _echo(data: bytearray, plan: Plan) -> bool:
    head = bytes(data).split(b"\r\n\r\n", 1)[0].lower()
    return f"x-request-id: {plan.request_id}".encode() in head or b"x-request-id" not in head


async def send(client: httpx.AsyncClient, base_url: str, port: int, plan: Plan, keys: dict[str, str],
               timeout_s: float = 120.0) -> Outcome:  # fmt: skip
    """Send ``plan`` as its behaviour says; never raises for the network."""
    if plan.behaviour in ("leave", "stall"):
        return await _raw(plan, port, keys, timeout_s)
    return await _plain(client, base_url, plan, keys)


# -- what a process holds ------------------------------------------------------------------------------
def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def children(pid: int) -> dict[int, bytes]:
    """The processes whose parent is ``pid``, with their command lines."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out[int(entry)] = cmdline
    return out


def learner_pid(proxy_pid: int) -> int | None:
    """The proxy's learner worker: its child started by multiprocessing's spawn."""
    return next((pid for pid, cmdline in children(proxy_pid).items() if b"spawn_main" in cmdline), None)


_SAMPLE = re.compile(
    r'^clairvoyant_(event_loop_tasks|retained_entries)(?:\{structure="([a-z_]+)"\})? ([0-9.e+-]+)$', re.M
)


@dataclass(slots=True)
class ProcessFigures:
    """One look at a proxy process."""

    rss_kib: int
    fds: int
    tasks: int | None  # asyncio tasks on its loop (None: /metrics did not answer)
    learner_rss_kib: int | None
    retained: dict[str, int] = field(default_factory=dict)


async def process_figures(client: httpx.AsyncClient, base_url: str, pid: int) -> ProcessFigures:
    """RSS and open fds from /proc; tasks and retained entries from /metrics; the learner's RSS."""
    tasks: int | None = None
    retained: dict[str, int] = {}
    try:
        text = (await client.get(base_url + "/metrics", timeout=10)).text
        for name, structure, value in _SAMPLE.findall(text):
            if name == "event_loop_tasks":
                tasks = int(float(value))
            else:
                retained[structure] = int(float(value))
    except httpx.HTTPError:
        pass
    learner = learner_pid(pid)
    learner_rss = None
    if learner is not None:
        try:
            learner_rss = rss_kib(learner)
        except OSError:
            pass
    return ProcessFigures(rss_kib(pid), open_fds(pid), tasks, learner_rss, retained)


# -- the tally ------------------------------------------------------------------------------------------
@dataclass
class Tally:
    """Answers as they come: statuses, how they ended, and what went wrong."""

    outcomes: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    ends: Counter[str] = field(default_factory=Counter)
    by_backend: Counter[str] = field(default_factory=Counter)
    lost: list[Outcome] = field(default_factory=list)
    answered_ids: Counter[str] = field(default_factory=Counter)
    resendable_ids: set[str] = field(default_factory=set)  # the backend answered 503: sent again by design
    wrong_id: int = 0
    faults: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: Outcome) -> None:
        self.outcomes += 1
        self.answered_ids[outcome.plan.request_id] += 1
        self.statuses[str(outcome.status) if outcome.status is not None else "none"] += 1
        self.ends[outcome.ended] += 1
        self.by_backend[outcome.plan.backend] += 1
        if outcome.lost:
            self.lost.append(outcome)
        if not outcome.echoed_id:
            self.wrong_id += 1
        if outcome.plan.behaviour == "status:503":
            self.resendable_ids.add(outcome.plan.request_id)
        kind = _fault_of(outcome)
        if kind is not None:
            self.faults[kind] += 1

    def duplicated(self, ledger: Counter[str]) -> int:
        """Requests the backend read more than once, and answers counted twice for one request. A
        request the backend answered 503 (it had not started) is sent again by design: not counted
        here (``resent_after_503``)."""
        backend = sum(n - 1 for i, n in ledger.items() if n > 1 and i not in self.resendable_ids)
        return backend + sum(n - 1 for n in self.answered_ids.values() if n > 1)

    def duplicated_ids(self, ledger: Counter[str]) -> list[str]:
        return [i for i, n in ledger.items() if n > 1 and i not in self.resendable_ids]

    def resent_after_503(self, ledger: Counter[str]) -> tuple[int, int]:
        """(requests the backend answered 503, the most times one of them was sent)."""
        return len(self.resendable_ids), max((ledger[i] for i in self.resendable_ids), default=0)


def _fault_of(outcome: Outcome) -> str | None:
    behaviour = outcome.plan.behaviour
    if behaviour == "leave":
        return "client_left"
    if behaviour == "stall":
        return "client_stalled"
    if behaviour.startswith("status:"):
        return "backend_4xx" if behaviour[7] == "4" else "backend_5xx"
    return None


async def run_workers(
    plans: list[Plan],
    workers: int,
    one: Callable[[Plan], Awaitable[Outcome]],
    done: Callable[[Outcome], Awaitable[None]],
) -> None:
    """Send ``plans`` in order, ``workers`` at a time; ``done`` sees each outcome."""
    queue: asyncio.Queue[Plan] = asyncio.Queue()
    for plan in plans:
        queue.put_nowait(plan)

    async def worker() -> None:
        while not queue.empty():
            outcome = await one(queue.get_nowait())
            await done(outcome)

    await asyncio.gather(*(worker() for _ in range(max(1, min(workers, len(plans))))))
