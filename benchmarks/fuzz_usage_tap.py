"""Fuzz the usage tap against an earlier version of it: same Usage, tail, partial line and event
count over random bodies (JSON, SSE, NDJSON; the Ollama fixtures, the benchmark's answers, random
objects with the keys the tap reads, truncated or with garbage) split at random. Not a test: the
earlier tap is a file of another checkout.

    git worktree add /tmp/wt-old <commit>
    PYTHONPATH=src python benchmarks/fuzz_usage_tap.py --old /tmp/wt-old/src/clairvoyant/prediction/usage.py \
        [--seed 0] [--n 3000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_request_path import ANSWER, SSE  # noqa: E402

from clairvoyant.prediction import usage as new  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--old", required=True, help="the earlier usage.py")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--n", type=int, default=3000)
args = parser.parse_args()
spec = importlib.util.spec_from_file_location("old_usage", args.old)
assert spec is not None and spec.loader is not None
old = importlib.util.module_from_spec(spec)
sys.modules["old_usage"] = old  # dataclasses look their module up
spec.loader.exec_module(old)
FIX = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "ollama"
rng = random.Random(args.seed)
VALUES = [0, 1, 7, -3, 2.0, 2.5, -1.0, True, False, None, "12", "", "x", [], {}, 1e400, 10**30, {"a": 1}]
KEYS = [
    "usage",
    "timings",
    "eval_count",
    "model",
    "tokens_predicted",
    "eval_duration",
    "prompt_eval_duration",
    "prompt_eval_count",
    "completion_tokens",
    "prompt_tokens",
    "predicted_n",
    "predicted_ms",
    "prompt_ms",
    "prompt_n",
    "cache_n",
    "content",
    "text",
    "response",
    "reasoning",
    "thinking",
    "arguments",
]


def rand_obj(depth=0):
    d = {}
    for _ in range(rng.randint(0, 5)):
        k = rng.choice(KEYS)
        if depth < 2 and rng.random() < 0.3:
            d[k] = rand_obj(depth + 1)
        else:
            d[k] = rng.choice(VALUES + [rng.choice(KEYS), f'"{rng.choice(KEYS)}":', rng.randint(0, 10**6)])
    return d


def dump(o):
    s = json.dumps(o, separators=rng.choice([(",", ":"), (", ", ": "), (",", " :\t"), ("\n,", "\r\n:\n ")]))
    return s


def body():
    kind = rng.random()
    if kind < 0.15:
        f = rng.choice(sorted(FIX.iterdir()))
        return f.read_bytes(), rng.choice(["application/x-ndjson", "application/json", "text/event-stream"])
    if kind < 0.25:
        return rng.choice([ANSWER, SSE]).encode(), rng.choice(["application/json", "text/event-stream"])
    framing = rng.choice(["json", "sse", "ndjson"])
    objs = [rand_obj() for _ in range(rng.randint(1, 40))]
    if framing == "json":
        b = dump(objs[-1]).encode()
        ct = "application/json; charset=utf-8"
    elif framing == "sse":
        b = "".join(f"data: {dump(o)}\n\n" for o in objs).encode() + rng.choice(
            [b"data: [DONE]\n\n", b"", b'data: {"x']
        )
        ct = "text/event-stream"
    else:
        b = "".join(dump(o) + "\n" for o in objs).encode()
        ct = "application/x-ndjson"
    if rng.random() < 0.2:  # truncated / garbage
        b = b[: rng.randint(0, len(b))]
    if rng.random() < 0.1:
        b = b + bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 30)))
    if rng.random() < 0.1:
        b = b"x" * rng.randint(1, 20000) + b
    return b, ct


def split(b):
    if not b:
        return [b]
    r = rng.random()
    if r < 0.2:
        return [b]
    if r < 0.3:
        return [b[i : i + 1] for i in range(len(b))]
    cuts = sorted(rng.sample(range(1, len(b)), min(rng.randint(1, 60), len(b) - 1))) if len(b) > 1 else []
    return [b[a:c] for a, c in zip([0, *cuts], [*cuts, len(b)])]


n = args.n
diffs = 0
sources: dict[str, int] = {}
for _ in range(n):
    b, ct = body()
    chunks = split(b)
    tb = rng.choice([new.TAIL_BYTES, 64, 200, 1024])
    rm = rng.choice([None, "req"])
    res = []
    for mod in (old, new):
        tap = mod.UsageTap(ct, tail_bytes=tb)
        for c in chunks:
            tap.feed(c)
        res.append((repr(tap.usage(wall_s=0.5, request_model=rm)), bytes(tap._tail), bytes(tap._partial), tap._events))
    if res[0] != res[1]:
        diffs += 1
        if diffs < 4:
            print("DIFF", ct, b[:200], res[0][0], res[1][0])
    src = res[1][0].split("source='")[1].split("'")[0]
    sources[src] = sources.get(src, 0) + 1
print("cases", n, "diffs", diffs, sources)
sys.exit(1 if diffs else 0)
