"""The text `clairvoyant status` prints: /queue's object (plus ``from_metrics``) as plain tables.

With replicas (/queue has a ``cluster`` part) the table adds the cluster: its mode (shared, or
local and degraded while Redis is unreachable), each replica's health, the slots held across the
cluster and the whole cluster's queue, each request with the replica that holds it. Without that
part the table is the one process's, as before.

Every field is read with a default: a proxy that sends fewer fields prints dashes, one that sends
new ones shows them (new columns of the backends and the tenants, new top-level fields in a last
section), and none makes it fail. A value that is not defined yet (a rank correlation over fewer
than two requests) reads "not enough data", never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from clairvoyant.scheduling.queue_view import (
    BackendView,
    ClusterLeaseView,
    ClusterPartView,
    ClusterWaitingView,
    ReplicaHealthView,
    RequestView,
    RunningView,
    WaitingView,
)

__all__ = ["render", "table"]

NOT_ENOUGH_DATA = "not enough data"
# /queue's top-level fields this module lays out itself; any other one goes to the last section.
_LAID_OUT = frozenset(
    {
        "policy", "policy_detail", "starvation_timeout_s", "starvation_slowdown", "slots", "max_queue",
        "tail_eta_s", "service_time", "backends", "waiting_count", "waiting", "in_flight", "recent", "tenants",
        "from_metrics", "cluster",
    }
)  # fmt: skip
# Backend fields with a column of their own (or left out: "url" is in --json).
_BACKEND_KNOWN = frozenset(
    {"name", "url", "kind", "healthy", "slots", "in_flight", "remaining_s", "slowness", "models", "loaded_models"}
)


def seconds(value: Any) -> str:
    """A duration for a person: "0.4 s", "17 s", "4m05s", "2h10m"; "-" when absent."""
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "never" if value > 0 else "-"
    if value < 10:
        return f"{value:.1f} s"
    if value < 60:
        return f"{value:.0f} s"
    minutes, secs = divmod(round(value), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def cell(value: Any) -> str:
    """Any JSON value as one table cell."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return NOT_ENOUGH_DATA if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, list):
        return ", ".join(cell(v) for v in value) if value else "-"
    if isinstance(value, dict):
        return " ".join(f"{k}={cell(v)}" for k, v in value.items()) if value else "-"
    text = str(value)
    return text if text else "-"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    """Columns padded to their widest cell; numbers-looking columns are not special-cased (the
    cells arrive formatted)."""
    rows = [list(r) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = [indent + "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return lines


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


View = TypeVar("View")


def _views(value: Any, view: type[View]) -> list[View]:
    """The objects of a /queue list as its typed view (``scheduling.queue_view``: a model, or a
    request's dataclass row); an object whose known fields have the wrong types is read without them."""
    adapter = TypeAdapter(view)
    rows = []
    for row in _dicts(value):
        try:
            rows.append(adapter.validate_python(row))
        except ValidationError:
            if isinstance(view, type) and issubclass(view, BaseModel):
                rows.append(view.model_construct(**{k: v for k, v in row.items() if k not in view.model_fields}))
            else:
                rows.append(adapter.validate_python({}))
    return rows


def _predicted(row: RequestView) -> str:
    tokens = row.predicted_tokens
    parts = [f"{tokens:.0f} tok" if tokens is not None and math.isfinite(tokens) else None]
    if row.predicted_s is not None:
        parts.append(seconds(row.predicted_s))
    return " / ".join(p for p in parts if p) or "-"


def _tenant(row: RequestView) -> str:
    return row.tenant or "(no key)"


def _header(status: Mapping[str, Any], url: str) -> list[str]:
    slowdown = status.get("starvation_slowdown")
    if isinstance(slowdown, dict):  # adaptive: base x (1 + CV^2) of measured service times
        slowdown_text = f"{cell(slowdown.get('slowdown'))} (adaptive, base {cell(slowdown.get('base'))})"
    else:
        slowdown_text = cell(slowdown)
    detail = status.get("policy_detail")
    extra = {k: v for k, v in detail.items() if k != "name"} if isinstance(detail, dict) else {}
    policy = cell(status.get("policy")) + (f" ({cell(extra)})" if extra else "")
    return [
        f"clairvoyant at {url}",
        f"  policy {policy}; starvation tau {seconds(status.get('starvation_timeout_s'))}, slowdown {slowdown_text}; "
        f"slots {cell(status.get('slots'))}; max queue {cell(status.get('max_queue'))}",
    ]


def _backends(status: Mapping[str, Any]) -> list[str]:
    listed = _dicts(status.get("backends"))
    if not listed:
        return ["backends: none reported"]
    backends = _views(listed, BackendView)
    extra = sorted({k for b in listed for k in b} - _BACKEND_KNOWN)
    headers = ["backend", "kind", "healthy", "in flight", "remaining", "slowness", "models", "loaded", *extra]
    rows = [
        [
            cell(b.name or None),
            cell(given.get("kind")),
            cell(b.healthy),
            f"{cell(given.get('in_flight'))}/{cell(given.get('slots'))}",
            seconds(b.remaining_s),
            cell(b.slowness),
            "any" if given.get("models") == [] else cell(given.get("models")),  # an empty list: serves every model
            cell(given.get("loaded_models")),
            *(cell(given.get(k)) for k in extra),
        ]
        for b, given in zip(backends, listed)
    ]
    return ["backends", *table(headers, rows)]


def _running(status: Mapping[str, Any]) -> list[str]:
    running = _views(status.get("in_flight"), RunningView)
    if not running:
        return ["running: none"]
    headers = ["backend", "slot", "request", "tenant", "prio", "model", "class", "predicted", "running"]
    rows = [
        [
            cell(r.backend),
            cell(r.slot),
            cell(r.request_id),
            _tenant(r),
            cell(r.priority),
            cell(r.model),
            cell(r.predicted_class),
            _predicted(r),
            seconds(r.running_s),
        ]
        for r in running
    ]
    return [f"running ({len(running)})", *table(headers, rows)]


def _waiting(status: Mapping[str, Any], limit: int | None) -> list[str]:
    waiting = _views(status.get("waiting"), WaitingView)
    count = status.get("waiting_count")
    total = count if isinstance(count, int) else len(waiting)
    waiting = waiting if limit is None else waiting[: max(0, limit)]
    if not waiting and not total:
        return ["waiting: none"]
    shown = f"{len(waiting)} of {total}" if total != len(waiting) else str(total)
    tail = status.get("tail_eta_s")
    title = f"waiting ({shown}, in dispatch order" + (f"; the last starts in {seconds(tail)})" if tail else ")")
    headers = ["#", "request", "tenant", "prio", "model", "class", "predicted", "waited", "eta"]
    rows = [
        [
            cell(i if w.position is None else w.position),
            cell(w.request_id),
            _tenant(w),
            cell(w.priority),
            cell(w.model),
            cell(w.predicted_class),
            _predicted(w),
            seconds(w.waited_s),
            seconds(w.eta_s),
        ]
        for i, w in enumerate(waiting)
    ]
    return [title, *table(headers, rows)]


def _cluster_part(status: Mapping[str, Any]) -> ClusterPartView | None:
    """/queue's ``cluster`` part as its typed view (a field of the wrong type read as absent); None
    without replicas."""
    given = status.get("cluster")
    if not isinstance(given, dict):
        return None
    lists = {"replicas": ReplicaHealthView, "waiting": ClusterWaitingView, "leases": ClusterLeaseView}
    fields = {}
    for key, value in given.items():
        if key in lists:
            continue
        try:
            ClusterPartView.model_validate({key: value})
        except ValidationError:
            continue
        fields[key] = value
    return ClusterPartView.model_validate(fields).model_copy(
        update={key: _views(given.get(key), view) for key, view in lists.items()}
    )


def _cluster(status: Mapping[str, Any], part: ClusterPartView) -> list[str]:
    """The cluster's line (this replica's mode: shared, or local = degraded) and its replicas' health.
    The line prints /queue's values as sent: an absent one is a dash, not the view's default."""
    given = status["cluster"]
    mode = cell(given.get("mode"))
    if mode == "local":
        mode = "local (DEGRADED: Redis unreachable, scheduling on this replica's share of the slots)"
    lines = [
        f"cluster {cell(given.get('name'))}: answered by replica {cell(given.get('replica'))}, mode {mode}; "
        f"lease {seconds(given.get('lease_s'))}"
        + (f"; no new grants for {seconds(part.quiet_s)} (Redis lost its state)" if part.quiet_s else "")
    ]
    if part.error:
        lines.append(f"  the shared state could not be read: {part.error}")
    if not part.replicas:
        return [*lines, "  replicas: none reported"]
    rows = [
        [
            cell(r.replica or None) + (" (this one)" if r.replica and r.replica == part.replica else ""),
            "live" if r.live else "GONE",
            f"{seconds(r.beat_age_s)} ago",
        ]
        for r in part.replicas
    ]
    return [*lines, *table(["replica", "state", "last heartbeat"], rows)]


def _cluster_running(status: Mapping[str, Any], part: ClusterPartView) -> list[str]:
    """The slots held across the cluster; this replica's requests with their details from ``in_flight``."""
    if not part.leases:
        return ["running in the cluster: none"]
    local = {r.request_id: r for r in _views(status.get("in_flight"), RunningView)}
    headers = ["backend", "slot", "request", "replica", "tenant", "prio", "model", "class", "running", "lease left"]
    rows = []
    for lease in part.leases:
        mine = local.get(lease.request_id)
        rows.append(
            [
                cell(lease.backend or None),
                cell(lease.slot),
                cell(lease.request_id or None),
                cell(lease.replica or None),
                "-" if mine is None else _tenant(mine),
                "-" if mine is None else cell(mine.priority),
                "-" if mine is None else cell(mine.model),
                "-" if mine is None else cell(mine.predicted_class),
                "-" if mine is None else seconds(mine.running_s),
                seconds(lease.expires_in_s),
            ]
        )
    held = f"{len(rows)} slot{'' if len(rows) == 1 else 's'} held"
    return [f"running in the cluster ({held})", *table(headers, rows)]


def _cluster_waiting(status: Mapping[str, Any], part: ClusterPartView, limit: int | None) -> list[str]:
    """The whole cluster's queue in dispatch order, with the replica that holds each request; the
    class of this replica's own requests from ``waiting``."""
    waiting = part.waiting if limit is None else part.waiting[: max(0, limit)]
    total = max(part.waiting_count, len(part.waiting))
    if not waiting and not total:
        return ["waiting in the cluster: none"]
    shown = f"{len(waiting)} of {total}" if total != len(waiting) else str(total)
    local = {w.request_id: w for w in _views(status.get("waiting"), WaitingView)}
    headers = ["#", "request", "replica", "tenant", "prio", "model", "class", "predicted", "waited", "overdue"]
    rows = [
        [
            str(i),
            cell(w.request_id or None),
            cell(w.replica or None),
            w.tenant or "(no key)",
            cell(w.priority),
            cell(w.model or None),
            cell(local[w.request_id].predicted_class) if w.request_id in local else "-",
            seconds(w.predicted_s),
            seconds(w.waited_s),
            "OVERDUE" if w.overdue else "-",
        ]
        for i, w in enumerate(waiting)
    ]
    return [f"waiting in the cluster ({shown}, in dispatch order)", *table(headers, rows)]


def _tenants(status: Mapping[str, Any]) -> list[str]:
    """Requests per tenant (from the rows), beside whatever /queue says of its tenants (a list of
    objects with a "tenant" or "name", or an object keyed by tenant)."""
    counts: dict[str, list[int]] = {}
    for index, key in enumerate(("waiting", "in_flight")):
        for request in _views(status.get(key), RequestView):
            counts.setdefault(_tenant(request), [0, 0])[index] += 1
    described: dict[str, dict[str, Any]] = {}
    listed = status.get("tenants")
    if isinstance(listed, dict):
        described = {
            str(name) if name else "(no key)": (v if isinstance(v, dict) else {"value": v})
            for name, v in listed.items()
        }
    for row in _dicts(listed):
        name = row.get("tenant", row.get("name"))
        described["(no key)" if name in ("", None) else str(name)] = {
            k: v for k, v in row.items() if k not in ("tenant", "name")
        }
    names = sorted(set(counts) | set(described))
    if not names:
        return ["tenants: none"]
    extra = sorted({k for d in described.values() for k in d})
    shown_total = status.get("waiting_count") != len(_dicts(status.get("waiting")))
    headers = ["tenant", "waiting" + (" (shown)" if shown_total else ""), "running", *extra]
    rows = [
        [name, str(counts.get(name, [0, 0])[0]), str(counts.get(name, [0, 0])[1])]
        + [cell(described.get(name, {}).get(k)) for k in extra]
        for name in names
    ]
    title = "tenants (this replica's requests)" if isinstance(status.get("cluster"), dict) else "tenants"
    return [title, *table(headers, rows)]


def _quality(status: Mapping[str, Any]) -> list[str]:
    metrics = status.get("from_metrics")
    title = "prediction quality (the online learner's rolling window)"
    if not isinstance(metrics, dict):
        return [f"{title}: not read"]
    if metrics.get("error"):
        return [f"{title}: /metrics could not be read ({metrics['error']})"]
    up = metrics.get("learner_up")
    state = {True: "running", False: "not running", None: "not reported"}.get(up, cell(up))
    refits = metrics.get("learner_refits")
    lines = [f"{title}; learner {state}" + ("" if refits is None else f", {refits} refits")]
    rows = _dicts(metrics.get("prediction_quality"))
    if not rows:
        return [*lines, f"  {NOT_ENOUGH_DATA}: no completed request observed yet"]

    def defined(value: Any, digits: int) -> str:
        return (
            NOT_ENOUGH_DATA if not isinstance(value, int | float) or not math.isfinite(value) else f"{value:.{digits}f}"
        )

    table_rows = [
        [
            cell(r.get("model") or "(default)"),
            cell(r.get("window_requests")),
            defined(r.get("kendall_tau"), 3),
            defined(r.get("abs_log_token_error"), 2),
        ]
        for r in rows
    ]
    return [*lines, *table(["model", "requests", "kendall tau", "mean |ln error|"], table_rows)]


def _others(status: Mapping[str, Any]) -> list[str]:
    """Top-level fields this module does not lay out (newer proxies): a table for a list of
    objects, one line for anything else."""
    lines: list[str] = []
    for key in sorted(set(status) - _LAID_OUT):
        value = status[key]
        rows = _dicts(value)
        if rows and len(rows) == len(value):
            columns = list(dict.fromkeys(k for r in rows for k in r))
            lines += [key, *table(columns, ([cell(r.get(c)) for c in columns] for r in rows))]
        else:
            lines.append(f"{key}: {cell(value)}")
    return lines


def render(status: Mapping[str, Any], *, url: str, limit: int | None = None) -> str:
    """The whole table, sections separated by blank lines, ending with a newline. ``limit``: list
    only the first waiting requests (the tenants' counts still cover every row there is)."""
    part = _cluster_part(status)
    if part is None:
        sections = [_header(status, url), _backends(status), _running(status), _waiting(status, limit)]
    else:  # with replicas: the whole cluster's slots and queue, each request with its replica
        sections = [
            _header(status, url),
            _cluster(status, part),
            _backends(status),
            _cluster_running(status, part),
            _cluster_waiting(status, part, limit),
        ]
    sections += [_tenants(status), _quality(status), _others(status)]
    return "\n\n".join("\n".join(s) for s in sections if s) + "\n"
