"""Scheduling-oriented metrics (paper section 4.1).

ranking_accuracy is Eq. 2: over every (Short, Long) pair, the share where the Long one has the
higher score. Ties count as half a correct pair (the paper counts them as wrong; with a
continuous P(Long) ties are rare for the model but common for coarse baselines such as a
prompt-length rule, where counting them as wrong would understate a coin flip at 0%).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["kendall_tau", "pairwise_accuracy", "ranking_accuracy", "summary", "three_class_accuracy"]


def ranking_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """Share of (Short, Long) pairs ordered correctly by ``scores``, ties as half; NaN without pairs.

    ``labels`` are classes 0 (Short), 1 (Medium, ignored), 2 (Long). Computed exactly in
    O(n log n) through average ranks (the Mann-Whitney U statistic).
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels)
    short, long_ = scores[labels == 0], scores[labels == 2]
    if len(short) == 0 or len(long_) == 0:
        return float("nan")
    both = np.concatenate([short, long_])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both), dtype=np.float64)
    sorted_vals = both[order]
    # average ranks for ties
    boundaries = np.flatnonzero(np.diff(sorted_vals)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(both)]])
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0
    u = ranks[len(short) :].sum() - len(long_) * (len(long_) + 1) / 2.0
    return float(u / (len(short) * len(long_)))


def three_class_accuracy(probabilities: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(probabilities, axis=1) == np.asarray(labels)))


def kendall_tau(scores: np.ndarray, lengths: np.ndarray) -> float:
    """Kendall tau_b between the scheduling score and the true answer length (scipy)."""
    from scipy.stats import kendalltau

    if len(scores) < 2:
        return float("nan")
    return float(kendalltau(scores, lengths, variant="b").statistic)


def pairwise_accuracy(scores: np.ndarray, lengths: np.ndarray, min_ratio: float = 2.0, chunk_rows: int = 512) -> float:
    """Over every pair whose true lengths differ by at least ``min_ratio`` x, the share that ``scores``
    orders the same way (ties in the score count half); NaN without such pairs. Exact, O(n^2) in chunks.
    Lengths below 1 token count as 1."""
    s = np.asarray(scores, dtype=np.float64)
    ln = np.log(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))
    gap = np.log(min_ratio)
    right = 0.0
    pairs = 0
    for start in range(0, len(s), chunk_rows):
        ds = s[start : start + chunk_rows, None] - s[None, :]
        longer = (ln[start : start + chunk_rows, None] - ln[None, :]) >= gap - 1e-12  # row i much longer than j
        pairs += int(longer.sum())
        right += float((ds[longer] > 0).sum()) + 0.5 * float((ds[longer] == 0).sum())
    return right / pairs if pairs else float("nan")


def summary(probabilities: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> dict[str, Any]:
    """The headline metrics of a model's P(Short, Medium, Long) on labelled rows."""
    score = probabilities[:, 2]
    return {
        "ranking_accuracy": ranking_accuracy(score, labels),
        "three_class_accuracy": three_class_accuracy(probabilities, labels),
        "kendall_tau_b": kendall_tau(score, lengths),
        "rows": int(len(labels)),
        "short_long_pairs": int(np.sum(labels == 0)) * int(np.sum(labels == 2)),
    }
