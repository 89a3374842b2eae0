"""Prediction: what a request is read as (dialects, features) and what is predicted of it (the
ONNX predictor in tokens, corrected online by the learner from what the backend really produced).

Imports nothing above it: scheduling, the proxy and the tools build on it.
"""
