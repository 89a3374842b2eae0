"""Several proxy replicas sharing one queue, one set of slots and one set of limits through Redis:
what the backends see, measured by the backends themselves, against one replica in the same run.

Every backend is a ``RecordingBackend`` (benchmarks/harness/recording_backend.py) in this process:
it generates exactly the body's ``max_tokens`` tokens at a fixed pace, keeps its own slot count and
counts every moment above it, and records when each request started and ended, tagged with the
replica that sent it. Redis is a real ``redis-server`` (harness/redis_process.py) on a free loopback
port. Each proxy is ``python -m clairvoyant serve`` (encoder and online learning off: neither is
under test here, and they cost CPU on a shared machine).

Each case runs in these modes, side by side, each with fresh proxies and backends:

    one       one replica, scheduling in the process (the baseline; always runs)
    cluster   --replicas replicas naming one Redis and cluster (--redis --cluster --replica-id
              --lease-s 15); printed as "cluster mode not available in this tree" when
              ``clairvoyant serve --help`` has no --redis
    local     --replicas replicas with no Redis, as without cluster mode: each believes it owns every
              slot. Not a target: it shows that each instrument catches the failure it is for.

Cases (``--cases``, comma-separated; all by default):

    oversubscription  2 backends of 1 slot; --requests (600) requests over the replicas, forced
                      lengths 4-16 or 60-150 tokens, 4 tenants, priorities 0 and 5. In cluster and
                      local modes one replica is killed with SIGKILL a third of the way in (requests go to the
                      survivors from then on), at a moment it holds a slot; in cluster mode Redis
                      is restarted empty at two thirds.
                      Violations at the backends (target 0); every request sent to a surviving
                      replica answered exactly once (an answer each, none served twice); seconds
                      from the kill until each slot the killed replica held serves a survivor
                      (target <= lease_s + 1; judged only with 0 violations).
    fair_share        tenants A (weight 1) and B (weight 3) as [[tenants]], A on the first replica
                      and B on the second, each keeping 6 requests waiting on one 1-slot backend.
                      B's share of the served seconds (target 75% +- 10%).
    limits            a key with max_concurrent 2 and requests_per_minute 30, 80 requests from 3
                      clients over the replicas (40 ms each): most of its requests at the backend at once
                      (target <= 2), most admitted in any 60 s (target <= 30), every refusal a 429
                      with Retry-After.
    supersede         a holder on replica 1; an edit with X-Clairvoyant-Supersede on replica 2, then
                      one with the same key on replica 3: the first answered 409 before the holder
                      ends and never sent, the second answered 200.
    deadline          a holder on replica 1; a request with X-Clairvoyant-Deadline: 0.5 on replica 2:
                      503 queue_deadline, never sent.
    cost              TTFB p50 through a replica with Redis against one without, requests
                      alternated between the two (target <= +1.0 ms); and, with a queue always
                      waiting, from a slot freed (the backend's last byte) to the next request read
                      by that backend, p50 (target <= 2 ms).
    redis_gone        2 backends of 1 slot under steady load; Redis paused (SIGSTOP: unreachable
                      without refusing) for --gone-s (10) seconds mid-run. Violations (target 0),
                      lost requests (target 0), a WARNING naming Redis in a replica's log, /readyz
                      200 "degraded" while it is gone, seconds from its return until every replica's
                      /readyz is no longer degraded (target <= 2; "never degraded" fails it).

    PYTHONPATH=src python benchmarks/bench_replicas.py
    PYTHONPATH=src python benchmarks/bench_replicas.py --cases limits,supersede --modes one,local
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.proxy_process import PROXY_SRC, ProxyProcess, serve_accepts  # noqa: E402
from harness.recording_backend import RecordingBackend, Served, most_at_once  # noqa: E402
from harness.redis_process import RedisProcess  # noqa: E402
from harness.results import add_json_option, write_json  # noqa: E402
from harness.verdicts import Row, percentile, print_table  # noqa: E402

from clairvoyant.proxy.access import hash_key  # noqa: E402

CASES = ("oversubscription", "fair_share", "limits", "supersede", "deadline", "cost", "redis_gone")
MODES = ("one", "cluster", "local")
LEASE_S = 15.0
CLUSTER = "bench"
NOT_AVAILABLE = "cluster mode not available in this tree"
SHORT_PROMPT = "What is 2+2? Answer with one word."
LONG_PROMPT = "Write a detailed essay on the history of the printing press, with many examples."
FAST = {"encoder": False, "online_learning": False}  # neither is under test; both cost CPU


def cluster_supported(src: Path) -> bool:
    """Whether the tree at ``src`` has cluster mode: ``clairvoyant serve --help`` names --redis."""
    return serve_accepts("--redis", src)


# -- requests ---------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One request as its client saw it."""

    rid: str
    replica: str
    status: int | None = None  # None: no answer (connection lost or timed out)
    code: str = ""  # the error object's code, on a refusal
    retry_after: str | None = None
    done: bool = False  # a stream that ended with [DONE]
    sent_s: float = 0.0
    ttfb_s: float | None = None  # to the answer's first body byte
    answered_s: float | None = None
    error: str = ""


