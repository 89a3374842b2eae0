"""Prometheus metrics, prefix ``clairvoyant_``, on a registry owned by one app instance
(prometheus_client's own Counter, Gauge and Histogram).

Labels are low-cardinality by construction: predicted class (3 values), endpoint (the 4 scheduled
paths or "passthrough"), dialect (2), status code, rejection reason (3), disconnect stage (3),
usage source (6), and the online learner's model keys (the model a request named: the first 16
names, then "other", and "default" for none; ``MAX_MODEL_LABELS`` bounds them here too).
Backend names come from the configuration. No request ids, users or prompt text ever become labels.
Series known at start (the classes, reasons, outcomes) are exported at 0 from the start, so
dashboards and alerts see them before the first event.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args, get_type_hints

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily
from prometheus_client.metrics_core import Metric as PromMetric

from clairvoyant.prediction.length_classes import CLASS_NAMES
from clairvoyant.prediction.usage import UsageSource

if TYPE_CHECKING:
    from clairvoyant.prediction.learner import ModelQuality

__all__ = ["CONTENT_TYPE_LATEST", "MAX_MODEL_LABELS", "Counts", "MetricSpec", "Metrics", "metric_specs"]

CLASSES = CLASS_NAMES  # one definition, in length_classes
# Seconds: from a cached 1-token answer to a 30-minute queue.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
PREDICTOR_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01)
# The encoder per waiting request: ~3 ms idle to ~100 ms on a loaded CPU.
ENCODER_BUCKETS = (1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Output tokens per answer: from a one-word reply to a long essay.
# The label values a family can take that are known before any event: exported at 0 from the start.
BACKEND_OUTCOMES = ("answered", "refused", "failed", "failed_mid_answer")
CLIENT_REJECTION_REASONS = ("client_timeout", "body_budget")
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 200, 256, 400, 600, 800, 1024, 1600, 2048, 4096, 8192)
# Model labels published, at most (the learner bounds its keys already: this is a second fence).
MAX_MODEL_LABELS = 32


class Counts:
    """A counter family with one label whose values are fixed (``declare``) and counted as plain
    integers, by the value's index: ``counts[i] += 1`` on the request path, where a prometheus
    ``Counter`` child's ``inc`` takes a lock and three calls. Read at each scrape (a collector)."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...], registry: CollectorRegistry) -> None:
        if len(labels) != 1:
            raise ValueError(f"{name}: Counts has one label")
        self._labelnames = labels
        self._name = name
        self._documentation = documentation
        self._values: tuple[str, ...] = ()
        self._created_s = time.time()
        self.counts: list[int] = []  # by the index of its value in ``declare``'s
        registry.register(self)

    def declare(self, values: Sequence[str]) -> list[int]:
        """Fix the label's values (exported at 0 from now on); the list to count in, by index."""
        if not self._values:
            self._values = tuple(values)
            self.counts = [0] * len(values)
        elif tuple(values) != self._values:
            raise ValueError(f"{self._name}: declared with other values before")
        return self.counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for value, count in zip(self._values, self.counts, strict=True):
            family.add_metric((value,), count, created=self._created_s)
        yield family


Kind = type[Counter] | type[Gauge] | type[Histogram] | type[Counts]


