"""Online learning: corrects the shipped prior for THIS deployment, from what its backend produced.

The shipped model (the prior) was trained on ShareGPT answers; the models a deployment serves answer
its own users at their own lengths. The learner fits, for each backend model the traffic allows,
a correction in log tokens that ``OnnxPredictor`` adds to the prior's calibrated log tokens:

    predicted log tokens = prior log tokens + correction(model, features, prior log tokens)

The correction: a ridge regression of (observed - prior) log tokens on the standardised
[prior log tokens, log1p(feature row)], with the ridge penalty chosen by generalised
cross-validation, so that with few or uninformative observations it shrinks to zero by itself.
The penalty is at least ``min_penalty_factor`` (1) x the observations n: on standardised columns
(a column's own sum of squares is n) that shrinks the least-squares weight of every direction whose
Gram eigenvalue is n or less by half or more.
GCV picks the penalty that predicts log tokens best, and left free (down to 0.001 x n) it undershoots
what ORDERS best: with 65 columns and 16-100 observations it chose near-interpolating fits that
took the replay's Kendall tau on lines 17-100 from the prior's 0.33-0.43 down to 0.21-0.33 on
AlpacaEval's four models, and from 0.46 to 0.30 on held-out ShareGPT; with the floor, 0.32-0.42
and 0.43, and a slightly better second half (measured with `clairvoyant replay` on the AlpacaEval set).
The mean correction is shrunk toward zero too (``intercept_prior_observations`` pseudo-observations).
First a global correction over every model's observations; then, for a model with
``min_model_observations`` of its own, a correction of the global one's residuals on top.
No fit is made before ``min_observations``: until then predictions are the prior's.

The target is clipped (``residual_clip`` c, 1 ln token; inf: off), Huber's pseudo-observation: at each refit,
with yhat the correction in force (the last fit; the model's own, else the global one), every kept row's target
y = observed - prior becomes yhat + clip(y - yhat, -c, c), so an answer more than e^c (2.7x) longer or shorter
than expected counts as if it were e^c off. Why: a few answers of 1-13 tokens to prompts that look like any other
(Qwen1.5 on AlpacaEval: 5% of its residuals carry 55% of their squares) pulled the squared-loss fit, which is
ranking noise for every other request. Made at each refit over the ring's RAW rows (only the target's sums,
sum y*, Z'y* and y*'y*, are recomputed: one pass of ``buffer_size`` x p per model; the Gram matrix still comes
from the moments), so nothing clipped is kept: the first fit is unclipped, each refit one more iteration, and a
prior far (> c) from a model's lengths is still learned as fast (a clip kept as observed would hold the first
observations toward the prior until evicted). Chosen by the replay's second-half gain of the weakest AlpacaEval
model: +0.050 -> +0.057 on seeds not used to choose it (mean +0.073 -> +0.076, ShareGPT held-out -0.011 -> -0.005). The fit a refit clipped against is
saved with the state (``clip_center``), so a restored learner's first refit makes the fit the saved one had.

On top of that linear correction, a residual kNN (``knn_neighbours`` k, 16; 0: off) for what no column
carries linearly: a request refined by the encoder carries the encoder's pooled embedding after its
columns (``EncoderModel.encode``), and each model keeps the unit embeddings of its last ``buffer_size``
uncensored observations with their residuals r = observed - (prior + the linear correction in force
when observed) ln tokens. A prediction adds

    sum_{j in the k nearest by cosine} w_j r_j / (sum_j w_j + ``knn_shrinkage``),  w_j = max(cos_j, 0)

(each r_j clipped to +-``residual_clip`` when remembered: the kNN is a memory, re-clipping it would cost a pass)

so few or far neighbours add about nothing. Residuals after the linear correction, not after the
prior: the kNN adds to that correction, so it must model what the correction leaves (a model's
mean shift, counted twice and scaled by each query's neighbourhood, would become ranking noise).
Chosen by the replay: k 16, shrinkage 16 raised the replay's second-half gain of the weakest AlpacaEval model from +0.048
to +0.058 (seeds 0-4) and +0.037 to +0.041 (seeds 5-14). Its cost is on the request path of a
refined (waiting) request: one 1 x 384 by 384 x 1024 mat-vec over the model's memory, 0.07-0.11 ms
with the memory out of cache; memory 1.6 MB per model (float32), allocated at its first embedding.
A row without the embedding (a lexical prediction) gets the linear correction only.

Observations: ``observe(prediction, observed_tokens)`` is O(1), 20-40 us (a row copied into the
model's ring buffer of ``buffer_size`` observations, a rank-2 update of its p x p sufficient
statistics for the one added and the one evicted, two floats into its quality window) and is what the
proxy calls, on the event loop, with the count the BACKEND reported (or the stream's counted
chunks): never with anything the client sent. A prediction capped by the request (``cap_tokens``)
whose answer reached the cap is censored: it counts for the rolling quality, not for the fit. The
per-model key is the model the REQUEST named (``Prediction.model``), the only name known when
predicting; the first ``max_models`` names get their own buffer, later ones share ``OTHER_MODEL``.
Memory is bounded: (max_models + 1) x buffer_size rows (and as many kNN embeddings).

Refits: ``refit()`` fits the corrections and swaps them in as one immutable object, so
``correction`` (the request path) reads them without a lock; ``refit_due`` says when
``refit_every`` new observations have arrived. It is synchronous: in the proxy the learner lives in
its own process (``clairvoyant.prediction.learner_process``), which refits whenever due, so no refit
ever holds the event loop's interpreter; ``clairvoyant replay`` calls it in line. A refit never
builds a Gram matrix from the rows: each observation updates its model's sufficient statistics (p x p
moments, p = features + 1: 65 with the encoder's components), so a refit solves small p x p systems, a few per
model (one ``np.linalg.solve`` per GCV penalty, with ``[Z'y, I]`` as right-hand sides: the weights
and the inverse's trace); the GCV search for a fit's penalty runs again only once a quarter of its
buffer is new. With the residual clip on, the target's sums are recomputed from the rows (one
matrix-vector product per model): a refit of 17 full models takes 9.5 ms of CPU (p50) instead of 3.9,
and the worker refits at most once a second. Unclipped, the
same penalties and coefficients as the stacked solve of earlier versions (tests/test_learner.py replays
a fixed trace against it).

Rolling quality per model (``quality()``): Kendall tau_b and mean |log-token error| between the
predictions as they were made (before their own observation was learned) and the observed
lengths, over the last ``quality_window`` observed requests; computed after each refit (or by
``update_quality()``), so reading it costs a dict lookup.

Persistence: ``save(path)`` writes the buffers and quality windows atomically (a temporary file in
the same directory, fsync, then ``os.replace``), so a crash leaves the old file or the new one,
never half of one. ``OnlineLearner.load(path, identity)`` restores them. A state file that is
corrupt, or was made for another prior (its feature set, feature names or model sha256 differ from
the loaded model's), is REFUSED: one warning log line says why, and the learner starts from the
prior (no observations). A missing file is not an error (first start). Loading does not refit:
``start()`` (or ``refit()``) does, off the event loop.

Serving path: numpy only.
"""

