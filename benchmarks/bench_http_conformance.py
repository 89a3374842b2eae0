"""HTTP/1.1 conformance of the proxy as a black box, beside nginx: the framing and smuggling vectors
(harness/http_vectors.py) and the ported scored tests of MDA2AV/Http11Probe (harness/http11probe.py;
which tests, and what could not be ported, is in that module's docstring).

Every target sits in front of the same recording backend (``recording_backend.RecordingBackend``, in a
thread of this process), which keeps each request's bytes as they arrived:

- the proxy, ``python -m clairvoyant serve`` as a child process, from this checkout's src/ or from
  each ``--proxy-src`` tree (several builds side by side in one run). Two processes per build: one
  as deployed on loopback (no keys, every path passes), and one with an API key and an allowlist for
  the vectors about ``Expect: 100-continue`` admission (``http_vectors.keyed_settings``);
- nginx as a reverse proxy (``servers.nginx`` with ``request_path.nginx_proxy_conf``: HTTP/1.1
  upstream keepalive, proxy_buffering off). It has no keys: the keyed vectors are "n/a" there.

Printed: one row per vector (each target's client outcome, backend deliveries, PASS/FAIL), the
targets the vectors judge (no smuggled request reaches the backend), and the suite's counts
side by side (pass / warn / fail / error over its scored tests, and the tests failing anywhere).
The figures go to ``--json FILE``.

    PYTHONPATH=src python benchmarks/bench_http_conformance.py                    # ~3-4 min
    PYTHONPATH=src python benchmarks/bench_http_conformance.py --proxy-src /path/to/new/src
    ... --no-nginx  --no-suite  --no-vectors  --probe-timeout 5  --only cl-te-both,options-asterisk

Vectors and suite tests run one at a time; a test that waits for the suite's read timeout (5 s,
as its command line) takes that long, so the suite takes about a minute per target.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harness import http11probe, servers
from harness import http_vectors as hv
from harness.proxy_process import PROXY_SRC, ProxyProcess, free_port
from harness.recording_backend import RecordingBackend
from harness.request_path import nginx_proxy_conf
from harness.results import add_json_option, write_json

MAX_SUITE_FAILURES = 10  # the target: at most this many of the suite's scored tests fail


@dataclass
class Target:
    label: str
    ports: dict[str, int]  # a vector's configuration ("open", "keyed") -> port
    kind: str  # "proxy" or "nginx"
    src: str | None = None


def tree_label(src: Path) -> str:
    """``proxy`` plus the tree's commit (and ``+changes`` when its src/ differs from it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=src, capture_output=True, text=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=src, capture_output=True)
    except OSError:
        return f"proxy ({src})"
    if head.returncode != 0:
        return f"proxy ({src})"
    return f"proxy@{head.stdout.strip()}{'+changes' if dirty.returncode else ''}"


@contextlib.contextmanager
def proxy_target(src: Path, backend: RecordingBackend, log_dir: Path, label: str) -> Iterator[Target]:
    tag = label.replace("@", "-").replace("+", "-").replace(" ", "_").replace("/", "_")
    proxies = [
        ProxyProcess(f"{tag}-open", backend.base_url, log_dir, src=src),
        ProxyProcess(f"{tag}-keyed", backend.base_url, log_dir, src=src, **hv.keyed_settings()),
    ]
    try:
        for proxy in proxies:
            proxy.start()
        yield Target(label, {"open": proxies[0].port, "keyed": proxies[1].port}, "proxy", str(src))
    finally:
        for proxy in proxies:
            proxy.stop()


@contextlib.contextmanager
def nginx_target(backend: RecordingBackend) -> Iterator[Target]:
    port = free_port()
    with servers.nginx(lambda prefix: nginx_proxy_conf(prefix, port, backend.base_url), port):
        yield Target("nginx", {"open": port}, "nginx")


