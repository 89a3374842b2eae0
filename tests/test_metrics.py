"""metrics.py: the families dashboards and alerts read keep their names, labels, HELP and buckets.

The proxy's traffic driven through ``Metrics`` renders the same text, byte for byte (the
``_created`` timestamps aside), as the families first published did (tests/fixtures/metrics_40b1676.txt,
written by ``drive``), less the families and series added since.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

from manual_clock import ManualClock
from prometheus_client.parser import text_string_to_metric_families

from clairvoyant.metrics import Children, Counts, Families, Metrics, MetricSpec
from clairvoyant.prediction.learner import ModelQuality
from clairvoyant.scheduling.dispatcher import Dispatcher
from clairvoyant.scheduling.policy import build_queue, make_policy
from clairvoyant.scheduling.routing import Backend

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "metrics_40b1676.txt"
FAMILIES = FIXTURE.with_name("metric_families.txt")
CREATED = re.compile(r"^(\S+_created(?:\{[^}]*\})?) \S+$", re.MULTILINE)


def drive(m: Metrics) -> str:
    """What the proxy's call sites do, 500 times over (seeded), then the exposition with each
    ``_created`` value replaced by T."""
    rng = random.Random(7)
    backend = m.backends.in_flight["b0"]
    m.backends.slots["b0"].set(4)
    m.backends.healthy["b0"].set(1)
    m.queue.starvation_timeout.set(float("inf"))
    for i in range(500):
        c = rng.choice(["short", "medium", "long"])
        m.queue.depth[c].inc()
        m.queue.depth[c].dec()
        m.queue.wait[c].observe(rng.choice([0.005, 0.01, 1, 1800, 5000, rng.random() * 10]))
        m.requests.ttft[c].observe(rng.random())
        m.requests.end_to_end[c].observe(rng.random() * 100)
        m.queue.in_flight.inc()
        backend.inc()
        m.requests.answered[
            rng.choice(["/v1/chat/completions", "/api/chat"]), "openai", rng.choice(["200", "503"])
        ].inc()
        m.backends.requests["b0", rng.choice(["answered", "refused"])].inc()
        m.prediction.latency.observe(rng.random() * 1e-3)
        m.prediction.count_usage(rng.choice(["openai_usage", "none"]), rng.choice([None, 1, 4, 17, 9000]))
        if i % 7 == 0:
            m.queue.starvation_promotions.inc()
            m.requests.rejections["too_large"].inc()
        m.requests.disconnects["queued"].inc()
        m.backends.errors["timeout"].inc()
        m.requests.client_rejections["client_timeout"].inc()
        m.encoder.latency.observe(0.003)
        m.encoder.requests["late"].inc()
    m.queue.in_flight.dec(3)
    nan = float("nan")
    m.prediction.set_quality({"default": ModelQuality("default", 3, nan, 0.5)})
    return CREATED.sub(r"\1 T", m.render().decode())


# added after 40b1676: not in its exposition
LATER_FAMILIES = (
    "clairvoyant_learner_", "clairvoyant_model_switches", "clairvoyant_tenant_", "clairvoyant_event_loop_tasks",
    "clairvoyant_retained_entries", "clairvoyant_request_status_",
)  # fmt: skip
# exported at 0 from the start since 40b1676 (drive() never counts this reason)
LATER_SERIES = re.compile(r'clairvoyant_client_rejections_(total|created)\{reason="body_budget"\}')


def test_the_proxys_traffic_renders_as_it_did_on_prometheus_client() -> None:
    rendered = drive(Metrics())
    later = [
        line for line in rendered.splitlines() if re.match(rf"(# (HELP|TYPE) )?({'|'.join(LATER_FAMILIES)})", line)
    ]
    # learner_up (HELP, TYPE, sample); three counters, each _total and _created;
    # model_switches and the four tenant families (HELP, TYPE: drive() counts no backend or tenant);
    # event_loop_tasks (HELP, TYPE, sample), retained_entries (HELP, TYPE: none set) and
    # request_status (HELP, TYPE: drive() counts no request status)
    assert len(later) == 3 + 3 * 6 + 2 + 4 * 2 + 3 + 2 + 2
    later += [line for line in rendered.splitlines() if LATER_SERIES.match(line)]
    assert len(later) == 3 + 3 * 6 + 2 + 4 * 2 + 3 + 2 + 2 + 2
    kept = "".join(line + "\n" for line in rendered.splitlines() if line not in later)
    # Each family's text whole; their order (the groups' order) is nothing to a scraper.
    assert by_family(kept) == by_family(FIXTURE.read_text())


def by_family(exposition: str) -> dict[str, str]:
    """Each family's lines (its HELP line on), by its HELP line."""
    blocks = re.split(r"(?m)^(?=# HELP )", exposition)
    return {block.splitlines()[0]: block for block in blocks if block}