from __future__ import annotations

import json
import logging
import math
import threading
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
_TAU_BLOCK = 64  # rows of the rolling quality's pair matrices per unit of work (window 256: 4 units)


@dataclass(frozen=True, slots=True)
class PriorIdentity:
    """What a learner's observations are tied to: the prior's log tokens and feature rows."""

    feature_set: str
    feature_names: tuple[str, ...]  # count features: the design reads log1p of each
    onnx_sha256: str
    # The encoder's components, appended to a refined prediction's row and read as they are (signed);
    # empty without an encoder. Its sha ties the columns to the graph that made them.
    component_names: tuple[str, ...] = ()
    encoder_sha256: str = ""
    # The encoder's blend weights (single-turn, with history): they define the refined prior whose
    # residuals a learner stores, so a state learned under other weights is refused. Empty without
    # an encoder.
    blend_weights: tuple[float, ...] = ()
    # How the encoder reads a long instruction (its last N word pieces after the first ones; 0: the
    # first pieces only): the components and the encoder's opinion of a long prompt depend on it.
    encoder_tail_word_pieces: int = 0
    # The kNN graph blended into the refined prior ("" without one; its weight is in blend_weights).
    knn_sha256: str = ""

    @classmethod
    def of(cls, predictor: Any, encoder: Any | None = None) -> PriorIdentity:
        """The identity of an ``OnnxPredictor`` (and of the encoder refining it, if any: then a row
        is the features followed by the encoder's components)."""
        components: tuple[str, ...] = ()
        encoder_sha = ""
        weights: tuple[float, ...] = ()
        tail = 0
        if encoder is not None:
            weights = tuple(encoder.blend_weights.as_list())
            tail = encoder.card.tail_word_pieces
            encoder_sha = encoder.card.onnx.sha256
            if encoder.components:
                components = tuple(f"encoder_component_{i}" for i in range(encoder.components))
        return cls(
            predictor.feature_set.name,
            tuple(predictor.feature_set.names),
            predictor.onnx_sha256,
            components,
            encoder_sha,
            weights,
            tail,
            encoder.card.knn.sha256 if encoder is not None and encoder.card.knn is not None else "",
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "feature_set": self.feature_set,
            "feature_names": list(self.feature_names),
            "onnx_sha256": self.onnx_sha256,
            "component_names": list(self.component_names),
            "encoder_sha256": self.encoder_sha256,
            "blend_weights": list(self.blend_weights),
            "encoder_tail_word_pieces": self.encoder_tail_word_pieces,
            "knn_sha256": self.knn_sha256,
        }


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    buffer_size: int = 1024  # observations kept per model (a ring buffer: the most recent win)
    refit_every: int = 8  # new observations that make a refit due
    min_observations: int = 16  # observations before the first (global) fit
    min_model_observations: int = 32  # a model's own observations before it gets its own correction
    max_models: int = 16  # models with their own buffer; the rest share OTHER_MODEL
    quality_window: int = 256  # observed requests per model in the rolling quality
    intercept_prior_observations: float = 16.0  # pseudo-observations shrinking the mean correction to 0
    # the smallest ridge penalty GCV may choose, per observation (the grid runs 1e-3 to 1e3 in
    # half decades); see the module docstring
    min_penalty_factor: float = 1.0
    worker_nice: int = 10  # the learner process's niceness above the proxy's
    # The residual kNN on the encoder's embedding (see the module docstring): the neighbours read (0: off)
    # and the shrinkage pseudo-weight lambda, in cosine units (the replay chose 16 and 16: module docstring).
    knn_neighbours: int = 16
    knn_shrinkage: float = 16.0
    # The residual clip c, ln tokens (inf: off): an observation whose residual after the linear correction
    # in force is beyond +-c is learned as if it were c off, by the ridge (re-clipped at each refit) and by
    # the kNN (clipped when remembered); the replay chose 1 (module docstring).
    residual_clip: float = 1.0

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