def chat(tag: str, tokens: int, prompt: str = SHORT_PROMPT) -> dict[str, Any]:
    return {"model": "m", "user": tag, "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip


async def post(
    client: httpx.AsyncClient, base: str, rid: str, replica: str, body: dict[str, Any], headers: dict[str, str]
) -> Answer:
    answer = Answer(rid, replica, sent_s=time.monotonic())
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as response:
            answer.status = response.status_code
            answer.retry_after = response.headers.get("retry-after")
            chunks = []
            async for chunk in response.aiter_bytes():
                if answer.ttfb_s is None:
                    answer.ttfb_s = time.monotonic() - answer.sent_s
                chunks.append(chunk)
            text = b"".join(chunks).decode(errors="replace")
        answer.answered_s = time.monotonic()
        if answer.status == 200:
            answer.done = text.rstrip().endswith("data: [DONE]")
            if not answer.done:  # how it ended instead: its last event
                answer.code = (text.strip().rsplit("\n", 1)[-1] or "empty")[:80]
        else:
            try:
                data = json.loads(text)
            except ValueError:
                data = text[:60]
            error = data.get("error", data) if isinstance(data, dict) else data
            answer.code = str(error.get("code", "")) if isinstance(error, dict) else str(error)
    except httpx.HTTPError as exc:
        answer.error = type(exc).__name__
    return answer


def tag_of(replica: str, rid: str) -> str:
    return f"{replica}|{rid}"


def replica_of(served: Served) -> str:
    return served.tag.split("|", 1)[0]


def rid_of(served: Served) -> str:
    return served.tag.split("|", 1)[-1]


# -- the replicas -----------------------------------------------------------------------------------


@dataclass
class Fleet:
    mode: str
    replicas: list[ProxyProcess]
    redis: RedisProcess | None

    def alive(self) -> list[ProxyProcess]:
        return [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]


@contextmanager
def fleet(mode: str, count: int, log_dir: Path, backends: Sequence[RecordingBackend], src: Path,
          label: str | None = None, **settings: Any) -> Iterator[Fleet]:  # fmt: skip
    """``count`` replicas (one in mode "one") in front of ``backends`` as a pool (each with the
    backend's own slot count), with Redis and the cluster flags in mode "cluster"."""
    n = 1 if mode == "one" else count
    pool = json.dumps([{"url": b.base_url, "name": f"b{i}", "slots": b.slots or 1} for i, b in enumerate(backends)])
    with ExitStack() as stack:
        redis = None
        if mode == "cluster":
            redis = RedisProcess(log_dir).start()
            stack.callback(redis.stop)
        replicas = []
        for i in range(n):
            name = f"{label or mode}-r{i}"  # its replica id, its log's name and its requests' tag
            args = []
            if redis is not None:
                args = ["--redis", redis.url, "--cluster", CLUSTER, "--replica-id", name, "--lease-s", f"{LEASE_S:g}"]
            proxy = ProxyProcess(
                name, backends[0].base_url, log_dir, src=src, args=args, backends=pool, **{**FAST, **settings}
            )
            stack.callback(proxy.stop)
            replicas.append(proxy.start())
        yield Fleet(mode, replicas, redis)


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(120), limits=httpx.Limits(max_connections=500))


def figures_line(case: str, mode: str, figures: dict[str, Any]) -> None:
    shown = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    print(f"  [{case} / {mode}] {shown}", flush=True)


# -- oversubscription ---------------------------------------------------------------------------------


def answered_once(answers: Sequence[Answer], served: Sequence[Served], survivors: set[str]) -> dict[str, Any]:
    """For requests sent to a replica in ``survivors``: how many got no answer, how many got a
    whole 200, any other status, and how many the backends served more than once."""
    to_survivors = [a for a in answers if a.replica in survivors]
    times_served = Counter(rid_of(s) for s in served)
    return {
        "sent_to_survivors": len(to_survivors),
        "unanswered": sum(a.status is None for a in to_survivors),
        "whole_200": sum(a.status == 200 and a.done for a in to_survivors),
        "other_status": sum(a.status is not None and not (a.status == 200 and a.done) for a in to_survivors),
        "served_twice": sum(times_served[a.rid] > 1 for a in to_survivors),
        "failed_after_backend_read": sum(
            times_served[a.rid] > 0 and not (a.status == 200 and a.done) for a in to_survivors
        ),
        "other_answers": dict(Counter(f"{a.status} {a.code}".strip() for a in to_survivors
                                      if a.status is not None and not (a.status == 200 and a.done))),
    }  # fmt: skip


