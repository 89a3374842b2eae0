"""Workloads for the simulator: who arrives when, with which class and which true service time.

A ``Workload`` is plain arrays (one row per request, in arrival order). It is built from an
arrival process (Poisson at a rate, or a burst of N at t = 0), a class mix and a service-time
model. Three service models draw per-class times (``normal``, ``lognormal``, ``replay``); a fourth,
``PromptService``, takes requests from a JSONL file of real prompts and derives their service
times from a per-token cost model, so the real predictor can score them.

Randomness: every draw takes an explicit ``numpy.random.Generator``; the caller derives separate
streams for arrivals, classes/services and scores, so the same seed gives the same workload under
every policy and predictor (common random numbers: paired comparisons across conditions). Two more
optional columns come from streams of their own: which model each request asks for
(``with_models``: two models share the backend) and each request's queue deadline (``with_deadlines``).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Protocol

import numpy as np

from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.length_classes import CLASS_NAMES  # one definition of the class names

__all__ = [
    "CLASS_NAMES",
    "LognormalService",
    "NormalService",
    "PromptRecord",
    "PromptService",
    "ReplayService",
    "ServiceModel",
    "Workload",
    "burst_arrivals",
    "class_index",
    "load_prompts",
    "load_replay",
    "make_workload",
    "two_tenant_workload",
    "poisson_arrivals",
    "rate_for_rho",
    "score_stream",
    "with_deadlines",
    "with_models",
]

# Class indices used in every array of this package are the predictor's CLASS_NAMES, in its order.
_CLASS_INDEX = {name: i for i, name in enumerate(CLASS_NAMES)}


def class_index(name: str) -> int:
    """Index of a class name; raises ValueError for anything but short/medium/long."""
    try:
        return _CLASS_INDEX[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown request class {name!r}; known: {', '.join(CLASS_NAMES)}") from None


@dataclass(frozen=True, slots=True)
class Workload:
    """One simulated request stream, in arrival order (``arrival_s`` non-decreasing).

    ``item`` indexes ``PromptService.records`` for prompt-based workloads, else is -1.
    ``tenant`` (int8 tenant id per request) is None for single-tenant workloads; ``model`` (int8
    model index) is None when every request asks for the one model; ``max_wait_s`` is None when no
    request carries a queue deadline.
    """

    arrival_s: np.ndarray  # float64 virtual seconds
    service_s: np.ndarray  # float64 seconds the backend takes (the truth, unknown to the scheduler), load excluded
    class_idx: np.ndarray  # int8 index into CLASS_NAMES
    item: np.ndarray  # int64 row of the prompt file, or -1
    tenant: np.ndarray | None = None  # int8 tenant id, or None (one tenant)
    model: np.ndarray | None = None  # int8 model index, or None (one model)
    max_wait_s: np.ndarray | None = None  # float64 queue deadline, seconds after arrival (inf: none), or None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not (len(self.service_s) == len(self.class_idx) == len(self.item) == n):
            raise ValueError("workload arrays differ in length")
        if any(a is not None and len(a) != n for a in (self.tenant, self.model, self.max_wait_s)):
            raise ValueError("workload arrays differ in length")
        if self.max_wait_s is not None and np.any(self.max_wait_s < 0):
            raise ValueError("queue deadlines must be >= 0 seconds after arrival")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("arrival times must be non-decreasing")
        if n and np.any(self.service_s <= 0):
            raise ValueError("service times must be positive")

    def __len__(self) -> int:
        return len(self.arrival_s)


# -- arrivals --------------------------------------------------------------------------------


def poisson_arrivals(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    """``n`` Poisson arrival times at ``rate_per_s``; the first arrives after one exponential gap."""
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        raise ValueError("arrival rate must be a positive finite number")
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=n))


def burst_arrivals(n: int) -> np.ndarray:
    """``n`` requests all arriving at t = 0 (the paper's closed-loop burst benchmark)."""
    return np.zeros(n, dtype=np.float64)


def rate_for_rho(rho: float, mean_service_s: float, slots: int = 1) -> float:
    """Arrival rate giving utilisation ``rho = lambda * E[S] / slots``."""
    if not 0 < rho:
        raise ValueError("rho must be > 0")
    return rho * slots / mean_service_s


# -- service models ---------------------------------------------------------------------------


class ServiceModel(Protocol):
    """Draws classes and true service times for ``n`` requests."""

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Returns ``(class_idx int8, service_s float64 > 0, item int64)`` of length ``n``."""
        ...

    def mean_service_s(self) -> float:
        """E[S] over the class mix (used to turn a target rho into an arrival rate)."""
        ...


def _mix_array(mix: dict[str, float]) -> np.ndarray:
    probs = np.zeros(len(CLASS_NAMES))
    for name, p in mix.items():
        if p < 0:
            raise ValueError("class mix weights must be >= 0")
        probs[class_index(name)] = p
    if probs.sum() <= 0:
        raise ValueError("class mix is empty")
    return probs / probs.sum()


def _draw_classes(rng: np.random.Generator, n: int, probs: np.ndarray) -> np.ndarray:
    return rng.choice(len(CLASS_NAMES), size=n, p=probs).astype(np.int8)


@dataclass(frozen=True, slots=True)
class NormalService:
    """Per-class normal service times, as in the paper (5.5): N(3.5, 0.8) Short, N(8.9, 2.0) Long.

    A normal can go negative; draws are clipped at ``floor_s`` (not resampled). With the paper's
    parameters the clip touches about 1 draw in 10^5, so means and percentiles are unaffected.
    """

    params: dict[str, tuple[float, float]]  # class -> (mean_s, std_s)
    mix: dict[str, float]  # class -> weight (normalised)
    floor_s: float = 0.05

    def __post_init__(self) -> None:
        if self.floor_s <= 0:
            raise ValueError("floor_s must be > 0")
        for name, p in self.mix.items():
            if p > 0 and name not in self.params:
                raise ValueError(f"class {name!r} has weight but no service parameters")

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cls = _draw_classes(rng, n, _mix_array(self.mix))
        mean = np.zeros(len(CLASS_NAMES))
        std = np.zeros(len(CLASS_NAMES))
        for name, (m, s) in self.params.items():
            mean[class_index(name)], std[class_index(name)] = m, s
        z = rng.standard_normal(n)
        service = np.maximum(mean[cls] + std[cls] * z, self.floor_s)
        return cls, service, np.full(n, -1, dtype=np.int64)

    def mean_service_s(self) -> float:
        # E[max(X, f)] for X ~ N(m, s): exact, so the clip is accounted for.
        probs = _mix_array(self.mix)
        total = 0.0
        for name, (m, s) in self.params.items():
            p = probs[class_index(name)]
            if p == 0:
                continue
            if s == 0:
                total += p * max(m, self.floor_s)
                continue
            a = (self.floor_s - m) / s
            unit = NormalDist()
            total += p * (self.floor_s * unit.cdf(a) + m * (1 - unit.cdf(a)) + s * unit.pdf(a))
        return total


@dataclass(frozen=True, slots=True)
class LognormalService:
    """Per-class lognormal service times, given by each class's mean and standard deviation (seconds)."""

    params: dict[str, tuple[float, float]]  # class -> (mean_s, std_s) of the lognormal itself
    mix: dict[str, float]

    def __post_init__(self) -> None:
        for name, (m, s) in self.params.items():
            if m <= 0 or s < 0:
                raise ValueError(f"class {name!r}: lognormal needs mean > 0 and std >= 0")

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cls = _draw_classes(rng, n, _mix_array(self.mix))
        mu = np.zeros(len(CLASS_NAMES))
        sigma = np.zeros(len(CLASS_NAMES))
        for name, (m, s) in self.params.items():
            sig2 = math.log1p((s / m) ** 2)
            mu[class_index(name)] = math.log(m) - sig2 / 2
            sigma[class_index(name)] = math.sqrt(sig2)
        service = np.exp(mu[cls] + sigma[cls] * rng.standard_normal(n))
        return cls, service, np.full(n, -1, dtype=np.int64)

    def mean_service_s(self) -> float:
        probs = _mix_array(self.mix)
        return float(sum(probs[class_index(name)] * m for name, (m, _) in self.params.items()))


@dataclass(frozen=True, slots=True)
class ReplayService:
    """Service times resampled (with replacement) from measured per-class times.

    With no explicit ``mix`` the classes come in the proportions they were measured in.
    """

    samples: dict[str, np.ndarray]  # class -> measured service seconds
    mix: dict[str, float] | None = None

    def _probs(self) -> np.ndarray:
        if self.mix is not None:
            probs = _mix_array(self.mix)
        else:
            probs = _mix_array({name: float(len(v)) for name, v in self.samples.items()})
        for i, p in enumerate(probs):
            if p > 0 and len(self.samples.get(CLASS_NAMES[i], ())) == 0:
                raise ValueError(f"class {CLASS_NAMES[i]!r} has weight but no measured times")
        return probs

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cls = _draw_classes(rng, n, self._probs())
        service = np.empty(n)
        picks = rng.random(n)  # one uniform per request, so draws do not depend on class order
        for i, name in enumerate(CLASS_NAMES):
            rows = cls == i
            if rows.any():
                pool = np.asarray(self.samples[name], dtype=np.float64)
                service[rows] = pool[np.minimum((picks[rows] * len(pool)).astype(np.int64), len(pool) - 1)]
        return cls, service, np.full(n, -1, dtype=np.int64)

    def mean_service_s(self) -> float:
        probs = self._probs()
        return float(
            sum(probs[i] * float(np.mean(self.samples[name])) for i, name in enumerate(CLASS_NAMES) if probs[i] > 0)
        )


def load_replay(path: Path | str) -> dict[str, np.ndarray]:
    """Measured per-class service times from a file.

    Accepted shapes: CSV with columns ``class`` and ``service_s``; JSON ``{"short": [s, ...], ...}``;
    JSON list of ``{"class": ..., "service_s": ...}``. Raises ValueError on anything else or on a
    non-positive time.
    """
    path = Path(path)
    pairs: list[tuple[str, float]] = []
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or not {"class", "service_s"} <= set(reader.fieldnames):
                raise ValueError(f"{path}: CSV needs columns 'class' and 'service_s'")
            pairs = [(row["class"], float(row["service_s"])) for row in reader]
    else:
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            pairs = [(name, float(v)) for name, values in data.items() for v in values]
        elif isinstance(data, list):
            pairs = [(str(row["class"]), float(row["service_s"])) for row in data]
        else:
            raise ValueError(f"{path}: expected a JSON object or list")
    samples: dict[str, list[float]] = {}
    for name, value in pairs:
        if not value > 0:
            raise ValueError(f"{path}: service time {value!r} is not positive")
        samples.setdefault(CLASS_NAMES[class_index(name)], []).append(value)
    if not samples:
        raise ValueError(f"{path}: no measured service times")
    return {name: np.asarray(v) for name, v in samples.items()}


# -- prompts (for the real predictor) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One line of the prompts file. The text stays in memory and is never written out."""

    prompt: Prompt = field(repr=False)
    output_tokens: int
    class_idx: int


def load_prompts(path: Path | str) -> list[PromptRecord]:
    """Read a JSONL file of ``{"prompt": str, "output_tokens": int, "class": "short"|"medium"|"long"}``,
    or the shipped reference file (profiler/data/prompts.jsonl: keys into the installed ShareGPT
    package, no text), whose texts are resolved by ``clairvoyant.tools.bench.prompt_set``.

    Blank lines are skipped. Raises ValueError naming the line number (never the text) on a bad line.
    """
    first = next((line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()), "")
    if first and "key" in json.loads(first):
        from clairvoyant.tools.bench.prompt_set import load_prompt_set, resolve

        return [
            PromptRecord(Prompt(p.text or ""), p.answer_tokens, class_index(p.cls))
            for p in resolve(load_prompt_set(path))
        ]
    records: list[PromptRecord] = []
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text, tokens = row["prompt"], int(row["output_tokens"])
                if not isinstance(text, str) or tokens < 0:
                    raise ValueError("bad prompt or output_tokens")
                records.append(PromptRecord(Prompt(text), tokens, class_index(str(row["class"]))))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a prompt record ({type(exc).__name__})") from None
    if not records:
        raise ValueError(f"{path}: no prompt records")
    return records


@dataclass(frozen=True, slots=True)
class PromptService:
    """Requests resampled (with replacement) from real prompts; ``s = c0_s + c_tok_s * output_tokens``."""

    records: Sequence[PromptRecord]
    c0_s: float = 0.3  # fixed cost per request (prefill, HTTP), seconds
    c_tok_s: float = 0.02  # decode cost per output token, seconds

    def __post_init__(self) -> None:
        if not self.records:
            raise ValueError("no prompt records")
        if self.c0_s < 0 or self.c_tok_s < 0 or self.c0_s + self.c_tok_s <= 0:
            raise ValueError("the cost model must give positive service times")

    def _service(self) -> np.ndarray:
        tokens = np.array([r.output_tokens for r in self.records], dtype=np.float64)
        return np.maximum(self.c0_s + self.c_tok_s * tokens, 1e-6)

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        item = rng.integers(0, len(self.records), size=n, dtype=np.int64)
        cls = np.array([r.class_idx for r in self.records], dtype=np.int8)[item]
        return cls, self._service()[item], item

    def mean_service_s(self) -> float:
        return float(self._service().mean())


# -- putting it together -----------------------------------------------------------------------


def make_workload(
    seed: int,
    n: int,
    service: ServiceModel,
    *,
    arrivals: str = "poisson",
    rate_per_s: float | None = None,
    rho: float | None = None,
    slots: int = 1,
) -> Workload:
    """Draw a workload of ``n`` requests, deterministic in ``seed``.

    ``arrivals`` is "poisson" (give exactly one of ``rate_per_s`` or ``rho``) or "burst" (all at
    t = 0; rate and rho are ignored). Arrivals and classes/services use independent streams derived
    from ``seed``; the predictor's noise uses a third (see ``score_stream``).
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    arrival_rng, service_rng, _ = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    if arrivals == "poisson":
        if (rate_per_s is None) == (rho is None):
            raise ValueError("poisson arrivals need exactly one of rate_per_s or rho")
        rate = rate_per_s if rate_per_s is not None else rate_for_rho(rho or 0.0, service.mean_service_s(), slots)
        arrival = poisson_arrivals(arrival_rng, n, rate)
    elif arrivals == "burst":
        arrival = burst_arrivals(n)
    else:
        raise ValueError(f"unknown arrival process {arrivals!r}; known: burst, poisson")
    cls, svc, item = service.draw(service_rng, n)
    return Workload(arrival, svc.astype(np.float64), cls, item)


def two_tenant_workload(
    seed: int,
    n: int,
    service: ServiceModel,
    *,
    flood_share: float = 0.5,
    interactive_rho: float = 0.3,
    flood_span_s: float = 0.0,
    only: int | None = None,
) -> Workload:
    """Tenant 0 floods: ``flood_share`` of the ``n`` requests arrive as one batch spread evenly over
    ``flood_span_s`` seconds from t = 0 (0 = all at t = 0). Tenant 1 is interactive: the rest arrive
    as a Poisson stream at ``interactive_rho`` of the backend on their own.

    ``only`` keeps one tenant's requests (the same draws): the interactive tenant "alone" is
    ``only=1``. Deterministic in ``seed``.
    """
    n_flood = int(round(n * flood_share))
    n_inter = n - n_flood
    if n_flood < 1 or n_inter < 1:
        raise ValueError("both tenants need at least one request")
    arrival_rng, service_rng, _ = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    flood_at = np.linspace(0.0, flood_span_s, n_flood) if flood_span_s > 0 else np.zeros(n_flood)
    inter_at = poisson_arrivals(arrival_rng, n_inter, rate_for_rho(interactive_rho, service.mean_service_s()))
    cls, svc, item = service.draw(service_rng, n)
    tenant = np.concatenate([np.zeros(n_flood, np.int8), np.ones(n_inter, np.int8)])
    arrival = np.concatenate([flood_at, inter_at])
    order = np.argsort(arrival, kind="stable")
    if only is not None:
        order = order[tenant[order] == only]
    return Workload(arrival[order], svc[order].astype(np.float64), cls[order], item[order], tenant[order])


def _extra_stream(seed: int, which: int) -> np.random.Generator:
    """Stream 3 (models) or 4 (deadlines) of ``seed``; the first three, and so the arrivals,
    services and scores, are those of ``make_workload``: runs pair with one-model runs."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(5)[which])


def with_models(workload: Workload, seed: int, shares: Sequence[float] = (0.5, 0.5)) -> Workload:
    """``workload`` with each request asking for model i with probability ``shares[i]`` (drawn
    independently of its class and service: the models differ only in name, and in that a backend
    holds one of them at a time). Deterministic in ``seed``."""
    probs = np.asarray(shares, dtype=np.float64)
    if len(probs) < 1 or np.any(probs < 0) or probs.sum() <= 0:
        raise ValueError("model shares must be >= 0 with a positive sum")
    model = _extra_stream(seed, 3).choice(len(probs), size=len(workload), p=probs / probs.sum()).astype(np.int8)
    return replace(workload, model=model)


def with_deadlines(workload: Workload, seed: int, max_wait_s: Sequence[float]) -> Workload:
    """``workload`` with each request carrying a queue deadline (the longest it will wait before
    dispatch, seconds after its arrival) drawn uniformly from ``max_wait_s`` (``math.inf``: none).
    Deterministic in ``seed``."""
    choices = np.asarray(max_wait_s, dtype=np.float64)
    if len(choices) < 1 or np.any(choices < 0):
        raise ValueError("queue deadlines must be >= 0 seconds")
    pick = _extra_stream(seed, 4).integers(0, len(choices), size=len(workload))
    return replace(workload, max_wait_s=choices[pick])


def score_stream(seed: int) -> np.random.Generator:
    """The random stream a predictor uses for workload ``seed`` (independent of arrivals and services)."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])
