"""The one definition of the answer-length classes: names and token bounds.

Short < ``SHORT_BELOW_TOKENS`` <= Medium < ``LONG_FROM_TOKENS`` <= Long, in output tokens. This
module sits at the bottom of the import graph (it imports nothing from the package), so the
predictor, the metrics, the simulator and the benchmarks can all share it.
"""

from __future__ import annotations

__all__ = ["CLASS_NAMES", "LONG_FROM_TOKENS", "SHORT_BELOW_TOKENS", "class_of_tokens"]

CLASS_NAMES: tuple[str, str, str] = ("short", "medium", "long")
SHORT_BELOW_TOKENS = 200
LONG_FROM_TOKENS = 600


def class_of_tokens(tokens: float) -> str:
    """The class name of an answer of ``tokens`` output tokens."""
    return CLASS_NAMES[0 if tokens < SHORT_BELOW_TOKENS else 1 if tokens < LONG_FROM_TOKENS else 2]