def slots_back_s(backends: Sequence[RecordingBackend], killed: str, kill_s: float) -> float | None:
    """Seconds from the kill until every backend the killed replica was using at the kill has begun
    a survivor's request after it; 0.0 when it held none; None when one never did."""
    worst = 0.0
    for backend in backends:
        held = [s for s in backend.served if replica_of(s) == killed and s.start_s <= kill_s
                and (s.end_s is None or s.end_s > kill_s)]  # fmt: skip
        if not held:
            continue
        after = [s.start_s for s in backend.served if replica_of(s) != killed and s.start_s > kill_s]
        if not after:
            return None
        worst = max(worst, min(after) - kill_s)
    return worst


async def oversubscription(mode: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    backends = [RecordingBackend(slots=1, token_s=args.token_s).start() for _ in range(2)]
    rng = random.Random(7)
    n = args.requests
    plan = [(f"q{i}", rng.choice([rng.randint(4, 16)] * 7 + [rng.randint(60, 150)] * 3)) for i in range(n)]
    figures: dict[str, Any] = {}
    try:
        with fleet(mode, args.replicas, log_dir, backends, args.proxy_src, tenants=json.dumps(
            [{"name": f"t{i}", "weight": 1 + i % 2} for i in range(4)]
        )) as f:  # fmt: skip
            killed = f.replicas[-1].name if len(f.replicas) > 1 else ""  # cluster and local: the same kill
            kill_s = 0.0
            restart_away_s = None
            started = itertools.count()
            answers: list[Answer] = []
            gate = asyncio.Semaphore(8 * len(f.replicas))  # a queue always waiting at every replica

            async def one(i: int, rid: str, tokens: int, http: httpx.AsyncClient) -> None:
                async with gate:
                    nth = next(started)
                    alive = [r for r in f.alive() if r.name != killed or kill_s == 0.0]
                    replica = alive[nth % len(alive)]
                    headers = {"X-Clairvoyant-Tenant": f"t{i % 4}", "X-Clairvoyant-Priority": str(5 * (i % 2))}
                    prompt = SHORT_PROMPT if tokens < 30 else LONG_PROMPT
                    answers.append(await post(http, replica.url, rid, replica.name,
                                              chat(tag_of(replica.name, rid), tokens, prompt), headers))  # fmt: skip

            async def faults() -> None:
                nonlocal kill_s, restart_away_s
                if not killed:
                    return
                deadline_s = time.monotonic() + 60
                # A third of the way in, at a moment it holds a slot (and so has requests waiting).
                while len(answers) < n // 3 or not any(
                    replica_of(s) == killed and s.end_s is None for b in backends for s in b.served
                ):
                    if time.monotonic() > deadline_s:
                        break
                    await asyncio.sleep(0.005)
                victim = next(r for r in f.replicas if r.name == killed)
                assert victim.proc is not None
                victim.proc.kill()  # SIGKILL, while it holds slots and has requests waiting
                kill_s = time.monotonic()
                print(f"  [oversubscription / {mode}] killed {killed} after {len(answers)} answers", flush=True)
                if f.redis is None:
                    return
                while len(answers) < 2 * n // 3:
                    await asyncio.sleep(0.05)
                restart_away_s = await asyncio.to_thread(f.redis.restart_empty)
                print(f"  [oversubscription / {mode}] Redis restarted empty after {len(answers)} answers", flush=True)

            t0 = time.monotonic()
            async with client() as http:
                await asyncio.gather(faults(), *(one(i, rid, tok, http) for i, (rid, tok) in enumerate(plan)))
            took_s = time.monotonic() - t0
            served = [s for b in backends for s in b.served]
            survivors = {r.name for r in f.replicas if r.name != killed}
            figures = {
                "requests": n, "replicas": len(f.replicas), "seconds": took_s,
                "violations": sum(b.violations for b in backends),
                "max_at_once_per_backend": [b.max_in_progress for b in backends],
                **answered_once(answers, served, survivors),
            }  # fmt: skip
            if killed:
                back = slots_back_s(backends, killed, kill_s)
                figures["killed"] = killed
                figures["killed_held_at_kill"] = sum(
                    any(replica_of(s) == killed and s.start_s <= kill_s and (s.end_s or 1e18) > kill_s
                        for s in b.served) for b in backends
                )  # fmt: skip
                figures["killed_slots_back_s"] = back if back is not None else "never"
                figures["redis_away_s"] = restart_away_s
    finally:
        for b in backends:
            b.stop()
    return figures


