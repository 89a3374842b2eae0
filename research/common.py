"""Shared loading and scoring for the step-1 study scripts (caches made by prepare_data.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau

CACHE = Path("/tmp/rcache")


@dataclass
class Data:
    x_rich: np.ndarray
    x_p19: np.ndarray
    log_tokens: np.ndarray
    tokens: np.ndarray
    train: np.ndarray  # bool masks over all pairs
    test: np.ndarray
    first: np.ndarray
    english: np.ndarray
    groups: np.ndarray
    ax_rich: np.ndarray
    ax_p19: np.ndarray
    a_lengths: np.ndarray  # [406, 4]
    a_models: list[str]


def load() -> Data:
    s = np.load(CACHE / "sharegpt.npz", allow_pickle=False)
    a = np.load(CACHE / "alpaca.npz", allow_pickle=False)
    tokens = s["tokens"]
    test = s["test"]
    return Data(
        x_rich=s["x_rich"], x_p19=s["x_p19"], log_tokens=np.log(np.maximum(tokens, 1)).astype(np.float32),
        tokens=tokens, train=~test, test=test, first=s["turn"] == 0, english=s["english"], groups=s["groups"],
        ax_rich=a["x_rich"], ax_p19=a["x_p19"], a_lengths=a["lengths"], a_models=[str(m) for m in a["models"]],
    )


def tau(score: np.ndarray, lengths: np.ndarray) -> float:
    return float(kendalltau(score, lengths, variant="b").statistic)


def alpaca_taus(score: np.ndarray, d: Data) -> tuple[list[float], float]:
    per = [tau(score, d.a_lengths[:, m]) for m in range(d.a_lengths.shape[1])]
    return per, float(np.mean(per))


def pair_accuracy_2x(score: np.ndarray, lengths: np.ndarray) -> float:
    """Share of pairs with lengths differing >= 2x that the score orders right (ties half)."""
    s = np.asarray(score, np.float64)
    ln = np.log(np.maximum(np.asarray(lengths, np.float64), 1))
    ds = s[:, None] - s[None, :]
    dl = ln[:, None] - ln[None, :]
    mask = dl >= np.log(2)
    right = (ds[mask] > 0).sum() + 0.5 * (ds[mask] == 0).sum()
    return float(right / max(mask.sum(), 1))


def heldout_rows(d: Data, *, first_only: bool = False) -> np.ndarray:
    m = d.test & d.english
    if first_only:
        m &= d.first
    return np.flatnonzero(m)


def report(name: str, score_alpaca: np.ndarray, score_heldout: np.ndarray, score_heldout_first: np.ndarray | None,
           d: Data, extra: str = "") -> dict:
    per, mean = alpaca_taus(score_alpaca, d)
    h = tau(score_heldout, d.tokens[heldout_rows(d)])
    hf = tau(score_heldout_first, d.tokens[heldout_rows(d, first_only=True)]) if score_heldout_first is not None else float("nan")
    line = (f"| {name} | " + " | ".join(f"{t:.3f}" for t in per) + f" | **{mean:.3f}** | {h:.3f} | {hf:.3f} | {extra} |")
    print(line, flush=True)
    with (Path(__file__).parent / "results.log").open("a") as fh:
        fh.write(line + "\n")
    return {"name": name, "alpaca": per, "alpaca_mean": mean, "heldout": h, "heldout_first": hf}
