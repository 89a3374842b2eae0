"""Fitting the XGBoost models: the shipped log-token regressor and the paper's 3-class softmax model.

``shipped`` (``model/predictor.onnx``) is a regressor (reg:squarederror) of ln(answer tokens) over
rich_v3 features, trained on the natural distribution of ShareGPT pairs: 150 rounds of depth-3 trees,
learning rate 0.1. Chosen by its AlpacaEval transfer (model/predictor.evaluation.md): Kendall tau_b 0.32 mean
over 4 models against 0.02 for the previous balanced 3-class model, with 150 small trees.
Answers of at least 760 tokens are left out of its fit (``RegressorConfig.censored_from_tokens``):
there the packaged answers were cut, not finished (AlpacaEval served mean tau_b 0.403 -> 0.406).

The classifier presets: ``paper`` is the paper's configuration (section 4.3: paper19 features, 300 trees per
class, depth 6, learning rate 0.1, seed 42); ``shipped`` is the configuration of
the previous shipped model (``model/baselines/rich_v2_3class.onnx``: rich_v2 features, 50 rounds x 3 classes, depth 3, learning rate 0.2),
chosen by 5-fold group cross-validation on the training split only (rich_v1 features): 300x6
0.853, 100x4 0.865, 60x4 0.866, 50x3 0.868, 30x3 0.866, 20x3 0.864 ranking accuracy (std ~0.015).
Shallow and few trees are as accurate here and ~6x cheaper per request than the paper's 900
depth-6 trees. rich_v2 (rich_v1 on a 600-character window) scored 0.870 in the same
cross-validation with 50x3. Training is deterministic for a given seed: the hist method, a fixed
thread count, no row or column subsampling.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from clairvoyant.prediction.features import FeatureSet, Prompt, get_feature_set

__all__ = ["PRESETS", "ModelConfig", "RegressorConfig", "featurize", "fit", "fit_regressor", "xgboost_version"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The model half of a training run (the data half is ``dataset.DataConfig``)."""

    feature_set: str
    n_estimators: int  # boosting rounds (one tree per class per round)
    max_depth: int
    learning_rate: float
    seed: int = 42

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "objective": "multi:softprob", "tree_method": "hist"}

    def with_overrides(self, **overrides: Any) -> ModelConfig:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True, slots=True)
class RegressorConfig:
    """A regressor of ln(answer tokens): one tree per round.

    ``censored_from_tokens``: training answers of at least this many tokens are left out of the fit
    (weight 0): the packaged ShareGPT answers pile up at 760-779 cl100k tokens, where about half end
    mid-sentence, so such a length is where the answer was cut, not how long it was. None: every row.
    """

    feature_set: str
    n_estimators: int
    max_depth: int
    learning_rate: float
    seed: int = 42
    censored_from_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "objective": "reg:squarederror",
            "target": "ln(answer cl100k tokens)",
            "tree_method": "hist",
        }

    def training_weights(self, lengths: np.ndarray) -> np.ndarray | None:
        """Each training row's weight: 0 for a censored answer, else 1 (None: all rows count)."""
        if self.censored_from_tokens is None:
            return None
        return np.where(np.asarray(lengths) >= self.censored_from_tokens, 0.0, 1.0).astype(np.float32)

    def with_overrides(self, **overrides: Any) -> RegressorConfig:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


PRESETS: dict[str, ModelConfig | RegressorConfig] = {
    "paper": ModelConfig("paper19", 300, 6, 0.1, 42),
    "shipped": RegressorConfig("rich_v3", 150, 3, 0.1, 42, censored_from_tokens=760),
    # the previous shipped model, kept reproducible as a baseline (model/baselines/rich_v2_3class.onnx)
    "rich_v2_3class": ModelConfig("rich_v2", 50, 3, 0.2, 42),
}


def featurize(feature_set: FeatureSet | str, prompts: Sequence[Prompt], *, progress: bool = False) -> np.ndarray:
    """The float32 feature matrix of ``prompts`` (the serving extractor, row by row)."""
    fs = get_feature_set(feature_set) if isinstance(feature_set, str) else feature_set
    from tqdm import tqdm

    matrix = np.zeros((len(prompts), fs.size), dtype=np.float32)
    for row, prompt in zip(matrix, tqdm(prompts, desc=f"features ({fs.name})", disable=not progress, unit="row")):
        fs.extract_into(prompt, row)
    return matrix


def xgboost_version() -> str:
    import xgboost

    return str(xgboost.__version__)


def fit(x: np.ndarray, y: np.ndarray, config: ModelConfig, *, threads: int = 2) -> Any:
    """A fitted ``xgboost.XGBClassifier`` (multi:softprob, 3 classes) on ``x`` (float32) and ``y`` (0/1/2).

    Raises ValueError if a class is missing from ``y`` (the softmax would have fewer outputs).
    """
    import xgboost

    classes = np.unique(y)
    if list(classes) != [0, 1, 2]:
        raise ValueError(f"training labels must contain classes 0, 1 and 2; got {list(classes)}")
    clf = xgboost.XGBClassifier(
        n_estimators=config.n_estimators,
        max_depth=config.max_depth,
        learning_rate=config.learning_rate,
        objective="multi:softprob",
        tree_method="hist",
        random_state=config.seed,
        n_jobs=threads,
    )
    logger.info("fitting %d rounds x 3 classes, depth %d on %d rows", config.n_estimators, config.max_depth, len(y))
    clf.fit(np.ascontiguousarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64))
    return clf


def fit_regressor(
    x: np.ndarray,
    log_tokens: np.ndarray,
    config: RegressorConfig,
    *,
    threads: int = 2,
    weights: np.ndarray | None = None,
) -> Any:
    """A fitted ``xgboost.XGBRegressor`` (reg:squarederror) of ``log_tokens`` on ``x`` (float32), each
    row weighted by ``weights`` (None: equally)."""
    import xgboost

    reg = xgboost.XGBRegressor(
        n_estimators=config.n_estimators,
        max_depth=config.max_depth,
        learning_rate=config.learning_rate,
        objective="reg:squarederror",
        tree_method="hist",
        random_state=config.seed,
        n_jobs=threads,
    )
    logger.info("fitting a regressor: %d rounds, depth %d on %d rows", config.n_estimators, config.max_depth, len(x))
    reg.fit(np.ascontiguousarray(x, dtype=np.float32), np.asarray(log_tokens, dtype=np.float32), sample_weight=weights)
    return reg
