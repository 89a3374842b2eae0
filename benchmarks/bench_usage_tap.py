"""What the closed loop costs on the event loop, per request: the usage tap fed every relayed chunk,
its read at the end, and the completion hook (metrics + the online learner's observe).

    nice -n 10 python benchmarks/bench_usage_tap.py [--events 1000] [--requests 2000]

Streams are llama.cpp-shaped SSE events (one token each, ~250 bytes) and Ollama NDJSON objects
(tests/fixtures/ollama/chat_stream.ndjson). Prints microseconds: per event fed, per end-of-answer
read, per completion hook (p50 / p99).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from clairvoyant.metrics import Metrics
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.learner import OnlineLearner
from clairvoyant.prediction.predictor import OnnxPredictor
from clairvoyant.prediction.usage import Usage, UsageTap
from clairvoyant.proxy.feedback import UsageRecorder

ROOT = Path(__file__).resolve().parents[1]
SSE_EVENT = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" welcome"}}],"created":1795369635,'
    b'"id":"chatcmpl-z3ExKTcW2U2ugVWxPpaEjEpJZOigJHY9","model":"SmolLM2-135M-Instruct",'
    b'"system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}\n\n'
)
SSE_LAST = (
    b'data: {"choices":[],"created":1795369635,"id":"x","model":"SmolLM2-135M-Instruct","object":"chat.completion.chunk",'
    b'"usage":{"completion_tokens":1000,"prompt_tokens":31,"total_tokens":1031},"timings":{"cache_n":30,"prompt_n":1,'
    b'"prompt_ms":24.4,"predicted_n":1000,"predicted_ms":25000.0}}\n\ndata: [DONE]\n\n'
)


def per_event_us(events: list[bytes], content_type: str, repeats: int = 20) -> tuple[float, float]:
    """Best-of-repeats microseconds per event fed, and per end-of-answer read."""
    feed, read = [], []
    for _ in range(repeats):
        tap = UsageTap(content_type)
        started = time.perf_counter()
        for event in events:
            tap.feed(event)
        fed = time.perf_counter()
        usage = tap.usage(wall_s=1.0)
        feed.append((fed - started) / len(events))
        read.append(time.perf_counter() - fed)
    assert usage.observed, usage
    return min(feed) * 1e6, min(read) * 1e6


def hook_us(requests: int) -> np.ndarray:
    predictor = OnnxPredictor()
    learner = OnlineLearner.for_predictor(predictor)
    recorder = UsageRecorder(Metrics(), learner)
    rng = np.random.default_rng(0)
    tickets = [
        SimpleNamespace(
            prediction=predictor.predict(Prompt(f"Write about topic {i}. " * int(rng.integers(1, 20))), model="m")
        )
        for i in range(requests)
    ]
    out = np.empty(requests)
    for i, ticket in enumerate(tickets):
        usage = Usage(int(rng.integers(1, 800)), 30, 1.0, 0.1, 1.2, "m", "openai_usage", 0)
        started = time.perf_counter()
        recorder(ticket, usage)  # type: ignore[arg-type]
        out[i] = time.perf_counter() - started
    return out * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1000, help="stream events per answer")
    parser.add_argument("--requests", type=int, default=2000, help="completion hooks timed")
    args = parser.parse_args()
    sse = [SSE_EVENT] * args.events + [SSE_LAST]
    ndjson = (ROOT / "tests/fixtures/ollama/chat_stream.ndjson").read_bytes().splitlines(keepends=True)
    rows = [
        ("llama.cpp SSE", *per_event_us(sse, "text/event-stream"), len(sse)),
        ("Ollama NDJSON", *per_event_us(ndjson, "application/x-ndjson"), len(ndjson)),
    ]
    print(f"{'stream':<16}{'events':>8}{'feed us/event':>15}{'read us/answer':>16}")
    for name, feed, read, n in rows:
        print(f"{name:<16}{n:>8}{feed:>15.2f}{read:>16.1f}")
    hook = hook_us(args.requests)
    print(
        f"completion hook (metrics + learner.observe), {args.requests} requests: "
        f"p50 {np.percentile(hook, 50):.1f} us, p99 {np.percentile(hook, 99):.1f} us"
    )


if __name__ == "__main__":
    main()
