"""Isotonic calibration of a raw model score to ln(answer tokens), stored as card breakpoints.

The card contract (schema 2): ``{"method": "isotonic", "score": [...], "log_tokens": [...]}``, both
arrays strictly increasing, 2..200 points; serving maps a raw score with
``np.interp(raw, score, log_tokens)`` (clamped at both ends).

Isotonic regression's step function has plateaus (runs of equal log_tokens); each plateau becomes
one point at the mean of its score range, so both arrays are strictly increasing and the
interpolation between plateau centres is monotone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["MAX_POINTS", "apply", "isotonic_breakpoints"]

MAX_POINTS = 200


def isotonic_breakpoints(score: np.ndarray, log_tokens: np.ndarray, *, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The card's calibration block fit on (``score``, ``log_tokens``) rows."""
    from sklearn.isotonic import IsotonicRegression

    score = np.asarray(score, dtype=np.float64)
    target = np.asarray(log_tokens, dtype=np.float64)
    if len(score) < 2 or not np.all(np.isfinite(score)) or not np.all(np.isfinite(target)):
        raise ValueError("calibration needs at least 2 rows of finite scores and labels")
    iso = IsotonicRegression(out_of_bounds="clip", increasing=True).fit(score, target)
    xs, ys = np.asarray(iso.X_thresholds_, np.float64), np.asarray(iso.y_thresholds_, np.float64)
    # one point per plateau: runs of equal y -> mean x
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ys) > 0) + 1])
    ends = np.concatenate([starts[1:], [len(ys)]])
    px = np.array([xs[a:b].mean() for a, b in zip(starts, ends)])
    py = ys[starts]
    if len(px) > max_points:
        keep = np.unique(np.round(np.linspace(0, len(px) - 1, max_points)).astype(int))
        px, py = px[keep], py[keep]
    if len(px) < 2:  # a constant fit: a flat map with a negligible slope keeps both arrays increasing
        centre, level = float(np.median(score)), float(py[0])
        px, py = np.array([centre - 1.0, centre + 1.0]), np.array([level - 1e-6, level + 1e-6])
    assert np.all(np.diff(px) > 0) and np.all(np.diff(py) > 0)
    return {
        "method": "isotonic",
        "score": [float(v) for v in px],
        "log_tokens": [float(v) for v in py],
        "fit_rows": int(len(score)),
    }


def apply(calibration: dict[str, Any], raw: np.ndarray) -> np.ndarray:
    """ln(predicted tokens) for raw scores (what serving computes)."""
    return np.interp(np.asarray(raw, np.float64), calibration["score"], calibration["log_tokens"])