def oversubscription_rows(mode: str, fig: dict[str, Any]) -> list[Row]:
    ok_once = fig["unanswered"] == 0 and fig["served_twice"] == 0
    rows = [
        Row(
            f"oversubscription [{mode}]: violations at the backends",
            "0",
            str(fig["violations"]),
            fig["violations"] == 0 if mode != "local" else None,
            fig,
        ),  # fmt: skip
        Row(
            f"oversubscription [{mode}]: answered exactly once",
            "0 unanswered, 0 served twice",
            f"{fig['unanswered']} unanswered, {fig['served_twice']} served twice of {fig['sent_to_survivors']}",
            ok_once if mode != "local" else None,
        ),  # fmt: skip
    ]
    if "killed_slots_back_s" in fig:
        back = fig["killed_slots_back_s"]
        held = fig["killed_held_at_kill"]
        rows.append(Row(f"oversubscription [{mode}]: killed replica's slots back", f"<= {LEASE_S + 1:g} s",
                        (f"{back:.2f} s" if isinstance(back, float) else str(back)) + f" ({held} held at the kill)",
                        # Slots coming back mean something only where they were respected.
                        (isinstance(back, float) and back <= LEASE_S + 1 and held > 0 and fig["violations"] == 0)
                        if mode == "cluster" else None))  # fmt: skip
    return rows


# -- fair share --------------------------------------------------------------------------------------


async def closed_loop(http: httpx.AsyncClient, base: str, replica: str, prefix: str, outstanding: int,
                      until_s: float, tokens: int, headers: dict[str, str]) -> list[Answer]:  # fmt: skip
    """``outstanding`` clients, each sending its next request as soon as its last is answered."""
    answers: list[Answer] = []
    counter = itertools.count()

    async def worker() -> None:
        while time.monotonic() < until_s:
            rid = f"{prefix}{next(counter)}"
            answers.append(await post(http, base, rid, replica, chat(tag_of(replica, rid), tokens), headers))

    await asyncio.gather(*(worker() for _ in range(outstanding)))
    return answers