def run_vectors(targets: list[Target], backend: RecordingBackend, only: set[str] | None) -> list[dict[str, Any]]:
    rows = []
    vectors = [v for v in hv.VECTORS if only is None or v.name in only]
    for vector in vectors:
        row: dict[str, Any] = {"name": vector.name, "group": vector.group, "source": vector.source,
                               "expected": " | ".join(c.describe() for c in vector.cases), "results": {}}  # fmt: skip
        for target in targets:
            port = target.ports.get(vector.proxy)
            if port is None:
                row["results"][target.label] = None
                continue
            verdict = hv.run_vector(vector, port, backend, scheduler=target.kind == "proxy")
            row["results"][target.label] = {
                "ok": verdict.ok,
                "outcome": verdict.exchange.outcome(),
                "answer_s": round(verdict.exchange.finals[0].at_s, 3) if verdict.exchange.finals else None,
                "deliveries": len(verdict.delivered),
                "delivered": verdict.deliveries_text(),
                "smuggled": any(hv.SMUGGLED in r.target for r in verdict.delivered),
                "problems": verdict.problems,
            }
        rows.append(row)
        print_vector_row(row, targets)
    return rows


def print_vector_row(row: dict[str, Any], targets: list[Target]) -> None:
    cells = []
    for t in targets:
        r = row["results"][t.label]
        cells.append("n/a" if r is None else f"{'PASS' if r['ok'] else 'FAIL'} {r['outcome']} [{r['deliveries']}]")
    print(f"{row['name']:30} {row['expected'][:44]:44} " + " ".join(f"{c:30}" for c in cells), flush=True)