def test_an_infinite_gauge_and_a_nan_gauge_render() -> None:
    metrics = Metrics()
    metrics.queue.starvation_timeout.set(math.inf)
    metrics.prediction.set_quality({"m": ModelQuality("m", 0, math.nan, math.nan)})
    text = metrics.render().decode()
    assert "clairvoyant_starvation_timeout_seconds +Inf\n" in text
    assert 'clairvoyant_prediction_kendall_tau{model="m"} NaN\n' in text


def test_every_exported_family_is_documented() -> None:
    # The operations page's metric table is what operators build dashboards from: a new family must
    # be named there, as it is exported (counters with their _total).
    readme = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
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
    for reason in ("client_timeout", "body_budget"):
        assert samples[("clairvoyant_client_rejections_total", (("reason", reason),))] == 0.0


def test_the_exported_families_keep_their_names_types_and_labels() -> None:
    # tests/fixtures/metric_families.txt: every family /metrics exported before its families were
    # grouped by concern (name, type, label names), one a line. A dashboard's queries name them.
    metrics = Metrics()
    for group in vars(metrics).values():
        for attribute, built in vars(group).items() if isinstance(group, Families) else ():
            if isinstance(built, Children):  # a child of each labelled family, for its label names
                built[tuple(f"{attribute}-{i}" for i in range(len(built.family._labelnames)))]
    metrics.requests.status.declare(["waiting"])
    exported = {
        f"{family.name} {family.type} {','.join(sorted({k for s in family.samples for k in s.labels} - {'le'}))}"
        for family in metrics.registry.collect()
    }
    assert exported == set(FAMILIES.read_text().splitlines())


def test_each_group_holds_its_families_as_declared() -> None:
    from prometheus_client import Histogram

    metrics = Metrics()
    specs = [(group, name, spec) for group in vars(metrics).values() if isinstance(group, Families)
             for name, spec in vars(type(group)).items() if isinstance(spec, MetricSpec)]  # fmt: skip
    assert len(specs) == 36 and len({spec.name for _, _, spec in specs}) == 36
    for group, attribute, spec in specs:
        built = getattr(group, attribute)
        family = built.family if spec.labels and spec.kind is not Counts else built
        assert type(family) is spec.kind, attribute
        assert (family._name, family._documentation, family._labelnames) == (spec.name, spec.help, spec.labels)
        if spec.kind is Histogram:
            assert spec.buckets is not None and family._upper_bounds == [*map(float, spec.buckets), math.inf]
    assert type(metrics.queue.wait.family).__name__ == "Histogram" and type(metrics.learner.up).__name__ == "Gauge"


def test_a_structure_no_longer_reported_reads_zero() -> None:
    # A queue reports its tenants' entries only while it has tenants: once they are gone, their
    # series must read 0, not the last size seen (a leak that is not there).
    metrics = Metrics()
    metrics.process.publish(12, {"fair_share_tenants": 3, "model_groups": 2})
    metrics.process.publish(7, {"model_groups": 0})
    text = metrics.render().decode()
    assert "clairvoyant_event_loop_tasks 7.0\n" in text
    assert 'clairvoyant_retained_entries{structure="fair_share_tenants"} 0.0\n' in text
    assert 'clairvoyant_retained_entries{structure="model_groups"} 0.0\n' in text


def test_with_replicas_every_series_carries_the_replica_label() -> None:
    metrics = Metrics()
    metrics.queue.depth["short"].inc()
    assert 'clairvoyant_queue_depth{predicted_class="short"} 1.0\n' in metrics.render().decode()
    metrics.replica = "r1"
    text = metrics.render().decode()
    assert 'clairvoyant_queue_depth{predicted_class="short",replica="r1"} 1.0\n' in text
    assert 'clairvoyant_in_flight_requests{replica="r1"} 0.0\n' in text