def kendall_tau_b(x: np.ndarray, y: np.ndarray, block: int = 0) -> float:
    """Kendall's tau_b of two equally long arrays, O(n^2) in numpy on boolean pair matrices (n is a
    few hundred here: about 0.2 ms for 256). NaN when undefined. ``block`` > 0: the pair matrices
    are built ``block`` rows at a time (less memory); the counts, and so the result, are the same."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(x)
    if n < 2:
        return math.nan
    block = block if block > 0 else n
    concordant = discordant = untied_x = untied_y = 0
    for start in range(0, n, block):
        rows = slice(start, start + block)
        x_greater = x[rows, None] > x[None, :]
        y_greater = y[rows, None] > y[None, :]
        y_less = y[rows, None] < y[None, :]
        # over ordered pairs (i, j) with x_i > x_j: concordant if y_i > y_j, discordant if y_i < y_j
        concordant += int(np.count_nonzero(x_greater & y_greater))
        discordant += int(np.count_nonzero(x_greater & y_less))
        untied_x += int(np.count_nonzero(x_greater))  # untied pairs in x, each counted once
        untied_y += int(np.count_nonzero(y_greater))
    if untied_x == 0 or untied_y == 0:
        return math.nan
    return (concordant - discordant) / math.sqrt(float(untied_x) * float(untied_y))


class _Ring:
    """A fixed-capacity buffer of the most recent observations of one model."""

    __slots__ = ("capacity", "count", "next", "observed", "prior", "rows")

    def __init__(self, capacity: int, n_features: int) -> None:
        self.capacity = capacity
        self.rows = np.zeros((capacity, n_features), dtype=np.float32)
        self.prior = np.zeros(capacity, dtype=np.float64)  # prior log tokens
        self.observed = np.zeros(capacity, dtype=np.float64)  # observed log tokens
        self.count = 0
        self.next = 0

    @property
    def full(self) -> bool:
        return self.count == self.capacity

    def append(self, row: np.ndarray, prior: float, observed: float) -> None:
        """Keep an observation, overwriting the oldest when full (read it first: ``oldest``)."""
        i = self.next
        self.rows[i] = row
        self.prior[i] = prior
        self.observed[i] = observed
        self.next = (i + 1) % self.capacity
        self.count = min(self.count + 1, self.capacity)

    def oldest(self) -> tuple[np.ndarray, float, float]:
        """The observation the next ``append`` overwrites (when full)."""
        i = self.next
        return self.rows[i], float(self.prior[i]), float(self.observed[i])

    def ordered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of the kept observations, oldest first."""
        if self.count < self.capacity:
            idx = np.arange(self.count)
        else:
            idx = (np.arange(self.capacity) + self.next) % self.capacity
        return self.rows[idx], self.prior[idx], self.observed[idx]


