"""Workloads: which prompts are sent, with which forced length, and when.

* burst: ``n_short`` Short and ``n_long`` Long requests all sent at t = 0 (the paper's 50 + 50), in a
  seeded shuffled order so neither class is favoured by send order.
* poisson: the same kind of mix sent with exponential inter-arrival gaps at rate
  ``lambda = rho / E[S]``, ``E[S]`` being the mean service time predicted by a measured
  :class:`ServiceModel` for this very workload.

The forced output length is ``n_predict = ceil(answer_tokens * length_scale)``: CPU generation at
~116 tokens/s would make true lengths take many minutes per burst; the scaling is monotone, so the
order of lengths, and each request's class (taken from the TRUE length), are unchanged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from clairvoyant.tools.bench.client import RequestSpec
from clairvoyant.tools.bench.prompt_set import BenchPrompt

__all__ = ["ServiceModel", "burst", "forced_length", "poisson", "with_poisson_arrivals"]


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


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """Service time of one request on the backend, alone: ``overhead_s + per_token_s * n_predict``.

    Fitted by least squares on requests sent one at a time (``runner.calibrate``); prompt processing
    (short prompts, under ~600 characters) is folded into the overhead.
    """

    overhead_s: float
    per_token_s: float

    def predict(self, n_predict: int) -> float:
        return self.overhead_s + self.per_token_s * n_predict

    def mean(self, specs: Sequence[RequestSpec]) -> float:
        return sum(self.predict(s.n_predict) for s in specs) / len(specs)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> ServiceModel:
        """Least squares over ``(n_predict, seconds)`` pairs (needs two distinct lengths)."""
        n = len(samples)
        mx = sum(x for x, _ in samples) / n
        my = sum(y for _, y in samples) / n
        sxx = sum((x - mx) ** 2 for x, _ in samples)
        if n < 2 or sxx == 0:
            raise ValueError("need at least two distinct lengths to fit a service model")
        slope = sum((x - mx) * (y - my) for x, y in samples) / sxx
        return cls(overhead_s=max(0.0, my - slope * mx), per_token_s=max(slope, 1e-6))


def with_poisson_arrivals(specs: Sequence[RequestSpec], *, rate_per_s: float, seed: int = 0) -> list[RequestSpec]:
    """The same requests with exponential gaps at ``rate_per_s`` (the first at t = 0)."""
    if rate_per_s <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, spec in enumerate(specs):
        if i:
            t += rng.expovariate(rate_per_s)
        out.append(replace(spec, offset_s=t))
    return out


def poisson(
    prompts: Sequence[BenchPrompt],
    *,
    n_short: int,
    n_long: int,
    length_scale: float,
    rho: float,
    service: ServiceModel,
    seed: int = 0,
) -> tuple[list[RequestSpec], float]:
    """A Poisson workload at utilisation ``rho``; returns the specs and the arrival rate used."""
    specs = burst(prompts, n_short=n_short, n_long=n_long, length_scale=length_scale, seed=seed)
    rate = rho / service.mean(specs)
    return with_poisson_arrivals(specs, rate_per_s=rate, seed=seed + 1), rate
