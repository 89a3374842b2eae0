"""The golden prompts (fixtures/encoder_golden.json) and how close this machine must come to them.

ONNX Runtime picks its kernels from the CPU (AVX2, AVX-512, VNNI, AMX on x86-64; NEON on arm64),
and the encoder's float work (LayerNorm, softmax, GELU, the scaling of its int8 products) rounds
differently in each: the same files give slightly different floats on another CPU. Each output is
held to a tolerance, and the order of the golden prompts is checked exactly.

Where the numbers come from (``python benchmarks/bench_cpu_drift.py``; docs/operations.md, "What
can differ across CPUs"). The goldens were computed on AVX2 kernels, which ``qemu-x86_64 -cpu
Haswell`` reproduces bit for bit. The largest differences from them, in ln tokens:

- an AMD EPYC with AVX-512 VNNI: encoder 1.03e-3, kNN 8.2e-4, refined prior 5.4e-4, a learner
  column 6.2e-3 (values up to 5.2). The x86-64 tolerances are about ten times those.
- arm64 (``qemu-aarch64``; ``-cpu neoverse-n1``, NEON and dot product, / ``-cpu max``, with SVE2
  and i8mm): encoder 9.9e-3 / 8.7e-3, kNN 7.5e-2 / 0.142, refined 6.2e-3 / 1.7e-2, a column
  3.8e-2 / 2.8e-2. Nearly all of it is on one prompt, whose kNN swaps a neighbour: the kNN is a
  top-16 choice, so a small move of the embedding can change it by a neighbour's share. That
  prompt's kNN order against the next one is not kept. The arm64 tolerances are two to three times
  the larger figure, and the kNN's order is not promised there.

The lexical predictor (trees: float comparisons and a sum in a fixed order) gave identical values
under every setting and CPU tried; its tolerance is float32 rounding only.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GOLDEN: list[dict[str, Any]] = json.loads((Path(__file__).parent / "fixtures" / "encoder_golden.json").read_text())[
    "cases"
]


@dataclass(frozen=True)
class Tolerances:
    encoder: float  # ln tokens (0.01 = 1% of the tokens)
    knn: float  # ln tokens
    refined: float  # ln tokens: the prior the queue is keyed on
    column: float  # a learner column's value (components and embedding, up to 5.2 in size)
    ordered: tuple[str, ...]  # the golden fields whose order is checked exactly
    lexical: float = 1e-5  # ln tokens: measured 0 everywhere


# The orders checked exactly: the one the queue keys on (refined), and those of its inputs that no
# near-tie blurs. The encoder's own values put two golden prompts only 0.003 ln tokens apart (0.3%
# of the tokens, less than three times the x86-64 drift): that tie may break either way on another
# CPU, so the encoder is held to its tolerance and its order is not promised.
X86_64 = Tolerances(
    encoder=0.01, knn=0.01, refined=0.01, column=0.06,
    ordered=("lexical_log_tokens", "knn_log_tokens", "refined_log_tokens"),
)  # fmt: skip
ARM64 = Tolerances(
    encoder=0.03, knn=0.3, refined=0.05, column=0.1, ordered=("lexical_log_tokens", "refined_log_tokens")
)

# Another architecture was never measured: it is held to the widest set.
TOLERANCES = X86_64 if platform.machine().lower() in ("x86_64", "amd64") else ARM64


def order(values: list[float]) -> list[int]:
    """The golden prompts' indices from the shortest predicted to the longest."""
    return np.argsort(np.asarray(values), kind="stable").tolist()  # type: ignore[no-any-return]
