"""Prometheus metrics, prefix ``clairvoyant_``, on a registry owned by one app instance
(prometheus_client's own Counter, Gauge and Histogram), in one group a concern: ``Metrics.queue``,
``.backends``, ``.requests``, ``.tenants``, ``.prediction``, ``.learner``, ``.encoder``, ``.process``.

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
from typing import TYPE_CHECKING, Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily
from prometheus_client.metrics_core import Metric as PromMetric

from clairvoyant.prediction.length_classes import CLASS_NAMES
from clairvoyant.prediction.usage import UsageSource

if TYPE_CHECKING:
    from clairvoyant.prediction.learner import ModelQuality

__all__ = ["CONTENT_TYPE_LATEST", "MAX_MODEL_LABELS", "Children", "Counts", "Families", "MetricSpec", "Metrics"]

# Seconds: from a cached 1-token answer to a 30-minute queue.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
PREDICTOR_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01)
# The encoder per waiting request: ~3 ms idle to ~100 ms on a loaded CPU.
ENCODER_BUCKETS = (1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Output tokens per answer: from a one-word reply to a long essay.
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
    a dict lookup a few dozen nanoseconds. For families whose label values are bounded; values
    given up front are exported at 0 from the start."""

    def __init__(self, family: Counter | Gauge | Histogram, values: Sequence[str] = ()) -> None:
        super().__init__()
        self.family = family
        for value in values:
            self[value]  # noqa: B018 (resolved now: exported at 0)

    def __missing__(self, key: str | tuple[str, ...]) -> Any:
        child = self[key] = self.family.labels(*key) if isinstance(key, tuple) else self.family.labels(key)
        return child


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric family as data."""

    kind: Kind
    name: str
    help: str
    labels: tuple[str, ...] = ()
    values: Sequence[str] = ()  # label values known at start: exported at 0 from the start
    buckets: tuple[float, ...] | None = None  # histograms only

    def build(self, registry: CollectorRegistry) -> Any:
        """The family; a labelled one (but ``Counts``) as its ``Children``."""
        extra: dict[str, Any] = {} if self.buckets is None else {"buckets": self.buckets}
        built: Any = self.kind(self.name, self.help, self.labels, registry=registry, **extra)
        return Children(built, self.values) if self.labels and self.kind is not Counts else built


def family(
    kind: Kind, name: str, *labels: str, help: str, values: Sequence[str] = (), buckets: tuple[float, ...] | None = None
) -> Any:
    """Declare a metric of a group. Typed ``Any``, as ``dataclasses.field`` is, so that the
    attribute keeps its annotated type for the type checker; the group's ``__init__`` builds it."""
    return MetricSpec(kind, name, help, labels, values, buckets)


class Families:
    """A group of families, declared as class attributes (``family``, one a row, its help on the
    next lines) and registered in that order when the group is made."""

    def __init__(self, registry: CollectorRegistry) -> None:
        for attribute, spec in vars(type(self)).items():
            if isinstance(spec, MetricSpec):
                setattr(self, attribute, spec.build(registry))


class QueueMetrics(Families):
    # fmt: off
    depth: Children = family(Gauge, "clairvoyant_queue_depth", "predicted_class", values=CLASS_NAMES,
        help="Requests waiting in the scheduling queue, by predicted class.")
    in_flight: Gauge = family(Gauge, "clairvoyant_in_flight_requests",
        help="Scheduled requests holding a backend slot.")
    starvation_promotions: Counter = family(Counter, "clairvoyant_starvation_promotions",
        help="Dispatches decided by the starvation timeout against the score order.")
    wait: Children = family(Histogram, "clairvoyant_queue_wait_seconds", "predicted_class", values=CLASS_NAMES,
        buckets=LATENCY_BUCKETS, help="Time from arrival to dispatch, by predicted class.")
    starvation_timeout: Gauge = family(Gauge, "clairvoyant_starvation_timeout_seconds",
        help="Current starvation timeout tau (+Inf when disabled).")
    # fmt: on


class BackendMetrics(Families):
    """Per backend of the pool (their names come from the configuration: bounded by it)."""

    # fmt: off
    in_flight: Children = family(Gauge, "clairvoyant_backend_in_flight_requests", "backend",
        help="Scheduled requests holding a slot of this backend.")
    healthy: Children = family(Gauge, "clairvoyant_backend_healthy", "backend",
        help="1 while this backend's last health check or connection succeeded, else 0.")
    slots: Children = family(Gauge, "clairvoyant_backend_slots", "backend", help="Requests this backend runs at once.")
    requests: Children = family(Counter, "clairvoyant_backend_requests", "backend", "outcome",
        help="Requests sent to this backend, scheduled or passed through, by outcome: answered (it sent a status), "
        "refused (connection refused: nothing sent), failed (no status), failed_mid_answer.")
    model_switches: Children = family(Counter, "clairvoyant_model_switches", "backend",
        help="Scheduled requests sent to this backend for a model it did not hold while it held another (it loads the "
        "model first: seconds to minutes on Ollama or llama-swap).")
    errors: Children = family(Counter, "clairvoyant_upstream_errors", "kind", values=("unavailable", "timeout"),
        help="Backend failures by kind (unavailable, timeout).")
    # fmt: on

    def declare(self, backend: str) -> None:
        """Export a configured backend's request counters at 0, one per outcome, so a dashboard's rate()
        and an alert on failures see the series before the first failure."""
        for outcome in ("answered", "refused", "failed", "failed_mid_answer"):
            self.requests[backend, outcome]  # noqa: B018 (resolved now: exported at 0)


