"""The length predictor: features -> ONNX XGBoost model -> P(Short), P(Medium), P(Long).

Serving imports only onnxruntime and numpy here. The model file ships with a JSON card beside it
(``<model>.card.json``); loading refuses a model whose card names a feature set or feature list
that differs from ``clairvoyant.features``, or whose sha256 differs from the file.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from clairvoyant.errors import ModelError
from clairvoyant.features import FEATURE_SETS, FeatureSet, Prompt

__all__ = [
    "CLASS_NAMES",
    "DEFAULT_MODEL_PATH",
    "OnnxPredictor",
    "Prediction",
    "Predictor",
    "card_path_for",
    "load_card",
]

CLASS_NAMES: tuple[str, str, str] = ("short", "medium", "long")
# STAND-IN until issue 6 (L1) lands a calibrated ``predicted_tokens`` on Prediction: expected output
# tokens from the class probabilities with these class midpoints (Short < 200 <= Medium < 600 <= Long).
_STAND_IN_CLASS_TOKENS: tuple[float, float, float] = (100.0, 400.0, 900.0)
# The shipped model: model/predictor.onnx at the top of the source tree. src/clairvoyant/model links
# to that folder, so a checkout, an editable install and a built wheel all find it here.
DEFAULT_MODEL_PATH = Path(__file__).parent / "model" / "predictor.onnx"


@dataclass(frozen=True, slots=True)
class Prediction:
    p_short: float
    p_medium: float
    p_long: float

    @property
    def score(self) -> float:
        """The scheduling key: ascending P(Long) (paper 3.4); lower runs earlier."""
        return self.p_long

    @property
    def predicted_tokens(self) -> float:
        """STAND-IN (see _STAND_IN_CLASS_TOKENS): expected output tokens from the class probabilities.
        L1's Prediction replaces this with a calibrated, max_tokens-capped value."""
        a, b, c = _STAND_IN_CLASS_TOKENS
        return a * self.p_short + b * self.p_medium + c * self.p_long

    @property
    def predicted_class(self) -> str:
        probs = (self.p_short, self.p_medium, self.p_long)
        return CLASS_NAMES[max(range(3), key=probs.__getitem__)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "p_short": self.p_short,
            "p_medium": self.p_medium,
            "p_long": self.p_long,
            "score": self.score,
            "predicted_class": self.predicted_class,
        }


class Predictor(Protocol):
    def predict(self, prompt: Prompt) -> Prediction:
        """Class probabilities for one request. Must not raise on any Prompt."""
        ...


def card_path_for(model_path: Path) -> Path:
    return model_path.with_suffix(".card.json")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
    if tuple(card.get("classes") or ()) != CLASS_NAMES:
        raise ModelError(f"model {model_path} card classes {card.get('classes')!r} are not {list(CLASS_NAMES)}")
    expected_sha = card.get("onnx_sha256")
    if not isinstance(expected_sha, str):
        raise ModelError(f"model {model_path} card has no 'onnx_sha256': cannot tell it describes this file")
    if expected_sha != _sha256(model_path):
        raise ModelError(
            f"model {model_path} does not match the sha256 in its card {card_path_for(model_path)}: "
            "the file was replaced or the card belongs to another model"
        )
    return feature_set


class OnnxPredictor:
    """Scores one request at a time with a single-threaded ONNX Runtime session.

    Single-threaded on purpose: the backend generates on the same cores, and a thread pool per
    call turns a 0.05 ms median into a multi-millisecond p99 under that load.
    """

    def __init__(self, model_path: Path | str | None = None) -> None:
        import onnxruntime as ort  # imported here so that importing this module stays cheap

        path = Path(model_path) if model_path is not None else DEFAULT_MODEL_PATH
        if not path.is_file():
            raise ModelError(f"model file {path} not found")
        self.model_path = path
        self.card = load_card(path)
        self.feature_set = _check_card(self.card, path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise ModelError(f"cannot load ONNX model {path}: {exc}") from exc
        inputs = self._session.get_inputs()
        if len(inputs) != 1 or inputs[0].shape[-1] != self.feature_set.size:
            raise ModelError(f"model {path} input does not take {self.feature_set.size} features")
        self._input_name = inputs[0].name
        outputs = {o.name: o for o in self._session.get_outputs()}
        if "probabilities" not in outputs:
            raise ModelError(f"model {path} has no 'probabilities' output (has {sorted(outputs)})")
        self._output_names = ["probabilities"]
        # The per-request path avoids every per-call allocation it can: one input row and one
        # output row, bound once to the session (IOBinding over numpy buffers shared with ORT), so
        # a call is "fill the row in place, run, read three floats". The lock makes the shared
        # buffers safe if predict is called from several threads.
        self._row = np.zeros((1, self.feature_set.size), dtype=np.float32)
        self._out = np.zeros((1, len(CLASS_NAMES)), dtype=np.float32)
        self._binding = self._session.io_binding()
        self._input_value = ort.OrtValue.ortvalue_from_numpy(self._row)  # shares self._row's memory
        self._binding.bind_ortvalue_input(self._input_name, self._input_value)
        self._binding.bind_output(
            "probabilities", "cpu", 0, np.float32, list(self._out.shape), self._out.ctypes.data
        )
        self._out_view = self._out[0]
        # struct packs the feature list straight into the bound buffer: cheaper than numpy's
        # list assignment, and the same float64 -> float32 rounding.
        self._pack_into = struct.Struct(f"={self.feature_set.size}f").pack_into
        self._values = self.feature_set.values
        self._run_bound = self._session.run_with_iobinding
        self._lock = threading.Lock()
        self.predict(Prompt(""))  # warm up (first-run allocations) and prove the binding works

    @property
    def feature_set_name(self) -> str:
        return self.feature_set.name

    def predict(self, prompt: Prompt) -> Prediction:
        """P(Short), P(Medium), P(Long) for one request. Never raises on any Prompt text."""
        with self._lock:
            self._pack_into(self._row, 0, *self._values(prompt))
            self._run_bound(self._binding)
            p_short, p_medium, p_long = self._out_view.tolist()
        return Prediction(p_short, p_medium, p_long)

    def predict_features(self, matrix: np.ndarray) -> np.ndarray:
        """Probabilities [N, 3] for a feature matrix (bulk scoring and evaluation)."""
        matrix = np.ascontiguousarray(matrix, dtype=np.float32)
        if matrix.ndim != 2 or matrix.shape[1] != self.feature_set.size:
            raise ValueError(f"expected a [N, {self.feature_set.size}] feature matrix, got {matrix.shape}")
        if len(matrix) == 0:
            return np.zeros((0, len(CLASS_NAMES)), dtype=np.float32)
        return np.asarray(self._session.run(self._output_names, {self._input_name: matrix})[0])

    def predict_many(self, prompts: list[Prompt]) -> list[Prediction]:
        """``predict`` for each prompt, in one ONNX call."""
        probs = self.predict_features(self.feature_set.extract_many(prompts))
        return [Prediction(float(p[0]), float(p[1]), float(p[2])) for p in probs]
