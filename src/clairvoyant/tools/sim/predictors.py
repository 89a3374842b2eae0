"""Scorers: what the scheduler believes about each request (the ``score`` pushed into the queue).

Lower score = predicted shorter, as everywhere in the project. Each scorer also gives ``beliefs``:
the score plus predicted service seconds and a prediction bucket, which boost, HRRN and fair share
use. Scorers:

- ``OracleScorer``: score = the true service time (clairvoyant SJF; an upper bound for any predictor).
- ``NoisyScorer``: score = class signal + Gaussian noise, the noise scale solved so that the
  Short-vs-Long pairwise ranking accuracy is the requested value (see the class docstring).
- ``LabelScorer``: a class predictor whose label is right a given fraction of the time (wrong
  labels pick another class of the workload uniformly); predicted seconds = the mean service time
  of the predicted class (what a calibrated per-class service-time model learns).
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

from clairvoyant.prediction.features import Prompt
from clairvoyant.scheduling.boost import bucket_for
from clairvoyant.tools.sim.engine import Beliefs
from clairvoyant.tools.sim.workload import CLASS_NAMES, PromptRecord, Workload

__all__ = [
    "LabelScorer",
    "NoisyScorer",
    "OracleScorer",
    "PredictorScorer",
    "Scorer",
    "pairwise_accuracy",
]

SHORT, MEDIUM, LONG = range(len(CLASS_NAMES))  # indices into the one CLASS_NAMES


class Scorer(Protocol):
    name: str

    def scores(self, workload: Workload, rng: np.random.Generator) -> np.ndarray:
        """One float score per request of ``workload`` (lower = shorter). Deterministic in ``rng``."""
        ...

    def beliefs(self, workload: Workload, rng: np.random.Generator) -> Beliefs:
        """Score, predicted seconds and bucket per request. Deterministic in ``rng``."""
        ...


def _class_means(workload: Workload) -> np.ndarray:
    """Mean true service seconds per class index (what a calibrated per-class model converges to)."""
    means = np.full(len(CLASS_NAMES), float(workload.service_s.mean()))
    for i in range(len(CLASS_NAMES)):
        rows = workload.class_idx == i
        if rows.any():
            means[i] = float(workload.service_s[rows].mean())
    return means


def _beliefs(score: np.ndarray, predicted_s: np.ndarray) -> Beliefs:
    pred = np.maximum(np.asarray(predicted_s, dtype=np.float64), 1e-3)
    return Beliefs(
        np.asarray(score, dtype=np.float64), pred, np.array([bucket_for(float(v)) for v in pred], dtype=np.int64)
    )


@dataclass(frozen=True, slots=True)
class OracleScorer:
    """Score = true service time: SJF with perfect knowledge of each request's length."""

    name: str = "oracle"

    def scores(self, workload: Workload, rng: np.random.Generator) -> np.ndarray:
        return workload.service_s.astype(np.float64, copy=True)

    def beliefs(self, workload: Workload, rng: np.random.Generator) -> Beliefs:
        return _beliefs(self.scores(workload, rng), workload.service_s)


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

    def beliefs(self, workload: Workload, rng: np.random.Generator) -> Beliefs:
        """Predicted seconds: the mean service of the class whose signal is nearest the score."""
        score = self.scores(workload, rng)
        c = self.signal_scale
        signal = np.array([0.0, 0.5, 1.0])
        scaled = signal if math.isinf(c) else c * signal
        present = np.array([(workload.class_idx == i).any() for i in range(len(CLASS_NAMES))])
        dist = np.abs(score[:, None] - scaled[None, :]) + np.where(present, 0.0, np.inf)[None, :]
        label = np.argmin(dist, axis=1)
        return _beliefs(score, _class_means(workload)[label])


@dataclass(frozen=True, slots=True)
class LabelScorer:
    """A class predictor whose label is right ``accuracy`` of the time (the paper 5.5 target's
    "class predictor right 80% of the time"). Score = the label's signal (0 / 0.5 / 1)."""

    accuracy: float
    name: str = field(default="label")

    def __post_init__(self) -> None:
        if not 0.0 <= self.accuracy <= 1.0:
            raise ValueError("accuracy must be in [0, 1]")

    def labels(self, workload: Workload, rng: np.random.Generator) -> np.ndarray:
        present = [i for i in range(len(CLASS_NAMES)) if (workload.class_idx == i).any()]
        wrong = rng.random(len(workload)) >= self.accuracy
        pick = rng.integers(0, max(len(present) - 1, 1), size=len(workload))
        label = workload.class_idx.astype(np.int64).copy()
        for row in np.flatnonzero(wrong).tolist():
            others = [c for c in present if c != label[row]]
            if others:
                label[row] = others[int(pick[row]) % len(others)]
        return label

    def scores(self, workload: Workload, rng: np.random.Generator) -> np.ndarray:
        return np.array([0.0, 0.5, 1.0])[self.labels(workload, rng)]

    def beliefs(self, workload: Workload, rng: np.random.Generator) -> Beliefs:
        label = self.labels(workload, rng)
        return _beliefs(np.array([0.0, 0.5, 1.0])[label], _class_means(workload)[label])


@dataclass(slots=True)
class PredictorScorer:
    """Scores from a real predictor over the prompts behind a ``PromptService`` workload.

    Each distinct prompt is predicted once (cached by row); the prompt text is never logged or
    returned. ``predictor`` needs only ``.predict(Prompt) -> object with a float .score``.
    """

    predictor: Any
    records: Sequence[PromptRecord]
    name: str = "onnx"
    c0_s: float = 0.3  # service-time model: seconds per request (the workload's cost model)
    c_tok_s: float = 0.02  # seconds per predicted output token
    _cache: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)

    def _predict(self, workload: Workload) -> tuple[np.ndarray, np.ndarray]:
        if len(workload) and int(workload.item.min()) < 0:
            raise ValueError("the predictor scorer needs a prompt-based workload (--service prompts)")
        score = np.empty(len(workload))
        tokens = np.empty(len(workload))
        for row, item in enumerate(workload.item.tolist()):
            got = self._cache.get(item)
            if got is None:
                prompt: Prompt = self.records[item].prompt
                prediction = self.predictor.predict(prompt)
                got = self._cache[item] = (
                    float(prediction.score),
                    float(getattr(prediction, "predicted_tokens", math.nan)),
                )
            score[row], tokens[row] = got
        return score, tokens

    def scores(self, workload: Workload, rng: np.random.Generator) -> np.ndarray:
        return self._predict(workload)[0]

    def beliefs(self, workload: Workload, rng: np.random.Generator) -> Beliefs:
        """Predicted seconds = c0 + c_tok x the predictor's predicted tokens (a service-time model
        that knows the backend's speed exactly; the prediction error is all in the tokens)."""
        score, tokens = self._predict(workload)
        if np.isnan(tokens).any():
            raise ValueError("the predictor gives no predicted_tokens")
        b = _beliefs(score, self.c0_s + self.c_tok_s * tokens)
        return Beliefs(b.score, b.predicted_s, b.bucket, tokens)


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