class _Window:
    """The last ``capacity`` (predicted, observed) log-token pairs of one model."""

    __slots__ = ("capacity", "count", "next", "observed", "predicted")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.predicted = np.zeros(capacity, dtype=np.float64)
        self.observed = np.zeros(capacity, dtype=np.float64)
        self.count = 0
        self.next = 0

    def append(self, predicted: float, observed: float) -> None:
        i = self.next
        self.predicted[i] = predicted
        self.observed[i] = observed
        self.next = (i + 1) % self.capacity
        self.count = min(self.count + 1, self.capacity)

    def ordered(self) -> tuple[np.ndarray, np.ndarray]:
        idx = (np.arange(self.count) + (self.next if self.count == self.capacity else 0)) % self.capacity
        return self.predicted[idx], self.observed[idx]


class ResidualKnn:
    """One model's residual kNN: a ring of the last ``capacity`` observations' unit embeddings and
    their residuals (observed - (prior + the linear correction at observe time) ln tokens).
    Appended under the learner's lock, read without it: the arrays are allocated once and never
    replaced, and ``count`` grows only after a row is written, so a reader sees whole rows (one
    being overwritten may be a neighbour of either age)."""

    __slots__ = ("count", "next", "residual", "unit")

    def __init__(self, capacity: int, width: int) -> None:
        self.unit = np.zeros((capacity, width), dtype=np.float32)
        self.residual = np.zeros(capacity, dtype=np.float64)
        self.count = 0
        self.next = 0

    def append(self, unit: np.ndarray, residual: float) -> None:
        i = self.next
        self.unit[i] = unit
        self.residual[i] = residual
        self.next = (i + 1) % len(self.residual)
        self.count = min(self.count + 1, len(self.residual))

    def ordered(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the unit embeddings and residuals, oldest first."""
        count, start = self.count, self.next
        unit, residual = self.unit[:count].copy(), self.residual[:count].copy()  # memcpy: ~0.2 ms
        order = (np.arange(count) + (start if count == len(self.residual) else 0)) % count
        return unit[order], residual[order]

    @classmethod
    def filled(cls, capacity: int, unit: np.ndarray, residual: np.ndarray) -> ResidualKnn:
        """A memory holding the last ``capacity`` of these rows (oldest first), as if appended."""
        knn = cls(capacity, unit.shape[1])
        n = min(len(unit), capacity)
        knn.unit[:n] = unit[len(unit) - n :]
        knn.residual[:n] = residual[len(unit) - n :]
        knn.count, knn.next = n, n % capacity
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
    def design(row: np.ndarray, prior: float, counts: int | None = None) -> np.ndarray:
        """[prior, log1p(max(row[:counts], 0)), row[counts:]] in float64: the first ``counts``
        columns (all by default) are count features (>= 0 by contract), the rest the encoder's
        signed components."""
        if counts is None:
            counts = len(row)
        z = np.empty(len(row) + 1)
        z[0] = prior
        z[1:] = row
        tail = z[1 : counts + 1]
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

    def copy(self) -> _Moments:
        out = _Moments(len(self.s_z))
        out.n, out.s_y, out.s_yy = self.n, self.s_y, self.s_yy
        out.s_z, out.s_zz, out.s_zy = self.s_z.copy(), self.s_zz.copy(), self.s_zy.copy()
        return out

    def __iadd__(self, other: _Moments) -> _Moments:
        self.n += other.n
        self.s_z += other.s_z
        self.s_y += other.s_y
        self.s_zz += other.s_zz
        self.s_zy += other.s_zy
        self.s_yy += other.s_yy
        return self


class _Bucket:
    __slots__ = ("counts", "knn", "moments", "observations", "ring", "window")

    def __init__(self, config: LearnerConfig, n_features: int, counts: int) -> None:
        self.ring = _Ring(config.buffer_size, n_features)
        self.window = _Window(config.quality_window)
        self.moments = _Moments(n_features + 1)
        self.counts = counts  # leading count columns (log1p in the design)
        self.observations = 0  # ever observed (censored ones included)
        self.knn: ResidualKnn | None = None  # allocated at the first embedding observed (kNN on)

    def learn(self, row: np.ndarray, prior: float, observed: float) -> None:
        """Keep an uncensored observation in the ring and the moments (evicting the oldest)."""
        z = _Moments.design(row, prior, self.counts)
        if self.ring.full:
            old_row, old_prior, old_observed = self.ring.oldest()
            old_z = _Moments.design(old_row, old_prior, self.counts)
            self.moments.update(z, observed - prior, old_z, old_observed - old_prior)
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


class OnlineLearner:
    """See the module docstring. Thread-safe (the rows and counters are guarded by a lock, the fit
    and quality are swapped whole), though the proxy's learner process and replay use it from one
    thread."""

    def __init__(self, identity: PriorIdentity, config: LearnerConfig | None = None) -> None:
        self.identity = identity
        self.config = config or LearnerConfig()
        self.n_counts = len(identity.feature_names)  # count columns; then the encoder's components
        self.n_features = self.n_counts + len(identity.component_names)
        self._row_bytes = 4 * self.n_features
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()  # guards _buckets and the counters below
        self._refit_lock = threading.Lock()  # one refit at a time
        self._quality_lock = threading.Lock()  # one quality update at a time
        self._new_since_fit = 0
        self._new_since_quality = 0
        self._observed_total = 0
        self._fitted: FittedCorrection | None = None  # swapped whole by refit; read without a lock
        # The fit the residual clip of the fit in force was made against (None: an unclipped fit), saved
        # in the state file; a restored learner's first refit clips against it (_restored_center), so
        # that it refits what the saved learner had fitted.
        self._center: FittedCorrection | None = None
        self._restored_center: FittedCorrection | None = None
        # per fit (model key or _GLOBAL): (GCV penalty, observations when it was searched); refit only
        self._penalties: dict[str, tuple[float, int]] = {}
        self._quality: dict[str, ModelQuality] = {}
        self._quality_at: dict[str, int] = {}  # each model's observation count when its quality was computed
        self.last_refit_s: float | None = None  # seconds the last refit took
        self.refits = 0  # refits completed (with or without enough observations to fit)

    @classmethod
    def for_predictor(cls, predictor: Any, config: LearnerConfig | None = None, encoder: Any = None) -> OnlineLearner:
        return cls(PriorIdentity.of(predictor, encoder), config)

    # -- the request path ----------------------------------------------------------------------
    def _key(self, model: str | None) -> str:
        return model if model else DEFAULT_MODEL

    def correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        """Log tokens to add to the prior's: the linear correction (0.0 before the first fit) plus,
        for a row that carries the encoder's embedding after its columns, the residual kNN's.
        Lock-free; never raises."""
        value = self._linear_correction(model, row, prior_log_tokens)
        if len(row) > self.n_features and self.config.knn_neighbours:
            value += self._knn_correction(model, row[self.n_features :])
        return value

    def _knn_correction(self, model: str | None, embedding: np.ndarray) -> float:
        """The residual kNN's log tokens for a request of ``model`` (0.0 without a memory)."""
        bucket = self._buckets.get(bucket_key(model, self._buckets, self.config.max_models))
        knn = None if bucket is None else bucket.knn
        return 0.0 if knn is None else knn.correction(embedding, self.config.knn_neighbours, self.config.knn_shrinkage)

    def _linear_correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        """The ridge correction alone (0.0 before the first fit); reads the row's first
        ``n_features`` columns."""
        fitted = self._fitted
        if fitted is None:
            return 0.0
        return fitted.correction(self._key(model), self._buckets, self.config.max_models, row, prior_log_tokens)

    def observe(self, prediction: Prediction, observed_tokens: int, knn_residual: float | None = None) -> bool:
        """Record what the backend produced for a request predicted as ``prediction``. O(1).
        Returns False (and records nothing) for an unusable observation: a negative or non-integer
        count, or a prediction without this prior's feature row. A row may carry the encoder's
        embedding after its columns: with the kNN on, its residual joins the model's kNN memory
        (``knn_residual``: the residual the proxy computed when it observed it, else now's)."""
        if not usable_observation(prediction, observed_tokens, self.n_counts, self.n_features):
            return False
        learnable = len(prediction.feature_row) >= self._row_bytes  # a lexical row: quality only
        observed_log = log_tokens(int(observed_tokens))
        cap = prediction.cap_tokens
        censored = cap is not None and observed_tokens >= cap
        with self._lock:
            key = bucket_key(prediction.model, self._buckets, self.config.max_models)
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket(self.config, self.n_features, self.n_counts)
            bucket.window.append(prediction.predicted_log_tokens, observed_log)
            bucket.observations += 1
            self._observed_total += 1
            self._new_since_quality += 1
            if not censored and learnable:
                full = np.frombuffer(prediction.feature_row, dtype=np.float32)
                prior = prediction.prior_log_tokens
                bucket.learn(full[: self.n_features], prior, observed_log)
                self._new_since_fit += 1
                if len(full) > self.n_features and self.config.knn_neighbours:
                    self._remember(bucket, prediction.model, full, prior, observed_log, knn_residual)
        return True

    def _remember(
        self,
        bucket: _Bucket,
        model: str | None,
        row: np.ndarray,
        prior: float,
        observed: float,
        residual: float | None = None,
    ) -> None:
        """Add an observation's unit embedding and its residual after the linear correction in
        force now to its model's kNN memory (under the lock; a few us)."""
        embedding = row[self.n_features :]
        if bucket.knn is None:
            bucket.knn = ResidualKnn(self.config.buffer_size, len(embedding))
        if residual is None:
            residual = observed - (prior + self._linear_correction(model, row, prior))
        bucket.knn.remember(embedding, clipped_residual(residual, self.config.residual_clip))

    # -- reading -------------------------------------------------------------------------------
    def knn_memory(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Model ``key``'s kNN memory (unit embeddings, residuals; oldest first), copied under one
        hold of the lock; None if it has none."""
        with self._lock:
            bucket = self._buckets.get(key)
            knn = None if bucket is None else bucket.knn
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
        return self._fitted is not None

    @property
    def current_fit(self) -> FittedCorrection | None:
        """The correction in use (immutable; swapped whole by each refit)."""
        return self._fitted

    @property
    def observed_total(self) -> int:
        return self._observed_total

    def quality(self) -> Mapping[str, ModelQuality]:
        """Rolling quality per model key, as last computed (by the worker or ``update_quality``)."""
        return self._quality

    def models(self) -> list[str]:
        with self._lock:
            return list(self._buckets)

    # -- fitting -------------------------------------------------------------------------------
    def _snapshot(self) -> tuple[list[tuple[str, _Moments, int]], FittedCorrection | None]:
        """Copies of every model's moments (p x p each) and its observation count, one model per
        hold of the lock; with the residual clip on and a fit in force (or restored as the last
        fit's center), the target's sums are those of the clipped target against that fit (also
        returned: the center of the fit about to be made; None: unclipped)."""
        with self._lock:
            self._new_since_fit = 0
            keys = list(self._buckets)
        data = []
        center = self._fitted if self._fitted is not None else self._restored_center
        clip = self.config.residual_clip
        reclip = center is not None and clip < math.inf
        for key in keys:
            with self._lock:
                bucket = self._buckets[key]
                if not bucket.moments.n:
                    continue
                moments = bucket.moments.copy()
                kept = bucket.ring.ordered() if reclip else None
            if kept is not None and center is not None:
                _clip_target(moments, *kept, center.by_model.get(key, center.global_), self.n_counts, clip)
            data.append((key, moments, bucket.observations))
        return data, (center if reclip else None)

    def refit(self) -> None:
        """Fit the corrections from the moments and swap them in; then update the rolling quality.
        Blocking, about 0.2 ms of work per model (0.5 with the residual clip: the target's sums from
        the rows): never on an event loop (the proxy runs it in the learner's process)."""
        with self._refit_lock:
            started = time.perf_counter()
            data, center = self._snapshot()
            total = sum(m.n for _, m, _ in data)
            if total >= self.config.min_observations:
                self._fitted = self._fit(data)
                self._center = center
            self.last_refit_s = time.perf_counter() - started
            self.refits += 1
            self.update_quality()

    def _fit(self, data: list[tuple[str, _Moments, int]]) -> FittedCorrection:
        cfg = self.config
        pooled = _Moments(self.n_features + 1)
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
            found = self._penalties.get(key)
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
            if key not in self._penalties or self._penalties[key][0] != alpha:
                self._penalties[key] = (alpha, observations)
            coef = np.zeros(self.n_features + 1)
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
        return FittedCorrection(linear(global_coef, global_intercept), by_model, n, self.n_counts)

    def update_quality(self) -> None:
        """Recompute the rolling quality of the models observed since the last update
        (O(window^2) each, about 0.2 ms for 256; off the event loop)."""
        with self._quality_lock:
            self._update_quality()

    def _update_quality(self) -> None:
        with self._lock:
            keys = list(self._buckets)
            self._new_since_quality = 0
        quality = dict(self._quality)
        for key in keys:
            with self._lock:
                bucket = self._buckets[key]
                if key in quality and bucket.observations == self._quality_at.get(key):
                    continue
                self._quality_at[key] = bucket.observations
                predicted, observed = bucket.window.ordered()
            mae = float(np.mean(np.abs(predicted - observed))) if len(observed) else math.nan
            tau = kendall_tau_b(predicted, observed, _TAU_BLOCK)
            quality[key] = ModelQuality(key, len(observed), tau, mae)
        self._quality = quality

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path: Path | str) -> None:
        """Write the state atomically (temp file + fsync + os.replace). Raises OSError."""
        path = Path(path)
        arrays: dict[str, np.ndarray] = {}
        with self._lock:
            keys = list(self._buckets)
            observations = []
            for i, key in enumerate(keys):
                bucket = self._buckets[key]
                arrays[f"rows_{i}"], arrays[f"prior_{i}"], arrays[f"observed_{i}"] = bucket.ring.ordered()
                arrays[f"qpredicted_{i}"], arrays[f"qobserved_{i}"] = bucket.window.ordered()
                observations.append(bucket.observations)
        for i, key in enumerate(keys):  # the kNN memories (1.5 MB each): one model per hold of the lock
            memory = self.knn_memory(key)
            if memory is not None:
                arrays[f"knn_unit_{i}"], arrays[f"knn_residual_{i}"] = memory
        meta = {
            "format": STATE_FORMAT,
            "identity": self.identity.as_dict(),
            "models": keys,
            "observations": observations,
            "config": asdict(self.config),
        }
        center = self._center
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
        with atomic_writer(path, "wb") as fh:
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
        except _Refused as exc:
            logger.warning("online learner: state file %s refused: %s; starting from the prior", path, exc)
            return cls(identity, config)
        except Exception as exc:  # numpy/zipfile raise many types for a damaged file
            logger.warning(
                "online learner: state file %s refused: unreadable or corrupt (%s: %s); starting from the prior",
                path,
                type(exc).__name__,
                exc,
            )
            return cls(identity, config)
        logger.info(
            "online learner: restored %d observations of %d models from %s",
            learner._observed_total,
            len(learner._buckets),
            path,
        )
        return learner

    def _restore(self, path: Path) -> None:
        with path.open("rb") as fh:  # our handle: closed even when np.load refuses the bytes
            npz = np.load(fh, allow_pickle=False)
            if not isinstance(npz, np.lib.npyio.NpzFile):
                raise _Refused("not a learner state file (not an npz archive)")
            self._restore_from(npz)

    def _restore_from(self, npz: Any) -> None:
        with npz:
            if "meta" not in npz.files:
                raise _Refused("not a learner state file (no metadata)")
            meta = json.loads(str(npz["meta"][()]))
            if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
                raise _Refused(
                    f"format {meta.get('format') if isinstance(meta, dict) else None!r} is not {STATE_FORMAT!r}"
                )
            theirs = meta.get("identity") or {}
            ours = self.identity.as_dict()
            # A file from before a field was recorded (the encoder, the turn-aware blend, the kNN) has
            # that field's default: refused whenever the loaded prior has more than the default.
            theirs = {**PriorIdentity("", (), "").as_dict(), **theirs}
            for field in ours:
                if theirs.get(field) != ours[field]:
                    shown = theirs.get(field) if not field.endswith("_names") else "a different list"
                    raise _Refused(f"made for another prior: its {field} is {shown!r}, the loaded model's differs")
            keys = meta.get("models")
            counts = meta.get("observations")
            if not isinstance(keys, list) or not isinstance(counts, list) or len(keys) != len(counts):
                raise _Refused("metadata lists no models")
            self._restored_center = self._restored_clip_center(npz, meta.get("clip_center"))
            cfg = self.config
            for i, key in enumerate(keys[: cfg.max_models + 1]):
                rows, prior, observed = npz[f"rows_{i}"], npz[f"prior_{i}"], npz[f"observed_{i}"]
                predicted_q, observed_q = npz[f"qpredicted_{i}"], npz[f"qobserved_{i}"]
                n = len(observed)
                if rows.shape != (n, self.n_features) or len(prior) != n or len(predicted_q) != len(observed_q):
                    raise _Refused(f"model {i}: arrays of inconsistent shapes")
                if not (np.isfinite(rows).all() and np.isfinite(prior).all() and np.isfinite(observed).all()):
                    raise _Refused(f"model {i}: non-finite values")
                bucket = _Bucket(cfg, self.n_features, self.n_counts)
                for j in range(max(0, n - cfg.buffer_size), n):
                    bucket.learn(rows[j], float(prior[j]), float(observed[j]))
                for j in range(max(0, len(observed_q) - cfg.quality_window), len(observed_q)):
                    bucket.window.append(float(predicted_q[j]), float(observed_q[j]))
                if f"knn_unit_{i}" in npz.files:  # a file from before the kNN has none: an empty memory
                    bucket.knn = _restored_knn(npz, i, cfg.buffer_size)
                bucket.observations = int(counts[i])
                self._buckets[str(key)] = bucket
                self._observed_total += bucket.observations
                self._new_since_fit += bucket.ring.count
                self._new_since_quality += bucket.window.count

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
        if fits != len(keys) + 1 or len(intercepts) != fits or weights.shape != (fits, self.n_features):
            raise _Refused("a clip center of inconsistent shapes")
        if not (np.isfinite(weights).all() and np.isfinite(prior_weights).all() and np.isfinite(intercepts).all()):
            raise _Refused("a clip center with non-finite values")
        packed = (keys, weights.tobytes(), prior_weights, intercepts, observations, self.n_counts)
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


def _clip_target(
    moments: _Moments,
    rows: np.ndarray,
    prior: np.ndarray,
    observed: np.ndarray,
    linear: _Linear,
    counts: int,
    clip: float,
) -> None:
    """Replace the target's sums in ``moments`` (the rows' own) by those of Huber's pseudo-target
    y* = yhat + clip(y - yhat, -clip, clip), yhat = ``linear``'s correction of each row."""
    z = np.empty((len(rows), rows.shape[1] + 1))
    z[:, 0] = prior
    z[:, 1:] = rows
    np.log1p(np.maximum(z[:, 1 : counts + 1], 0.0), out=z[:, 1 : counts + 1])
    expected = z[:, 1:] @ linear.weights.astype(np.float64) + linear.prior_weight * prior + linear.intercept
    target = expected + np.clip(observed - prior - expected, -clip, clip)
    moments.s_y = float(target.sum())
    moments.s_zy = z.T @ target
    moments.s_yy = float(target @ target)


class _Refused(ValueError):
    """A state file that must not be used (the message says why)."""
