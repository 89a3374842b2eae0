"""Workloads: which prompts are sent, with which forced length, and when.

A burst: ``n_short`` Short and ``n_long`` Long requests all sent at t = 0 (the paper's 50 + 50), in
a seeded shuffled order so neither class is favoured by send order. (benchmarks/bench_scheduling.py
gives the same requests Poisson arrival times.)

The forced output length is ``n_predict = ceil(answer_tokens * length_scale)``: CPU generation at
~116 tokens/s would make true lengths take many minutes per burst; the scaling is monotone, so the
order of lengths, and each request's class (taken from the TRUE length), are unchanged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from clairvoyant.tools.bench.client import RequestSpec
from clairvoyant.tools.bench.prompt_set import BenchPrompt

__all__ = ["burst", "forced_length"]


def forced_length(answer_tokens: int, length_scale: float) -> int:
    """``ceil(answer_tokens * length_scale)``, at least 1."""
    if length_scale <= 0:
        raise ValueError("length_scale must be > 0")
    return max(1, math.ceil(answer_tokens * length_scale - 1e-9))


def _sample(pool: Sequence[BenchPrompt], n: int, rng: random.Random) -> list[BenchPrompt]:
    """``n`` prompts from ``pool``: without replacement while it lasts, then cycling a fresh shuffle."""
    if n and not pool:
        raise ValueError("no prompts of the requested class")
    picked: list[BenchPrompt] = []
    while len(picked) < n:
        order = list(pool)
        rng.shuffle(order)
        picked.extend(order[: n - len(picked)])
    return picked


def burst(
    prompts: Sequence[BenchPrompt],
    *,
    n_short: int,
    n_long: int,
    length_scale: float,
    seed: int = 0,
) -> list[RequestSpec]:
    """A burst: every request at offset 0, classes interleaved in a seeded random order."""
    rng = random.Random(seed)
    chosen = _sample([p for p in prompts if p.cls == "short"], n_short, rng)
    chosen += _sample([p for p in prompts if p.cls == "long"], n_long, rng)
    rng.shuffle(chosen)
    specs = []
    for index, prompt in enumerate(chosen):
        if prompt.text is None:
            raise ValueError(f"prompt {prompt.key} has no text: resolve() the prompt set first")
        specs.append(
            RequestSpec(
                index=index,
                key=prompt.key,
                cls=prompt.cls,
                answer_tokens=prompt.answer_tokens,
                n_predict=forced_length(prompt.answer_tokens, length_scale),
                prompt_chars=prompt.prompt_chars,
                text=prompt.text,
            )
        )
    return specs
