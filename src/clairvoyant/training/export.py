"""XGBoost -> ONNX (onnxmltools 1.16.0), the parity check, and the model card.

The ONNX graph takes ``input`` float32 [N, n_features] and returns ``label`` int64 [N] and
``probabilities`` float32 [N, 3] (Short, Medium, Long). The card (``<model>.card.json``) is what
``clairvoyant.predictor`` checks on load: feature-set name and names, classes, the file's sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.predictor import CLASS_NAMES, card_path_for

__all__ = ["PARITY_TOLERANCE", "ParityError", "check_parity", "sha256_of", "to_onnx", "write_card", "write_model"]

logger = logging.getLogger(__name__)

PARITY_TOLERANCE = 1e-5
CARD_SCHEMA = 1


class ParityError(RuntimeError):
    """The ONNX model's probabilities differ from xgboost's by more than the tolerance."""


def to_onnx(clf: Any, n_features: int) -> bytes:
    """The serialized ONNX model of a fitted XGBClassifier trained on ``n_features`` columns."""
    from onnxmltools import convert_xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType

    model = convert_xgboost(clf, initial_types=[("input", FloatTensorType([None, n_features]))], target_opset=15)
    model.doc_string = "clairvoyant length predictor: P(Short), P(Medium), P(Long)"
    return bytes(model.SerializeToString())


def onnx_probabilities(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["probabilities"], {"input": np.ascontiguousarray(x, dtype=np.float32)})[0])


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
    """Write ``<model>.card.json``; ``card`` must carry feature_set and feature_names."""
    for key in ("feature_set", "feature_names"):
        if key not in card:
            raise ValueError(f"model card needs {key!r}")
    full = {"schema": CARD_SCHEMA, "classes": list(CLASS_NAMES), "onnx_sha256": sha256_of(model_path), **card}
    path = card_path_for(model_path)
    path.write_text(json.dumps(full, indent=2, sort_keys=False) + "\n")
    return path


def update_card(model_path: Path, section: str, values: dict[str, Any]) -> None:
    """Merge ``values`` into one top-level section of an existing card (evaluation, benchmark)."""
    path = card_path_for(model_path)
    card = json.loads(path.read_text())
    merged = dict(card.get(section) or {})
    merged.update(values)
    card[section] = merged
    path.write_text(json.dumps(card, indent=2) + "\n")
