"""Service time in seconds, per backend model: S = c0 + c_p * prompt_tokens + c_d * output_tokens,
and each (backend, model)'s load cost: the seconds a backend that loads models on demand (Ollama,
llama-swap) spends loading a model it does not hold. docs/scheduling.md ("Service time in seconds")
gives the reasons and the measurements.

Fitted online by recursive least squares with a forgetting factor (a backend that changes speed is
followed), seeded with defaults worth ``prior_weight`` observations; one fit per model name
(``None`` = the default model). The fit cannot turn the order upside down:

- **Bounded coefficients.** After each update the coefficients are projected onto c0 >= 0,
  c_p >= 0 and c_d >= ``C_DECODE_MIN_S`` in the fit's own covariance metric (the constrained
  least-squares answer, not a clip): more predicted tokens always predict more seconds.
- **Bounded influence.** A measured time beyond ``OUTLIER_FACTOR``x of the prediction counts as
  that bound (winsorised); the bound widens with the median of the last ``SPREAD_WINDOW``
  |log(measured / predicted)|, so a backend that really changed speed is followed once about half
  of them agree, while a few outliers (a wait on a busy CPU or a model load) move the fit little.

Load costs: a moving average seeded with ``ServiceTimeDefaults.load_s``, taught by
``observe_load`` (Ollama's ``load_duration``) or ``observe_first_byte``: a streamed answer's
first-byte delay after a switch beyond the median of the last ``FIRST_BYTE_WINDOW`` that followed
none. A sample counts as at most ``LOAD_OUTLIER_FACTOR`` times the current cost.

Nothing here reads a clock or does I/O except ``save``/``load`` (atomic JSON, kept over restarts).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clairvoyant.state_file import atomic_writer

__all__ = [
    "C_DECODE_MIN_S", "FREE_LOAD_S", "LOAD_WEIGHT", "OUTLIER_FACTOR", "ServiceTimeDefaults", "ServiceTimeModel",
    "write_state",
]  # fmt: skip

logger = logging.getLogger(__name__)

_MIN_SERVICE_S = 0.01
_MAX_MODELS = 64  # bounded: model names come from clients
_MAX_BACKENDS = 64  # load costs are kept for this many backends at most (they come from the configuration)
# The least seconds an output token costs (10,000 tokens/s, faster than any backend decodes): more
# predicted tokens are strictly more predicted seconds, not merely as many.
C_DECODE_MIN_S = 1e-4
OUTLIER_FACTOR = 3.0  # a measured time beyond this factor of the prediction counts as this factor
_LOG_OUTLIER_FACTOR = math.log(OUTLIER_FACTOR)
SPREAD_WINDOW = 16  # recent |log(measured / predicted)| whose median widens the bound
SPREAD_WIDTH = 2.0  # the bound is at least exp(this x that median): a backend that changed speed gets through
LOAD_WEIGHT = 0.25  # of each new load sample in its moving average (about the last 4 switches)
LOAD_OUTLIER_FACTOR = 4.0  # a load sample counts at most this factor above the current cost
# A learned load this short (seconds) counts as none: no reason to put a switch off or route around
# it (a backend that holds both models, or a server that answers every model name with one model).
FREE_LOAD_S = 0.5
FIRST_BYTE_WINDOW = 9  # answers whose median first-byte delay is a backend model's baseline


@dataclass(frozen=True, slots=True)
class ServiceTimeDefaults:
    """The seed coefficients, used until a model has data (a small CPU model's order of magnitude)."""

    c0_s: float = 0.3  # seconds per request (HTTP, scheduling, first prefill overheads)
    c_prompt_s: float = 0.0005  # seconds per prompt token (prefill)
    c_decode_s: float = 0.02  # seconds per output token (decode)
    prior_weight: float = 20.0  # the defaults count as this many observations
    forgetting: float = 0.995  # RLS forgetting factor per observation (effective memory ~200)
    # Seconds to load a model not held, until measured (worth one observation): a few-GB model
    # read from a local disk by Ollama or a llama-server that llama-swap starts.
    load_s: float = 5.0


_PAIRS = ((0, 1, 2), (0, 2, 1), (1, 2, 0))  # (clamped, clamped, free)


def _project(theta: list[float], p: list[list[float]], lower: tuple[float, float, float]) -> list[float]:
    """The point of {theta >= lower} closest to ``theta`` in the metric P^-1 (the constrained
    least-squares estimate, given the fit's covariance P). ``theta`` itself when feasible.

    With d = theta - lower and a set A of coordinates held at their bound, the best point of that
    face is the Gaussian conditional ``d_F - P_FA z`` with ``z = P_AA^-1 d_A``; it is the projection
    when it is feasible and ``z <= 0`` (the KKT conditions: the multipliers are ``-z``). The faces
    are tried smallest first; holding all three is the last, always feasible."""
    d0, d1, d2 = theta[0] - lower[0], theta[1] - lower[1], theta[2] - lower[2]
    if d0 >= 0 and d1 >= 0 and d2 >= 0:
        return theta
    d = (d0, d1, d2)
    for i in range(3):  # one coordinate at its bound
        if d[i] >= 0 or not p[i][i] > 0:
            continue
        z = d[i] / p[i][i]
        moved = [d[j] - p[j][i] * z for j in range(3)]
        moved[i] = 0.0
        if moved[0] >= 0 and moved[1] >= 0 and moved[2] >= 0:
            return [moved[j] + lower[j] for j in range(3)]
    for i, j, k in _PAIRS:  # two at their bound
        a, b, c = p[i][i], p[i][j], p[j][j]
        det = a * c - b * b
        if not det > 0:
            continue
        zi, zj = (c * d[i] - b * d[j]) / det, (a * d[j] - b * d[i]) / det
        if zi > 0 or zj > 0:
            continue
        free = d[k] - p[k][i] * zi - p[k][j] * zj
        if free >= 0:
            moved = [0.0, 0.0, 0.0]
            moved[k] = free
            return [moved[m] + lower[m] for m in range(3)]
    return list(lower)


@dataclass(slots=True)
class _Rls:
    theta: list[float]  # [c0_s, c_prompt_s, c_decode_s], scaled (tokens in thousands)
    p: list[list[float]]  # 3x3 covariance (scaled)
    n: int = 0  # observations so far
    # |log(measured / predicted)| of the last observations (0 = as predicted until there are some)
    spread: deque[float] = field(default_factory=lambda: deque([0.0] * SPREAD_WINDOW, maxlen=SPREAD_WINDOW))

    def bound(self) -> float:
        """The factor beyond which a measured time counts as an outlier (at least ``OUTLIER_FACTOR``)."""
        return max(OUTLIER_FACTOR, math.exp(min(SPREAD_WIDTH * statistics.median(self.spread), 700.0)))

    def update(self, x: list[float], y: float, lam: float, max_trace: float) -> None:
        # Unrolled 3x3 (it runs once per completed request, on the event loop).
        (p00, p01, p02), (p10, p11, p12), (p20, p21, p22) = self.p
        x0, x1, x2 = x
        px0 = p00 * x0 + p01 * x1 + p02 * x2
        px1 = p10 * x0 + p11 * x1 + p12 * x2
        px2 = p20 * x0 + p21 * x1 + p22 * x2
        denom = lam + (x0 * px0 + x1 * px1 + x2 * px2)
        g0, g1, g2 = px0 / denom, px1 / denom, px2 / denom
        t0, t1, t2 = self.theta
        err = y - (t0 * x0 + t1 * x1 + t2 * x2)
        self.theta = [t0 + g0 * err, t1 + g1 * err, t2 + g2 * err]
        p = [
            [(p00 - g0 * px0) / lam, (p01 - g0 * px1) / lam, (p02 - g0 * px2) / lam],
            [(p10 - g1 * px0) / lam, (p11 - g1 * px1) / lam, (p12 - g1 * px2) / lam],
            [(p20 - g2 * px0) / lam, (p21 - g2 * px1) / lam, (p22 - g2 * px2) / lam],
        ]
        # Bounded covariance: forgetting divides P by lam every step, so in a direction the inputs
        # never vary (identical requests) P grows as lam^-n, and the estimate diverges (NaN after
        # ~100,000 identical requests). Its trace is kept at most the prior's.
        trace = p[0][0] + p[1][1] + p[2][2]
        if not trace <= max_trace:
            scale = max_trace / trace if math.isfinite(trace) and trace > 0 else 0.0
            p = [[value * scale for value in row] for row in p]
        self.p = p
        self.n += 1


@dataclass(slots=True)
class _Load:  # one (backend, model)'s load cost
    load_s: float  # moving average of measured loads, seconds (the prior until observed)
    n: int = 0  # loads observed
    # The first-byte delays of the last streamed answers that followed no switch, seconds
    first_bytes: deque[float] = field(default_factory=lambda: deque(maxlen=FIRST_BYTE_WINDOW))

    @property
    def first_byte_s(self) -> float | None:  # the usual first-byte delay, None before any
        return statistics.median(self.first_bytes) if self.first_bytes else None


@dataclass(slots=True)
class ServiceTimeModel:
    """Per-model online linear service-time model, and load costs per (backend, model)."""

    defaults: ServiceTimeDefaults = field(default_factory=ServiceTimeDefaults)
    path: Path | None = None  # state file; None = in memory only
    _models: dict[str, _Rls] = field(default_factory=dict)
    _loads: dict[str, dict[str, _Load]] = field(default_factory=dict)  # backend -> model ("" = default) -> cost
    # the trace of the defaults' covariance, which the fit's is kept under (``_Rls.update``)
    _max_trace: float = field(init=False, repr=False, compare=False)

    # Feature scales keep the RLS well conditioned: tokens in thousands.
    _SCALE = (1.0, 1e-3, 1e-3)
    # The coefficients' lower bounds, scaled as theta: c0 >= 0, c_p >= 0, c_d >= C_DECODE_MIN_S.
    _LOWER = (0.0, 0.0, C_DECODE_MIN_S / 1e-3)

    def __post_init__(self) -> None:
        fresh = self._fresh().p
        self._max_trace = fresh[0][0] + fresh[1][1] + fresh[2][2]

    def _fresh(self) -> _Rls:
        d = self.defaults
        theta = [d.c0_s, d.c_prompt_s / self._SCALE[1], d.c_decode_s / self._SCALE[2]]
        # Prior variance ~ (size of the coefficient)^2 / prior_weight: the defaults hold for a while.
        var = [max(abs(t), 1e-3) ** 2 * 100.0 / d.prior_weight for t in theta]
        p = [[var[i] if i == j else 0.0 for j in range(3)] for i in range(3)]
        return _Rls(_project(theta, p, self._LOWER), p)

    def _x(self, prompt_tokens: float, output_tokens: float) -> list[float]:
        return [1.0, max(prompt_tokens, 0.0) * self._SCALE[1], max(output_tokens, 0.0) * self._SCALE[2]]

    def predict_s(self, model: str | None, prompt_tokens: float, output_tokens: float) -> float:
        """Never below 10 ms, and never fewer for more tokens of either kind."""
        rls = self._models.get(model or "")
        t0, t1, t2 = rls.theta if rls is not None else self._fresh().theta
        _, x1, x2 = self._x(prompt_tokens, output_tokens)
        return max(_MIN_SERVICE_S, t0 * 1.0 + t1 * x1 + t2 * x2)

    def observe(self, model: str | None, prompt_tokens: int, output_tokens: int, duration_s: float) -> None:
        """A completed request: its token counts and how long the backend took, in seconds."""
        if not (duration_s > 0 and math.isfinite(duration_s)):
            return
        key = model or ""
        rls = self._models.get(key)
        if rls is None:
            if len(self._models) >= _MAX_MODELS:
                return
            rls = self._models[key] = self._fresh()
        x = self._x(prompt_tokens, output_tokens)
        t0, t1, t2 = rls.theta
        predicted_s = max(_MIN_SERVICE_S, t0 * x[0] + t1 * x[1] + t2 * x[2])
        spread = abs(math.log(duration_s / predicted_s))
        counted_s = duration_s
        if spread > _LOG_OUTLIER_FACTOR:  # (the bound is never narrower: most observations skip the median)
            bound = rls.bound()  # before this observation joins the spread: an outlier cannot widen its own bound
            counted_s = min(max(duration_s, predicted_s / bound), predicted_s * bound)
        rls.spread.append(spread)
        rls.update(x, counted_s, self.defaults.forgetting, self._max_trace)
        t0, t1, t2 = theta = rls.theta
        if not (math.isfinite(t0) and math.isfinite(t1) and math.isfinite(t2)):
            self._models[key] = self._fresh()  # never serve a broken fit: start again from the defaults
            return
        rls.theta = _project(theta, rls.p, self._LOWER)

    def coefficients(self, model: str | None) -> dict[str, float]:
        """Its coefficients (per token), observations, and the outlier bound now (``outlier_factor``)."""
        rls = self._models.get(model or "") or self._fresh()
        return {
            "c0_s": rls.theta[0],
            "c_prompt_s": rls.theta[1] * self._SCALE[1],
            "c_decode_s": rls.theta[2] * self._SCALE[2],
            "observations": float(rls.n),
            "outlier_factor": rls.bound(),
        }

    def fits(self) -> dict[str, dict[str, float]]:
        """Every model's ``coefficients``, by name ("default" for none), the default model's first."""
        names: list[str] = ["", *(name for name in self._models if name)]
        return {(name or "default"): self.coefficients(name) for name in names}

    # -- load costs ------------------------------------------------------------------------------
    def load_s(self, backend: str, model: str | None) -> float:
        """Predicted seconds ``backend`` takes to load ``model`` when it does not hold it."""
        load = self._loads.get(backend, {}).get(model or "")
        return self.defaults.load_s if load is None else load.load_s

    def _load(self, backend: str, model: str | None) -> _Load | None:
        models = self._loads.get(backend)
        if models is None:
            if len(self._loads) >= _MAX_BACKENDS:
                return None
            models = self._loads[backend] = {}
        key = model or ""
        load = models.get(key)
        if load is None:
            if len(models) >= _MAX_MODELS:
                return None
            load = models[key] = _Load(self.defaults.load_s)
        return load

    def observe_load(self, backend: str, model: str | None, load_s: float) -> None:
        """``backend`` took ``load_s`` seconds to load ``model``. A moving average in which the prior
        counts as one observation (the first sample weighs 1/2, then 1/3, down to ``LOAD_WEIGHT``);
        a sample counts as at most ``LOAD_OUTLIER_FACTOR`` times the current cost (or ``FREE_LOAD_S``,
        so a free load can grow): one outlier moves the cost by a bounded factor."""
        if not (load_s >= 0 and math.isfinite(load_s)):
            return
        load = self._load(backend, model)
        if load is None:
            return
        current = load.load_s
        counted = min(load_s, LOAD_OUTLIER_FACTOR * max(current, FREE_LOAD_S))
        weight = max(LOAD_WEIGHT, 1.0 / (load.n + 2))
        load.load_s = current + weight * (counted - current)
        load.n += 1

    def observe_first_byte(
        self, backend: str, model: str | None, first_byte_s: float, *, after_switch: bool
    ) -> float | None:
        """A streamed answer's first byte came ``first_byte_s`` seconds after it was sent. One that
        followed no switch joins the baseline (a median: one slow first byte does not raise it); one
        that followed a switch teaches the load: its delay beyond the baseline (the backend's other
        models' while this one has none), which is returned. None when nothing was learned."""
        if not (first_byte_s >= 0 and math.isfinite(first_byte_s)):
            return None
        load = self._load(backend, model)
        if load is None:
            return None
        if not after_switch:
            load.first_bytes.append(first_byte_s)
            return None
        baseline = load.first_byte_s
        if baseline is None:  # none for this model yet: the backend's others' (a first token is a first token)
            others = [b for x in self._loads[backend].values() if (b := x.first_byte_s) is not None]
            baseline = sum(others) / len(others) if others else 0.0
        measured = max(0.0, first_byte_s - baseline)
        self.observe_load(backend, model, measured)
        return measured

    def loads(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per backend, per model ("default" for none): the load cost in seconds and how many loads taught it."""
        return {
            backend: {
                (model or "default"): {"load_s": load.load_s, "observations": float(load.n)}
                for model, load in models.items()
            }
            for backend, models in self._loads.items()
        }

    # -- persistence ---------------------------------------------------------------------------
    def save(self) -> None:
        if self.path is None:
            return
        write_state(self.path, self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        """The state to save, copied (cheap: a few numbers per model), so another thread may write it."""
        return {
            "version": 1,
            "models": {
                name: {"theta": list(r.theta), "p": [list(row) for row in r.p], "n": r.n, "spread": list(r.spread)}
                for name, r in self._models.items()
            },
            "loads": {
                backend: {
                    model: {"load_s": x.load_s, "n": x.n, "first_bytes": list(x.first_bytes)}
                    for model, x in models.items()
                }
                for backend, models in self._loads.items()
            },
        }

    def _fit_from(self, state: dict[str, Any]) -> _Rls:
        theta = [float(v) for v in state["theta"]]
        p = [[float(v) for v in row] for row in state["p"]]
        if len(theta) != 3 or len(p) != 3 or any(len(row) != 3 for row in p):
            raise ValueError("wrong shape")
        if not all(math.isfinite(v) for v in [*theta, *(v for row in p for v in row)]):
            raise ValueError("not finite")
        rls = _Rls(_project(theta, p, self._LOWER), p, int(state["n"]))  # a file may predate the bounds
        rls.spread.extend(float(v) for v in state.get("spread", ()))
        return rls

    @staticmethod
    def _load_from(state: dict[str, Any]) -> _Load:
        load = _Load(max(0.0, float(state["load_s"])), int(state["n"]))
        if not math.isfinite(load.load_s):
            raise ValueError("not finite")
        # Files written before the baseline was a median hold one value ("first_byte_s").
        older = state.get("first_byte_s")
        load.first_bytes.extend(float(v) for v in state.get("first_bytes", () if older is None else (older,)))
        return load

    def load(self) -> bool:
        """Read the state file if there is one (a corrupt one is logged and ignored); True if read."""
        if self.path is None or not self.path.is_file():
            return False
        try:
            state = json.loads(self.path.read_text())
            models = {str(name): self._fit_from(m) for name, m in state["models"].items()}
            loads = {  # absent from files written before load costs were learned
                str(backend): {str(model): self._load_from(x) for model, x in by_model.items()}
                for backend, by_model in state.get("loads", {}).items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning(
                "service-time state %s unreadable (%s); starting from the defaults", self.path, type(exc).__name__
            )
            return False
        self._models = models
        self._loads = loads
        return True


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Write a ``snapshot`` atomically (``atomic_writer``); safe to run in a worker thread."""
    with atomic_writer(path) as fh:
        json.dump(state, fh)
