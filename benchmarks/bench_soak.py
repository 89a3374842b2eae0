"""A long soak with faults: tens of thousands of requests through the proxy as deployed, and what it
holds as they pass.

Two proxies run as their own processes (``python -m clairvoyant serve``):

- the **fake** one, in front of ``harness.soak.SoakBackend`` (a fast fake backend in a thread of
  this process, declared ``kind = "ollama"`` so both dialects are scheduled: OpenAI chat and
  completions, Ollama /api/chat and /api/generate), 4 slots, four tenants by API key (c may have 4
  requests in the system, d 3,000 a minute), 24 clients at once;
- the **llama** one, in front of a real llama.cpp (``clairvoyant backend``: SmolLM2, 1 thread, 1
  slot) as a child process, unkeyed, each request with a tenant header never seen before, 2
  clients at once.

Both run with ``backend_wait_s`` 2 (the llama one 60, for llama.cpp's restart),
``first_byte_timeout_s`` 60, ``client_timeout_s`` 10 and ``max_queue`` 1000; the rest are defaults.
``--llama-share`` of the requests (default 1%) go to llama.cpp, the rest to the fake backend. Each
has a priority (0, 1, 5 or 10), one in ten a queue deadline (0.05 s or 30 s), 40% are streamed.
Faults, on a schedule: the fake backend killed (every connection aborted, the port closed for
1 s) ``--backend-kills`` times and llama.cpp SIGKILLed and started again ``--llama-kills`` times;
the fake proxy's learner worker SIGKILLed ``--learner-kills`` times; and by their rates in the plan,
clients that leave mid-stream (1%, a reset or a close by turns), stalled clients (0.3%: nothing
read for 2 s with a 4 KB receive buffer, then the rest read in small pieces), and 4xx and 5xx
answers from the backend (400 and 500 at 1%, 404 and 503 at 0.5%).

Every ``--report-every`` requests it prints, per proxy: RSS and open fds (/proc), the event loop's
tasks and the retained entries of every long-lived structure (``clairvoyant_event_loop_tasks`` and
``clairvoyant_retained_entries`` in /metrics), and the learner worker's RSS. At the end: lost,
duplicated and crashed counts, each status code's count, the RSS growth from request 10,000 to the
end, and whether open fds and tasks are back to their idle level (taken after a warm-up) within
5 s of the end (once a learner killed near the end runs again).

Lost: no answer at all, or a stream that stopped without its end or an error event (a client that
left on purpose aside). Duplicated: a request id the fake backend read twice, but a request it
answered 503, which the proxy sends again by design within ``backend_wait_s`` (counted apart);
llama.cpp cannot be asked. Crashed: a proxy that exited, or a traceback or unexpected error in its
log.

    PYTHONPATH=src python benchmarks/bench_soak.py                      # 50,000 requests
    PYTHONPATH=src python benchmarks/bench_soak.py --requests 2000 --llama-share 0   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from harness.proxy_process import ProxyProcess
from harness.results import add_json_option, write_json
from harness.soak import (
    FAULT_KINDS,
    LlamaBackendProcess,
    Outcome,
    Plan,
    ProcessFigures,
    SoakBackend,
    Tally,
    api_keys_setting,
    learner_pid,
    make_plan,
    process_figures,
    run_workers,
    send,
)
from harness.verdicts import Row, print_table

IDLE_WITHIN_S = 5.0
RSS_GROWTH_LIMIT_KIB = 20 * 1024
CRASH_MARKS = ("unexpected error", "Traceback", "internal error")


@dataclass
class Proxied:
    """One proxy under soak, and what was seen of it."""

    name: str
    proxy: ProxyProcess
    idle: ProcessFigures | None = None
    samples: list[tuple[int, ProcessFigures]] = field(default_factory=list)  # (requests done, figures)
    end: ProcessFigures | None = None
    back_to_idle_s: float | None = None
    after_idle_wait: ProcessFigures | None = None


@dataclass
class SoakResult:
    requests: int
    split: dict[str, int]
    seconds: float
    tally: Tally
    ledger: Counter[str]
    proxies: list[Proxied]
    faults: Counter[str]
    crashed: int
    crash_lines: list[str]
    rss_baseline_at: int

    @property
    def lost(self) -> int:
        return len(self.tally.lost) + (self.requests - self.tally.outcomes)

    @property
    def duplicated(self) -> int:
        return self.tally.duplicated(self.ledger)


def describe(figures: ProcessFigures) -> str:
    learner = "-" if figures.learner_rss_kib is None else f"{figures.learner_rss_kib / 1024:.1f} MB"
    sizes = " ".join(f"{k}={v}" for k, v in sorted(figures.retained.items()) if v)
    return (
        f"rss {figures.rss_kib / 1024:.1f} MB, fds {figures.fds}, tasks {figures.tasks}, learner {learner}; "
        f"held: {sizes or 'nothing'}"
    )


async def _kill_fake_backend(holder: list[SoakBackend], ledger: Counter[str], down_s: float) -> None:
    backend = holder[0]
    await asyncio.to_thread(backend.kill)
    await asyncio.sleep(down_s)
    holder[0] = await asyncio.to_thread(SoakBackend(ledger, port=backend.port).start)


async def _kill_learner(proxy: ProxyProcess, faults: Counter[str]) -> None:
    pid = learner_pid(proxy.pid)
    if pid is None:  # still being started again after the last kill
        faults["learner_kill_skipped"] += 1
        return
    os.kill(pid, signal.SIGKILL)
    faults["learner_killed"] += 1


async def _kill_llama(llama: LlamaBackendProcess, faults: Counter[str]) -> None:
    await asyncio.to_thread(llama.kill)
    faults["backend_killed"] += 1
    await asyncio.to_thread(llama.start)


def _positions(total: int, times: int) -> set[int]:
    """``times`` points spread evenly over ``total`` requests (none at 0 or the very end)."""
    return {int((k + 0.5) * total / times) for k in range(times)} if times and total else set()


async def run_soak(
    requests: int,
    *,
    log_dir: Path,
    llama_share: float = 0.01,
    report_every: int = 5000,
    rss_baseline_at: int = 10_000,
    fake_workers: int = 24,
    llama_workers: int = 2,
    backend_kills: int = 10,
    llama_kills: int = 2,
    learner_kills: int = 5,
    seed: int = 0,
    out: Any = print,
    **settings: Any,
) -> SoakResult:
    """Run the soak (module docstring) and return what it saw; ``out`` prints the progress lines.
    ``settings``: more CLAIRVOYANT_* settings for both proxies."""
    plans = make_plan(requests, llama_share=llama_share, seed=seed)
    fake_plans = [p for p in plans if p.backend == "fake"]
    llama_plans = [p for p in plans if p.backend == "llama"]
    ledger: Counter[str] = Counter()
    holder = [SoakBackend(ledger).start()]
    keys_json, keys = api_keys_setting()
    backends = json.dumps([{"url": holder[0].base_url, "kind": "ollama", "slots": 4, "name": "fake"}])
    common = {"backend_wait_s": 2, "first_byte_timeout_s": 60, "max_queue": 1000, "log_level": "warning",
              "client_timeout_s": 10, **settings}  # fmt: skip
    proxies = [Proxied("fake", ProxyProcess("soak-fake", holder[0].base_url, log_dir, backends=backends,
                                            api_keys=keys_json, **common))]  # fmt: skip
    llama: LlamaBackendProcess | None = None
    tally = Tally()
    faults: Counter[str] = Counter()
    fault_tasks: list[asyncio.Task[None]] = []
    started = time.monotonic()
    try:
        proxies[0].proxy.start()
        if llama_plans:
            llama = await asyncio.to_thread(LlamaBackendProcess(log_dir).start)
            proxies.append(Proxied("llama", ProxyProcess("soak-llama", llama.base_url, log_dir,
                                                         **{**common, "backend_wait_s": 60})))  # fmt: skip
            proxies[1].proxy.start()
        urls = {p.name: p.proxy.url for p in proxies}
        ports = {p.name: p.proxy.port for p in proxies}
        limits = httpx.Limits(max_connections=fake_workers + llama_workers + 8)
        # The observer reads /metrics on one connection of its own; the clients' connections are
        # closed at the end of the load (as its clients would go), before "back to idle" is judged.
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1)) as observer:
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                # Warm-up: every dialect, streamed and not, through each proxy (no faults).
                for p in make_plan(24, llama_share=0.0, seed=seed + 1):
                    warm = replace(p, index=-1 - p.index, behaviour="plain")
                    await send(client, urls["fake"], ports["fake"], warm, keys)
                for p in llama_plans[:2]:
                    await send(client, urls["llama"], ports["llama"], replace(p, index=-100 - p.index), keys)
            await asyncio.sleep(1.0)
            for proxied in proxies:
                proxied.idle = await process_figures(observer, proxied.proxy.url, proxied.proxy.pid)
                out(f"idle {proxied.name}: {describe(proxied.idle)}")
            started = time.monotonic()
            done_count = fake_done = llama_done = 0
            kill_at = _positions(len(fake_plans), backend_kills)
            learner_at = _positions(len(fake_plans), learner_kills)
            llama_kill_at = _positions(len(llama_plans), llama_kills)

            async def report(at: int) -> None:
                line = [f"{at:>7} requests, {time.monotonic() - started:6.0f} s:"]
                for proxied in proxies:
                    figures = await process_figures(observer, proxied.proxy.url, proxied.proxy.pid)
                    proxied.samples.append((at, figures))
                    line.append(f"  {proxied.name}: {describe(figures)}")
                out("\n".join(line))

            async def done(outcome: Outcome) -> None:
                nonlocal done_count, fake_done, llama_done
                tally.add(outcome)
                done_count += 1
                if outcome.plan.backend == "fake":
                    fake_done += 1
                    if fake_done in kill_at:
                        faults["backend_killed"] += 1
                        fault_tasks.append(asyncio.create_task(_kill_fake_backend(holder, ledger, 1.0)))
                    if fake_done in learner_at:
                        fault_tasks.append(asyncio.create_task(_kill_learner(proxies[0].proxy, faults)))
                else:
                    llama_done += 1
                    if llama is not None and llama_done in llama_kill_at:
                        fault_tasks.append(asyncio.create_task(_kill_llama(llama, faults)))
                if done_count % report_every == 0 or done_count == rss_baseline_at:
                    await report(done_count)

            async with httpx.AsyncClient(timeout=120, limits=limits) as client:

                async def one(plan: Plan) -> Outcome:
                    return await send(client, urls[plan.backend], ports[plan.backend], plan, keys)

                await asyncio.gather(
                    run_workers(fake_plans, fake_workers, one, done), run_workers(llama_plans, llama_workers, one, done)
                )
                await asyncio.gather(*fault_tasks)
            seconds = time.monotonic() - started
            # A learner killed near the end is started again 10 s later: its pipes count in the fds.
            await asyncio.gather(*(_learner_back(p.proxy) for p in proxies))
            ended = time.monotonic()
            for proxied in proxies:
                proxied.end = await process_figures(observer, proxied.proxy.url, proxied.proxy.pid)
                out(f"end {proxied.name}: {describe(proxied.end)}")
            await asyncio.gather(*(_wait_idle(observer, proxied, ended) for proxied in proxies))
            for proxied in proxies:
                out(
                    f"{IDLE_WITHIN_S:g} s after the end, {proxied.name}: {describe(proxied.after_idle_wait or proxied.end)}"
                )
        crashed = sum(p.proxy.proc is not None and p.proxy.proc.poll() is not None for p in proxies)
    finally:
        for proxied in proxies:
            proxied.proxy.stop()
        holder[0].stop()
        if llama is not None:
            llama.stop()
    crash_lines = [
        line.strip()
        for p in proxies
        for line in p.proxy.log_path.read_text(errors="replace").splitlines()
        if any(mark in line for mark in CRASH_MARKS)
    ]
    faults.update(tally.faults)
    split = {"fake": len(fake_plans), "llama": len(llama_plans)}
    return SoakResult(requests, split, seconds, tally, ledger, proxies, faults, crashed + len(crash_lines),
                      crash_lines, rss_baseline_at)  # fmt: skip


async def _learner_back(proxy: ProxyProcess, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while learner_pid(proxy.pid) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    await asyncio.sleep(1.0)  # its start: the state it loads, its first answer


async def _wait_idle(client: httpx.AsyncClient, proxied: Proxied, start: float) -> None:
    """Poll until open fds and tasks are at most their idle level, up to ``IDLE_WITHIN_S`` after
    ``start`` (time.monotonic() at the end of the load)."""
    assert proxied.idle is not None
    while True:
        figures = await process_figures(client, proxied.proxy.url, proxied.proxy.pid)
        proxied.after_idle_wait = figures
        if figures.fds <= proxied.idle.fds and (figures.tasks or 0) <= (proxied.idle.tasks or 0):
            proxied.back_to_idle_s = time.monotonic() - start
            return
        if time.monotonic() - start > IDLE_WITHIN_S:
            return
        await asyncio.sleep(0.25)


def rss_growth_kib(proxied: Proxied, at: int) -> int | None:
    """RSS at the end minus RSS at the sample taken at ``at`` requests (or the first after it)."""
    base = next((f for n, f in proxied.samples if n >= at), None)
    if base is None or proxied.end is None:
        return None
    return proxied.end.rss_kib - base.rss_kib


def rows(result: SoakResult) -> list[Row]:
    tally = result.tally
    out = [
        Row(
            f"{result.requests} requests ({result.split['fake']} fake, {result.split['llama']} llama.cpp), "
            f"{result.seconds:.0f} s",
            "0 lost",
            f"lost {result.lost}",
            result.lost == 0,
            {"lost": result.lost, "examples": [f"{o.plan} {o.status} {o.ended} {o.detail}" for o in tally.lost[:5]]},
        ),
        Row(
            "duplicated (backend read twice, or answered twice)",
            "0",
            f"{result.duplicated}",
            result.duplicated == 0,
            {"ids": tally.duplicated_ids(result.ledger)[:20]},
        ),
        Row(
            "sent again after the backend's 503 (by design, within backend_wait_s)",
            "-",
            "{} requests, at most {} sends each".format(*tally.resent_after_503(result.ledger)),
            None,
        ),
        Row(
            "crashed (proxy exited, or an unexpected error logged)",
            "0",
            f"{result.crashed}",
            result.crashed == 0,
            {"lines": result.crash_lines[:5]},
        ),
        Row("answers with another request's X-Request-Id", "0", f"{tally.wrong_id}", tally.wrong_id == 0),
        Row(
            "status codes",
            "-",
            " ".join(f"{k}:{v}" for k, v in sorted(tally.statuses.items())),
            None,
            dict(tally.statuses),
        ),
        Row(
            "how answers ended",
            "-",
            " ".join(f"{k}:{v}" for k, v in sorted(tally.ends.items())),
            None,
            dict(tally.ends),
        ),
        Row(
            "faults injected",
            "each kind at least once",
            " ".join(f"{k}:{result.faults.get(k, 0)}" for k in (*FAULT_KINDS, "learner_kill_skipped")),
            all(result.faults.get(k, 0) > 0 for k in FAULT_KINDS),
            dict(result.faults),
        ),
    ]
    for proxied in result.proxies:
        growth = rss_growth_kib(proxied, result.rss_baseline_at)
        if growth is not None:
            out.append(Row(f"{proxied.name}: RSS growth from request {result.rss_baseline_at:,} to the end",
                           "<= 20 MB", f"{growth / 1024:+.1f} MB", growth <= RSS_GROWTH_LIMIT_KIB,
                           {"growth_kib": growth}))  # fmt: skip
        idle, after = proxied.idle, proxied.after_idle_wait
        if idle is not None and after is not None:
            back = proxied.back_to_idle_s
            out.append(Row(f"{proxied.name}: fds and tasks back to idle within {IDLE_WITHIN_S:g} s", "yes",
                           f"idle fds {idle.fds} tasks {idle.tasks}; after {after.fds} / {after.tasks}; "
                           + ("not back" if back is None else f"back in {back:.2f} s"), back is not None))  # fmt: skip
    return out


def as_json(result: SoakResult) -> dict[str, Any]:
    return {
        "requests": result.requests, "split": result.split, "seconds": result.seconds, "lost": result.lost,
        "duplicated": result.duplicated, "crashed": result.crashed, "statuses": dict(result.tally.statuses),
        "ends": dict(result.tally.ends), "faults": dict(result.faults),
        "proxies": {
            p.name: {
                "idle": None if p.idle is None else asdict(p.idle),
                "samples": [{"requests": n, **asdict(f)} for n, f in p.samples],
                "end": None if p.end is None else asdict(p.end),
                "after_idle_wait": None if p.after_idle_wait is None else asdict(p.after_idle_wait),
                "back_to_idle_s": p.back_to_idle_s,
            }
            for p in result.proxies
        },
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--llama-share", type=float, default=0.01, help="share of requests to llama.cpp (0: none)")
    parser.add_argument("--report-every", type=int, default=5000)
    parser.add_argument("--backend-kills", type=int, default=10)
    parser.add_argument("--llama-kills", type=int, default=2)
    parser.add_argument("--learner-kills", type=int, default=5)
    parser.add_argument("--workers", type=int, default=24, help="concurrent clients of the fake proxy")
    parser.add_argument("--log-dir", type=Path, help="the proxies' logs (default: a temporary directory)")
    add_json_option(parser, "soak")
    args = parser.parse_args()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="clairvoyant-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", flush=True)
    result = asyncio.run(
        run_soak(
            args.requests, log_dir=log_dir, llama_share=args.llama_share, report_every=args.report_every,
            backend_kills=args.backend_kills, llama_kills=args.llama_kills, learner_kills=args.learner_kills,
            fake_workers=args.workers, out=lambda line: print(line, flush=True),
        )
    )  # fmt: skip
    table = rows(result)
    print_table(table)
    write_json(args.json, {**as_json(result), "rows": [r.as_json() for r in table]})
    return 0 if all(r.ok is not False for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
