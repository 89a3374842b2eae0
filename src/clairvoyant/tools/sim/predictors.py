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
  ``.predict(Prompt) -> object with .score``) over the prompts of a ``PromptService`` workload;
  with a ``LogSpread``, ordered by each request's expected tokens instead of its median.

``LogSpread`` is a prediction's spread: the variance of ln tokens around the prediction, by request
(a ridge regression of the squared residual on the prediction and the feature row), so that a
log-normal prediction's expected tokens ``exp(m + v / 2)`` can order the queue (``PredictorScorer``).

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
    "LogSpread",
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


@dataclass(frozen=True, slots=True)
class LogSpread:
    """The variance of ln tokens around a prediction m, request by request:

        v(x) = max(floor, mean + w . standardise([m, m^2, log1p(features)]))

    a ridge regression of the squared residual (observed - m)^2 on the prediction and the request's
    count features (``fit``). A function of m alone cannot change an order (exp(m + v(m) / 2) stays
    monotone wherever v falls slower than -2 per ln token), so the feature row is what makes the
    expected-tokens key differ from the median's. Fit it on data the scored requests are not in.
    """

    mean: np.ndarray  # [p] column means of the design
    scale: np.ndarray  # [p] column standard deviations (> 0)
    weights: np.ndarray  # [p] on the standardised columns
    intercept: float  # mean squared residual of the fitting data, ln tokens^2
    floor: float = 0.05  # the smallest variance returned, ln tokens^2

    @staticmethod
    def design(features: np.ndarray, predicted_log_tokens: np.ndarray) -> np.ndarray:
        m = np.asarray(predicted_log_tokens, dtype=np.float64).reshape(-1)
        counts = np.log1p(np.maximum(np.asarray(features, dtype=np.float64).reshape(len(m), -1), 0.0))
        return np.column_stack([m, m * m, counts])

    @classmethod
    def fit(
        cls,
        features: np.ndarray,
        predicted_log_tokens: np.ndarray,
        observed_log_tokens: np.ndarray,
        penalty: float = 100.0,
        floor: float = 0.05,
    ) -> LogSpread:
        """Ridge (``penalty`` on standardised columns) of (observed - predicted)^2 ln tokens."""
        z = cls.design(features, predicted_log_tokens)
        if len(z) < 2:
            raise ValueError("a spread needs at least two observations")
        target = (np.asarray(observed_log_tokens, dtype=np.float64) - z[:, 0]) ** 2
        mean, scale = z.mean(axis=0), z.std(axis=0)
        scale = np.where(scale > 1e-9, scale, 1.0)  # a constant column: weight 0 after centring
        a = (z - mean) / scale
        weights = np.linalg.solve(a.T @ a + penalty * np.eye(a.shape[1]), a.T @ (target - target.mean()))
        return cls(mean, scale, weights, float(target.mean()), floor)

    def variance(self, features: np.ndarray, predicted_log_tokens: np.ndarray) -> np.ndarray:
        """v per request, ln tokens^2 (>= ``floor``)."""
        a = (self.design(features, predicted_log_tokens) - self.mean) / self.scale
        return np.asarray(np.maximum(a @ self.weights + self.intercept, self.floor), dtype=np.float64)

    def as_dict(self) -> dict[str, Any]:
        return {
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "weights": self.weights.tolist(),
            "intercept": self.intercept,
            "floor": self.floor,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LogSpread:
        """The spread ``as_dict`` wrote; ValueError if its arrays differ in length."""
        mean, scale, weights = (np.asarray(data[k], dtype=np.float64) for k in ("mean", "scale", "weights"))
        if not mean.ndim == 1 or not mean.shape == scale.shape == weights.shape:
            raise ValueError("a spread's mean, scale and weights must be equally long lists")
        return cls(mean, scale, weights, float(data["intercept"]), float(data["floor"]))

    def expected_log_tokens(self, features: np.ndarray, predicted_log_tokens: np.ndarray) -> np.ndarray:
        """ln of the log-normal's expected tokens: m + v / 2."""
        m = np.asarray(predicted_log_tokens, dtype=np.float64).reshape(-1)
        return m + self.variance(features, m) / 2.0


@dataclass(slots=True)
class PredictorScorer:
    """Scores from a real predictor over the prompts behind a ``PromptService`` workload.

    Each distinct prompt is predicted once (cached by row); the prompt text is never logged or
    returned. ``predictor`` needs only ``.predict(Prompt) -> object with a float .score``.

    ``spread`` (a ``LogSpread``): order by expected tokens, not the median. The score is then ln of
    the expected tokens, m + v / 2 (m: ln of the prediction's tokens, v: the spread of its feature
    row), and the predicted tokens (so the predicted seconds) are the expected tokens.
    """

    predictor: Any
    records: Sequence[PromptRecord]
    name: str = "onnx"
    c0_s: float = 0.3  # service-time model: seconds per request (the workload's cost model)
    c_tok_s: float = 0.02  # seconds per predicted output token
    spread: LogSpread | None = None  # None: the predictor's own key (its median)
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
                got = self._cache[item] = self._key(prediction)
            score[row], tokens[row] = got
        return score, tokens

    def _key(self, prediction: Any) -> tuple[float, float]:
        """(score, predicted tokens) of one prediction: its own, or by expected tokens (``spread``)."""
        tokens = float(getattr(prediction, "predicted_tokens", math.nan))
        if self.spread is None:
            return float(prediction.score), tokens
        if not tokens > 0:
            raise ValueError("ordering by expected tokens needs predictions with predicted_tokens")
        expected = float(
            self.spread.expected_log_tokens(prediction.features()[None, :], np.array([math.log(tokens)]))[0]
        )
        return expected, math.exp(expected)

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
