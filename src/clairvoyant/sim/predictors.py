"""Scorers: what the scheduler believes about each request (the ``score`` pushed into the queue).

Lower score = predicted shorter, as everywhere in the project. Three scorers:

- ``OracleScorer``: score = the true service time (clairvoyant SJF; an upper bound for any predictor).
- ``NoisyScorer``: score = class signal + Gaussian noise, the noise scale solved so that the
  Short-vs-Long pairwise ranking accuracy is the requested value (see the class docstring).
- ``PredictorScorer``: the real predictor (``OnnxPredictor`` or anything with
  ``.predict(Prompt) -> object with .score``) over the prompts of a ``PromptService`` workload.

``pairwise_accuracy`` measures what a scorer achieved on a workload (paper 5.3's metric).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Protocol

import numpy as np

from clairvoyant.features import Prompt
from clairvoyant.sim.workload import CLASS_NAMES, PromptRecord, Workload

__all__ = [
    "NoisyScorer",
    "OracleScorer",
    "PredictorScorer",
    "Scorer",
    "pairwise_accuracy",
]

SHORT, MEDIUM, LONG = (CLASS_NAMES.index(c) for c in ("short", "medium", "long"))


class Scorer(Protocol):
    name: str

    def scores(self, workload: Workload, rng: np.random.Generator) -> np.ndarray:
        """One float score per request of ``workload`` (lower = shorter). Deterministic in ``rng``."""
        ...


@dataclass(frozen=True, slots=True)
class OracleScorer:
    """Score = true service time: SJF with perfect knowledge of each request's length."""

    name: str = "oracle"

    def scores(self, workload: Workload, rng: np.random.Generator) -> np.ndarray:
        return workload.service_s.astype(np.float64, copy=True)


@dataclass(frozen=True, slots=True)
class NoisyScorer:
    """A predictor of a chosen Short-vs-Long pairwise ranking accuracy ``a``.

    score = c * signal(class) + N(0, 1), with signal 0 for Short, 0.5 for Medium, 1 for Long.
    For a Short/Long pair the score difference is N(c, 2), so
    P(score_short < score_long) = Phi(c / sqrt 2) = a  =>  c = sqrt(2) * Phi^-1(a).
    ``a`` = 0.5 is a useless (random) predictor, ``a`` < 0.5 an inverted one, ``a`` = 1 a perfect
    class oracle (score = signal; within a class, arrival order decides). Note that even at a = 1
    this knows classes, not lengths: it does not order requests within a class by length.
    """

    accuracy: float
    name: str = field(default="noisy")

    def __post_init__(self) -> None:
        if not 0.0 <= self.accuracy <= 1.0:
            raise ValueError("accuracy must be in [0, 1]")

    @property
    def signal_scale(self) -> float:
        """c in the formula above (inf at a = 1, -inf at a = 0)."""
        if self.accuracy in (0.0, 1.0):
            return math.copysign(math.inf, self.accuracy - 0.5)
        return math.sqrt(2.0) * NormalDist().inv_cdf(self.accuracy)

    def scores(self, workload: Workload, rng: np.random.Generator) -> np.ndarray:
        signal = np.array([0.0, 0.5, 1.0])[workload.class_idx]
        c = self.signal_scale
        noise = rng.standard_normal(len(workload))  # drawn even when unused: same stream position
        if math.isinf(c):
            return signal if c > 0 else -signal
        return c * signal + noise


@dataclass(slots=True)
class PredictorScorer:
    """Scores from a real predictor over the prompts behind a ``PromptService`` workload.

    Each distinct prompt is predicted once (cached by row); the prompt text is never logged or
    returned. ``predictor`` needs only ``.predict(Prompt) -> object with a float .score``.
    """

    predictor: Any
    records: Sequence[PromptRecord]
    name: str = "onnx"
    _cache: dict[int, float] = field(default_factory=dict, repr=False)

    def scores(self, workload: Workload, rng: np.random.Generator) -> np.ndarray:
        if len(workload) and int(workload.item.min()) < 0:
            raise ValueError("the predictor scorer needs a prompt-based workload (--service prompts)")
        out = np.empty(len(workload))
        for row, item in enumerate(workload.item.tolist()):
            score = self._cache.get(item)
            if score is None:
                prompt: Prompt = self.records[item].prompt
                score = self._cache[item] = float(self.predictor.predict(prompt).score)
            out[row] = score
        return out


def pairwise_accuracy(scores: np.ndarray, class_idx: np.ndarray, lo: int = SHORT, hi: int = LONG) -> float:
    """Fraction of (class ``lo``, class ``hi``) pairs with score_lo < score_hi; ties count one half.

    Over all pairs, in O(n log n). Returns NaN when either class is absent.
    """
    a = np.sort(scores[class_idx == lo])
    b = np.sort(scores[class_idx == hi])
    if len(a) == 0 or len(b) == 0:
        return math.nan
    below = np.searchsorted(a, b, side="left")  # short scores strictly below each long score
    ties = np.searchsorted(a, b, side="right") - below
    return float((below.sum() + 0.5 * ties.sum()) / (len(a) * len(b)))
