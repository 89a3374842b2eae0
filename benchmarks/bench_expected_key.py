"""The queue ordered by expected tokens (exp(m + v/2), a log-normal's mean) against today's key, the
median (exp(m)), in the simulator: mean and P99 sojourn at rho 0.7 and 0.9, side by side.

    nice -n 10 python benchmarks/bench_expected_key.py [--seeds 0 1 2 3 4 5 6 7 8 9] [--n 2000] \
        [--rhos 0.7 0.9] [--train-rows 8000] [--penalty 100] [--spread FILE] [--json FILE]
    nice -n 10 python benchmarks/bench_expected_key.py --llamacpp [--runs 2] [--n-short 20 --n-long 20] \
        [--length-scale 0.1] [--spread FILE]

The workload is the simulator's prompt workload (``clairvoyant simulate --service prompts``): the 274
held-out ShareGPT first turns of profiler/data/prompts.jsonl, resampled, each served in
0.3 s + 0.02 s x its reference answer's tokens, Poisson arrivals. The scheduler is the proxy's own
queue code (``clairvoyant.tools.sim.simulate``): pure sjf, and the default starvation guard
(tau = 1 s + 2.56 x (1 + CV^2) x predicted seconds) with predicted seconds from the fixed cost model
and, as the proxy has them, from the online service-time model ("learned S": measured seconds
regressed on the key's tokens, which takes the median's bias out of them).

The spread v (``LogSpread``: a ridge of the squared ln-token residual on the prediction and the
feature row) is fitted on the shipped model's residuals over ``--train-rows`` English first turns
of ShareGPT's TRAINING conversations (the side the shipped model trained on), so the held-out
prompts the simulator scores are not in it. A function of m alone leaves the order as it is; the
feature row is what moves it. The oracle (the true service time) is printed as the ceiling.

``--spread FILE``: read the fitted spread from FILE if it exists, else fit it and write it there
(the fit reads ShareGPT and checks languages: minutes).

``--llamacpp``: the same two keys in front of real llama.cpp (the embedded SmolLM2 server, one slot;
or ``--backend URL``), Poisson arrivals at each rho, the rate from a service model fitted on requests
sent one at a time (``bench_scheduling.calibrate``), Short and Long held-out prompts with forced
answer lengths (``bench_scheduling.poisson``). The proxy orders by the key through its
benchmark-only field (``allow_oracle``: the field's value becomes the score), pure sjf; both keys
run on the same requests, in an order rotated by run. Prints mean and P99 end-to-end seconds and
their paired ratios.

Keys per request: median = the shipped model's ln tokens m; expected = m + v/2; oracle = the truth.
Predicted seconds (the guard's deadline) are 0.3 + 0.02 x that key's tokens, or learned. Target (expected vs
median): mean <= 95%, P99 <= 110%, per rho, seed-paired ratios averaged over seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clairvoyant.prediction.predictor import OnnxPredictor  # noqa: E402
from clairvoyant.scheduling.boost import bucket_for  # noqa: E402
from clairvoyant.scheduling.service_time import ServiceTimeModel  # noqa: E402
from clairvoyant.scheduling.slowdown import AdaptiveSlowdown  # noqa: E402
from clairvoyant.tools.sim.engine import Beliefs, simulate  # noqa: E402
from clairvoyant.tools.sim.predictors import LogSpread  # noqa: E402
from clairvoyant.tools.sim.workload import PromptService, load_prompts, make_workload  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "profiler" / "data" / "prompts.jsonl"
C0_S, C_TOK_S = 0.3, 0.02
GUARDS = {
    "sjf": {},
    "default guard": {"starvation_timeout_s": 1.0, "slowdown": 2.56},
    "default, learned S": {"starvation_timeout_s": 1.0, "slowdown": 2.56, "learn": True},
}


def training_sample(rows: int, seed: int = 0) -> tuple[list, np.ndarray]:
    """``rows`` English first turns of ShareGPT training conversations (seeded) and their answers'
    ln cl100k tokens."""
    from clairvoyant.tools.training.dataset import NaturalConfig, _is_test_group, is_english, load_pairs
    from clairvoyant.tools.training.labels import count_tokens

    split = NaturalConfig()
    train = [p for p in load_pairs() if p.turn == 0 and not _is_test_group(p.group, split.seed, split.test_fraction)]
    picked = []
    for i in np.random.default_rng(seed).permutation(len(train)):
        if is_english(train[i].prompt.instruction):
            picked.append(train[i])
            if len(picked) == rows:
                break
    tokens = count_tokens([p.answer for p in picked])
    return [p.prompt for p in picked], np.log(np.maximum(tokens.astype(np.float64), 1.0))


def fitted_spread(predictor: OnnxPredictor, path: Path | None, rows: int, penalty: float) -> LogSpread:
    """The spread read from ``path``, or fitted (and written to ``path`` if given)."""
    if path is not None and path.is_file():
        return LogSpread.from_dict(json.loads(path.read_text()))
    train_prompts, train_observed = training_sample(rows)
    train_features = predictor.feature_set.extract_many(train_prompts)
    train_m = predictor.calibration.log_tokens_many(predictor.raw_scores(train_features))
    spread = LogSpread.fit(train_features, train_m, train_observed, penalty=penalty)
    if path is not None:
        path.write_text(json.dumps({**spread.as_dict(), "fitted_on_rows": len(train_observed)}) + "\n")
    return spread


def llamacpp(args: argparse.Namespace, predictor: OnnxPredictor, spread: LogSpread) -> int:
    """Both keys in front of real llama.cpp (see the module docstring)."""
    from dataclasses import replace

    from bench_scheduling import calibrate, poisson

    from clairvoyant.prediction.features import Prompt
    from clairvoyant.tools.bench.commands import backend
    from clairvoyant.tools.bench.commands import load_prompts as bench_prompts
    from clairvoyant.tools.bench.runner import BenchConfig, run_workload, target_for, wait_idle
    from clairvoyant.tools.bench.workload import burst

    prompts = bench_prompts(PROMPTS, ("short", "long"))

    def keyed(specs: list, key: str) -> list:
        """``specs`` carrying the key's tokens as their benchmark-only length (the proxy's score)."""
        out = []
        for spec in specs:
            prediction = predictor.predict(Prompt(spec.text))
            m = float(np.log(prediction.predicted_tokens))
            if key == "expected":
                m = float(spread.expected_log_tokens(prediction.features()[None, :], np.array([m]))[0])
            out.append(replace(spec, answer_tokens=float(np.exp(m))))
        return out

    figures: dict[str, dict[str, list[tuple[float, float]]]] = {}
    with backend(args.backend) as (url, label):
        config = BenchConfig(backend_url=url, tau_s=float("inf"), conditions=("oracle",))
        run_workload(url, burst(prompts, n_short=1, n_long=0, length_scale=args.length_scale, seed=999))  # warm-up
        sample = burst(prompts, n_short=3, n_long=3, length_scale=args.length_scale, seed=1000)
        service, _ = calibrate(config, sample)
        for rho in args.rhos:
            runs: dict[str, list[tuple[float, float]]] = {"median": [], "expected": []}
            for run in range(args.runs):
                specs, _ = poisson(
                    prompts, n_short=args.n_short, n_long=args.n_long, length_scale=args.length_scale,
                    rho=rho, service=service, seed=run,
                )  # fmt: skip
                order = ["median", "expected"] if run % 2 == 0 else ["expected", "median"]
                for key in order:
                    wait_idle(url)
                    with target_for(config, "oracle") as proxy_url:
                        results = run_workload(proxy_url, keyed(specs, key), oracle=True, hide_length=True)
                    e2e = np.array([r.e2e_s for r in results if r.ok])
                    if len(e2e) != len(specs):
                        raise RuntimeError(f"{len(specs) - len(e2e)} requests failed")
                    runs[key].append((float(e2e.mean()), float(np.percentile(e2e, 99))))
                    print(
                        f"rho {rho:g} run {run} {key}: mean {e2e.mean():.2f} s, P99 {np.percentile(e2e, 99):.2f} s",
                        flush=True,
                    )
            figures[f"rho {rho:g}, sjf, {label}"] = runs
    _table(figures, args)
    return 0


def _table(figures: dict[str, dict[str, list[tuple[float, float]]]], args: argparse.Namespace) -> bool:
    """Print mean and P99 per run and key, and the per-seed ratios to the median key's."""
    header = f"{'run':32s} {'key':9s} {'mean s':>8s} {'P99 s':>8s} {'mean ratio':>11s} {'P99 ratio':>10s}"
    print(header)
    print("-" * len(header))
    met = True
    for run, runs in figures.items():
        base = np.array(runs["median"])
        for name, values in runs.items():
            a = np.array(values)
            mean_ratio, p99_ratio = float(np.mean(a[:, 0] / base[:, 0])), float(np.mean(a[:, 1] / base[:, 1]))
            print(
                f"{run:32s} {name:9s} {a[:, 0].mean():8.2f} {a[:, 1].mean():8.1f} {mean_ratio:11.3f} {p99_ratio:10.3f}"
            )
            if name == "expected" and not (mean_ratio <= 0.95 and p99_ratio <= 1.10):
                met = False
    print(f"target: expected key mean <= 0.95 x median's, P99 <= 1.10 x, every run: {'MET' if met else 'NOT MET'}")
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": figures, "met": met}, indent=2) + "\n")
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--n", type=int, default=2000, help="requests per seed")
    parser.add_argument("--rhos", type=float, nargs="+", default=[0.7, 0.9])
    parser.add_argument("--train-rows", type=int, default=8000, help="ShareGPT training turns the spread is fitted on")
    parser.add_argument(
        "--penalty", type=float, default=100.0, help="the spread's ridge penalty (standardised columns)"
    )
    parser.add_argument("--model", type=Path, default=None, help="ONNX model (default: the shipped model)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--spread", type=Path, default=None, help="the fitted spread: read if it exists, else written")
    parser.add_argument("--llamacpp", action="store_true", help="in front of real llama.cpp instead of the simulator")
    parser.add_argument("--backend", default=None, help="--llamacpp: a running llama.cpp URL (default: embedded)")
    parser.add_argument("--runs", type=int, default=2, help="--llamacpp: paired runs per rho")
    parser.add_argument("--n-short", type=int, default=20, help="--llamacpp: Short requests per run")
    parser.add_argument("--n-long", type=int, default=20, help="--llamacpp: Long requests per run")
    parser.add_argument("--length-scale", type=float, default=0.1, help="--llamacpp: forced length / true length")
    args = parser.parse_args(argv)

    predictor = OnnxPredictor(args.model)
    spread = fitted_spread(predictor, args.spread, args.train_rows, args.penalty)
    if args.llamacpp:
        return llamacpp(args, predictor, spread)

    records = load_prompts(PROMPTS)
    features = predictor.feature_set.extract_many([r.prompt for r in records])
    m = predictor.calibration.log_tokens_many(predictor.raw_scores(features))
    observed = np.log(np.maximum([r.output_tokens for r in records], 1.0))
    v = spread.variance(features, m)
    r2 = (observed - m) ** 2
    print(
        f"spread: mean v {spread.intercept:.3f} ln tokens^2 over its ShareGPT training first turns; "
        f"on the {len(records)} held-out prompts: v p5/p50/p95 {np.percentile(v, [5, 50, 95]).round(2).tolist()}, "
        f"corr(v, squared residual) {np.corrcoef(v, r2)[0, 1]:.3f}"
    )
    keys = {"median": m, "expected": m + v / 2, "oracle": observed}
    service = PromptService(records, C0_S, C_TOK_S)
    figures: dict[str, dict] = {}
    for rho in args.rhos:
        for guard, kw in GUARDS.items():
            runs: dict[str, list[tuple[float, float]]] = {k: [] for k in keys}
            for seed in args.seeds:
                workload = make_workload(seed, args.n, service, rho=rho)
                for name, key in keys.items():
                    score = key[workload.item]
                    predicted_s = C0_S + C_TOK_S * np.exp(score)
                    buckets = np.array([bucket_for(float(s)) for s in predicted_s], dtype=np.int64)
                    beliefs = Beliefs(score, predicted_s, buckets, np.exp(score))
                    guard_kw: dict = {}
                    if kw:
                        guard_kw = {
                            "starvation_timeout_s": kw["starvation_timeout_s"],
                            "starvation_slowdown": AdaptiveSlowdown(kw["slowdown"]),
                            "service_time": ServiceTimeModel() if kw.get("learn") else None,
                        }
                    sojourn = simulate(workload, beliefs, policy="sjf", **guard_kw).sojourn_s(workload)
                    runs[name].append((float(sojourn.mean()), float(np.percentile(sojourn, 99))))
            figures[f"rho {rho:g}, {guard}"] = runs

    print(f"seeds {args.seeds}, {args.n} requests each; sojourn seconds, mean over seeds; ratio: per-seed key / median")
    _table(figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
