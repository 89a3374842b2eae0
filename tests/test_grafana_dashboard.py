"""deploy/grafana/clairvoyant.json queries only metrics the proxy exports, and shows what operators need.

Every PromQL expression of the dashboard is parsed for the metric names it selects (a small PromQL
reader: functions, aggregations, label matchers, ranges and Grafana variables are told apart from
metric names), and each name must be one that ``Metrics().render()`` exposes, with the series
suffixes of its type (``_total`` counters, ``_bucket``/``_sum``/``_count`` histograms).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clairvoyant.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "clairvoyant.json"

# PromQL words that are followed by something other than "(" and are not metric names.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def exported_names() -> set[str]:
    """Every series name the proxy's /metrics can carry, read from the exposition text."""
    metrics = Metrics()
    metrics.requests.answered["/v1/chat/completions", "openai", "200"].inc()  # labelled families with no child yet
    names: set[str] = set()
    for line in metrics.render().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "counter":
                names |= {name if name.endswith("_total") else f"{name}_total"}
            elif kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(IDENT.match(line).group(0))  # type: ignore[union-attr]
    return names


def _strip_balanced(expr: str, opener: str, closer: str, keep: str = " ") -> str:
    out, depth = [], 0
    for ch in expr:
        if ch == opener:
            depth += 1
            continue
        if ch == closer:
            if depth == 0:
                raise ValueError(f"unbalanced {closer!r} in {expr!r}")
            depth -= 1
            out.append(keep)
            continue
        if depth == 0:
            out.append(ch)
    if depth:
        raise ValueError(f"unclosed {opener!r} in {expr!r}")
    return "".join(out)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects. Raises ValueError on unbalanced brackets or quotes."""
    if expr.count('"') % 2:
        raise ValueError(f"unbalanced quote in {expr!r}")
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    text = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "1m", text)  # Grafana variables ($__rate_interval, ...)
    text = _strip_balanced(text, "{", "}")  # label matchers
    text = _strip_balanced(text, "[", "]")  # range and subquery selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)  # label lists
    if text.count("(") != text.count(")"):
        raise ValueError(f"unbalanced parentheses in {expr!r}")
    names = set()
    for match in IDENT.finditer(text):
        word, rest = match.group(0), text[match.end() :].lstrip()
        if rest.startswith("(") or word in KEYWORDS:
            continue  # a function or an aggregation, or an operator word
        if re.fullmatch(r"\d+[smhdwy]", word) or match.start() > 0 and text[match.start() - 1].isdigit():
            continue  # a duration, or the exponent/unit of a number
        names.add(word)
    return names


def dashboard_exprs() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            assert inner, query
            out.append((f"variable {variable['name']}", inner.group(1)))
    return out


def test_every_expression_queries_only_exported_metrics() -> None:
    exported = exported_names()
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        assert names <= exported, f"{title}: {sorted(names - exported)} not exported by the proxy ({expr!r})"


def test_the_dashboard_covers_what_operators_watch() -> None:
    used = set().union(*(metric_names(e) for _, e in dashboard_exprs()))
    required = {
        "clairvoyant_queue_depth",
        "clairvoyant_in_flight_requests",
        "clairvoyant_queue_wait_seconds_bucket",
        "clairvoyant_time_to_first_byte_seconds_bucket",
        "clairvoyant_rejections_total",
        "clairvoyant_starvation_promotions_total",
        "clairvoyant_upstream_errors_total",
        "clairvoyant_client_disconnects_total",
        "clairvoyant_prediction_kendall_tau",
        "clairvoyant_prediction_abs_log_token_error",
        "clairvoyant_backend_in_flight_requests",
        "clairvoyant_backend_healthy",
        "clairvoyant_backend_requests_total",
    }
    assert required <= used, sorted(required - used)
    # Waits and TTFT are shown per predicted class, not only in total.
    by_class = [e for _, e in dashboard_exprs() if "predicted_class" in e]
    assert any("queue_wait" in e for e in by_class) and any("time_to_first_byte" in e for e in by_class)


def test_panels_use_the_datasource_variable_and_do_not_overlap() -> None:
    board = json.loads(DASHBOARD.read_text())
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        (
            'sum by (le, predicted_class) (rate(a_bucket{instance=~"$instance", x="y{z}"}[$__rate_interval]))',
            {"a_bucket"},
        ),
        (
            "histogram_quantile(0.95, sum by (le) (rate(b_bucket[5m]))) / on (job) group_left c_total",
            {"b_bucket", "c_total"},
        ),
        ("rate(d_total[1h:5m] offset 1d) > bool 1e3", {"d_total"}),
        ("max without (model) (e)", {"e"}),
    ],
)
def test_the_reader_finds_metric_names_and_nothing_else(expr: str, expected: set[str]) -> None:
    assert metric_names(expr) == expected


def test_the_check_would_catch_a_wrong_name_or_a_broken_expression() -> None:
    exported = exported_names()
    assert "clairvoyant_queue_depth_total" not in exported  # a gauge has no _total
    assert "clairvoyant_queue_wait_seconds" not in exported  # a histogram is queried by its series
    assert "clairvoyant_requests_total" in exported and "clairvoyant_queue_wait_seconds_count" in exported
    assert "clairvoyant_prediction_kendall_tau" in exported  # a labelled gauge with no child yet
    with pytest.raises(ValueError):
        metric_names("sum(rate(clairvoyant_requests_total[5m])")
    with pytest.raises(ValueError):
        metric_names('clairvoyant_queue_depth{predicted_class="short}')
