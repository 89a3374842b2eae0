"""The length predictor: features -> ONNX XGBoost model -> a queue key and calibrated output tokens.

The model file ships with a JSON card beside it (``<model>.card.json``); loading refuses a model
whose card names another feature set or feature list than ``clairvoyant.prediction.features``, or
another sha256 than the file's. Two card schemas are read:

- ``"schema": 2`` says what the model outputs and how to turn it into tokens::

      "kind": "regressor" | "classifier",
      "output": "<ONNX output name>",             # regressor: one float [N, 1]
      "score": "log_tokens" | "rank" | "p_long",  # classifier: raw score = probabilities[:, 2]
      "calibration": {"method": "isotonic", "score": [...], "log_tokens": [...]},
      "classes": ["short", "medium", "long"]       # classifier only

  Predicted log tokens (natural log of output tokens) = ``np.interp(raw_score, score, log_tokens)``.
- ``"schema": 1`` (3-class models from before schema 2): a classifier whose raw score is P(Long),
  read with ``STAND_IN_P_LONG_CALIBRATION`` (not fitted) so that it still reports tokens.

The queue key (``Prediction.score``, lower = sooner) is the model's raw score, monotone in predicted
tokens for one model. A request's own cap (``max_tokens`` and friends) bounds it: tokens <= cap and
``score = min(raw score, calibration^-1(log cap))``. An online corrector (``clairvoyant.prediction.learner``)
may add a learned correction in log tokens; the key is then the calibration's inverse of the
corrected log tokens. Both inverses extend linearly beyond the calibrated range, so that caps below
it (4 and 24 tokens under a first knot of 100) and corrections past its ends still order strictly.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
import threading
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from clairvoyant.errors import ModelError
from clairvoyant.prediction.features import FEATURE_SETS, FeatureSet, Prompt
from clairvoyant.prediction.length_classes import CLASS_NAMES, class_of_tokens

__all__ = [
    "CLASS_NAMES",
    "DEFAULT_MODEL_PATH",
    "STAND_IN_P_LONG_CALIBRATION",
    "BlendWeights",
    "Calibration",
    "Corrector",
    "ModelOutput",
    "OnnxPredictor",
    "Prediction",
    "Predictor",
    "SESSION_PROVIDERS",
    "card_path_for",
    "load_card",
    "log_tokens",
    "pinned_session_options",
    "single_threaded_session",
]

# The shipped model: model/predictor.onnx at the top of the source tree. src/clairvoyant/model links
# to that folder, so a checkout, an editable install and a built wheel all find it here.
DEFAULT_MODEL_PATH = Path(__file__).parents[1] / "model" / "predictor.onnx"

SCORE_KINDS = ("log_tokens", "rank", "p_long")


def log_tokens(tokens: float) -> float:
    """Natural log of an output-token count, counting 0 as 1 (the unit of every ``*_log_tokens``)."""
    return math.log(tokens) if tokens > 1 else 0.0


@dataclass(frozen=True, slots=True)
class Calibration:
    """Raw model score -> natural log of output tokens: piecewise linear through strictly increasing
    knots, clamped at the ends (``np.interp`` semantics). Scalar calls use ``bisect`` on tuples:
    about ten times cheaper than ``np.interp`` on one value, and this is the request path."""

    score: tuple[float, ...]
    log_tokens: tuple[float, ...]
    method: str
    stand_in: bool = False  # True: not fitted on data (a schema-1 card's class-midpoint stand-in)

    def __post_init__(self) -> None:
        xs, ys = self.score, self.log_tokens
        if len(xs) != len(ys) or len(xs) < 2:
            raise ValueError(f"calibration needs two equally long arrays of >= 2 knots, got {len(xs)} and {len(ys)}")
        if not all(math.isfinite(v) for v in (*xs, *ys)):
            raise ValueError("calibration knots must be finite")
        if any(b <= a for a, b in zip(xs, xs[1:])) or any(b <= a for a, b in zip(ys, ys[1:])):
            raise ValueError("calibration 'score' and 'log_tokens' must both be strictly increasing")

    @classmethod
    def from_card(cls, spec: Any) -> Calibration:
        if not isinstance(spec, dict):
            raise ValueError("'calibration' must be an object")
        score, logs = spec.get("score"), spec.get("log_tokens")
        if not isinstance(score, list) or not isinstance(logs, list):
            raise ValueError("'calibration' needs 'score' and 'log_tokens' arrays")
        try:
            return cls(tuple(float(v) for v in score), tuple(float(v) for v in logs), str(spec.get("method", "")))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad calibration: {exc}") from None

    @staticmethod
    def _interp(x: float, xs: tuple[float, ...], ys: tuple[float, ...]) -> float:
        if not x > xs[0]:  # also catches NaN
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect_right(xs, x)
        x0, y0 = xs[i - 1], ys[i - 1]
        return y0 + (ys[i] - y0) * (x - x0) / (xs[i] - x0)

    def log_tokens_of(self, score: float) -> float:
        """Predicted log tokens of a raw score (clamped at the calibrated range)."""
        return self._interp(score, self.score, self.log_tokens)

    def score_of(self, log_tokens: float) -> float:
        """The raw score whose calibrated log tokens are ``log_tokens`` (the inverse, clamped)."""
        return self._interp(log_tokens, self.log_tokens, self.score)

    def score_of_extended(self, log_tokens: float) -> float:
        """``score_of``, extended beyond the calibrated range with the calibration's mean slope,
        so that learned corrections past its ends still order strictly."""
        xs, ys = self.log_tokens, self.score
        if log_tokens < xs[0]:
            return ys[0] - (xs[0] - log_tokens) * (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        if log_tokens > xs[-1]:
            return ys[-1] + (log_tokens - xs[-1]) * (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        return self._interp(log_tokens, xs, ys)

    def log_tokens_many(self, scores: np.ndarray) -> np.ndarray:
        """``log_tokens_of`` for an array of raw scores."""
        return np.interp(np.asarray(scores, dtype=np.float64), self.score, self.log_tokens)


# Schema-1 cards have no calibration. This stand-in is NOT fitted: it puts the class midpoints
# (Short 100, Medium 400, Long 1000 tokens) at P(Long) = 0, 0.5 and 1, so a 3-class model still
# reports tokens, and P(Long) < 0.25 reads as Short, P(Long) >= 0.72 as Long.
STAND_IN_P_LONG_CALIBRATION = Calibration(
    score=(0.0, 0.5, 1.0),
    log_tokens=(math.log(100.0), math.log(400.0), math.log(1000.0)),
    method="stand-in: class midpoints on the P(Long) axis (schema-1 card, not fitted)",
    stand_in=True,
)


@dataclass(frozen=True, slots=True)
class BlendWeights:
    """How much a second opinion (the encoder's ln tokens) counts in a refined prior, by turn, and
    how much a third (the kNN's, ``knn``) counts in the result, for every request.

    The encoder reads only the request's instruction (its last user turn); the lexical model also
    sees the conversation before it. So the weight depends on whether there is one: a request with
    conversation history (``history_chars`` > 0 in its feature row: characters of earlier messages,
    system prompts excluded) gets ``later``, any other request ``first``. This is the one rule:
    ``OnnxPredictor.refined`` applies it when serving, ``clairvoyant evaluate`` when measuring.
    """

    first: float  # in [0, 1]: a request without conversation history (a single-turn request)
    later: float  # in [0, 1]: a request with earlier messages the encoder does not read
    knn: float = 0.0  # v in [0, 1]: the kNN's share of the final prior, any turn (0: no kNN)

    def __post_init__(self) -> None:
        if not (0.0 <= self.first <= 1.0 and 0.0 <= self.later <= 1.0 and 0.0 <= self.knn <= 1.0):
            raise ValueError(
                f"blend weights must be in [0, 1], got first {self.first}, later {self.later}, knn {self.knn}"
            )

    @staticmethod
    def blend(
        prior: Any, encoder_log_tokens: Any, weight: Any, knn_log_tokens: Any = None, knn_weight: float = 0.0
    ) -> Any:
        """The refined prior, in ln tokens (floats, or numpy arrays elementwise: one formula for
        serving and ``clairvoyant evaluate``): refined = prior + weight x (encoder - prior); then,
        with a kNN value, refined + knn_weight x (knn - refined)."""
        refined = prior + weight * (encoder_log_tokens - prior)
        if knn_log_tokens is None or not knn_weight:
            return refined
        return refined + knn_weight * (knn_log_tokens - refined)

    def for_history(self, history_chars: float) -> float:
        """The weight for a request whose feature row has ``history_chars``."""
        return self.later if history_chars > 0 else self.first

    def as_list(self) -> list[float]:
        """[first, later], and knn when there is one (the learner's prior identity records it)."""
        return [self.first, self.later, self.knn] if self.knn else [self.first, self.later]


@dataclass(slots=True)  # not frozen: a frozen dataclass sets each field through object.__setattr__ (one a request)
class Prediction:
    """One request's prediction, not changed after it is made. Compact on purpose (a waiting request carries it): about 0.2 KB,
    and 0.2 KB more with the 48-feature row. A queued request's carries no row while it waits
    (``proxy/app.py``: the learner re-derives it from the body after completion); a row with the
    encoder's 16 components and 384-d embedding after it (the learner's columns and its residual
    kNN's key) is about 1.8 KB.

    score: the queue key, unitless, lower = sooner; for one model monotone in predicted tokens.
    predicted_tokens: calibrated output tokens, after the learned correction and the cap.
    probabilities: P(Short), P(Medium), P(Long) for class models, else None.
    prior_log_tokens: the shipped model's calibrated log tokens, before correction and cap
        (what the online learner corrects).
    feature_row: the float32 feature row as bytes (what the online learner regresses on).
    model: the backend model the request named (the learner's per-model key), if any.
    cap_tokens: the request's own output-token cap, if any.
    """

    score: float
    predicted_tokens: float
    probabilities: tuple[float, float, float] | None = None
    prior_log_tokens: float = 0.0
    feature_row: bytes = b""
    model: str | None = None
    cap_tokens: int | None = None

    @classmethod
    def from_probabilities(
        cls, p_short: float, p_medium: float, p_long: float, *, model: str | None = None, cap_tokens: int | None = None
    ) -> Prediction:
        """A class-model prediction scored like a schema-1 card: key P(Long), tokens from the
        stand-in calibration (for test doubles and simulators)."""
        prior = STAND_IN_P_LONG_CALIBRATION.log_tokens_of(p_long)
        tokens = math.exp(prior) if cap_tokens is None else min(math.exp(prior), cap_tokens)
        score = p_long
        if cap_tokens is not None:
            score = min(score, STAND_IN_P_LONG_CALIBRATION.score_of_extended(log_tokens(cap_tokens)))
        return cls(score, tokens, (p_short, p_medium, p_long), prior, b"", model, cap_tokens)

    @property
    def predicted_class(self) -> str:
        return class_of_tokens(self.predicted_tokens)

    @property
    def predicted_log_tokens(self) -> float:
        return log_tokens(self.predicted_tokens)

    def features(self) -> np.ndarray:
        """The feature row as a float32 array (a copy-free view of ``feature_row``)."""
        return np.frombuffer(self.feature_row, dtype=np.float32)

    def as_dict(self) -> dict[str, Any]:
        """The public fields: p_short/p_medium/p_long (class models only), score, predicted_tokens,
        predicted_class."""
        out: dict[str, Any] = {}
        if self.probabilities is not None:
            out["p_short"], out["p_medium"], out["p_long"] = self.probabilities
        out["score"] = self.score
        out["predicted_tokens"] = self.predicted_tokens
        out["predicted_class"] = self.predicted_class
        return out


class Predictor(Protocol):
    def predict(self, prompt: Prompt, *, model: str | None = None, cap_tokens: int | None = None) -> Prediction:
        """The prediction for one request. Must not raise on any Prompt."""
        ...


class Corrector(Protocol):
    """A learned correction of the prior (``clairvoyant.prediction.learner.OnlineLearner``)."""

    def correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        """Log tokens to add to ``prior_log_tokens``. ``row`` is a float32 view valid only during
        the call. Must be cheap (request path) and must not raise."""
        ...


def card_path_for(model_path: Path) -> Path:
    return model_path.with_suffix(".card.json")


def load_card(model_path: Path) -> dict[str, Any]:
    card_path = card_path_for(model_path)
    try:
        card = json.loads(card_path.read_text())
    except FileNotFoundError:
        raise ModelError(f"model card {card_path} not found beside {model_path}") from None
    except ValueError as exc:
        raise ModelError(f"model card {card_path} is not valid JSON: {exc}") from None
    if not isinstance(card, dict):
        raise ModelError(f"model card {card_path} must be a JSON object")
    return card


@dataclass(frozen=True, slots=True)
class ModelOutput:
    """What a card says the ONNX model outputs and how its raw score becomes tokens."""

    kind: str  # "regressor" or "classifier"
    output: str  # ONNX output name
    score: str  # one of SCORE_KINDS
    calibration: Calibration


def _model_output(card: dict[str, Any], model_path: Path) -> ModelOutput:
    schema = card.get("schema", 1)
    classes = tuple(card.get("classes") or ())
    if schema == 1:
        if classes != CLASS_NAMES:
            raise ModelError(f"model {model_path} card classes {card.get('classes')!r} are not {list(CLASS_NAMES)}")
        return ModelOutput("classifier", "probabilities", "p_long", STAND_IN_P_LONG_CALIBRATION)
    if schema != 2:
        raise ModelError(f"model {model_path} card has schema {schema!r}; this clairvoyant reads schemas 1 and 2")
    kind, output, score = card.get("kind"), card.get("output"), card.get("score")
    if kind not in ("regressor", "classifier"):
        raise ModelError(f"model {model_path} card kind {kind!r} is neither 'regressor' nor 'classifier'")
    if not isinstance(output, str) or not output:
        raise ModelError(f"model {model_path} card has no 'output' name")
    if score not in SCORE_KINDS or (kind == "classifier") != (score == "p_long"):
        raise ModelError(f"model {model_path} card score {score!r} does not fit kind {kind!r}")
    if kind == "classifier" and classes != CLASS_NAMES:
        raise ModelError(f"model {model_path} card classes {card.get('classes')!r} are not {list(CLASS_NAMES)}")
    try:
        calibration = Calibration.from_card(card.get("calibration"))
    except ValueError as exc:
        raise ModelError(f"model {model_path} card: {exc}") from None
    return ModelOutput(kind, output, score, calibration)


def _check_card(card: dict[str, Any], model_path: Path) -> FeatureSet:
    name = card.get("feature_set")
    if name not in FEATURE_SETS:
        raise ModelError(
            f"model {model_path} was trained on feature set {name!r}, which this version of "
            f"clairvoyant does not have (known: {', '.join(sorted(FEATURE_SETS))})"
        )
    feature_set = FEATURE_SETS[name]
    names = tuple(card.get("feature_names") or ())
    if names != feature_set.names:
        raise ModelError(
            f"model {model_path} card lists features {list(names)} but feature set {name!r} "
            f"extracts {list(feature_set.names)}: retrain the model or use a matching clairvoyant"
        )
    expected_sha = card.get("onnx_sha256")
    if not isinstance(expected_sha, str):
        raise ModelError(f"model {model_path} card has no 'onnx_sha256': cannot tell it describes this file")
    with model_path.open("rb") as fh:
        sha = hashlib.file_digest(fh, "sha256").hexdigest()
    if expected_sha != sha:
        raise ModelError(
            f"model {model_path} does not match the sha256 in its card {card_path_for(model_path)}: "
            "the file was replaced or the card belongs to another model"
        )
    return feature_set


def _bound_runner(session: Any, binding: Any) -> Callable[[], None]:
    """A call that runs ``session`` once on the buffers bound in ``binding``.

    ``InferenceSession.run_with_iobinding`` wraps the C call in WebGPU graph-capture bookkeeping (a
    capture check and a run-options lookup on every call: about 1.8 of its 5.4 us here, a third of
    the ONNX time). The CPU provider never captures, so the session's C method is called directly
    when this onnxruntime has it (``_sess``, ``_iobinding``), and the public method otherwise.

    Either way it is given one ``RunOptions``, made here: called without, onnxruntime builds default
    run options on every call, which cost 1.2-3.4 us of a 5-12 us run on an AMD EPYC (the two
    alternated call by call). These are the same defaults, so the outputs are the same.
    """
    import onnxruntime as ort

    options = ort.RunOptions()
    run = getattr(getattr(session, "_sess", None), "run_with_iobinding", None)
    c_binding = getattr(binding, "_iobinding", None)
    if run is None or c_binding is None:
        return functools.partial(session.run_with_iobinding, binding, options)
    return functools.partial(run, c_binding, options)


SESSION_PROVIDERS = ("CPUExecutionProvider",)  # never a GPU or another provider that a wheel happens to bring


def pinned_session_options() -> Any:
    """The options of every serving session, each one that can change what a model gives pinned
    (docs/operations.md, "What can differ across CPUs"): one thread and sequential execution (one
    order of every reduction), every graph optimisation (the same fused kernels whatever the
    library's default), deterministic compute, and denormals kept. What stays free is the
    instruction set: ONNX Runtime picks its kernels from the CPU, and no option chooses them."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.use_deterministic_compute = True
    options.add_session_config_entry("session.set_denormal_as_zero", "0")
    return options


def single_threaded_session(path: Path, what: str, content: bytes | None = None) -> Any:
    """An onnxruntime session on one thread: the backend generates on the same cores, and a thread
    pool per call turns a 0.05 ms median into a multi-millisecond p99 under that load. ``what``
    names the file in the error; ``content``: its bytes, if already read (and checked)."""
    import onnxruntime as ort

    try:
        model = str(path) if content is None else content
        return ort.InferenceSession(model, pinned_session_options(), providers=list(SESSION_PROVIDERS))
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise ModelError(f"cannot load {what} {path}: {exc}") from exc


class _BoundRow:
    """``session`` bound once to one float32 input row and one output row (IOBinding over numpy
    buffers shared with ONNX Runtime), so that a request is "fill the row in place, run, read the
    outputs" with no per-call allocation. Whoever reads ``row`` or runs holds ``lock``."""

    def __init__(self, session: Any, size: int, output: str, out_shape: list[int]) -> None:
        import onnxruntime as ort

        self.session = session
        self.input_name = session.get_inputs()[0].name
        self.row = np.zeros(size, dtype=np.float32)
        out = np.zeros(out_shape, dtype=np.float32)
        self.binding = session.io_binding()
        # shares self.row's memory (the memoryview below keeps ``out`` alive)
        self._input = ort.OrtValue.ortvalue_from_numpy(self.row.reshape(1, size))
        self.binding.bind_ortvalue_input(self.input_name, self._input)
        self.binding.bind_output(output, "cpu", 0, np.float32, out_shape, out.ctypes.data)
        # memoryviews of the two bound buffers: reading them back (tolist, tobytes) without a numpy
        # call is about 0.25 us cheaper per request, with the same float32 -> float values and bytes
        # (numpy's stubs omit the buffer protocol)
        self.outputs = memoryview(out.reshape(-1)).tolist  # type: ignore[arg-type]
        self.row_bytes = memoryview(self.row).tobytes  # type: ignore[arg-type]
        # struct packs the feature list straight into the bound buffer: cheaper than numpy's list
        # assignment, and the same float64 -> float32 rounding.
        self.fill = functools.partial(struct.Struct(f"={size}f").pack_into, self.row, 0)  # type: ignore[arg-type]
        self.run = _bound_runner(session, self.binding)
        self.lock = threading.Lock()


class OnnxPredictor:
    """Scores one request at a time with a single-threaded ONNX Runtime session (see
    ``single_threaded_session``).

    ``corrector`` (settable later): an online correction of the prior, e.g.
    ``clairvoyant.prediction.learner.OnlineLearner``; None = the static shipped model.
    """

    def __init__(self, model_path: Path | str | None = None, *, corrector: Corrector | None = None) -> None:
        path = Path(model_path) if model_path is not None else DEFAULT_MODEL_PATH
        if not path.is_file():
            raise ModelError(f"model file {path} not found")
        self.model_path = path
        self.card = load_card(path)
        self.output = _model_output(self.card, path)
        self.feature_set = _check_card(self.card, path)
        self.calibration = self.output.calibration
        self.corrector: Corrector | None = None
        session = single_threaded_session(path, "ONNX model")
        inputs = session.get_inputs()
        if len(inputs) != 1 or inputs[0].shape[-1] != self.feature_set.size:
            raise ModelError(f"model {path} input does not take {self.feature_set.size} features")
        outputs = {o.name: o for o in session.get_outputs()}
        if self.output.output not in outputs:
            raise ModelError(f"model {path} has no {self.output.output!r} output (has {sorted(outputs)})")
        out_shape = outputs[self.output.output].shape
        width = out_shape[-1] if len(out_shape) == 2 else 1
        self._is_classifier = self.output.kind == "classifier"
        expected_width = len(CLASS_NAMES) if self._is_classifier else 1
        if width != expected_width:
            raise ModelError(
                f"model {path} output {self.output.output!r} has shape {out_shape}, expected [N, {expected_width}]"
            )
        self._bound = _BoundRow(
            session, self.feature_set.size, self.output.output, [1, width] if len(out_shape) == 2 else [1]
        )
        self._pack = struct.Struct(f"={self.feature_set.size}f").pack
        # where a feature row keeps history_chars (BlendWeights' rule); None: this feature set has none
        names = self.feature_set.names
        self.history_column: int | None = names.index("history_chars") if "history_chars" in names else None
        self._values = self.feature_set.values
        self.predict(Prompt(""))  # warm up (first-run allocations) and prove the binding works
        self.corrector = corrector

    @property
    def onnx_sha256(self) -> str:
        return str(self.card["onnx_sha256"])

    @property
    def feature_set_name(self) -> str:
        return self.feature_set.name

    def predict(self, prompt: Prompt, *, model: str | None = None, cap_tokens: int | None = None) -> Prediction:
        """The prediction for one request (see the module docstring). Never raises on any Prompt."""
        bound = self._bound
        with bound.lock:
            bound.fill(*self._values(prompt))
            bound.run()
            out = bound.outputs()
            row = bound.row_bytes()
            raw = out[-1]  # the raw score: a regressor's one output, a class model's P(Long)
            prior = self.calibration.log_tokens_of(raw)
            corrector = self.corrector
            correction = 0.0 if corrector is None else corrector.correction(model, bound.row, prior)
        probabilities = (out[0], out[1], out[2]) if self._is_classifier else None
        return self._prediction(raw, prior, correction, probabilities, row, model, cap_tokens)

    def feature_row(self, prompt: Prompt) -> bytes:
        """``prompt``'s feature row, float32 bytes: the ``feature_row`` ``predict`` gives it (the
        same values, packed the same way), without running the model. Reads no shared buffer."""
        return self._pack(*self._values(prompt))

    def history_chars(self, row: bytes) -> float:
        """The ``history_chars`` feature of a feature row; 0.0 if the row or the column is missing:
        a feature set without it cannot tell turns apart, see ``encoder.encoder_for``."""
        column = self.history_column
        if column is None or len(row) < 4 * (column + 1):
            return 0.0
        return float(struct.unpack_from("=f", row, 4 * column)[0])

    def refined(
        self,
        prediction: Prediction,
        encoder_log_tokens: float,
        weights: BlendWeights,
        components: bytes = b"",
        knn_log_tokens: float | None = None,
        *,
        row: bytes | None = None,
    ) -> Prediction:
        """``prediction`` with the encoder's (and kNN's) opinion blended into its prior
        (``BlendWeights.blend``, w by the row's history), then the learned correction and the cap
        as in ``predict``. ``components`` (float32 bytes) are appended to the feature row, for the
        learner. ``row``: the lexical row to read instead of the prediction's own (a queued
        request's prediction carries none). Reads no shared buffer."""
        row = prediction.feature_row if row is None else row
        weight = weights.for_history(self.history_chars(row))
        prior = BlendWeights.blend(prediction.prior_log_tokens, encoder_log_tokens, weight, knn_log_tokens, weights.knn)
        feature_row = row + components
        corrector = self.corrector
        correction = 0.0
        if corrector is not None and feature_row:
            correction = corrector.correction(prediction.model, np.frombuffer(feature_row, dtype=np.float32), prior)
        return self._prediction(
            None, prior, correction, prediction.probabilities, feature_row, prediction.model, prediction.cap_tokens
        )

    def _prediction(
        self,
        raw: float | None,
        prior_log_tokens: float,
        correction: float,
        probabilities: tuple[float, float, float] | None,
        row: bytes,
        model: str | None,
        cap_tokens: int | None,
    ) -> Prediction:
        calibration = self.calibration
        if correction or raw is None:  # no raw score of its own: a corrected or refined prior
            predicted_log = prior_log_tokens + correction
            score = calibration.score_of_extended(predicted_log)
        else:
            predicted_log = prior_log_tokens
            score = raw
        tokens = math.exp(predicted_log)
        if cap_tokens is not None and cap_tokens >= 0:
            # extended beyond the calibrated range: caps below it still order by cap (module docstring)
            cap_score = calibration.score_of_extended(log_tokens(cap_tokens))
            if cap_score < score:
                score = cap_score
            if cap_tokens < tokens:
                tokens = float(cap_tokens)
        else:
            cap_tokens = None
        return Prediction(score, tokens, probabilities, prior_log_tokens, row, model, cap_tokens)

    def predict_features(self, matrix: np.ndarray) -> np.ndarray:
        """The model's raw ONNX output for a feature matrix: probabilities [N, 3] for a class
        model, [N, 1] (or [N]) for a regressor (bulk scoring and evaluation)."""
        matrix = np.ascontiguousarray(matrix, dtype=np.float32)
        if matrix.ndim != 2 or matrix.shape[1] != self.feature_set.size:
            raise ValueError(f"expected a [N, {self.feature_set.size}] feature matrix, got {matrix.shape}")
        if len(matrix) == 0:
            return np.zeros((0, len(CLASS_NAMES) if self._is_classifier else 1), dtype=np.float32)
        bound = self._bound
        return np.asarray(bound.session.run([self.output.output], {bound.input_name: matrix})[0])

    def raw_scores(self, matrix: np.ndarray) -> np.ndarray:
        """The raw score [N] of each row (P(Long) for a class model, the regressor's output else)."""
        out = self.predict_features(matrix)
        return out[:, -1] if out.ndim == 2 else out

    def predict_many(
        self,
        prompts: Sequence[Prompt],
        *,
        models: Sequence[str | None] | None = None,
        caps_tokens: Sequence[int | None] | None = None,
    ) -> list[Prediction]:
        """``predict`` for each prompt (with its model and cap, if given), in one ONNX call."""
        if not prompts:
            return []
        matrix = self.feature_set.extract_many(prompts)
        outs = self.predict_features(matrix).reshape(len(prompts), -1).tolist()
        priors = self.calibration.log_tokens_many(np.array([out[-1] for out in outs])).tolist()
        none = [None] * len(prompts)
        corrector = self.corrector
        predictions = []
        for row, out, prior, model, cap in zip(matrix, outs, priors, models or none, caps_tokens or none):
            correction = 0.0 if corrector is None else corrector.correction(model, row, prior)
            probabilities = (out[0], out[1], out[2]) if self._is_classifier else None
            predictions.append(self._prediction(out[-1], prior, correction, probabilities, row.tobytes(), model, cap))
        return predictions
