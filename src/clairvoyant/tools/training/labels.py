"""Answer-length labels: a named offline tokenizer and the class bounds.

Lengths are counted with ``quicktok``'s bundled ``cl100k_base`` (exactly tiktoken's cl100k counts,
offline). Classes: Short < ``short_below`` <= Medium < ``long_from`` <= Long.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PAPER_BOUNDS", "TOKENIZER_NAME", "ClassBounds", "count_tokens"]

TOKENIZER_PACKAGE = "quicktok-v1==0.4.0"
TOKENIZER_NAME = "cl100k_base"

SHORT, MEDIUM, LONG = 0, 1, 2


@dataclass(frozen=True, slots=True)
class ClassBounds:
    """Token bounds of the three classes (in tokenizer tokens of the reference answer)."""

    short_below: int = 200
    long_from: int = 800

    def __post_init__(self) -> None:
        if not 0 < self.short_below < self.long_from:
            raise ValueError(f"need 0 < short_below < long_from, got {self.short_below}, {self.long_from}")

    def classify(self, lengths: np.ndarray) -> np.ndarray:
        """0 (Short), 1 (Medium) or 2 (Long) for each length."""
        lengths = np.asarray(lengths)
        return np.where(lengths < self.short_below, SHORT, np.where(lengths < self.long_from, MEDIUM, LONG)).astype(
            np.int64
        )

    def as_dict(self) -> dict[str, int]:
        return {"short_below": self.short_below, "long_from": self.long_from}


# The paper's bounds (section 4.1): Short < 200, Medium 200-799, Long >= 800.
PAPER_BOUNDS = ClassBounds(200, 800)


def count_tokens(texts: Sequence[str], threads: int = 1) -> np.ndarray:
    """Token counts (int64) of ``texts`` with cl100k_base. ``threads=1`` keeps the shared cores free."""
    import quicktok

    encoding = quicktok.get_encoding(TOKENIZER_NAME)
    if not texts:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(quicktok.count_batch(encoding, list(texts), threads=threads), dtype=np.int64)