async def fair_share(mode: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    backend = RecordingBackend(slots=1, token_s=args.token_s).start()
    weight_a, weight_b = args.weights
    tenants = json.dumps([{"name": "A", "weight": weight_a}, {"name": "B", "weight": weight_b}])
    try:
        with fleet(mode, args.replicas, log_dir, [backend], args.proxy_src, tenants=tenants) as f:
            ra, rb = f.replicas[0], f.replicas[min(1, len(f.replicas) - 1)]
            async with client() as http:
                # The service-time model learns seconds from answers; while cold, its predictions
                # (what fair share charges) are far from the 50 ms these take. Warm every replica.
                for i in range(args.fair_warmup):
                    for r in f.replicas:
                        await post(http, r.url, f"W{i}", r.name, chat(tag_of(r.name, f"W{i}"), 25), {})
            t0 = time.monotonic()
            until = t0 + args.fair_s
            async with client() as http:
                await asyncio.gather(
                    closed_loop(http, ra.url, ra.name, "A", 6, until, 25, {"X-Clairvoyant-Tenant": "A"}),
                    closed_loop(http, rb.url, rb.name, "B", 6, until, 25, {"X-Clairvoyant-Tenant": "B"}),
                )
        # Served seconds while both were backlogged: from 1 s in (the queues filled) to the end.
        window = [s for s in backend.served if t0 + 1.0 <= s.start_s <= until]
        seconds = {t: sum(s.seconds for s in window if rid_of(s).startswith(t)) for t in "AB"}
        total = seconds["A"] + seconds["B"]
        return {"b_share": seconds["B"] / total if total else float("nan"),
                "b_share_target": weight_b / (weight_a + weight_b), "a_served_s": seconds["A"],
                "b_served_s": seconds["B"], "violations": backend.violations,
                "max_at_once": backend.max_in_progress}  # fmt: skip
    finally:
        backend.stop()


def fair_share_rows(mode: str, fig: dict[str, Any]) -> list[Row]:
    share, target = fig["b_share"], fig["b_share_target"]
    return [Row(f"fair share [{mode}]: B's share of served seconds", f"{100 * target:.0f}% +- 10%",
                f"{100 * share:.1f}% ({fig['violations']} violations)",
                abs(share - target) <= 0.10 if mode != "local" else None, fig)]  # fmt: skip


# -- limits ------------------------------------------------------------------------------------------

LIMITED_KEY = "cv-bench-limited-key"
LIMITED_REQUESTS = 80  # well beyond its requests_per_minute, sent within seconds
LIMITED_CLIENTS = 3  # one more than its max_concurrent


def most_in_window(times_s: Sequence[float], window_s: float) -> int:
    """The most of ``times_s`` inside any window of ``window_s`` seconds (both ends included)."""
    ordered = sorted(times_s)
    best, lo = 0, 0
    for hi, t in enumerate(ordered):
        while t - ordered[lo] > window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


async def limits(mode: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    backend = RecordingBackend(slots=4, token_s=args.token_s).start()  # room for more than the key may use
    keys = json.dumps([{"hash": hash_key(LIMITED_KEY), "tenant": "k", "max_concurrent": 2,
                        "requests_per_minute": 30}])  # fmt: skip
    try:
        with fleet(mode, args.replicas, log_dir, [backend], args.proxy_src, api_keys=keys) as f:
            headers = {"Authorization": f"Bearer {LIMITED_KEY}"}
            counter = itertools.count()
            answers: list[Answer] = []

            async def worker(http: httpx.AsyncClient) -> None:
                while (i := next(counter)) < LIMITED_REQUESTS:
                    replica = f.replicas[i % len(f.replicas)]
                    answer = await post(http, replica.url, f"k{i}", replica.name,
                                        chat(tag_of(replica.name, f"k{i}"), 20), headers)  # fmt: skip
                    answers.append(answer)
                    if answer.status == 429:
                        await asyncio.sleep(0.1)  # a client backing off a little, not Retry-After's seconds

            async with client() as http:
                await asyncio.gather(*(worker(http) for _ in range(LIMITED_CLIENTS)))
        refused = [a for a in answers if a.status == 429]
        return {
            "sent": len(answers), "admitted": len(backend.served),
            "most_at_once": most_at_once(backend.served),
            "most_in_60s": most_in_window([s.start_s for s in backend.served], 60.0),
            "refused_429": len(refused), "refused_codes": dict(Counter(a.code for a in refused)),
            "refused_without_retry_after": sum(a.retry_after is None for a in refused),
            "other": dict(Counter(str(a.status) for a in answers if a.status not in (200, 429))),
        }  # fmt: skip
    finally:
        backend.stop()


def limits_rows(mode: str, fig: dict[str, Any]) -> list[Row]:
    judged = mode != "local"
    return [
        Row(
            f"limits [{mode}]: most of the key's requests at once",
            "<= 2",
            str(fig["most_at_once"]),
            fig["most_at_once"] <= 2 if judged else None,
            fig,
        ),  # fmt: skip
        Row(
            f"limits [{mode}]: most admitted in any 60 s",
            "<= 30",
            f"{fig['most_in_60s']} of {fig['sent']}",
            fig["most_in_60s"] <= 30 if judged else None,
        ),  # fmt: skip
        Row(
            f"limits [{mode}]: refusals are 429 with Retry-After",
            "all",
            f"{fig['refused_429']} x 429 {fig['refused_codes']}, {fig['refused_without_retry_after']} without "
            f"Retry-After, other {fig['other']}",
            (
                fig["refused_without_retry_after"] == 0
                and not fig["other"]
                and fig["admitted"] + fig["refused_429"] == fig["sent"]
            )
            if judged
            else None,
        ),  # fmt: skip
    ]


# -- supersede and deadlines --------------------------------------------------------------------------


async def hold(http: httpx.AsyncClient, backend: RecordingBackend, replica: ProxyProcess) -> asyncio.Task[Answer]:
    """A request holding the backend's one slot (2000 tokens); returns once the backend has it."""
    task = asyncio.create_task(
        post(http, replica.url, "holder", replica.name, chat(tag_of(replica.name, "holder"), 2000), {})
    )
    deadline = time.monotonic() + 30
    while not backend.served and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return task


async def waiting_at(http: httpx.AsyncClient, replica: ProxyProcess, count: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        queue = (await http.get(f"{replica.url}/queue")).json()
        if queue.get("waiting_count", 0) >= count:
            return
        await asyncio.sleep(0.02)


async def supersede(mode: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    backend = RecordingBackend(slots=1, token_s=args.token_s).start()
    try:
        with fleet(mode, args.replicas, log_dir, [backend], args.proxy_src) as f:
            r = f.replicas
            first_at, second_at = r[min(1, len(r) - 1)], r[min(2, len(r) - 1)]
            edit = {"X-Clairvoyant-Supersede": "editor:file.py"}
            async with client() as http:
                holder = await hold(http, backend, r[0])
                first = asyncio.create_task(
                    post(http, first_at.url, "edit1", first_at.name, chat(tag_of(first_at.name, "edit1"), 5), edit)
                )
                await asyncio.sleep(0.05)
                await waiting_at(http, first_at, 1)
                second = await post(http, second_at.url, "edit2", second_at.name,
                                    chat(tag_of(second_at.name, "edit2"), 5), edit)  # fmt: skip
                done = await asyncio.gather(holder, first)
        held, old = done
        served = {rid_of(s) for s in backend.served}
        return {"first_status": old.status, "first_code": old.code, "second_status": second.status,
                "first_sent_to_backend": "edit1" in served, "second_sent_to_backend": "edit2" in served,
                "first_answered_before_holder_ended": (old.answered_s or 1e18) < (held.answered_s or 0.0),
                "violations": backend.violations}  # fmt: skip
    finally:
        backend.stop()


def supersede_rows(mode: str, fig: dict[str, Any]) -> list[Row]:
    ok = (fig["first_status"] == 409 and fig["first_code"] == "superseded" and not fig["first_sent_to_backend"]
          and fig["first_answered_before_holder_ended"] and fig["second_status"] == 200
          and fig["second_sent_to_backend"])  # fmt: skip
    measured = (f"first {fig['first_status']} {fig['first_code'] or ''} (sent: {fig['first_sent_to_backend']}), "
                f"second {fig['second_status']}")  # fmt: skip
    return [Row(f"supersede [{mode}]: edits on two replicas", "409 superseded, never sent; then 200", measured,
                ok if mode != "local" else None, fig)]  # fmt: skip


async def deadline(mode: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    backend = RecordingBackend(slots=1, token_s=args.token_s).start()
    try:
        with fleet(mode, args.replicas, log_dir, [backend], args.proxy_src) as f:
            r = f.replicas
            late_at = r[min(1, len(r) - 1)]
            async with client() as http:
                holder = await hold(http, backend, r[0])
                late = await post(http, late_at.url, "late", late_at.name, chat(tag_of(late_at.name, "late"), 5),
                                  {"X-Clairvoyant-Deadline": "0.5"})  # fmt: skip
                await holder
        return {"status": late.status, "code": late.code, "retry_after": late.retry_after,
                "answered_after_s": (late.answered_s or late.sent_s) - late.sent_s,
                "sent_to_backend": any(rid_of(s) == "late" for s in backend.served),
                "violations": backend.violations}  # fmt: skip
    finally:
        backend.stop()


def deadline_rows(mode: str, fig: dict[str, Any]) -> list[Row]:
    ok = fig["status"] == 503 and fig["code"] == "queue_deadline" and not fig["sent_to_backend"]
    return [Row(f"deadline [{mode}]: 0.5 s, behind a holder elsewhere", "503 queue_deadline, never sent",
                f"{fig['status']} {fig['code']} after {fig['answered_after_s']:.2f} s "
                f"(sent: {fig['sent_to_backend']})", ok if mode != "local" else None, fig)]  # fmt: skip


# -- cost --------------------------------------------------------------------------------------------


def freed_to_next_ms(served: Sequence[Served]) -> list[float]:
    """Per slot freed on a one-slot backend: ms from its last byte to the next request read, for
    the next requests read after it (a request read before the end is an oversubscription, not a gap)."""
    ordered = sorted(served, key=lambda s: s.start_s)
    gaps = []
    for before, after in itertools.pairwise(ordered):
        if before.end_s is not None and after.start_s >= before.end_s:
            gaps.append(1000 * (after.start_s - before.end_s))
    return gaps


async def freed_gaps_ms(mode: str, args: argparse.Namespace, log_dir: Path) -> tuple[list[float], int]:
    """With a queue kept waiting at every replica of ``mode`` in front of one 1-slot backend: ms
    from each slot freed to the next request read there, and the backend's violations."""
    busy = RecordingBackend(slots=1, token_s=args.token_s).start()
    try:
        with fleet(mode, args.replicas, log_dir, [busy], args.proxy_src) as f:
            counter = itertools.count()
            gate = asyncio.Semaphore(6 * len(f.replicas))

            async def one(http: httpx.AsyncClient) -> None:
                async with gate:
                    i = next(counter)
                    replica = f.replicas[i % len(f.replicas)]
                    await post(http, replica.url, f"g{i}", replica.name, chat(tag_of(replica.name, f"g{i}"), 10), {})

            async with client() as http:
                await asyncio.gather(*(one(http) for _ in range(args.cost_requests)))
        return freed_to_next_ms(busy.served[10:]), busy.violations  # the first 10 warm up
    finally:
        busy.stop()


async def cost(mode: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """TTFB: requests one at a time, alternating between this mode's first replica and a replica
    with scheduling in the process, both in front of one idle backend (in mode "one", two
    in-process replicas: what the measure reads when nothing differs). Freed-to-next: this mode,
    then (unless it is "one") one replica in the process, each with a queue kept waiting."""
    figures: dict[str, Any] = {}
    idle = RecordingBackend(slots=1, token_s=0.0005).start()
    try:
        with fleet(mode, args.replicas, log_dir, [idle], args.proxy_src) as f, \
                fleet("one", 1, log_dir, [idle], args.proxy_src, label="in-process") as ref:  # fmt: skip
            ttfb: dict[str, list[float]] = {"this": [], "in_process": []}
            async with client() as http:
                for i in range(args.cost_requests):
                    pair = [("this", f.replicas[0]), ("in_process", ref.replicas[0])]
                    got = {}
                    for label, replica in pair if i % 2 else pair[::-1]:
                        a = await post(http, replica.url, f"c{i}{label}", replica.name,
                                       chat(tag_of(replica.name, f"c{i}{label}"), 4), {})  # fmt: skip
                        got[label] = a.ttfb_s if a.status == 200 else None
                    if i >= 10 and None not in got.values():  # the first 10 warm up
                        for label, seconds in got.items():
                            ttfb[label].append(1000 * (seconds or 0.0))
        figures["ttfb_p50_ms"] = statistics.median(ttfb["this"])
        figures["ttfb_p50_in_process_ms"] = statistics.median(ttfb["in_process"])
        figures["added_ttfb_p50_ms"] = figures["ttfb_p50_ms"] - figures["ttfb_p50_in_process_ms"]
        figures["paired_difference_p50_ms"] = statistics.median(
            a - b for a, b in zip(ttfb["this"], ttfb["in_process"], strict=True)
        )
    finally:
        idle.stop()
    gaps, violations = await freed_gaps_ms(mode, args, log_dir)
    figures["freed_to_next_p50_ms"] = percentile(gaps, 0.5)  # NaN when none: every start overlapped an end
    figures["freed_to_next_p95_ms"] = percentile(gaps, 0.95)
    figures["violations"] = violations
    if mode != "one":
        reference, _ = await freed_gaps_ms("one", args, log_dir)
        figures["freed_to_next_p50_in_process_ms"] = percentile(reference, 0.5)
    return figures


def cost_rows(mode: str, fig: dict[str, Any]) -> list[Row]:
    judged = mode == "cluster"
    in_process = fig.get("freed_to_next_p50_in_process_ms")
    what = "A/A, two in-process replicas: the noise" if mode == "one" else "vs in-process"
    return [
        Row(
            f"cost [{mode}]: added TTFB p50 ({what})",
            "<= +1.0 ms",
            f"{fig['added_ttfb_p50_ms']:+.2f} ms ({fig['ttfb_p50_ms']:.2f} vs {fig['ttfb_p50_in_process_ms']:.2f}; "
            f"paired {fig['paired_difference_p50_ms']:+.2f})",
            fig["added_ttfb_p50_ms"] <= 1.0 if judged else None,
            fig,
        ),  # fmt: skip
        Row(
            f"cost [{mode}]: slot freed to next request read, p50",
            "<= 2 ms",
            f"{fig['freed_to_next_p50_ms']:.2f} ms (p95 {fig['freed_to_next_p95_ms']:.2f}"
            + (f"; in-process {in_process:.2f}" if in_process is not None else "")
            + ")",
            fig["freed_to_next_p50_ms"] <= 2.0 if judged else None,
        ),  # fmt: skip
    ]


# -- Redis gone ---------------------------------------------------------------------------------------


async def redis_gone(mode: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    backends = [RecordingBackend(slots=1, token_s=args.token_s).start() for _ in range(2)]
    try:
        with fleet(mode, args.replicas, log_dir, backends, args.proxy_src) as f:
            readyz: list[tuple[float, str, int, bool]] = []  # (when, replica, status, degraded)
            t0 = time.monotonic()
            pause_at, resume_at = t0 + 5.0, t0 + 5.0 + args.gone_s
            until = resume_at + 5.0
            stop = asyncio.Event()

            async def watch(http: httpx.AsyncClient) -> None:
                while not stop.is_set():
                    for r in f.replicas:
                        try:
                            got = await http.get(f"{r.url}/readyz", timeout=1.0)
                            readyz.append((time.monotonic(), r.name, got.status_code, "degraded" in got.text))
                        except httpx.HTTPError:
                            readyz.append((time.monotonic(), r.name, 0, False))
                    await asyncio.sleep(0.05)

            async def outage() -> None:
                if f.redis is None:
                    return
                await asyncio.sleep(pause_at - time.monotonic())
                f.redis.pause()
                await asyncio.sleep(resume_at - time.monotonic())
                f.redis.resume()

            async with client() as http:
                watcher = asyncio.create_task(watch(http))
                loads = [closed_loop(http, r.url, r.name, f"{r.name}-", 4, until, rng_tokens, {})
                         for r, rng_tokens in zip(f.replicas, itertools.cycle([8, 40]), strict=False)]  # fmt: skip
                results = await asyncio.gather(outage(), *loads)
                stop.set()
                await watcher
        answers = [a for batch in results[1:] if batch for a in batch]
        figures: dict[str, Any] = {
            "requests": len(answers), "violations": sum(b.violations for b in backends),
            "lost": sum(a.status is None for a in answers),
            "statuses": dict(Counter(str(a.status) if a.status is not None else f"none: {a.error}" for a in answers)),
        }  # fmt: skip
        if mode == "cluster":
            warnings = [line for r in f.replicas for line in r.log_path.read_text(errors="replace").splitlines()
                        if " WARNING " in line and "redis" in line.lower()]  # fmt: skip
            during = [(s, d) for t, _, s, d in readyz if pause_at + 1.0 <= t <= resume_at]
            figures["warnings_naming_redis"] = len(warnings)
            figures["readyz_degraded_while_gone"] = f"{sum(s == 200 and d for s, d in during)} of {len(during)}"
            figures["readyz_all_200_degraded"] = bool(during) and all(s == 200 and d for s, d in during)
            degraded = any(s == 200 and d for s, d in during)
            # Back from nothing is no figure: a tree that never degraded did not resume either.
            figures["resumed_after_s"] = (
                resumed_after(readyz, [r.name for r in f.replicas], resume_at) if degraded else "never degraded"
            )
        return figures
    finally:
        for b in backends:
            b.stop()


def resumed_after(readyz: Sequence[tuple[float, str, int, bool]], names: Sequence[str], resume_at: float) -> Any:
    """Seconds from ``resume_at`` until each replica's /readyz has answered 200 not degraded
    (the latest of them); "never" when one did not within the run."""
    latest = 0.0
    for name in names:
        ok = [t for t, n, s, d in readyz if n == name and t >= resume_at and s == 200 and not d]
        if not ok:
            return "never"
        latest = max(latest, min(ok) - resume_at)
    return latest


def redis_gone_rows(mode: str, fig: dict[str, Any]) -> list[Row]:
    judged = mode != "local"
    rows = [Row(f"redis gone [{mode}]: violations, lost requests", "0, 0",
                f"{fig['violations']}, {fig['lost']} of {fig['requests']} {fig['statuses']}",
                fig["violations"] == 0 and fig["lost"] == 0 if judged else None, fig)]  # fmt: skip
    if mode == "cluster":
        resumed = fig["resumed_after_s"]
        rows += [
            Row(
                "redis gone [cluster]: WARNING naming Redis in a log",
                ">= 1",
                str(fig["warnings_naming_redis"]),
                fig["warnings_naming_redis"] >= 1,
            ),  # fmt: skip
            Row(
                "redis gone [cluster]: /readyz 200 degraded while gone",
                "every poll",
                fig["readyz_degraded_while_gone"],
                fig["readyz_all_200_degraded"],
            ),  # fmt: skip
            Row(
                "redis gone [cluster]: shared scheduling back after Redis returns",
                "<= 2 s",
                f"{resumed:.2f} s" if isinstance(resumed, float) else str(resumed),
                isinstance(resumed, float) and resumed <= 2.0,
            ),  # fmt: skip
        ]
    return rows


RUNNERS: dict[str, tuple[Callable[..., Any], Callable[[str, dict[str, Any]], list[Row]]]] = {
    "oversubscription": (oversubscription, oversubscription_rows),
    "fair_share": (fair_share, fair_share_rows),
    "limits": (limits, limits_rows),
    "supersede": (supersede, supersede_rows),
    "deadline": (deadline, deadline_rows),
    "cost": (cost, cost_rows),
    "redis_gone": (redis_gone, redis_gone_rows),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of one,cluster,local")
    p.add_argument("--replicas", type=int, default=3, help="replicas in the cluster and local modes (default 3)")
    p.add_argument("--reps", type=int, default=1, help="repetitions of every case and mode (default 1)")
    p.add_argument("--requests", type=int, default=600, help="requests in the oversubscription case (default 600)")
    p.add_argument("--token-s", type=float, default=0.002, help="the fake backends' seconds per token")
    p.add_argument("--fair-s", type=float, default=15.0, help="seconds of the fair-share run (default 15)")
    p.add_argument(
        "--fair-warmup",
        type=int,
        default=30,
        help="fair share: requests per replica before the run, to warm the service-time model",
    )
    p.add_argument(
        "--weights",
        type=lambda s: tuple(float(w) for w in s.split(",")),
        default=(1.0, 3.0),
        help="fair share: tenants A's and B's weights (default 1,3)",
    )
    p.add_argument("--gone-s", type=float, default=10.0, help="seconds Redis is paused (default 10)")
    p.add_argument("--cost-requests", type=int, default=500, help="requests per mode in the cost case (default 500)")
    p.add_argument("--proxy-src", type=Path, default=PROXY_SRC[0], help="the src/ directory the proxies run from")
    add_json_option(p, "bench_replicas")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(cases) - set(CASES)) + sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown case or mode: {', '.join(unknown)}")
    has_cluster = cluster_supported(args.proxy_src)
    log_dir = Path(tempfile.mkdtemp(prefix="clairvoyant-bench-replicas-"))
    print(f"proxies from {args.proxy_src}; logs in {log_dir}; cluster mode: {'yes' if has_cluster else 'no'}")
    rows: list[Row] = []
    results: list[dict[str, Any]] = []
    for case in cases:
        run, to_rows = RUNNERS[case]
        for rep, mode in itertools.product(range(args.reps), modes):
            if mode == "cluster" and not has_cluster:
                print(f"  [{case} / cluster] {NOT_AVAILABLE}", flush=True)
                if rep == 0:
                    rows.append(Row(f"{case} [cluster]", "-", NOT_AVAILABLE, None))
                continue
            if case == "redis_gone" and mode == "local":
                continue  # no Redis to lose
            case_dir = log_dir / f"{case}-{rep}"  # each case's proxy logs apart
            case_dir.mkdir(exist_ok=True)
            figures = asyncio.run(run(mode, args, case_dir))
            figures_line(case, mode, figures)
            rows += to_rows(mode, figures)
            results.append({"case": case, "mode": mode, "rep": rep, "figures": figures})
    print_table(rows)
    write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "cluster_mode": has_cluster,
                           "results": results, "rows": [r.as_json() for r in rows]})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