class RequestMetrics(Families):
    """The answers clients get, and the requests that never got that far."""

    # fmt: off
    answered: Children = family(Counter, "clairvoyant_requests", "endpoint", "dialect", "status",
        help="Answered requests by endpoint, dialect and HTTP status.")
    rejections: Children = family(Counter, "clairvoyant_rejections", "reason",
        values=("queue_full", "too_large", "bad_request"), help="Requests refused before queueing, by reason.")
    end_to_end: Children = family(Histogram, "clairvoyant_end_to_end_seconds", "predicted_class", values=CLASS_NAMES,
        buckets=LATENCY_BUCKETS, help="Time from arrival to the last byte sent, by predicted class.")
    ttft: Children = family(Histogram, "clairvoyant_time_to_first_byte_seconds", "predicted_class",
        values=CLASS_NAMES, buckets=LATENCY_BUCKETS,
        help="Time from arrival to the first body byte relayed (TTFT for streams), by predicted class.")
    client_rejections: Children = family(Counter, "clairvoyant_client_rejections", "reason",
        values=("client_timeout", "body_budget"),
        help="Requests cut off by a client limit: client_timeout (a body not whole in time), body_budget (no room for "
        "its body).")
    disconnects: Children = family(Counter, "clairvoyant_client_disconnects", "stage",
        values=("upload", "queued", "streaming"), help="Clients that left before their answer ended, by stage.")
    status: Counts = family(Counts, "clairvoyant_request_status_changes", "status",
        help="Requests' changes of status, by the status entered: a scheduled request enters waiting, dispatched, "
        "streaming (holding) and one way it ends (completed, refused, expired, client_left_queued, ...); a "
        "pass-through request enters dispatched, streaming and its ending.")
    # fmt: on


class TenantMetrics(Families):
    """Per tenant, under ``label``'s bounded values."""

    # fmt: off
    requests: Children = family(Counter, "clairvoyant_tenant_requests", "tenant",
        help="Scheduled requests admitted past the tenant's limits, by tenant.")
    tokens: Children = family(Counter, "clairvoyant_tenant_output_tokens", "tenant",
        help="Completion tokens the backend reported for the tenant's answers (what tokens_per_day counts), by tenant.")
    wait: Children = family(Histogram, "clairvoyant_tenant_queue_wait_seconds", "tenant", buckets=LATENCY_BUCKETS,
        help="Time from arrival to dispatch, by tenant.")
    refusals: Children = family(Counter, "clairvoyant_tenant_refusals", "tenant", "limit",
        help="Scheduled requests refused with 429 for a tenant's limit, by tenant and limit (max_concurrent, "
        "requests_per_minute, tokens_per_day).")
    # fmt: on

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.known: frozenset[str] = frozenset()  # the configured tenants

    def label(self, name: str) -> str:
        """A tenant's label: its name when configured, else "other" ("none" for no tenant)."""
        if name in self.known:
            return name
        return "none" if not name else "other"


class PredictionMetrics(Families):
    """The predictor's cost, and the closed loop: what the backend really produced, and how well it
    was predicted."""

    # fmt: off
    latency: Histogram = family(Histogram, "clairvoyant_predictor_seconds", buckets=PREDICTOR_BUCKETS,
        help="Feature extraction plus model scoring time per request.")
    usage: Children = family(Counter, "clairvoyant_usage_observations", "source", values=get_args(UsageSource),
        help="Completed scheduled requests by where their output length came from (openai_usage, llamacpp_timings, "
        "llamacpp_tokens_predicted, ollama_eval_count, stream_events, none).")
    observed_tokens: Histogram = family(Histogram, "clairvoyant_observed_output_tokens", buckets=TOKEN_BUCKETS,
        help="Output tokens per completed scheduled request, as the backend reported (or the stream counted) them.")
    kendall_tau: Children = family(Gauge, "clairvoyant_prediction_kendall_tau", "model",
        help="Rolling Kendall tau_b between predicted and observed output tokens (each prediction as made, before "
        "learning its request), by model (the online learner's key: the model the request named).")
    log_error: Children = family(Gauge, "clairvoyant_prediction_abs_log_token_error", "model",
        help="Rolling mean |ln(predicted tokens) - ln(observed tokens)|, by model.")
    window: Children = family(Gauge, "clairvoyant_prediction_quality_window_requests", "model",
        help="Observed requests in the rolling prediction-quality window, by model.")
    # fmt: on

    def count_usage(self, source: str, output_tokens: int | None) -> None:
        """One completed scheduled request's usage record (see ``clairvoyant.prediction.usage``)."""
        self.usage[source].inc()
        if output_tokens is not None:
            self.observed_tokens.observe(output_tokens)

    def set_quality(self, quality: Mapping[str, ModelQuality]) -> None:
        """Publish the online learner's rolling prediction quality, one series per model key
        (NaN while undefined). Keys past ``MAX_MODEL_LABELS`` are not published."""
        for model, q in quality.items():
            if model not in self.window and len(self.window) >= MAX_MODEL_LABELS:
                continue
            self.kendall_tau[model].set(q.kendall_tau_b)
            self.log_error[model].set(q.mean_abs_log_error)
            self.window[model].set(q.observations)


