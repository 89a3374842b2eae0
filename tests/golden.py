"""The golden prompts (fixtures/encoder_golden.json) and how close another CPU must come to them.

ONNX Runtime picks its kernels from the CPU's instruction set (AVX2, AVX-512, VNNI, AMX), and the
float operations of the encoder (LayerNorm, softmax, GELU, the scaling of its int8 products) round
differently in each: the same files give slightly different floats on another CPU. What every CPU
must give is checked with these tolerances, and the order of the golden prompts exactly.

Where the numbers come from (``python benchmarks/bench_cpu_drift.py``, docs/operations.md, "What
can differ across CPUs"): the goldens were computed on AVX2 kernels, which ``qemu-x86_64 -cpu
Haswell`` reproduces bit for bit; an AMD EPYC with AVX-512 VNNI gives, at most, 1.03e-3 ln tokens
from the encoder, 8.2e-4 from the kNN, 5.4e-4 on the refined prior and 6.2e-3 on a learner column
(values up to 5.2). The tolerances are about ten times those. The lexical predictor (trees: float
comparisons and a sum in a fixed order) gave identical values under every setting and CPU tried; its
tolerance is float32 rounding only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

GOLDEN: list[dict[str, Any]] = json.loads((Path(__file__).parent / "fixtures" / "encoder_golden.json").read_text())[
    "cases"
]

LOG_TOKENS_ABS = 0.01  # ln tokens (1% of the tokens): the encoder's, the kNN's and the refined prior; measured 1.03e-3
COLUMN_ABS = 0.06  # a learner column's value (components and embedding, up to 5.2 in size); measured 6.2e-3
LEXICAL_ABS = 1e-5  # ln tokens: the lexical predictor's prior; measured 0 everywhere

# The orders checked exactly: the one the queue keys on (refined), and those of its inputs that no
# near-tie blurs. The encoder's own values put two golden prompts only 0.003 ln tokens apart (0.3%
# of the tokens, less than three times the measured drift): that tie may break either way on
# another CPU, so the encoder's values are held to the tolerance, and its order is not promised.
ORDERED = ("lexical_log_tokens", "knn_log_tokens", "refined_log_tokens")


def order(values: list[float]) -> list[int]:
    """The golden prompts' indices from the shortest predicted to the longest."""
    return np.argsort(np.asarray(values), kind="stable").tolist()  # type: ignore[no-any-return]
