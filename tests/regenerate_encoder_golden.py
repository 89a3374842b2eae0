"""Recompute the predictor-dependent fields of fixtures/encoder_golden.json after a retrained
lexical model: each case's ``lexical_log_tokens`` and ``refined_log_tokens``. The encoder's own
fields (``log_tokens``, ``knn_log_tokens``, ``columns``) are left as they are.

Run it on AVX2 kernels, as the goldens were made (tests/golden.py), from the repository's root:

    PYTHONPATH=src qemu-x86_64 -cpu Haswell .venv/bin/python tests/regenerate_encoder_golden.py

(``apt-get install qemu-user``). The lexical values are the same on every CPU; the refined ones
move by up to 5.4e-4 ln tokens on AVX-512 VNNI kernels, well inside their tolerance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from clairvoyant.prediction.encoder import EncoderModel, refined_by
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import OnnxPredictor

GOLDEN_PATH = Path(__file__).parent / "fixtures" / "encoder_golden.json"


def main(out: Path = GOLDEN_PATH) -> None:
    golden = json.loads(GOLDEN_PATH.read_text())
    encoder, predictor = EncoderModel(), OnnxPredictor()
    for case in golden["cases"]:
        lexical = predictor.predict(Prompt(case["text"]))
        case["lexical_log_tokens"] = float(lexical.prior_log_tokens)
        case["refined_log_tokens"] = float(refined_by(encoder, predictor, lexical, case["text"]).prior_log_tokens)
    cases = golden["cases"]
    lines = ["{", ' "what": ' + json.dumps(golden["what"]) + ",", ' "cases": [']
    lines += ["  " + json.dumps(case) + ("," if i < len(cases) - 1 else "") for i, case in enumerate(cases)]
    lines += [" ]", "}"]
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN_PATH)
