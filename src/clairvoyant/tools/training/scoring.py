"""Bulk scoring of any model file by its card (schema 1 or 2), for evaluation: independent of the
serving predictor so that a baseline classifier and the shipped regressor are scored alike.

The raw score is what the queue orders by (lower = sooner): P(Long) for a classifier,
the ``output`` column for a regressor. ``predicted_log_tokens`` applies the card's calibration.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.prediction.features import FeatureSet, Prompt, get_feature_set
from clairvoyant.prediction.predictor import load_card
from clairvoyant.tools.training import calibration

__all__ = ["ModelScorer"]


class ModelScorer:
    def __init__(self, model_path: Path) -> None:
        import onnxruntime as ort

        self.model_path = Path(model_path)
        self.card: dict[str, Any] = load_card(self.model_path)
        if self.card.get("onnx_sha256") != hashlib.sha256(self.model_path.read_bytes()).hexdigest():
            raise ValueError(f"{self.model_path} does not match the sha256 in its card")
        self.feature_set: FeatureSet = get_feature_set(self.card["feature_set"])
        if tuple(self.card.get("feature_names") or ()) != self.feature_set.names:
            raise ValueError(f"{self.model_path}: card feature names differ from feature set {self.feature_set.name}")
        self.kind: str = self.card.get("kind", "classifier")
        self.output: str = self.card.get("output", "probabilities")
        self.score_meaning: str = self.card.get("score", "p_long")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(self.model_path), options, providers=["CPUExecutionProvider"])

    @property
    def name(self) -> str:
        return self.model_path.name

    def features(self, prompts: Sequence[Prompt]) -> np.ndarray:
        return self.feature_set.extract_many(list(prompts))

    def raw_scores(self, x: np.ndarray) -> np.ndarray:
        """The queue key of each row (float64)."""
        if len(x) == 0:
            return np.zeros(0)
        out = np.asarray(self._session.run([self.output], {"input": np.ascontiguousarray(x, dtype=np.float32)})[0])
        return (out[:, 2] if self.kind == "classifier" else out.reshape(len(x), -1)[:, 0]).astype(np.float64)

    def score_prompts(self, prompts: Sequence[Prompt]) -> np.ndarray:
        return self.raw_scores(self.features(prompts))

    def predicted_log_tokens(self, raw: np.ndarray) -> np.ndarray | None:
        calib = self.card.get("calibration")
        return calibration.apply(calib, raw) if calib else None