class LearnerMetrics(Families):
    """The online learner's process (clairvoyant.prediction.learner_process), as last seen at a scrape."""

    # fmt: off
    up: Gauge = family(Gauge, "clairvoyant_learner_up",
        help="1 while the online learner's process runs; 0 if it could not start, or died and is not yet running "
        "again (its last fit keeps correcting predictions meanwhile).")
    refits: Counter = family(Counter, "clairvoyant_learner_refits",
        help="Fits the online learner's process has sent since the proxy started.")
    dropped: Counter = family(Counter, "clairvoyant_learner_dropped_observations",
        help="Completed requests the online learner never received: its process was not running, or was backed up.")
    sampled_out: Counter = family(Counter, "clairvoyant_learner_sampled_out_observations",
        help="Completed requests the online learner skipped because they came faster than "
        "learner_max_observations_per_s (counted in the usage metrics all the same).")
    # fmt: on

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self._totals = (0, 0)  # refits and dropped observations published so far

    def publish(self, running: bool, refits: int, dropped: int) -> None:
        """The process's state (its totals, read at a scrape)."""
        self.up.set(1.0 if running else 0.0)
        published_refits, published_dropped = self._totals
        self.refits.inc(max(0, refits - published_refits))
        self.dropped.inc(max(0, dropped - published_dropped))
        self._totals = (max(refits, published_refits), max(dropped, published_dropped))


class EncoderMetrics(Families):
    """Updated from the encoder's thread too (prometheus_client's metrics are thread-safe)."""

    # fmt: off
    latency: Histogram = family(Histogram, "clairvoyant_encoder_seconds", buckets=ENCODER_BUCKETS,
        help="The encoder's time per waiting request it refines (on its own thread, never the event loop).")
    requests: Children = family(Counter, "clairvoyant_encoder_requests", "outcome",
        help="Requests handed to the encoder, by outcome. Waiting requests: refined (re-keyed in the queue), late "
        "(dispatched before its result), skipped (dispatched before its turn), bypassed (not handed over: the queue "
        "has been turning over faster than the encoder answers; one a second still is), dropped (the encoder's queue "
        "was full), failed. Completed requests encoded for the online learner: learning, or learning_dropped (over "
        "its share of the encoder's time; the learner counts the request for its quality figures only).")
    # fmt: on


class ProcessMetrics(Families):
    """What a long-lived process holds, read at each scrape: a figure that only grows is a leak."""

    # fmt: off
    event_loop_tasks: Gauge = family(Gauge, "clairvoyant_event_loop_tasks",
        help="Tasks alive on the proxy's event loop (requests, loops, checks).")
    retained: Children = family(Gauge, "clairvoyant_retained_entries", "structure",
        help="Entries the proxy's structures hold, by structure (queues, fair-share tenants, model groups, history "
        "rings, tenants' limit windows, the learner's pending observations); each is bounded by the requests in "
        "the system or by a fixed size.")
    # fmt: on

    def publish(self, tasks: int, retained: Mapping[str, int]) -> None:
        """The event loop's task count and the structures' sizes (names fixed in the code: bounded).
        A structure not reported now (its parts are gone: no tenant, no model group) is 0."""
        self.event_loop_tasks.set(tasks)
        for structure, gauge in self.retained.items():
            gauge.set(retained.get(structure, 0))
        for structure in retained.keys() - self.retained.keys():
            self.retained[structure].set(retained[structure])


class Metrics:
    """The proxy's metrics, a group a concern; ``render()`` is the exposition."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.replica: str | None = None  # with replicas: this one's name, a label on every series
        self.queue = QueueMetrics(self.registry)
        self.backends = BackendMetrics(self.registry)
        self.requests = RequestMetrics(self.registry)
        self.tenants = TenantMetrics(self.registry)
        self.prediction = PredictionMetrics(self.registry)
        self.learner = LearnerMetrics(self.registry)
        self.encoder = EncoderMetrics(self.registry)
        self.process = ProcessMetrics(self.registry)

    def render(self) -> bytes:
        """The exposition text; with replicas, every series carries this replica's ``replica`` label."""
        return generate_latest(self.registry if self.replica is None else self)

    def collect(self) -> Iterator[PromMetric]:
        """The registry's families, each sample with the ``replica`` label added (at scrape time: the
        request path's labelled children stay as they are)."""
        replica = {"replica": self.replica} if self.replica else {}
        for family in self.registry.collect():
            family.samples = [s._replace(labels={**s.labels, **replica}) for s in family.samples]
            yield family
