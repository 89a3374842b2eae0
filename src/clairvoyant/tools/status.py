"""`clairvoyant status`: what a running proxy is doing, read from its /queue and /metrics.

    clairvoyant status                                  # the proxy on 127.0.0.1:8080, once
    clairvoyant status --url http://gpu-box:8080 --watch
    clairvoyant status --json | jq -r '.waiting[].request_id'

The table (``status_table.render``) shows the backends with their slots and loaded models, the
running requests, every waiting request in dispatch order with its ETA, the tenants, and the online
learner's prediction quality. With replicas it shows each replica's health, and the slots held and
the queue across the whole cluster, each request with the replica that holds it. ``--json`` prints
/queue's object as the proxy sent it (its ``waiting`` rows unchanged) plus one key of its own,
``from_metrics``: the learner's state and its rolling prediction quality per model as /metrics has
them, ``null`` where a value is not defined yet.

A proxy with ``status_requires_key`` needs a client key: ``--key KEY``, or the environment variable
``CLAIRVOYANT_STATUS_KEY`` (which keeps the key out of the process list and the shell history).

/queue gains fields from release to release: the table prints the fields it knows, shows other ones
as they come, and fails on none that is absent or new.

Errors: ``StatusError`` (a ``ClairvoyantError``: the CLI prints it and exits 2) when the proxy cannot
be reached, refuses the key, or answers /queue with something other than a JSON object. ``--watch``
shows such an error in place of the table (on standard error beside ``--json``) and tries again at
the next refresh, except a refused key, which ends it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import IO, Any

from clairvoyant.errors import ClairvoyantError

__all__ = ["DEFAULT_URL", "KEY_ENV", "KeyRefused", "StatusError", "add_arguments", "fetch", "read_metrics", "run"]

DEFAULT_URL = "http://127.0.0.1:8080"
KEY_ENV = "CLAIRVOYANT_STATUS_KEY"
METRICS_KEY = "from_metrics"  # the one key status adds to /queue's object
# /metrics series status reads: (its key in from_metrics, the metric family's name)
_QUALITY = (
    ("kendall_tau", "clairvoyant_prediction_kendall_tau"),
    ("abs_log_token_error", "clairvoyant_prediction_abs_log_token_error"),
    ("window_requests", "clairvoyant_prediction_quality_window_requests"),
)
_CLEAR_SCREEN = "\x1b[H\x1b[2J"


class StatusError(ClairvoyantError):
    """The proxy could not be asked (unreachable, the key refused, not a Clairvoyant proxy).

    StatusError
    └── KeyRefused    401 or 403: asking again will not help, so --watch stops too
    """


class KeyRefused(StatusError):
    """The proxy wants a client key, or another one."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the proxy's base URL (default {DEFAULT_URL})")
    parser.add_argument(
        "--key",
        default=None,
        help=f"a client key, for a proxy with status_requires_key (default: ${KEY_ENV}; the variable keeps "
        "the key out of the process list)",
    )
    parser.add_argument("--json", action="store_true", help="print /queue's object plus from_metrics, as JSON")
    parser.add_argument(
        "--watch",
        action="store_true",
        help="refresh every --interval seconds until Ctrl-C (with --json: one JSON object per line)",
    )
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    parser.add_argument(
        "--limit", type=int, default=None, help="show only the first N waiting requests (default: all of them)"
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the proxy (default 10)")


def _headers(key: str | None) -> dict[str, str]:
    return {} if not key else {"Authorization": f"Bearer {key}"}


def _get(client: Any, url: str, path: str, **params: Any) -> Any:
    import httpx

    try:
        response = client.get(f"{url}{path}", params={k: v for k, v in params.items() if v is not None})
    except httpx.HTTPError as exc:
        raise StatusError(f"cannot reach the proxy at {url}: {exc!r}") from exc
    if response.status_code in (401, 403):
        raise KeyRefused(
            f"{url}{path} answered {response.status_code}: the proxy wants a client key (--key KEY, or set {KEY_ENV})"
        )
    if response.status_code != 200:
        raise StatusError(f"{url}{path} answered {response.status_code}: {response.text[:200]}")
    return response


def fetch(client: Any, url: str, *, limit: int | None = None) -> dict[str, Any]:
    """/queue's object, unchanged, plus ``from_metrics`` (``read_metrics``; ``{"error": ...}``
    instead when /metrics could not be read: the queue is still worth showing).

    Raises:
        StatusError: /queue could not be read, or is not a JSON object.
    """
    response = _get(client, url, "/queue", limit=limit)
    try:
        queue = response.json()
    except ValueError:
        queue = None
    if not isinstance(queue, dict):
        raise StatusError(f"{url}/queue did not answer with a JSON object: is this a Clairvoyant proxy?")
    try:
        metrics = read_metrics(_get(client, url, "/metrics").text)
    except (StatusError, ValueError) as exc:
        metrics = {"error": str(exc)}
    return {**queue, METRICS_KEY: metrics}


def _number(value: float) -> float | None:
    """A gauge's value for JSON: None where it is not defined (NaN) or infinite."""
    return value if math.isfinite(value) else None


def read_metrics(text: str) -> dict[str, Any]:
    """What status shows from a /metrics exposition: ``learner_up`` (bool, None if absent),
    ``learner_refits`` (int, None if absent) and ``prediction_quality``, one entry per model with
    ``kendall_tau``, ``abs_log_token_error`` and ``window_requests`` (None while undefined).

    Raises:
        ValueError: the text is not Prometheus' exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))

    def single(name: str) -> float | None:
        found = samples.get(name)
        return None if not found else _number(found[0][1])

    quality: dict[str, dict[str, Any]] = {}
    for key, name in _QUALITY:
        for labels, value in samples.get(name, []):
            row = quality.setdefault(labels.get("model", ""), dict.fromkeys(k for k, _ in _QUALITY))
            row[key] = _number(value)
    for row in quality.values():
        if row["window_requests"] is not None:
            row["window_requests"] = int(row["window_requests"])
    up = single("clairvoyant_learner_up")
    refits = single("clairvoyant_learner_refits_total")
    return {
        "learner_up": None if up is None else up > 0,
        "learner_refits": None if refits is None else int(refits),
        "prediction_quality": [{"model": model, **row} for model, row in sorted(quality.items())],
    }


def _show(out: IO[str], args: argparse.Namespace, client: Any, url: str, *, clear: bool) -> None:
    """One refresh. Under --watch a failed fetch is reported (in place of the table, or on stderr
    beside JSON) and the next refresh tries again; without it, the error ends the command."""
    from clairvoyant.tools.status_table import render

    try:
        # The table asks for every row and shows the first --limit (the tenants' counts cover all).
        status = fetch(client, url, limit=args.limit if args.json else None)
    except StatusError as exc:
        if not args.watch or isinstance(exc, KeyRefused):
            raise
        message = f"clairvoyant status: {exc} (trying again in {args.interval:g} s)\n"
        if args.json:
            sys.stderr.write(message)
        else:
            out.write((_CLEAR_SCREEN if clear else "") + message)
        out.flush()
        return
    if args.json:
        # Under --watch one object per line (JSON Lines); once, indented.
        out.write(json.dumps(status, indent=None if args.watch else 1) + "\n")
    else:
        out.write((_CLEAR_SCREEN if clear else "") + render(status, url=url, limit=args.limit))
    out.flush()


def run(args: argparse.Namespace) -> int:
    import httpx

    if args.interval <= 0:
        raise StatusError("--interval must be positive")
    # The command line is the edge: the key's variable is read here, like the flag, never by the proxy.
    key = args.key if args.key is not None else os.environ.get(KEY_ENV)
    url = args.url.rstrip("/")
    out = sys.stdout
    # Redraw in place only on a terminal; piped, each refresh follows the last.
    clear = args.watch and not args.json and out.isatty()
    with httpx.Client(headers=_headers(key), timeout=httpx.Timeout(args.timeout)) as client:
        _show(out, args, client, url, clear=clear)
        while args.watch:
            time.sleep(args.interval)  # the refresh period itself, not a wait for an event
            if not clear and not args.json:
                out.write("\n")
            _show(out, args, client, url, clear=clear)
    return 0
