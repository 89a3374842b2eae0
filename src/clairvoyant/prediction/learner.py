"""Online learning: corrects the shipped prior for THIS deployment, from what its backend produced.

The reasons and the measurements are in docs/online-learning.md ("What the learner learns", "Measured"); this is
how it is built. Per backend model as traffic allows, the learner fits a correction in log tokens that
``OnnxPredictor`` adds:

    predicted log tokens = prior log tokens + correction(model, features, prior log tokens)

The correction: a ridge regression of (observed - prior) log tokens on the standardised [prior log tokens,
log1p(feature row)], the penalty chosen by generalised cross-validation, so that with few or uninformative
observations it shrinks to zero by itself. The penalty is at least ``min_penalty_factor`` x n: on standardised
columns (a column's own sum of squares is n) that halves, or more, the least-squares weight of every direction
whose Gram eigenvalue is n or less (left free, GCV picks what predicts log tokens best, near-interpolating fits
that ORDER worse). The mean correction is shrunk toward zero by ``intercept_prior_observations``
pseudo-observations. A global correction first; then, for a model with ``min_model_observations`` of its own, a
correction of the global one's residuals on top. No fit before ``min_observations``.

The residual clip c (``residual_clip``; inf: off) is Huber's pseudo-observation: at each refit, with yhat the
correction in force (the model's own, else the global one), each kept row's target y = observed - prior becomes
yhat + clip(y - yhat, -c, c), so that a few answers of a handful of tokens to ordinary prompts (Qwen1.5 on
AlpacaEval: 5% of its residuals carry 55% of their squares) stop pulling the squared-loss fit. It is made over
the ring's RAW rows (only the target's sums are recomputed: one pass of ``buffer_size`` x p per model), so
nothing clipped is kept: each refit is one more iteration, and a prior far (> c) from a model's lengths is still
learned as fast (a clip kept as observed would hold the first observations toward the prior until evicted). The
fit a refit clipped against is saved with the state (``clip_center``), so a restored learner's first refit makes
the fit the saved one had. The clip raised the replay's second-half gain of the weakest AlpacaEval model from
+0.050 to +0.057 on seeds not used to choose it (mean +0.073 -> +0.076, held-out ShareGPT -0.011 -> -0.005).

A residual kNN (``knn_neighbours``; 0: off, ``ResidualKnn.correction``) adds what no column carries linearly. A
request refined by the encoder carries its pooled embedding after its columns; each model keeps the unit
embeddings of its last ``buffer_size`` uncensored observations with their residuals after the linear correction
in force when observed, clipped to +-c when remembered (a memory: re-clipping it would cost a pass). Residuals
after the linear correction, not the prior: the kNN must model what the correction leaves (a model's mean shift,
counted twice and scaled by each neighbourhood, would be ranking noise). With k 16 and shrinkage 16 it raised
the weakest model's gain from +0.048 to +0.058 (seeds 0-4) and +0.037 to +0.041 (seeds 5-14). It costs a refined
request one 1 x 384 by 384 x 1024 mat-vec, 0.07-0.11 ms with the memory out of cache. A lexical prediction gets
the linear part only.

``observe`` is O(1), 20-40 us: a row copied into the model's ring of ``buffer_size``, a rank-2 update of its
p x p sufficient statistics (the one added, the one evicted), two floats into its quality window. The proxy
calls it with the count the BACKEND reported, never one the client sent. An answer that reached the request's
``cap_tokens`` is censored: it counts for the quality, not the fit. The key is the model the REQUEST named
(the only name known when predicting); past ``max_models`` names, they share ``OTHER_MODEL``, so memory is
bounded by (max_models + 1) x buffer_size rows and as many kNN embeddings.

``refit`` is synchronous (the proxy runs it in ``clairvoyant.prediction.learner_process``, ``clairvoyant replay``
in line) and swaps in one immutable fit, which the proxy's side receives whole. A refit never builds a Gram
matrix from the rows: it solves p x p systems from the moments (p = features + 1: 65 with the encoder's
components), one ``np.linalg.solve`` per GCV penalty with ``[Z'y, I]`` as right-hand sides (the weights and the
inverse's trace), and searches a fit's penalty again only once a quarter of its buffer is new. With the clip
on, a refit of 17 full models takes 9.5 ms of CPU (p50) instead of 3.9. Unclipped, it makes the same penalties
and coefficients as the stacked solve of earlier versions (tests/test_learner.py replays a fixed trace).

``quality()``: per model, Kendall tau_b and mean |log-token error| between the predictions as made (before
their own observation was learned) and the observed lengths, over the last ``quality_window`` requests;
computed after each refit (or by ``update_quality``), so reading it costs a dict lookup.

``save`` writes atomically (``state_file.atomic_writer``): a crash leaves the old file or the new one.
``load`` REFUSES a corrupt file, or one made for another prior (``PriorIdentity``): one warning line says
why, and the learner starts from the prior. A missing file is a first start. Loading does not refit.

Serving path: numpy only.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.prediction.predictor import Prediction, log_tokens
from clairvoyant.state_file import atomic_writer

__all__ = [
    "DEFAULT_MODEL",
    "OTHER_MODEL",
    "FittedCorrection",
    "LearnedCorrection",
    "LearnerConfig",
    "ModelQuality",
    "OnlineLearner",
    "PriorIdentity",
    "ResidualKnn",
    "clipped_residual",
    "kendall_tau_b",
]

logger = logging.getLogger(__name__)

STATE_FORMAT = "clairvoyant-learner-1"
DEFAULT_MODEL = "default"  # the key of requests that name no model
_GLOBAL = "\x00global"  # the penalty cache's key of the global fit (never a model name)
OTHER_MODEL = "other"  # the shared key of models beyond max_models
# Ridge penalties tried by GCV, relative to the number of observations (features are standardised,
# so the Gram matrix's eigenvalues are of order n).
_ALPHA_FACTORS = 10.0 ** np.linspace(-3, 3, 13)


@dataclass(frozen=True, slots=True)
class PriorIdentity:
    """What a learner's observations are tied to: the prior's log tokens and feature rows."""

    feature_set: str
    feature_names: tuple[str, ...]  # count features: the design reads log1p of each
    onnx_sha256: str
    # The rest is empty without an encoder. Its components follow the counts in a refined prediction's
    # row, read as they are (signed); its sha ties them to the graph that made them.
    component_names: tuple[str, ...] = ()
    encoder_sha256: str = ""
    # Its blend weights (single-turn, with history) define the refined prior whose residuals a learner
    # stores, so a state learned under other weights is refused.
    blend_weights: tuple[float, ...] = ()
    # How it reads a long instruction (its last N word pieces after the first ones; 0: the first
    # pieces only): the components and its opinion of a long prompt depend on it.
    encoder_tail_word_pieces: int = 0
    # The kNN graph blended into the refined prior ("" without one; its weight is in blend_weights).
    knn_sha256: str = ""

    @property
    def n_counts(self) -> int:
        """A row's leading count columns; the encoder's components follow them."""
        return len(self.feature_names)

    @property
    def n_features(self) -> int:
        return len(self.feature_names) + len(self.component_names)

    @classmethod
    def of(cls, predictor: Any, encoder: Any | None = None) -> PriorIdentity:
        """The identity of an ``OnnxPredictor`` (and of the encoder refining it, if any: then a row
        is the features followed by the encoder's components)."""
        prior = (predictor.feature_set.name, tuple(predictor.feature_set.names), predictor.onnx_sha256)
        if encoder is None:
            return cls(*prior)
        card = encoder.card
        return cls(
            *prior,
            tuple(f"encoder_component_{i}" for i in range(encoder.components or 0)),
            card.onnx.sha256,
            tuple(encoder.blend_weights.as_list()),
            card.tail_word_pieces,
            card.knn.sha256 if card.knn is not None else "",
        )

    def as_dict(self) -> dict[str, Any]:
        """The fields as JSON reads them back (tuples as lists)."""
        return {name: list(value) if isinstance(value, tuple) else value for name, value in asdict(self).items()}


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    buffer_size: int = 1024  # observations kept per model (a ring buffer: the most recent win)
    refit_every: int = 8  # new observations that make a refit due
    min_observations: int = 16  # observations before the first (global) fit
    min_model_observations: int = 32  # a model's own observations before it gets its own correction
    max_models: int = 16  # models with their own buffer; the rest share OTHER_MODEL
    quality_window: int = 256  # observed requests per model in the rolling quality
    intercept_prior_observations: float = 16.0  # pseudo-observations shrinking the mean correction to 0
    # The module docstring says why each of the following is what it is.
    min_penalty_factor: float = 1.0  # the smallest ridge penalty GCV may choose, per observation (grid: 1e-3..1e3)
    worker_nice: int = 10  # the learner process's niceness above the proxy's
    knn_neighbours: int = 16  # the residual kNN's neighbours read (0: off)
    knn_shrinkage: float = 16.0  # its shrinkage pseudo-weight, in cosine units
    residual_clip: float = 1.0  # ln tokens (inf: off); a residual beyond +-c is learned as if c off

    def __post_init__(self) -> None:
        if min(self.buffer_size, self.refit_every, self.min_observations, self.max_models, self.quality_window) < 1:
            raise ValueError(f"learner settings must be >= 1: {self}")
        if self.min_observations < 2 or self.min_model_observations < 2:
            raise ValueError("min_observations and min_model_observations must be >= 2")
        if not _ALPHA_FACTORS[0] <= self.min_penalty_factor * (1 + 1e-9) <= _ALPHA_FACTORS[-1] * (1 + 1e-9):
            raise ValueError(f"min_penalty_factor must be in [1e-3, 1e3]: {self.min_penalty_factor}")
        if self.knn_neighbours < 0 or not 0 <= self.knn_shrinkage < math.inf:
            raise ValueError(f"knn_neighbours and knn_shrinkage must be >= 0 and finite: {self}")
        if not self.residual_clip > 0:
            raise ValueError(f"residual_clip must be > 0 (inf: off): {self.residual_clip}")


@dataclass(frozen=True, slots=True)
class ModelQuality:
    """Rolling prediction quality of one model's last observed requests."""

    model: str
    observations: int  # in the window
    kendall_tau_b: float  # NaN while undefined (fewer than 2 observations, or all tied)
    mean_abs_log_error: float  # mean |predicted - observed| natural-log tokens; NaN when empty


def kendall_tau_b(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau_b of two equally long arrays, O(n^2) in numpy on boolean pair matrices (n is a
    few hundred here: about 0.2 ms for 256). NaN when undefined."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if len(x) < 2:
        return math.nan
    x_greater = x[:, None] > x[None, :]
    y_greater = y[:, None] > y[None, :]
    # over ordered pairs (i, j) with x_i > x_j: concordant if y_i > y_j, discordant if y_i < y_j
    concordant = int(np.count_nonzero(x_greater & y_greater))
    discordant = int(np.count_nonzero(x_greater & (y[:, None] < y[None, :])))
    untied_x = int(np.count_nonzero(x_greater))  # untied pairs in x, each counted once
    untied_y = int(np.count_nonzero(y_greater))
    if untied_x == 0 or untied_y == 0:
        return math.nan
    return (concordant - discordant) / math.sqrt(float(untied_x) * float(untied_y))


class _Ring:
    """The last ``capacity`` rows of parallel arrays, the oldest overwritten first."""

    __slots__ = ("arrays", "capacity", "count", "next")

    def __init__(self, *arrays: np.ndarray) -> None:
        self.arrays = arrays
        self.capacity = len(arrays[0])
        self.count = 0
        self.next = 0

    @property
    def full(self) -> bool:
        return self.count == self.capacity

    def append(self, *values: Any) -> None:
        """Keep a row, overwriting the oldest when full (read it first: ``oldest``)."""
        i = self.next
        for array, value in zip(self.arrays, values):
            array[i] = value
        self.next = (i + 1) % self.capacity
        self.count = min(self.count + 1, self.capacity)

    def oldest(self) -> tuple[Any, ...]:
        """The row the next ``append`` overwrites (when full)."""
        return tuple(array[self.next] for array in self.arrays)

    def ordered(self) -> tuple[np.ndarray, ...]:
        """Copies of the kept rows, oldest first."""
        idx = (np.arange(self.count) + (self.next if self.full else 0)) % self.capacity
        return tuple(array[idx] for array in self.arrays)


class ResidualKnn(_Ring):
    """One model's residual kNN: the last ``capacity`` observations' unit embeddings and their
    residuals (observed - (prior + the linear correction at observe time) ln tokens)."""

    __slots__ = ()

    def __init__(self, capacity: int, width: int) -> None:
        super().__init__(np.zeros((capacity, width), dtype=np.float32), np.zeros(capacity, dtype=np.float64))

    @property
    def unit(self) -> np.ndarray:
        return self.arrays[0]

    @property
    def residual(self) -> np.ndarray:
        return self.arrays[1]

    @classmethod
    def filled(cls, capacity: int, unit: np.ndarray, residual: np.ndarray) -> ResidualKnn:
        """A memory holding the last ``capacity`` of these rows (oldest first), as if appended."""
        knn = cls(capacity, unit.shape[1])
        for i in range(max(0, len(unit) - capacity), len(unit)):
            knn.append(unit[i], residual[i])
        return knn

    def remember(self, embedding: np.ndarray, residual: float) -> None:
        """Append ``embedding``'s unit vector with ``residual``; nothing for an embedding of another
        width (not comparable), without a direction, or a residual that is not finite."""
        if len(embedding) != self.unit.shape[1] or not math.isfinite(residual):
            return
        unit = unit_vector(embedding)
        if unit is not None:
            self.append(unit, residual)

    def correction(self, embedding: np.ndarray, neighbours: int, shrinkage: float) -> float:
        """sum w_j r_j / (sum w_j + shrinkage) over the ``neighbours`` nearest rows by cosine to
        ``embedding``, w_j = max(cos_j, 0); 0.0 with an empty memory, or an embedding of another
        width or without a direction. One 1 x d by d x count mat-vec."""
        n = self.count
        if n == 0 or neighbours == 0 or len(embedding) != self.unit.shape[1]:
            return 0.0
        unit = unit_vector(embedding)
        if unit is None:
            return 0.0
        cos = self.unit[:n] @ unit
        if n > neighbours:
            top = np.argpartition(-cos, neighbours - 1)[:neighbours]
            cos, residual = cos[top], self.residual[top]
        else:
            residual = self.residual[:n]
        weights = np.maximum(cos, 0.0).astype(np.float64)
        value = float(weights @ residual / (weights.sum() + shrinkage))
        return value if math.isfinite(value) else 0.0


def bucket_key(model: str | None, known: Collection[str], max_models: int) -> str:
    """The buffer a model's observations go to, given the keys that have one (``known``): its own
    while fewer than ``max_models`` have one, else ``OTHER_MODEL``."""
    key = model or DEFAULT_MODEL
    return key if key in known or len(known) < max_models else OTHER_MODEL


def usable_observation(prediction: Prediction, observed_tokens: int, n_counts: int, n_features: int) -> bool:
    """Whether ``OnlineLearner.observe`` records this: a count that is a non-negative integer, and
    a prediction with the prior's feature row (``n_counts`` lexical columns, or ``n_features`` with
    the encoder's components and possibly its embedding after them)."""
    if isinstance(observed_tokens, bool) or not isinstance(observed_tokens, (int, np.integer)) or observed_tokens < 0:
        return False
    row_bytes = len(prediction.feature_row)
    return not row_bytes % 4 and (row_bytes >= 4 * n_features or row_bytes == 4 * n_counts)


def clipped_residual(residual: float, clip: float) -> float:
    """``residual`` clipped to [-clip, clip] (``clip`` inf: unchanged); one that is not finite is
    returned as it is (and refused where it would be learned)."""
    return residual if abs(residual) <= clip or not math.isfinite(residual) else math.copysign(clip, residual)


def unit_vector(embedding: np.ndarray) -> np.ndarray | None:
    """``embedding`` scaled to unit length (float32), or None if it has no finite direction."""
    norm = float(np.linalg.norm(embedding))
    if not (norm > 0.0 and math.isfinite(norm)):
        return None
    return (embedding / norm).astype(np.float32)


class _Moments:
    """Sufficient statistics of the regression over a ring buffer's observations, kept up to date
    by each observation (add the new one, subtract the evicted one): a refit then works on p x p
    matrices only, never on the rows. That keeps it short and off multi-threaded BLAS (a Gram
    matrix over 17k rows makes OpenBLAS wake its threads, which then compete with the event loop
    for the cores). Design column 0 is the prior's log tokens, then log1p of the features; the
    target is observed - prior log tokens."""

    __slots__ = ("n", "s_yy", "s_y", "s_z", "s_zy", "s_zz")

    def __init__(self, p: int) -> None:
        self.n = 0
        self.s_z = np.zeros(p)
        self.s_y = 0.0
        self.s_zz = np.zeros((p, p))
        self.s_zy = np.zeros(p)
        self.s_yy = 0.0

    @staticmethod
    def design(row: np.ndarray, prior: Any, counts: int | None = None) -> np.ndarray:
        """[prior, log1p(max(row[:counts], 0)), row[counts:]] in float64, of one row or of each row of
        a matrix: the first ``counts`` columns (all by default) are count features (>= 0 by
        contract), the rest the encoder's signed components."""
        if counts is None:
            counts = row.shape[-1]
        z = np.empty(row.shape[:-1] + (row.shape[-1] + 1,))
        z[..., 0] = prior
        z[..., 1:] = row
        tail = z[..., 1 : counts + 1]
        np.maximum(tail, 0.0, out=tail)
        np.log1p(tail, out=tail)
        return z

    def update(self, z: np.ndarray, y: float, z_out: np.ndarray | None = None, y_out: float = 0.0) -> None:
        """Add the observation (z, y) and, if given, remove (z_out, y_out): one rank-2 update."""
        if z_out is None:
            self.n += 1
            self.s_z += z
            self.s_y += y
            self.s_zz += np.outer(z, z)
            self.s_zy += y * z
            self.s_yy += y * y
            return
        both = np.stack((z, z_out))  # [2, p]
        signed = both * np.array([[1.0], [-1.0]])
        self.s_z += signed[0] + signed[1]
        self.s_y += y - y_out
        self.s_zz += both.T @ signed
        self.s_zy += y * z - y_out * z_out
        self.s_yy += y * y - y_out * y_out

    def __iadd__(self, other: _Moments) -> _Moments:
        self.n += other.n
        self.s_z += other.s_z
        self.s_y += other.s_y
        self.s_zz += other.s_zz
        self.s_zy += other.s_zy
        self.s_yy += other.s_yy
        return self


class _Bucket:
    """One model's observations: the uncensored ones' ring and moments, and the quality window."""

    __slots__ = ("counts", "moments", "observations", "quality_at", "ring", "window")

    def __init__(self, config: LearnerConfig, n_features: int, counts: int) -> None:
        rows = config.buffer_size
        # rows, prior and observed log tokens
        self.ring = _Ring(np.zeros((rows, n_features), dtype=np.float32), np.zeros(rows), np.zeros(rows))
        self.window = _Ring(np.zeros(config.quality_window), np.zeros(config.quality_window))  # predicted, observed
        self.moments = _Moments(n_features + 1)
        self.counts = counts  # leading count columns (log1p in the design)
        self.observations = 0  # ever observed (censored ones included)
        self.quality_at = -1  # observations when its rolling quality was last computed

    def learn(self, row: np.ndarray, prior: float, observed: float) -> None:
        """Keep an uncensored observation in the ring and the moments (evicting the oldest)."""
        z = _Moments.design(row, prior, self.counts)
        if self.ring.full:
            old_row, old_prior, old_observed = self.ring.oldest()
            old_z = _Moments.design(old_row, float(old_prior), self.counts)
            self.moments.update(z, observed - prior, old_z, float(old_observed - old_prior))
        else:
            self.moments.update(z, observed - prior)
        self.ring.append(row, prior, observed)


@dataclass(frozen=True, slots=True)
class _Linear:
    """correction = weights[:counts] . log1p(row[:counts]) + weights[counts:] . row[counts:]
    + prior_weight * prior_log_tokens + intercept (a row without components: their mean, 0)."""

    weights: np.ndarray  # float32 [n_features]
    prior_weight: float
    intercept: float


@dataclass(frozen=True, slots=True)
class FittedCorrection:
    global_: _Linear
    by_model: dict[str, _Linear]  # global + the model's own correction
    observations: int  # rows the fit used
    n_counts: int  # the rows' count columns; the encoder's components follow them

    def packed(self) -> tuple[tuple[str, ...], bytes, tuple[float, ...], tuple[float, ...], int, int]:
        """The fit as plain values, cheap to pickle (one process sends it to another): the model
        keys, every weight row (the global fit's first) as float32 bytes, the prior weights, the
        intercepts, the observations and the count columns."""
        linears = [self.global_, *self.by_model.values()]
        return (
            tuple(self.by_model),
            np.stack([linear.weights for linear in linears]).astype(np.float32).tobytes(),
            tuple(linear.prior_weight for linear in linears),
            tuple(linear.intercept for linear in linears),
            self.observations,
            self.n_counts,
        )

    @classmethod
    def unpacked(
        cls, packed: tuple[tuple[str, ...], bytes, tuple[float, ...], tuple[float, ...], int, int]
    ) -> FittedCorrection:
        """The fit ``packed`` describes (its weights are views of one array)."""
        keys, weights, prior_weights, intercepts, observations, n_counts = packed
        rows = np.frombuffer(weights, dtype=np.float32).reshape(len(prior_weights), -1)
        linears = [_Linear(rows[i], prior_weights[i], intercepts[i]) for i in range(len(prior_weights))]
        return cls(linears[0], dict(zip(keys, linears[1:])), observations, n_counts)

    def correction(
        self, key: str, known: Collection[str], max_models: int, row: np.ndarray, prior_log_tokens: float
    ) -> float:
        """The correction for model ``key``; ``known``: the model keys with a buffer (a key beyond
        ``max_models`` of them is corrected as ``OTHER_MODEL``, ``bucket_key``). Never raises on a
        finite row."""
        linear = self.by_model.get(bucket_key(key, known, max_models), self.global_)
        # features are counts (>= 0), so log1p(row) is the design's log1p(max(row, 0)), one call cheaper
        counts = self.n_counts
        if len(row) == counts:  # a lexical row (no encoder's components): each component at 0, its mean
            dot = float(np.dot(linear.weights[:counts], np.log1p(row)))
        else:
            dot = float(  # the encoder's components; an embedding after them is the kNN's
                np.dot(linear.weights[:counts], np.log1p(row[:counts]))
                + np.dot(linear.weights[counts:], row[counts : len(linear.weights)])
            )
        value = dot + linear.prior_weight * prior_log_tokens + linear.intercept
        return value if math.isfinite(value) else 0.0


def _ridge_gcv(
    gram: np.ndarray,
    zy: np.ndarray,
    yy: float,
    n: int,
    alpha: float | None = None,
    factors: np.ndarray = _ALPHA_FACTORS,
) -> tuple[np.ndarray, float]:
    """Ridge weights of a centred target on standardised, centred columns, given their Gram
    matrix ``Z'Z``, ``Z'y`` and ``y'y`` over ``n`` rows, and the penalty used. Without ``alpha``
    the penalty is picked by generalised cross-validation among ``n * factors``: the first
    penalty of the lowest GCV score (every score infinite: the first penalty).

    One ``np.linalg.solve`` (LU on p x p, right-hand sides ``[Z'y, I]``: the weights and the
    inverse whose trace gives the degrees of freedom) per penalty tried (``eigh`` once for every
    penalty would be neater, but OpenBLAS may run it multi-threaded, and on cores busy generating it
    then takes 15 ms instead of 0.3 ms). Each solve is the one the stacked solve of every penalty
    made before (LAPACK solves a stack one matrix at a time), so the weights and the choice are the
    same.
    """
    p = len(zy)
    eye = np.eye(p)
    if alpha is not None:  # a penalty chosen earlier: one p x p solve
        return np.linalg.solve(gram + alpha * eye, zy), alpha
    rhs = np.concatenate([zy[:, None], eye], axis=1)
    best_weights: np.ndarray | None = None
    best_alpha, best_gcv = 0.0, math.inf
    for candidate in n * factors:
        solved = np.linalg.solve(gram + candidate * eye, rhs)
        weights = solved[:, 0]
        dof = p - candidate * float(np.trace(solved[:, 1:]))  # trace of the hat matrix
        rss = yy - 2.0 * float(weights @ zy) + float((weights @ gram) @ weights)
        gcv = n * rss / (n - dof) ** 2 if n - dof > 0.5 else math.inf
        if best_weights is None or gcv < best_gcv:
            best_weights, best_alpha, best_gcv = weights, float(candidate), gcv
    assert best_weights is not None  # factors is not empty
    return best_weights, best_alpha


class LearnedCorrection:
    """What the request path reads of a learner (``OnlineLearner``'s, and ``LearnerProcess``'s copy
    of its worker's): the fit in force, swapped whole, and each model's residual kNN memory.
    ``known``: the model keys with a buffer (``bucket_key``), filled by the owner."""

    __slots__ = ("config", "fit", "knn", "known", "n_features")

    def __init__(self, config: LearnerConfig, n_features: int, known: dict[str, Any]) -> None:
        self.config = config
        self.n_features = n_features
        self.known = known
        self.fit: FittedCorrection | None = None
        self.knn: dict[str, ResidualKnn] = {}

    def correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        """Log tokens to add to the prior's: the linear correction (0.0 before the first fit) plus,
        for a row that carries the encoder's embedding after its columns, the residual kNN's.
        Never raises."""
        value = self.linear(model, row, prior_log_tokens)
        cfg = self.config
        if len(row) > self.n_features and cfg.knn_neighbours:
            knn = self.knn.get(bucket_key(model, self.known, cfg.max_models))
            if knn is not None:
                value += knn.correction(row[self.n_features :], cfg.knn_neighbours, cfg.knn_shrinkage)
        return value

    def linear(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        """The ridge correction alone (0.0 before the first fit); reads the row's first ``n_features`` columns."""
        fit = self.fit
        if fit is None:
            return 0.0
        return fit.correction(model or DEFAULT_MODEL, self.known, self.config.max_models, row, prior_log_tokens)

    def remember(
        self, key: str, prediction: Prediction, observed_tokens: int, residual: float | None = None
    ) -> float | None:
        """With the kNN on, add an uncensored observation whose row carries the encoder's embedding
        to model ``key``'s memory, with ``residual`` (None: its residual after the linear correction
        in force now), clipped. Returns the residual kept (None: not remembered)."""
        cap = prediction.cap_tokens
        if (
            not self.config.knn_neighbours
            or len(prediction.feature_row) <= 4 * self.n_features
            or (cap is not None and observed_tokens >= cap)
        ):
            return None
        row = np.frombuffer(prediction.feature_row, dtype=np.float32)
        embedding = row[self.n_features :]
        knn = self.knn.get(key)
        if knn is None:
            knn = self.knn[key] = ResidualKnn(self.config.buffer_size, len(embedding))
        if residual is None:
            prior = prediction.prior_log_tokens
            residual = log_tokens(int(observed_tokens)) - (prior + self.linear(prediction.model, row, prior))
        residual = clipped_residual(residual, self.config.residual_clip)
        knn.remember(embedding, residual)
        return residual


class _Ridge:
    """What a refit carries to the next (see the module docstring): each fit's GCV penalty, searched
    again once a quarter of its buffer is new, and ``center``, the fit the target of the fit in force
    was clipped against (None: unclipped), saved with the state so that a restored learner's first
    refit makes the fit the saved one had."""

    __slots__ = ("center", "config", "identity", "penalties")

    def __init__(self, config: LearnerConfig, identity: PriorIdentity) -> None:
        self.config = config
        self.identity = identity
        self.penalties: dict[str, tuple[float, int]] = {}  # per fit (model or _GLOBAL): (penalty, observations then)
        self.center: FittedCorrection | None = None

    def fit(self, data: list[tuple[str, _Moments, int]]) -> FittedCorrection:
        """The corrections from each model's (key, moments, observations)."""
        cfg = self.config
        n_features = self.identity.n_features
        pooled = _Moments(n_features + 1)
        for _, moments, _ in data:
            pooled += moments
        n = pooled.n
        mean = pooled.s_z / n
        covariance = pooled.s_zz / n - np.outer(mean, mean)
        std = np.sqrt(np.clip(np.diag(covariance), 0.0, None))
        used = std > 1e-6
        all_used = bool(used.all())
        scale = std[used]
        outer_scale = np.outer(scale, scale)
        factors = _ALPHA_FACTORS[_ALPHA_FACTORS >= cfg.min_penalty_factor * (1 - 1e-9)]

        def penalty(key: str, observations: int, n: int) -> float | None:
            """The penalty chosen for ``key`` earlier, or None (search again): GCV runs again once
            a quarter of the buffer, and at least 32 observations, are new since the last search."""
            found = self.penalties.get(key)
            if found is None or observations - found[1] >= max(32, n // 4):
                return None
            return found[0]

        def fit(
            m: _Moments, key: str, observations: int, offset: np.ndarray | None = None, offset_intercept: float = 0.0
        ) -> tuple[np.ndarray, float]:
            """Ridge (with intercept) of the target minus ``z . offset + offset_intercept`` on the
            columns standardised by the pooled std; returns raw-column coefficients and the
            intercept, both shrunk."""
            k = m.n
            s_y, s_zy, s_yy = m.s_y, m.s_zy, m.s_yy
            if offset is not None:  # moments of the residual r = y - z.c - b
                c, b = offset, offset_intercept
                zc = m.s_z @ c
                s_y = m.s_y - zc - k * b
                s_zy = m.s_zy - m.s_zz @ c - m.s_z * b
                s_yy = m.s_yy - 2 * (c @ m.s_zy) - 2 * b * m.s_y + c @ m.s_zz @ c + 2 * b * zc + k * b * b
            z_mean = m.s_z / k
            y_mean = s_y / k
            centred = m.s_zz - k * np.outer(z_mean, z_mean)
            gram = (centred if all_used else centred[np.ix_(used, used)]) / outer_scale
            zy = (s_zy - k * z_mean * y_mean)[used] / scale
            yy = max(s_yy - k * y_mean * y_mean, 0.0)
            weights, alpha = _ridge_gcv(gram, zy, yy, k, penalty(key, observations, k), factors)
            if key not in self.penalties or self.penalties[key][0] != alpha:
                self.penalties[key] = (alpha, observations)
            coef = np.zeros(n_features + 1)
            coef[used] = weights / scale
            shrunk_mean = y_mean * k / (k + cfg.intercept_prior_observations)
            return coef, shrunk_mean - float(coef @ z_mean)

        def linear(coef: np.ndarray, intercept: float) -> _Linear:
            return _Linear(coef[1:].astype(np.float32), float(coef[0]), float(intercept))

        global_coef, global_intercept = fit(pooled, _GLOBAL, sum(o for _, _, o in data))
        by_model: dict[str, _Linear] = {}
        if len(data) > 1:  # with one model the global fit is already that model's
            for key, moments, observations in data:
                if moments.n >= cfg.min_model_observations:
                    coef, intercept = fit(moments, key, observations, global_coef, global_intercept)
                    by_model[key] = linear(global_coef + coef, global_intercept + intercept)
        return FittedCorrection(linear(global_coef, global_intercept), by_model, n, self.identity.n_counts)


class OnlineLearner:
    """See the module docstring. Used from one thread: the proxy's learner process calls it in turn, and
    so does ``clairvoyant replay``."""

    def __init__(self, identity: PriorIdentity, config: LearnerConfig | None = None) -> None:
        self.identity = identity
        self.config = config or LearnerConfig()
        self._buckets: dict[str, _Bucket] = {}
        self._new_since_fit = 0
        self.corrector = LearnedCorrection(self.config, identity.n_features, self._buckets)
        self._ridge = _Ridge(self.config, identity)
        self._quality: dict[str, ModelQuality] = {}
        self.last_refit_s: float | None = None  # seconds the last refit took
        self.refits = 0  # refits completed (with or without enough observations to fit)

    @classmethod
    def for_predictor(cls, predictor: Any, config: LearnerConfig | None = None, encoder: Any = None) -> OnlineLearner:
        return cls(PriorIdentity.of(predictor, encoder), config)

    # -- the request path ----------------------------------------------------------------------
    def correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        """``LearnedCorrection.correction``: never raises."""
        return self.corrector.correction(model, row, prior_log_tokens)

    def observe(self, prediction: Prediction, observed_tokens: int, knn_residual: float | None = None) -> bool:
        """Record what the backend produced for a request predicted as ``prediction``. O(1).
        Returns False (and records nothing) for an unusable observation: a negative or non-integer
        count, or a prediction without this prior's feature row. A row may carry the encoder's
        embedding after its columns: with the kNN on, its residual joins the model's kNN memory
        (``knn_residual``: the residual the proxy computed when it observed it, else now's)."""
        n_counts, n_features = self.identity.n_counts, self.identity.n_features
        if not usable_observation(prediction, observed_tokens, n_counts, n_features):
            return False
        observed_log = log_tokens(int(observed_tokens))
        key = bucket_key(prediction.model, self._buckets, self.config.max_models)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.config, n_features, n_counts)
        bucket.window.append(prediction.predicted_log_tokens, observed_log)
        bucket.observations += 1
        cap = prediction.cap_tokens
        censored = cap is not None and observed_tokens >= cap
        if not censored and len(prediction.feature_row) >= 4 * n_features:  # a lexical row: quality only
            row = np.frombuffer(prediction.feature_row, dtype=np.float32)[:n_features]
            bucket.learn(row, prediction.prior_log_tokens, observed_log)
            self._new_since_fit += 1
            self.corrector.remember(key, prediction, observed_tokens, knn_residual)
        return True

    # -- reading -------------------------------------------------------------------------------
    def knn_memory(self, key: str) -> tuple[np.ndarray, ...] | None:
        """Model ``key``'s kNN memory (unit embeddings, residuals; oldest first); None if it has none."""
        knn = self.corrector.knn.get(key)
        return None if knn is None or not knn.count else knn.ordered()

    @property
    def refit_due(self) -> bool:
        return self._new_since_fit >= self.config.refit_every

    @property
    def unfitted(self) -> int:
        """Observations learned since the last refit started."""
        return self._new_since_fit

    @property
    def fitted(self) -> bool:
        return self.corrector.fit is not None

    @property
    def observed_total(self) -> int:
        return sum(bucket.observations for bucket in self._buckets.values())

    def quality(self) -> Mapping[str, ModelQuality]:
        """Rolling quality per model key, as last computed (by the worker or ``update_quality``)."""
        return self._quality

    def models(self) -> list[str]:
        return list(self._buckets)

    # -- fitting -------------------------------------------------------------------------------
    def refit(self) -> None:
        """Fit the corrections from the moments and swap them in; then update the rolling quality.
        Blocking, about 0.2 ms of work per model (0.5 with the residual clip: the target's sums from
        the rows): never on an event loop (the proxy runs it in the learner's process).

        With the residual clip on and a fit in force (or restored as the last fit's center), each
        model's target sums are those of its target clipped against that fit, which becomes the
        center of the fit made now."""
        started = time.perf_counter()
        self._new_since_fit = 0
        center = self.corrector.fit or self._ridge.center
        if self.config.residual_clip == math.inf:
            center = None
        data = []
        for key, bucket in self._buckets.items():
            if not bucket.moments.n:
                continue
            moments = bucket.moments
            if center is not None:
                linear = center.by_model.get(key, center.global_)
                moments = _clipped(
                    moments, bucket.ring.ordered(), linear, self.identity.n_counts, self.config.residual_clip
                )
            data.append((key, moments, bucket.observations))
        if sum(m.n for _, m, _ in data) >= self.config.min_observations:
            self.corrector.fit = self._ridge.fit(data)
            self._ridge.center = center
        self.last_refit_s = time.perf_counter() - started
        self.refits += 1
        self.update_quality()

    def update_quality(self) -> None:
        """Recompute the rolling quality of the models observed since the last update
        (O(window^2) each, about 0.2 ms for 256; off the event loop)."""
        for key, bucket in self._buckets.items():
            if key in self._quality and bucket.observations == bucket.quality_at:
                continue
            bucket.quality_at = bucket.observations
            predicted, observed = bucket.window.ordered()
            mae = float(np.mean(np.abs(predicted - observed))) if len(observed) else math.nan
            self._quality[key] = ModelQuality(key, len(observed), kendall_tau_b(predicted, observed), mae)

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path: Path | str) -> None:
        """Write the state atomically (temp file + fsync + os.replace). Raises OSError."""
        arrays: dict[str, np.ndarray] = {}
        keys = list(self._buckets)
        for i, bucket in enumerate(self._buckets.values()):
            arrays[f"rows_{i}"], arrays[f"prior_{i}"], arrays[f"observed_{i}"] = bucket.ring.ordered()
            arrays[f"qpredicted_{i}"], arrays[f"qobserved_{i}"] = bucket.window.ordered()
            memory = self.knn_memory(keys[i])
            if memory is not None:
                arrays[f"knn_unit_{i}"], arrays[f"knn_residual_{i}"] = memory
        meta = {
            "format": STATE_FORMAT,
            "identity": self.identity.as_dict(),
            "models": keys,
            "observations": [bucket.observations for bucket in self._buckets.values()],
            "config": asdict(self.config),
        }
        center = self._ridge.center
        if center is not None:  # the fit the fit in force clipped its target against (see refit)
            center_keys, weights, prior_weights, intercepts, center_n, _ = center.packed()
            meta["clip_center"] = {
                "models": list(center_keys),
                "prior_weights": list(prior_weights),
                "intercepts": list(intercepts),
                "observations": center_n,
            }
            arrays["clip_center_weights"] = np.frombuffer(weights, dtype=np.float32).reshape(len(prior_weights), -1)
        arrays["meta"] = np.array(json.dumps(meta))
        with atomic_writer(Path(path), "wb") as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]  # numpy's stubs read the first ** key as allow_pickle

    @classmethod
    def load(cls, path: Path | str, identity: PriorIdentity, config: LearnerConfig | None = None) -> OnlineLearner:
        """A learner restored from ``path``; a fresh one (the prior) if the file is missing, or is
        refused: corrupt, or made for another prior (one warning line says which). Does not refit."""
        path = Path(path)
        learner = cls(identity, config)
        if not path.exists():
            logger.info("online learner: no state file at %s yet; starting from the prior", path)
            return learner
        try:
            learner._restore(path)
        except Exception as exc:  # numpy/zipfile raise many types for a damaged file
            why = str(exc) if isinstance(exc, _Refused) else f"unreadable or corrupt ({type(exc).__name__}: {exc})"
            logger.warning("online learner: state file %s refused: %s; starting from the prior", path, why)
            return cls(identity, config)
        logger.info(
            "online learner: restored %d observations of %d models from %s",
            learner.observed_total,
            len(learner._buckets),
            path,
        )
        return learner

    def _restore(self, path: Path) -> None:
        with path.open("rb") as fh:  # our handle: closed even when np.load refuses the bytes
            npz = np.load(fh, allow_pickle=False)
            if not isinstance(npz, np.lib.npyio.NpzFile):
                raise _Refused("not a learner state file (not an npz archive)")
            with npz:
                self._restore_from(npz)

    def _restore_from(self, npz: np.lib.npyio.NpzFile) -> None:
        if "meta" not in npz.files:
            raise _Refused("not a learner state file (no metadata)")
        meta = json.loads(str(npz["meta"][()]))
        if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
            raise _Refused(f"format {meta.get('format') if isinstance(meta, dict) else None!r} is not {STATE_FORMAT!r}")
        # A file from before a field was recorded (the encoder, the turn-aware blend, the kNN) has
        # that field's default: refused whenever the loaded prior has more than the default.
        theirs = {**PriorIdentity("", (), "").as_dict(), **(meta.get("identity") or {})}
        for field, ours in self.identity.as_dict().items():
            if theirs.get(field) != ours:
                shown = theirs.get(field) if not field.endswith("_names") else "a different list"
                raise _Refused(f"made for another prior: its {field} is {shown!r}, the loaded model's differs")
        keys = meta.get("models")
        counts = meta.get("observations")
        if not isinstance(keys, list) or not isinstance(counts, list) or len(keys) != len(counts):
            raise _Refused("metadata lists no models")
        self._ridge.center = self._restored_clip_center(npz, meta.get("clip_center"))
        cfg, n_features = self.config, self.identity.n_features
        for i, key in enumerate(keys[: cfg.max_models + 1]):
            rows, prior, observed = npz[f"rows_{i}"], npz[f"prior_{i}"], npz[f"observed_{i}"]
            predicted_q, observed_q = npz[f"qpredicted_{i}"], npz[f"qobserved_{i}"]
            n = len(observed)
            if rows.shape != (n, n_features) or len(prior) != n or len(predicted_q) != len(observed_q):
                raise _Refused(f"model {i}: arrays of inconsistent shapes")
            if not (np.isfinite(rows).all() and np.isfinite(prior).all() and np.isfinite(observed).all()):
                raise _Refused(f"model {i}: non-finite values")
            bucket = _Bucket(cfg, n_features, self.identity.n_counts)
            for j in range(max(0, n - cfg.buffer_size), n):
                bucket.learn(rows[j], float(prior[j]), float(observed[j]))
            for j in range(max(0, len(observed_q) - cfg.quality_window), len(observed_q)):
                bucket.window.append(float(predicted_q[j]), float(observed_q[j]))
            if f"knn_unit_{i}" in npz.files:  # a file from before the kNN has none: an empty memory
                self.corrector.knn[str(key)] = _restored_knn(npz, i, cfg.buffer_size)
            bucket.observations = int(counts[i])
            self._buckets[str(key)] = bucket
            self._new_since_fit += bucket.ring.count

    def _restored_clip_center(self, npz: Any, meta: Any) -> FittedCorrection | None:
        """The saved fit's clip center (None: the file has none, e.g. from before the clip); _Refused if damaged."""
        if meta is None:
            return None
        try:
            keys = tuple(str(k) for k in meta["models"])
            prior_weights = tuple(float(w) for w in meta["prior_weights"])
            intercepts = tuple(float(b) for b in meta["intercepts"])
            observations = int(meta["observations"])
            weights = np.asarray(npz["clip_center_weights"], dtype=np.float32)
        except (KeyError, TypeError, ValueError) as exc:
            raise _Refused(f"a damaged clip center ({type(exc).__name__})") from exc
        fits = len(prior_weights)
        if fits != len(keys) + 1 or len(intercepts) != fits or weights.shape != (fits, self.identity.n_features):
            raise _Refused("a clip center of inconsistent shapes")
        if not (np.isfinite(weights).all() and np.isfinite(prior_weights).all() and np.isfinite(intercepts).all()):
            raise _Refused("a clip center with non-finite values")
        packed = (keys, weights.tobytes(), prior_weights, intercepts, observations, self.identity.n_counts)
        return FittedCorrection.unpacked(packed)


def _restored_knn(npz: Any, i: int, capacity: int) -> ResidualKnn:
    """Model ``i``'s kNN memory from a state file (its last ``capacity`` rows); _Refused if damaged."""
    if f"knn_residual_{i}" not in npz.files:
        raise _Refused(f"model {i}: kNN embeddings without residuals")
    unit, residual = npz[f"knn_unit_{i}"], npz[f"knn_residual_{i}"]
    if unit.ndim != 2 or unit.shape[1] < 1 or residual.shape != (len(unit),):
        raise _Refused(f"model {i}: kNN arrays of inconsistent shapes")
    if not (np.isfinite(unit).all() and np.isfinite(residual).all()):
        raise _Refused(f"model {i}: non-finite kNN values")
    return ResidualKnn.filled(capacity, unit.astype(np.float32), residual.astype(np.float64))


def _clipped(moments: _Moments, kept: tuple[np.ndarray, ...], linear: _Linear, counts: int, clip: float) -> _Moments:
    """``moments`` with the target's sums (those of the ring's ``kept`` rows, prior and observed log tokens)
    replaced by those of Huber's pseudo-target y* = yhat + clip(y - yhat, -clip, clip), yhat = ``linear``'s
    correction of each row."""
    rows, prior, observed = kept
    z = _Moments.design(rows, prior, counts)
    expected = z[:, 1:] @ linear.weights.astype(np.float64) + linear.prior_weight * prior + linear.intercept
    target = expected + np.clip(observed - prior - expected, -clip, clip)
    clipped = copy.copy(moments)  # the design's sums are shared, never written
    clipped.s_y, clipped.s_zy, clipped.s_yy = float(target.sum()), z.T @ target, float(target @ target)
    return clipped


class _Refused(ValueError):
    """A state file that must not be used (the message says why)."""
