"""metrics.py records in plain Python and exports what prometheus_client's own metrics would.

Two checks: the proxy's traffic driven through ``Metrics`` renders the same text, byte for byte (the
``_created`` timestamps aside), as main at 40b1676 did with prometheus_client's Counter, Gauge and
Histogram (tests/fixtures/metrics_40b1676.txt, written by ``drive`` on that commit); and random
updates of every family, labelled or not, parse to the same samples as a prometheus_client
metric declared alike and given the same updates.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clairvoyant.clock import ManualClock
from clairvoyant.metrics import CounterChild, Family, GaugeChild, HistogramChild, Metrics
from clairvoyant.prediction.learner import ModelQuality
from clairvoyant.scheduling.dispatcher import Dispatcher
from clairvoyant.scheduling.policy import build_queue, make_policy
from clairvoyant.scheduling.routing import Backend

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "metrics_40b1676.txt"
CREATED = re.compile(r"^(\S+_created(?:\{[^}]*\})?) \S+$", re.MULTILINE)


def drive(m: Metrics) -> str:
    """What the proxy's call sites do, 500 times over (seeded), then the exposition with each
    ``_created`` value replaced by T."""
    rng = random.Random(7)
    backend = m.backend_in_flight.labels("b0")
    m.backend_slots.labels("b0").set(4)
    m.backend_healthy.labels("b0").set(1)
    m.starvation_timeout.set(float("inf"))
    for i in range(500):
        c = rng.choice(["short", "medium", "long"])
        m.depth_by_class[c].inc()
        m.depth_by_class[c].dec()
        m.wait_by_class[c].observe(rng.choice([0.005, 0.01, 1, 1800, 5000, rng.random() * 10]))
        m.ttft_by_class[c].observe(rng.random())
        m.end_to_end_by_class[c].observe(rng.random() * 100)
        m.in_flight.inc()
        backend.inc()
        m.count_request(rng.choice(["/v1/chat/completions", "/api/chat"]), "openai", rng.choice(["200", "503"]))
        m.count_backend_request("b0", rng.choice(["answered", "refused"]))
        m.predictor_latency.observe(rng.random() * 1e-3)
        m.count_usage(rng.choice(["openai_usage", "none"]), rng.choice([None, 1, 4, 17, 9000]))
        if i % 7 == 0:
            m.starvation_promotions.inc()
            m.rejections_by_reason["too_large"].inc()
        m.disconnects_by_stage["queued"].inc()
        m.upstream_errors_by_kind["timeout"].inc()
        m.client_rejections.labels("client_timeout").inc()
        m.encoder_latency.observe(0.003)
        m.encoder_requests.labels("late").inc()
    m.in_flight.dec(3)
    nan = float("nan")
    m.set_prediction_quality({"default": ModelQuality("default", 3, nan, 0.5)})
    return CREATED.sub(r"\1 T", m.render().decode())


# added after 40b1676: not in its exposition
LATER_FAMILIES = ("clairvoyant_learner_", "clairvoyant_parked_", "clairvoyant_model_switches")
# exported at 0 from the start since 40b1676 (drive() never counts these two reasons)
LATER_SERIES = re.compile(
    r'clairvoyant_client_rejections_(total|created)\{reason="(header_too_large|max_connections)"\}'
)


def test_the_proxys_traffic_renders_as_it_did_on_prometheus_client() -> None:
    rendered = drive(Metrics())
    later = [
        line for line in rendered.splitlines() if re.match(rf"(# (HELP|TYPE) )?({'|'.join(LATER_FAMILIES)})", line)
    ]
    # learner_up and parked_connections (HELP, TYPE, sample each); three counters, each _total and _created;
    # model_switches (HELP, TYPE: drive() declares no backend)
    assert len(later) == 2 * 3 + 3 * 6 + 2
    later += [line for line in rendered.splitlines() if LATER_SERIES.match(line)]
    assert len(later) == 2 * 3 + 3 * 6 + 2 + 2 * 2
    kept = "".join(line + "\n" for line in rendered.splitlines() if line not in later)
    assert kept == FIXTURE.read_text()


def _reference(family: Family, registry: CollectorRegistry) -> Counter | Gauge | Histogram:  # type: ignore[type-arg]
    kind = {"counter": Counter, "gauge": Gauge}.get(family.type)
    if kind is not None:
        return kind(family.name, family.documentation, family.labelnames, registry=registry)  # type: ignore[no-any-return]
    bounds = family.make().bounds  # type: ignore[union-attr]
    return Histogram(family.name, family.documentation, family.labelnames, buckets=bounds, registry=registry)


def _samples(text: str) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float | str]]]]:
    """Parsed families: name, type, HELP and samples (a ``_created`` value only as present)."""
    return [
        (
            f.name,
            f.type,
            f.documentation,
            [(s.name, s.labels, "T" if s.name.endswith("_created") else s.value) for s in f.samples],
        )
        for f in text_string_to_metric_families(text)
    ]


@pytest.mark.parametrize("seed", range(5))
def test_random_updates_parse_to_prometheus_clients_samples(seed: int) -> None:
    rng = random.Random(seed)
    metrics = Metrics()
    plain = [f for f in metrics._exported if isinstance(f, Family)]
    assert {f.type for f in plain} == {"counter", "gauge", "histogram"}
    reference = CollectorRegistry(auto_describe=True)
    twins = {f.name: _reference(f, reference) for f in plain}
    for family in plain:  # the series Metrics() creates up front exist in the reference too
        for values in family.children:
            if values:
                twins[family.name].labels(*values)
    for _ in range(2000):
        family = rng.choice(plain)
        values = tuple(rng.choice(["a", "b", "x y", 'q"uote']) for _ in family.labelnames)
        child, twin = family.labels(*values), twins[family.name]
        if values:
            twin = twin.labels(*values)
        amount = rng.choice([1, 2.5, 0.0, 1e-6, 3e9, rng.random()])
        if isinstance(child, HistogramChild):
            amount = rng.choice([*child.bounds[:-1], amount, 1e12])  # bounds themselves: "le" is inclusive
            child.observe(amount)
            twin.observe(amount)  # type: ignore[union-attr]
        elif isinstance(child, CounterChild):
            child.inc(amount)
            twin.inc(amount)  # type: ignore[union-attr]
        else:
            assert isinstance(child, GaugeChild)
            op = rng.choice(["inc", "dec", "set"])
            getattr(child, op)(amount)
            getattr(twin, op)(amount)
    ours = _samples(metrics.render().decode())
    theirs = _samples(generate_latest(reference).decode())
    encoder = ("clairvoyant_encoder_seconds", "clairvoyant_encoder_requests")  # not plain: not in the reference
    assert [f for f in ours if not f[0].startswith(encoder)] == theirs
    assert sum(len(f[3]) for f in theirs) > 200


def test_labels_are_checked_and_shared() -> None:
    metrics = Metrics()
    with pytest.raises(ValueError, match="1 label values expected"):
        metrics.rejections.labels()
    assert metrics.rejections.labels("queue_full") is metrics.rejections_by_reason["queue_full"]
    assert metrics.client_rejections.labels(503) is metrics.client_rejections.labels("503")
    with pytest.raises(ValueError, match="sorted"):
        metrics._histogram("clairvoyant_bad", "unsorted buckets", buckets=(2, 1))


def test_an_infinite_gauge_and_a_nan_gauge_render() -> None:
    metrics = Metrics()
    metrics.starvation_timeout.set(math.inf)
    metrics.set_prediction_quality({"m": ModelQuality("m", 0, math.nan, math.nan)})
    text = metrics.render().decode()
    assert "clairvoyant_starvation_timeout_seconds +Inf\n" in text
    assert 'clairvoyant_prediction_kendall_tau{model="m"} NaN\n' in text


def test_the_encoders_metrics_stay_prometheus_clients() -> None:
    """The encoder's thread and the event loop both update them: they keep prometheus_client's lock."""
    metrics = Metrics()
    assert isinstance(metrics.encoder_requests, Counter) and isinstance(metrics.encoder_latency, Histogram)
    metrics.encoder_requests.labels("learning").inc()
    assert 'clairvoyant_encoder_requests_total{outcome="learning"} 1.0\n' in metrics.render().decode()


def test_every_exported_family_is_documented_in_the_readme() -> None:
    # The README's metric table (and its pool section) is what operators build dashboards from: a new
    # family must be named there, as it is exported (counters with their _total).
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    documented = set(re.findall(r"`(clairvoyant_[a-z_]+)", readme))
    exported = set()
    for family in Metrics().registry.collect():
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    assert exported - documented == set()
    assert {name for name in documented if name.startswith("clairvoyant_")} - exported == set()


def test_series_known_at_start_are_exported_at_zero_before_any_event() -> None:
    """An alert on rate(...{outcome="failed"}) or a dashboard must see the series before the first
    failure: every configured backend's outcomes and every client-limit reason are there at 0."""
    metrics = Metrics()
    policy = make_policy("fcfs")
    Dispatcher(build_queue(policy), policy, backends=[Backend("gpu-a", 1), Backend("gpu-b", 2)], metrics=metrics,
               max_queue=4, clock=ManualClock())  # fmt: skip
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    for backend in ("gpu-a", "gpu-b"):
        for outcome in ("answered", "refused", "failed", "failed_mid_answer"):
            key = ("clairvoyant_backend_requests_total", (("backend", backend), ("outcome", outcome)))
            assert samples[key] == 0.0
    for reason in ("client_timeout", "header_too_large", "max_connections"):
        assert samples[("clairvoyant_client_rejections_total", (("reason", reason),))] == 0.0


def test_a_nan_observation_lands_in_no_bucket_as_in_prometheus_client() -> None:
    child = HistogramChild((0.1, 1.0, math.inf))
    twin = Histogram("h", "h", buckets=(0.1, 1.0), registry=CollectorRegistry())
    for amount in (0.05, math.nan, 0.5):
        child.observe(amount)
        twin.observe(amount)
    theirs = {s.labels["le"]: s.value for s in twin.collect()[0].samples if s.name == "h_bucket"}  # cumulative
    cumulative = [sum(child.counts[: i + 1]) for i in range(3)]
    assert cumulative == [theirs["0.1"], theirs["1.0"], theirs["+Inf"]] == [1, 2, 2]
    assert math.isnan(child.sum)
