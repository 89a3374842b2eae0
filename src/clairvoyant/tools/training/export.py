"""XGBoost -> ONNX (onnxmltools 1.16.0), the parity checks, and the model card.

Every ONNX graph takes ``input`` float32 [N, n_features]. A classifier returns ``label`` int64 [N] and
``probabilities`` float32 [N, 3] (Short, Medium, Long); a regressor returns ``variable`` float32
[N, 1] (its raw score: ln tokens for reg:squarederror). The card (``<model>.card.json``, schema 2) is
what the serving predictor reads: ``kind``, ``output``, ``score``, ``calibration`` (see
``training.calibration``), ``classes`` (classifier only), feature-set name and names, and the
file's sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.prediction.predictor import CLASS_NAMES, card_path_for

__all__ = [
    "PARITY_TOLERANCE",
    "REGRESSOR_OUTPUT",
    "ParityError",
    "check_parity",
    "check_regressor_parity",
    "onnx_outputs",
    "regressor_to_onnx",
    "sha256_of",
    "to_onnx",
    "write_card",
    "write_model",
]

logger = logging.getLogger(__name__)

PARITY_TOLERANCE = 1e-5
CARD_SCHEMA = 2
REGRESSOR_OUTPUT = "variable"  # onnxmltools' name for an XGBRegressor's output


class ParityError(RuntimeError):
    """The ONNX model's probabilities differ from xgboost's by more than the tolerance."""


def to_onnx(clf: Any, n_features: int) -> bytes:
    """The serialized ONNX model of a fitted XGBClassifier trained on ``n_features`` columns."""
    from onnxmltools import convert_xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType

    model = convert_xgboost(clf, initial_types=[("input", FloatTensorType([None, n_features]))], target_opset=15)
    model.doc_string = "clairvoyant length predictor: P(Short), P(Medium), P(Long)"
    return bytes(model.SerializeToString())


def regressor_to_onnx(reg: Any, n_features: int) -> bytes:
    """The serialized ONNX model of a fitted XGBRegressor: output ``variable`` float32 [N, 1]."""
    from onnxmltools import convert_xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType

    model = convert_xgboost(reg, initial_types=[("input", FloatTensorType([None, n_features]))], target_opset=15)
    model.doc_string = "clairvoyant length predictor: ln(answer tokens), uncalibrated"
    outputs = [o.name for o in model.graph.output]
    if outputs != [REGRESSOR_OUTPUT]:
        raise ParityError(f"unexpected regressor outputs {outputs} (expected [{REGRESSOR_OUTPUT!r}])")
    return bytes(model.SerializeToString())


def onnx_outputs(model_bytes: bytes, x: np.ndarray, output: str) -> np.ndarray:
    """One output of the ONNX model on rows ``x`` (single-threaded session, as serving runs it)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    return np.asarray(session.run([output], {"input": np.ascontiguousarray(x, dtype=np.float32)})[0])


def onnx_probabilities(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    return onnx_outputs(model_bytes, x, "probabilities")


def check_regressor_parity(reg: Any, model_bytes: bytes, x: np.ndarray, tolerance: float = PARITY_TOLERANCE) -> float:
    """Max |score_onnx - score_xgboost| (xgboost's ``predict(output_margin=True)``); raises above ``tolerance``."""
    expected = np.asarray(reg.predict(np.ascontiguousarray(x, dtype=np.float32), output_margin=True), np.float64)
    got = onnx_outputs(model_bytes, x, REGRESSOR_OUTPUT)[:, 0].astype(np.float64)
    diff = float(np.max(np.abs(got - expected))) if len(x) else 0.0
    if not diff <= tolerance:  # also catches NaN
        raise ParityError(f"ONNX and xgboost scores differ by {diff:.3g} (> {tolerance:g})")
    return diff


def check_parity(clf: Any, model_bytes: bytes, x: np.ndarray, tolerance: float = PARITY_TOLERANCE) -> float:
    """Max |P_onnx - P_xgboost| over the rows of ``x``; raises ParityError above ``tolerance``."""
    expected = clf.predict_proba(np.ascontiguousarray(x, dtype=np.float32))
    got = onnx_probabilities(model_bytes, x)
    diff = float(np.max(np.abs(got - expected))) if len(x) else 0.0
    if not diff <= tolerance:  # also catches NaN
        raise ParityError(f"ONNX and xgboost probabilities differ by {diff:.3g} (> {tolerance:g})")
    return diff


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_model(model_bytes: bytes, path: Path) -> str:
    """Write the ONNX file and return its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model_bytes)
    return sha256_of(path)


def write_card(model_path: Path, card: dict[str, Any]) -> Path:
    """Write ``<model>.card.json`` (schema 2); ``card`` must carry feature_set and feature_names.

    ``kind`` defaults to "classifier" (output "probabilities", score "p_long", the three classes); a
    "regressor" card must name its ``output`` and ``score``. ``calibration`` is required and checked.
    """
    for key in ("feature_set", "feature_names"):
        if key not in card:
            raise ValueError(f"model card needs {key!r}")
    kind = card.get("kind", "classifier")
    if kind == "classifier":
        head: dict[str, Any] = {
            "kind": kind,
            "output": "probabilities",
            "score": "p_long",
            "classes": list(CLASS_NAMES),
        }
    elif kind == "regressor":
        if card.get("score") not in ("log_tokens", "rank") or not card.get("output"):
            raise ValueError("a regressor card needs 'output' and 'score' ('log_tokens' or 'rank')")
        head = {"kind": kind}
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    calibration = card.get("calibration")
    if calibration is None:  # the predictor needs it to speak in tokens (a cap, seconds, the ETA)
        raise ValueError("a schema-2 model card needs a 'calibration' (raw score -> ln tokens)")
    check_calibration(calibration)
    full = {"schema": CARD_SCHEMA, **head, "onnx_sha256": sha256_of(model_path), **card}
    path = card_path_for(model_path)
    path.write_text(json.dumps(full, indent=2, sort_keys=False) + "\n")
    return path


def check_calibration(calibration: dict[str, Any]) -> None:
    """Raise ValueError unless ``calibration`` keeps the card contract (isotonic, 2..200 strictly increasing points)."""
    score, log_tokens = calibration.get("score"), calibration.get("log_tokens")
    if calibration.get("method") != "isotonic" or not isinstance(score, list) or not isinstance(log_tokens, list):
        raise ValueError("calibration must be {'method': 'isotonic', 'score': [...], 'log_tokens': [...]}")
    if not 2 <= len(score) == len(log_tokens) <= 200:
        raise ValueError(f"calibration needs 2..200 points in both arrays, got {len(score)} and {len(log_tokens)}")
    if not (np.all(np.diff(score) > 0) and np.all(np.diff(log_tokens) > 0)):
        raise ValueError("calibration arrays must be strictly increasing")


def update_card(model_path: Path, section: str, values: dict[str, Any]) -> None:
    """Merge ``values`` into one top-level section of an existing card (evaluation, benchmark)."""
    path = card_path_for(model_path)
    card = json.loads(path.read_text())
    merged = dict(card.get(section) or {})
    merged.update(values)
    card[section] = merged
    path.write_text(json.dumps(card, indent=2) + "\n")