def run_suites(targets: list[Target], timeout_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target in targets:
        started = time.monotonic()
        results, score = http11probe.run_suite(target.ports["open"], timeout_s=timeout_s)
        out[target.label] = {
            "passed": score.passed, "warned": score.warned, "failed": score.failed, "errors": score.errors,
            "scored": len(results), "failures": score.failures,
            "seconds": round(time.monotonic() - started, 1),
            "results": {r.case.id: {"verdict": r.verdict, "got": r.got} for r in results},
        }  # fmt: skip
        print(f"  {target.label}: {score.passed} pass, {score.warned} warn, {score.failed} fail, {score.errors} error "
              f"of {len(results)} scored ({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
    return out


def print_vector_failures(rows: list[dict[str, Any]], targets: list[Target]) -> None:
    print("\nFailing vectors, why:")
    for row in rows:
        for t in targets:
            r = row["results"][t.label]
            if r is not None and not r["ok"]:
                print(f"  {row['name']} @ {t.label}: {'; '.join(r['problems'])[:200]}")


def print_suite_table(suite: dict[str, Any], targets: list[Target]) -> None:
    labels = [t.label for t in targets if t.label in suite]
    if not labels:
        return
    print("\nHttp11Probe scored tests (ported):")
    print(f"{'':10} " + " ".join(f"{label:>26}" for label in labels))
    for key in ("passed", "warned", "failed", "errors", "scored"):
        print(f"{key:10} " + " ".join(f"{suite[label][key]:>26}" for label in labels))
    failing = sorted({f for label in labels for f in suite[label]["failures"]})
    if failing:
        print(f"\n{'failing somewhere':46} " + " ".join(f"{label:>26}" for label in labels))
        for test in failing:
            cells = []
            for label in labels:
                r = suite[label]["results"][test]
                cells.append(f"{r['verdict'].upper()} {r['got']}"[:26])
            print(f"{test:46} " + " ".join(f"{c:>26}" for c in cells))


def judge_targets(rows: list[dict[str, Any]], suite: dict[str, Any], targets: list[Target]) -> list[str]:
    """The lines stating the targets for each proxy build."""
    lines = []
    for t in targets:
        if t.kind != "proxy":
            continue
        smuggled = [row["name"] for row in rows if (r := row["results"].get(t.label)) and r["smuggled"]]
        if rows:
            lines.append(f"{t.label}: smuggled requests reaching the backend: {len(smuggled)} "
                         f"{'PASS' if not smuggled else 'FAIL ' + ', '.join(smuggled)}")  # fmt: skip
        if t.label in suite:
            failed = suite[t.label]["failed"]
            verdict = "PASS" if failed <= MAX_SUITE_FAILURES else "FAIL"
            lines.append(f"{t.label}: suite failures {failed} (target <= {MAX_SUITE_FAILURES}): {verdict}")
    builds = [t.label for t in targets if t.kind == "proxy" and t.label in suite]
    for label in builds[1:]:  # against the first build given: what it newly fails, and fixes
        first, this = set(suite[builds[0]]["failures"]), set(suite[label]["failures"])
        lines.append(f"{label} vs {builds[0]}: newly failing {sorted(this - first) or 'none'}; "
                     f"fixed {sorted(first - this) or 'none'}")  # fmt: skip
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy-src", type=Path, action="append",
                        help="src/ directory of a proxy build (repeat for several side by side; default this checkout's)")  # fmt: skip
    parser.add_argument("--no-nginx", action="store_true", help="leave nginx out")
    parser.add_argument("--no-suite", action="store_true", help="skip the ported Http11Probe tests")
    parser.add_argument("--no-vectors", action="store_true", help="skip the vectors")
    parser.add_argument("--only", help="comma-separated vector names (default all)")
    parser.add_argument("--probe-timeout", type=float, default=5.0, help="the suite's read timeout, s (default 5)")
    add_json_option(parser, "http_conformance")
    parser.add_argument("--log-dir", type=Path, help="where the proxies' logs go (default a temporary directory)")
    args = parser.parse_args()
    srcs = [p.resolve() for p in (args.proxy_src or [PROXY_SRC[0]])]
    only = {n.strip() for n in args.only.split(",")} if args.only else None
    if only and (unknown := only - {v.name for v in hv.VECTORS}):
        parser.error(f"unknown vectors: {', '.join(sorted(unknown))}")
    if not args.no_nginx:
        servers.require_tools("nginx")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-conformance-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    backend = RecordingBackend().start()
    targets: list[Target] = []
    with contextlib.ExitStack() as stack:
        labels: list[str] = []
        for src in srcs:
            label = tree_label(src)
            while label in labels:
                label += "'"
            labels.append(label)
            print(f"starting {label} from {src}", flush=True)
            targets.append(stack.enter_context(proxy_target(src, backend, log_dir, label)))
        if not args.no_nginx:
            targets.append(stack.enter_context(nginx_target(backend)))
        rows: list[dict[str, Any]] = []
        suite: dict[str, Any] = {}
        if not args.no_vectors:
            print("\nVectors (client outcome [requests that reached the backend]):")
            print(f"{'vector':30} {'expected':44} " + " ".join(f"{t.label:30}" for t in targets), flush=True)
            rows = run_vectors(targets, backend, only)
        if not args.no_suite:
            print("\nHttp11Probe, ported:", flush=True)
            suite = run_suites(targets, args.probe_timeout)
    backend.stop()
    if rows:
        print_vector_failures(rows, targets)
    print_suite_table(suite, targets)
    verdicts = judge_targets(rows, suite, targets)
    if verdicts:
        print("\nTargets:")
        for line in verdicts:
            print(f"  {line}")
    took = time.monotonic() - started
    print(f"\n{took:.0f} s; proxy logs in {log_dir}")
    result = {
        "command": " ".join(["PYTHONPATH=src python benchmarks/bench_http_conformance.py", *sys.argv[1:]]),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "seconds": round(took),
        "load_average": os.getloadavg(),
        "targets": [{"label": t.label, "kind": t.kind, "src": t.src} for t in targets],
        "vectors": rows,
        "suite": suite,
        "verdicts": verdicts,
    }
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
