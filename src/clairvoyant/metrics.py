"""Prometheus metrics, prefix ``clairvoyant_``, on a registry owned by one app instance.

Labels are low-cardinality by construction: predicted class (3 values), endpoint (the 4 scheduled
paths or "passthrough"), dialect (2), status code, rejection reason (3), disconnect stage (2),
usage source (6), and the online learner's model keys (the model a request named: the first 16
names, then "other", and "default" for none; ``MAX_MODEL_LABELS`` bounds them here too).
Backend names come from the configuration. No request ids, users or prompt text ever become labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from clairvoyant.prediction.length_classes import CLASS_NAMES
from clairvoyant.prediction.usage import UsageSource

if TYPE_CHECKING:
    from clairvoyant.prediction.learner import ModelQuality

__all__ = ["CONTENT_TYPE_LATEST", "MAX_MODEL_LABELS", "Metrics"]

CLASSES = CLASS_NAMES  # one definition, in length_classes
# Seconds: from a cached 1-token answer to a 30-minute queue.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
PREDICTOR_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01)
# The encoder per waiting request: ~3 ms idle to ~100 ms on a loaded CPU.
ENCODER_BUCKETS = (1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Output tokens per answer: from a one-word reply to a long essay.
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 200, 256, 400, 600, 800, 1024, 1600, 2048, 4096, 8192)
# Model labels published, at most (the learner bounds its keys already: this is a second fence).
MAX_MODEL_LABELS = 32


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_depth = Gauge(
            "clairvoyant_queue_depth",
            "Requests waiting in the scheduling queue, by predicted class.",
            ["predicted_class"],
            registry=r,
        )
        self.in_flight = Gauge(
            "clairvoyant_in_flight_requests", "Scheduled requests holding a backend slot.", registry=r
        )
        # Per backend of the pool (their names come from the configuration: bounded by it).
        self.backend_in_flight = Gauge(
            "clairvoyant_backend_in_flight_requests",
            "Scheduled requests holding a slot of this backend.",
            ["backend"],
            registry=r,
        )
        self.backend_healthy = Gauge(
            "clairvoyant_backend_healthy",
            "1 while this backend's last health check or connection succeeded, else 0.",
            ["backend"],
            registry=r,
        )
        self.backend_slots = Gauge(
            "clairvoyant_backend_slots", "Requests this backend runs at once.", ["backend"], registry=r
        )
        self.backend_requests = Counter(
            "clairvoyant_backend_requests",
            "Requests sent to this backend, scheduled or passed through, by outcome: answered (it sent a status), "
            "refused (connection refused: nothing sent), failed (no status), failed_mid_answer.",
            ["backend", "outcome"],
            registry=r,
        )
        self._backend_outcomes: dict[tuple[str, str], Counter] = {}
        self.requests = Counter(
            "clairvoyant_requests",
            "Answered requests by endpoint, dialect and HTTP status.",
            ["endpoint", "dialect", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "clairvoyant_rejections",
            "Requests refused before queueing, by reason.",
            ["reason"],
            registry=r,
        )
        self.starvation_promotions = Counter(
            "clairvoyant_starvation_promotions",
            "Dispatches decided by the starvation timeout against the score order.",
            registry=r,
        )
        self.queue_wait = Histogram(
            "clairvoyant_queue_wait_seconds",
            "Time from arrival to dispatch, by predicted class.",
            ["predicted_class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.end_to_end = Histogram(
            "clairvoyant_end_to_end_seconds",
            "Time from arrival to the last byte sent, by predicted class.",
            ["predicted_class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "clairvoyant_time_to_first_byte_seconds",
            "Time from arrival to the first body byte relayed (TTFT for streams), by predicted class.",
            ["predicted_class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.predictor_latency = Histogram(
            "clairvoyant_predictor_seconds",
            "Feature extraction plus model scoring time per request.",
            buckets=PREDICTOR_BUCKETS,
            registry=r,
        )
        self.starvation_timeout = Gauge(
            "clairvoyant_starvation_timeout_seconds",
            "Current starvation timeout tau (+Inf when disabled).",
            registry=r,
        )
        self.upstream_errors = Counter(
            "clairvoyant_upstream_errors",
            "Backend failures by kind (unavailable, timeout).",
            ["kind"],
            registry=r,
        )
        self.client_rejections = Counter(
            "clairvoyant_client_rejections",
            "Client connections cut off by a limit (client_timeout, header_too_large, max_connections).",
            ["reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "clairvoyant_client_disconnects",
            "Clients that left before their answer ended, by stage.",
            ["stage"],
            registry=r,
        )
        # Labelled children resolved once: `.labels()` costs ~20 us, and this is the request path.
        # Creating them also exports zeros, so dashboards see every series from the start.
        self.depth_by_class = {cls: self.queue_depth.labels(cls) for cls in CLASSES}
        self.wait_by_class = {cls: self.queue_wait.labels(cls) for cls in CLASSES}
        self.end_to_end_by_class = {cls: self.end_to_end.labels(cls) for cls in CLASSES}
        self.ttft_by_class = {cls: self.ttft.labels(cls) for cls in CLASSES}
        self.rejections_by_reason = {r: self.rejections.labels(r) for r in ("queue_full", "too_large", "bad_request")}
        self.disconnects_by_stage = {s: self.client_disconnects.labels(s) for s in ("upload", "queued", "streaming")}
        self.upstream_errors_by_kind = {k: self.upstream_errors.labels(k) for k in ("unavailable", "timeout")}
        self._requests_children: dict[tuple[str, str, str], Counter] = {}

        # Closed loop: what the backend really produced, and how well it was predicted.
        self.usage_observations = Counter(
            "clairvoyant_usage_observations",
            "Completed scheduled requests by where their output length came from "
            "(openai_usage, llamacpp_timings, llamacpp_tokens_predicted, ollama_eval_count, stream_events, none).",
            ["source"],
            registry=r,
        )
        self.observed_output_tokens = Histogram(
            "clairvoyant_observed_output_tokens",
            "Output tokens per completed scheduled request, as the backend reported (or the stream counted) them.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.prediction_kendall_tau = Gauge(
            "clairvoyant_prediction_kendall_tau",
            "Rolling Kendall tau_b between predicted and observed output tokens (each prediction as made, "
            "before learning its request), by model (the online learner's key: the model the request named).",
            ["model"],
            registry=r,
        )
        self.prediction_log_error = Gauge(
            "clairvoyant_prediction_abs_log_token_error",
            "Rolling mean |ln(predicted tokens) - ln(observed tokens)|, by model.",
            ["model"],
            registry=r,
        )
        self.prediction_window = Gauge(
            "clairvoyant_prediction_quality_window_requests",
            "Observed requests in the rolling prediction-quality window, by model.",
            ["model"],
            registry=r,
        )
        self.encoder_latency = Histogram(
            "clairvoyant_encoder_seconds",
            "The encoder's time per waiting request it refines (on its own thread, never the event loop).",
            buckets=ENCODER_BUCKETS,
            registry=r,
        )
        self.encoder_requests = Counter(
            "clairvoyant_encoder_requests",
            "Requests handed to the encoder, by outcome. Waiting requests: refined (re-keyed in the queue), late "
            "(dispatched before its result), skipped (dispatched before its turn), dropped (the encoder's queue was "
            "full), failed. Completed requests encoded for the online learner: learning, or learning_dropped (over "
            "its share of the encoder's time; the learner counts the request for its quality figures only).",
            ["outcome"],
            registry=r,
        )
        self.usage_by_source = {s: self.usage_observations.labels(s) for s in get_args(UsageSource)}
        self._quality_gauges: dict[str, tuple[Gauge, Gauge, Gauge]] = {}  # model key -> its three gauges

    def count_request(self, endpoint: str, dialect: str, status: str) -> None:
        key = (endpoint, dialect, status)
        child = self._requests_children.get(key)
        if child is None:  # bounded: a handful of endpoints x 2 dialects x status codes
            child = self._requests_children[key] = self.requests.labels(*key)
        child.inc()

    def count_backend_request(self, backend: str, outcome: str) -> None:
        key = (backend, outcome)
        child = self._backend_outcomes.get(key)
        if child is None:  # bounded: the configured backends x 4 outcomes
            child = self._backend_outcomes[key] = self.backend_requests.labels(*key)
        child.inc()

    def count_usage(self, source: str, output_tokens: int | None) -> None:
        """One completed scheduled request's usage record (see ``clairvoyant.prediction.usage``)."""
        self.usage_by_source[source].inc()
        if output_tokens is not None:
            self.observed_output_tokens.observe(output_tokens)

    def set_prediction_quality(self, quality: Mapping[str, ModelQuality]) -> None:
        """Publish the online learner's rolling prediction quality, one series per model key
        (NaN while undefined). Keys past ``MAX_MODEL_LABELS`` are not published."""
        for model, q in quality.items():
            if model not in self._quality_gauges:
                if len(self._quality_gauges) >= MAX_MODEL_LABELS:
                    continue
                self._quality_gauges[model] = (
                    self.prediction_kendall_tau.labels(model),
                    self.prediction_log_error.labels(model),
                    self.prediction_window.labels(model),
                )
            tau, error, window = self._quality_gauges[model]
            tau.set(q.kendall_tau_b)
            error.set(q.mean_abs_log_error)
            window.set(q.observations)

    def render(self) -> bytes:
        return generate_latest(self.registry)
