"""Prometheus metrics, prefix ``clairvoyant_``, on a registry owned by one app instance.

Labels are low-cardinality by construction: predicted class (3 values), endpoint (the 4 scheduled
paths or "passthrough"), dialect (2), status code, rejection reason (3), disconnect stage (2).
No request ids, users or prompt text ever become labels.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from clairvoyant.predictor import CLASS_NAMES

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

CLASSES = CLASS_NAMES  # one definition (predictor.py; the lead moves it to a bottom-layer module)
# Seconds: from a cached 1-token answer to a 30-minute queue.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
PREDICTOR_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_depth = Gauge(
            "clairvoyant_queue_depth", "Requests waiting in the scheduling queue, by predicted class.",
            ["predicted_class"], registry=r,
        )
        self.in_flight = Gauge("clairvoyant_in_flight_requests", "Scheduled requests holding a backend slot.", registry=r)
        self.requests = Counter(
            "clairvoyant_requests", "Answered requests by endpoint, dialect and HTTP status.",
            ["endpoint", "dialect", "status"], registry=r,
        )
        self.rejections = Counter(
            "clairvoyant_rejections", "Requests refused before queueing, by reason.", ["reason"], registry=r,
        )
        self.starvation_promotions = Counter(
            "clairvoyant_starvation_promotions",
            "Dispatches decided by the starvation timeout against the score order.", registry=r,
        )
        self.queue_wait = Histogram(
            "clairvoyant_queue_wait_seconds", "Time from arrival to dispatch, by predicted class.",
            ["predicted_class"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.end_to_end = Histogram(
            "clairvoyant_end_to_end_seconds", "Time from arrival to the last byte sent, by predicted class.",
            ["predicted_class"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "clairvoyant_time_to_first_byte_seconds",
            "Time from arrival to the first body byte relayed (TTFT for streams), by predicted class.",
            ["predicted_class"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.predictor_latency = Histogram(
            "clairvoyant_predictor_seconds", "Feature extraction plus model scoring time per request.",
            buckets=PREDICTOR_BUCKETS, registry=r,
        )
        self.starvation_timeout = Gauge(
            "clairvoyant_starvation_timeout_seconds", "Current starvation timeout tau (+Inf when disabled).",
            registry=r,
        )
        self.upstream_errors = Counter(
            "clairvoyant_upstream_errors", "Backend failures by kind (unavailable, timeout).", ["kind"], registry=r,
        )
        self.client_disconnects = Counter(
            "clairvoyant_client_disconnects", "Clients that left before their answer ended, by stage.",
            ["stage"], registry=r,
        )
        # Labelled children resolved once: `.labels()` costs ~20 us, and this is the request path.
        # Creating them also exports zeros, so dashboards see every series from the start.
        self.depth_by_class = {cls: self.queue_depth.labels(cls) for cls in CLASSES}
        self.wait_by_class = {cls: self.queue_wait.labels(cls) for cls in CLASSES}
        self.end_to_end_by_class = {cls: self.end_to_end.labels(cls) for cls in CLASSES}
        self.ttft_by_class = {cls: self.ttft.labels(cls) for cls in CLASSES}
        self.rejections_by_reason = {r: self.rejections.labels(r) for r in ("queue_full", "too_large", "bad_request")}
        self.disconnects_by_stage = {s: self.client_disconnects.labels(s) for s in ("queued", "streaming")}
        self.upstream_errors_by_kind = {k: self.upstream_errors.labels(k) for k in ("unavailable", "timeout")}
        self._requests_children: dict[tuple[str, str, str], Counter] = {}

    def count_request(self, endpoint: str, dialect: str, status: str) -> None:
        key = (endpoint, dialect, status)
        child = self._requests_children.get(key)
        if child is None:  # bounded: a handful of endpoints x 2 dialects x status codes
            child = self._requests_children[key] = self.requests.labels(*key)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