class Children(dict[Any, Any]):
    """A family's labelled children by their label values (a str, or a tuple for several labels),
    each resolved by ``labels()`` once: ``labels()`` takes microseconds (a lock, a tuple, checks),
    a dict lookup a few dozen nanoseconds. For families whose label values are bounded."""

    def __init__(self, family: Counter | Gauge | Histogram) -> None:
        super().__init__()
        self.family = family

    def __missing__(self, key: str | tuple[str, ...]) -> Any:
        child = self[key] = self.family.labels(*key) if isinstance(key, tuple) else self.family.labels(key)
        return child


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric family as data. Its kind (Counter, Gauge, Histogram) is the type its attribute
    is annotated with in ``Metrics``."""

    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only

    def build(self, kind: Kind, registry: CollectorRegistry) -> Counter | Gauge | Histogram | Counts:
        if kind is Counts:
            return Counts(self.name, self.help, self.labels, registry)
        if kind is Histogram:
            assert self.buckets is not None, f"{self.name}: a histogram needs buckets"
            return Histogram(self.name, self.help, self.labels, registry=registry, buckets=self.buckets)
        return kind(self.name, self.help, self.labels, registry=registry)


def family(name: str, *labels: str, help: str, buckets: tuple[float, ...] | None = None) -> Any:
    """Declare a metric of ``Metrics``. Typed ``Any``, as ``dataclasses.field`` is, so that the
    attribute keeps its metric type for the type checker; ``Metrics()`` builds the real metric."""
    return MetricSpec(name, help, labels, buckets)


class Metrics:
    """The proxy's metrics. Attributes are the metrics (``labels()``) and the children the request
    path updates (``inc``/``dec``/``set``/``observe``); ``render()`` is the exposition. The families
    are declared below as data (``family``), one a row (its help on the next lines), and registered in
    that order by ``__init__``."""

    # fmt: off
    queue_depth: Gauge = family("clairvoyant_queue_depth", "predicted_class",
        help="Requests waiting in the scheduling queue, by predicted class.")
    in_flight: Gauge = family("clairvoyant_in_flight_requests", help="Scheduled requests holding a backend slot.")
    # Per backend of the pool (their names come from the configuration: bounded by it).
    backend_in_flight: Gauge = family("clairvoyant_backend_in_flight_requests", "backend",
        help="Scheduled requests holding a slot of this backend.")
    backend_healthy: Gauge = family("clairvoyant_backend_healthy", "backend",
        help="1 while this backend's last health check or connection succeeded, else 0.")
    backend_slots: Gauge = family("clairvoyant_backend_slots", "backend", help="Requests this backend runs at once.")
    backend_requests: Counter = family("clairvoyant_backend_requests", "backend", "outcome",
        help="Requests sent to this backend, scheduled or passed through, by outcome: answered (it sent a status), "
        "refused (connection refused: nothing sent), failed (no status), failed_mid_answer.")
    model_switches: Counter = family("clairvoyant_model_switches", "backend",
        help="Scheduled requests sent to this backend for a model it did not hold while it held another (it loads the "
        "model first: seconds to minutes on Ollama or llama-swap).")
    requests: Counter = family("clairvoyant_requests", "endpoint", "dialect", "status",
        help="Answered requests by endpoint, dialect and HTTP status.")
    rejections: Counter = family("clairvoyant_rejections", "reason",
        help="Requests refused before queueing, by reason.")
    starvation_promotions: Counter = family("clairvoyant_starvation_promotions",
        help="Dispatches decided by the starvation timeout against the score order.")
    queue_wait: Histogram = family("clairvoyant_queue_wait_seconds", "predicted_class", buckets=LATENCY_BUCKETS,
        help="Time from arrival to dispatch, by predicted class.")
    end_to_end: Histogram = family("clairvoyant_end_to_end_seconds", "predicted_class", buckets=LATENCY_BUCKETS,
        help="Time from arrival to the last byte sent, by predicted class.")
    ttft: Histogram = family("clairvoyant_time_to_first_byte_seconds", "predicted_class", buckets=LATENCY_BUCKETS,
        help="Time from arrival to the first body byte relayed (TTFT for streams), by predicted class.")
    predictor_latency: Histogram = family("clairvoyant_predictor_seconds", buckets=PREDICTOR_BUCKETS,
        help="Feature extraction plus model scoring time per request.")
    starvation_timeout: Gauge = family("clairvoyant_starvation_timeout_seconds",
        help="Current starvation timeout tau (+Inf when disabled).")
    upstream_errors: Counter = family("clairvoyant_upstream_errors", "kind",
        help="Backend failures by kind (unavailable, timeout).")
    client_rejections: Counter = family("clairvoyant_client_rejections", "reason",
        help="Requests cut off by a client limit: client_timeout (a body not whole in time), body_budget (no room for "
        "its body).")
    client_disconnects: Counter = family("clairvoyant_client_disconnects", "stage",
        help="Clients that left before their answer ended, by stage.")
    request_status: Counts = family("clairvoyant_request_status_changes", "status",
        help="Requests' changes of status, by the status entered: a scheduled request enters waiting, dispatched, "
        "streaming (holding) and one way it ends (completed, refused, expired, client_left_queued, ...); a "
        "pass-through request enters dispatched, streaming and its ending.")
    # Per tenant (configured tenants by name; any other "other", none "none": bounded).
    tenant_requests: Counter = family("clairvoyant_tenant_requests", "tenant",
        help="Scheduled requests admitted past the tenant's limits, by tenant.")
    tenant_tokens: Counter = family("clairvoyant_tenant_output_tokens", "tenant",
        help="Completion tokens the backend reported for the tenant's answers (what tokens_per_day counts), by tenant.")
    tenant_wait: Histogram = family("clairvoyant_tenant_queue_wait_seconds", "tenant", buckets=LATENCY_BUCKETS,
        help="Time from arrival to dispatch, by tenant.")
    tenant_refusals: Counter = family("clairvoyant_tenant_refusals", "tenant", "limit",
        help="Scheduled requests refused with 429 for a tenant's limit, by tenant and limit (max_concurrent, "
        "requests_per_minute, tokens_per_day).")
    # Closed loop: what the backend really produced, and how well it was predicted.
    usage_observations: Counter = family("clairvoyant_usage_observations", "source",
        help="Completed scheduled requests by where their output length came from (openai_usage, llamacpp_timings, "
        "llamacpp_tokens_predicted, ollama_eval_count, stream_events, none).")
    observed_output_tokens: Histogram = family("clairvoyant_observed_output_tokens", buckets=TOKEN_BUCKETS,
        help="Output tokens per completed scheduled request, as the backend reported (or the stream counted) them.")
    prediction_kendall_tau: Gauge = family("clairvoyant_prediction_kendall_tau", "model",
        help="Rolling Kendall tau_b between predicted and observed output tokens (each prediction as made, before "
        "learning its request), by model (the online learner's key: the model the request named).")
    prediction_log_error: Gauge = family("clairvoyant_prediction_abs_log_token_error", "model",
        help="Rolling mean |ln(predicted tokens) - ln(observed tokens)|, by model.")
    prediction_window: Gauge = family("clairvoyant_prediction_quality_window_requests", "model",
        help="Observed requests in the rolling prediction-quality window, by model.")
    # The online learner's process (clairvoyant.prediction.learner_process), as last seen at a scrape
    learner_up: Gauge = family("clairvoyant_learner_up",
        help="1 while the online learner's process runs; 0 if it could not start, or died and is not yet running "
        "again (its last fit keeps correcting predictions meanwhile).")
    learner_refits: Counter = family("clairvoyant_learner_refits",
        help="Fits the online learner's process has sent since the proxy started.")
    learner_dropped: Counter = family("clairvoyant_learner_dropped_observations",
        help="Completed requests the online learner never received: its process was not running, or was backed up.")
    learner_sampled_out: Counter = family("clairvoyant_learner_sampled_out_observations",
        help="Completed requests the online learner skipped because they came faster than "
        "learner_max_observations_per_s (counted in the usage metrics all the same).")
    # Updated from the encoder's thread too (prometheus_client's metrics are thread-safe).
    encoder_latency: Histogram = family("clairvoyant_encoder_seconds", buckets=ENCODER_BUCKETS,
        help="The encoder's time per waiting request it refines (on its own thread, never the event loop).")
    encoder_requests: Counter = family("clairvoyant_encoder_requests", "outcome",
        help="Requests handed to the encoder, by outcome. Waiting requests: refined (re-keyed in the queue), late "
        "(dispatched before its result), skipped (dispatched before its turn), bypassed (not handed over: the queue "
        "has been turning over faster than the encoder answers; one a second still is), dropped (the encoder's queue "
        "was full), failed. Completed requests encoded for the online learner: learning, or learning_dropped (over "
        "its share of the encoder's time; the learner counts the request for its quality figures only).")
    # What a long-lived process holds, read at each scrape: a figure that only grows is a leak.
    event_loop_tasks: Gauge = family("clairvoyant_event_loop_tasks",
        help="Tasks alive on the proxy's event loop (requests, loops, checks).")
    retained_entries: Gauge = family("clairvoyant_retained_entries", "structure",
        help="Entries the proxy's structures hold, by structure (queues, fair-share tenants, model groups, history "
        "rings, tenants' limit windows, the learner's pending observations); each is bounded by the requests in "
        "the system or by a fixed size.")
    # fmt: on

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.replica: str | None = None  # with replicas: this one's name, a label on every series
        for attribute, kind, spec in metric_specs():
            setattr(self, attribute, spec.build(kind, self.registry))
        # Labelled children resolved once: `.labels()` costs ~20 us, and this is the request path.
        # Creating them also exports zeros, so dashboards see every series from the start.
        self.depth_by_class = {cls: self.queue_depth.labels(cls) for cls in CLASSES}
        self.wait_by_class = {cls: self.queue_wait.labels(cls) for cls in CLASSES}
        self.end_to_end_by_class = {cls: self.end_to_end.labels(cls) for cls in CLASSES}
        self.ttft_by_class = {cls: self.ttft.labels(cls) for cls in CLASSES}
        self.rejections_by_reason = {r: self.rejections.labels(r) for r in ("queue_full", "too_large", "bad_request")}
        self.disconnects_by_stage = {s: self.client_disconnects.labels(s) for s in ("upload", "queued", "streaming")}
        self.upstream_errors_by_kind = {k: self.upstream_errors.labels(k) for k in ("unavailable", "timeout")}
        for reason in CLIENT_REJECTION_REASONS:
            self.client_rejections.labels(reason)
        self.known_tenants: frozenset[str] = frozenset()
        self.usage_by_source = {s: self.usage_observations.labels(s) for s in get_args(UsageSource)}
        # Per request, under bounded labels (see ``tenant``, ``count_request``, ``count_backend_request``)
        self.tenant_requests_by = Children(self.tenant_requests)
        self.tenant_wait_by = Children(self.tenant_wait)
        self.tenant_tokens_by = Children(self.tenant_tokens)
        self._requests_by = Children(self.requests)
        self._backend_requests_by = Children(self.backend_requests)
        self._quality_gauges: dict[str, tuple[Any, Any, Any]] = {}  # model key -> its 3 gauges
        self._retained_published: set[str] = set()  # structures given a retained_entries series
        self._learner_totals = (0, 0)  # refits and dropped observations published so far

    def tenant(self, name: str) -> str:
        """A tenant's label: its name when configured, else "other" ("none" for no tenant)."""
        if name in self.known_tenants:
            return name
        return "none" if not name else "other"

    def count_request(self, endpoint: str, dialect: str, status: str) -> None:
        self._requests_by[endpoint, dialect, status].inc()  # bounded: 5 endpoints x 2 dialects x statuses

    def declare_backend(self, backend: str) -> None:
        """Export a configured backend's request counters at 0, one per outcome, so a dashboard's rate()
        and an alert on failures see the series before the first failure."""
        for outcome in BACKEND_OUTCOMES:
            self.backend_requests.labels(backend, outcome)

    def count_backend_request(self, backend: str, outcome: str) -> None:
        self._backend_requests_by[backend, outcome].inc()  # bounded: the configured backends x 4 outcomes

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

    def set_learner(self, running: bool, refits: int, dropped: int) -> None:
        """Publish the online learner's process state (its totals, read at a scrape)."""
        self.learner_up.set(1.0 if running else 0.0)
        published_refits, published_dropped = self._learner_totals
        self.learner_refits.inc(max(0, refits - published_refits))
        self.learner_dropped.inc(max(0, dropped - published_dropped))
        self._learner_totals = (max(refits, published_refits), max(dropped, published_dropped))

    def set_retained(self, tasks: int, retained: Mapping[str, int]) -> None:
        """Publish the event loop's task count and the structures' sizes (names fixed in the code:
        bounded). A structure not reported now (its parts are gone: no tenant, no model group) is 0."""
        self.event_loop_tasks.set(tasks)
        for structure in self._retained_published - retained.keys():
            self.retained_entries.labels(structure).set(0)
        for structure, entries in retained.items():
            self.retained_entries.labels(structure).set(entries)
        self._retained_published |= retained.keys()

    def render(self) -> bytes:
        """The exposition text; with replicas, every series carries this replica's ``replica`` label."""
        if self.replica is None:
            return generate_latest(self.registry)
        return generate_latest(_WithReplica(self.registry, self.replica))


class _WithReplica:
    """A registry's families, each sample with a ``replica`` label added (at scrape time: the
    request path's labelled children stay as they are)."""

    def __init__(self, registry: CollectorRegistry, replica: str) -> None:
        self.registry = registry
        self.replica = replica

    def collect(self) -> Iterator[PromMetric]:
        for family in self.registry.collect():
            family.samples = [s._replace(labels={**s.labels, "replica": self.replica}) for s in family.samples]
            yield family


def metric_specs() -> list[tuple[str, Kind, MetricSpec]]:
    """Every family ``Metrics`` declares, in order: (attribute, kind, spec)."""
    kinds = get_type_hints(Metrics)  # the families' annotations, as classes
    return [(name, kinds[name], spec) for name, spec in vars(Metrics).items() if isinstance(spec, MetricSpec)]
