"""`clairvoyant simulate`: the discrete-event simulator on the command line.

    clairvoyant simulate run        [workload flags] [--conditions fcfs sjf:10.5 sjf:inf]
    clairvoyant simulate tau-sweep  [workload flags] [--mu-short 3.5|fcfs] [--multiples 0.5 1 2 3 5 10]
    clairvoyant simulate spectrum   [workload flags] [--rhos 0.3 0.5 0.6 0.74 0.85] [--tau-multiple 3]
    clairvoyant simulate compare    [--n 2000] [--seeds 5] [--prompts FILE]
                                    [--workloads paper heavy tenants models deadlines] [--switch-s 5]
    clairvoyant simulate swaps      [--seeds 5] [--small-cases 40] [--small-n 7] [--models 2 3] [--switch-s 3]

Workload defaults are the paper's (5.5): Poisson lambda = 0.12/s, N(3.5, 0.8) Short and
N(8.9, 2.0) Long 50/50 (clipped at --floor), n = 2,000, 5 seeds, oracle predictor, one slot.
Each command writes ``<name>.json`` (everything, per seed), ``<name>.csv`` (summary, long format),
``<name>_seeds.csv`` (per seed, wide), ``<name>.md`` (the tables) into --out, and PNG plots into
--plots (default: --out); it prints the tables. Nothing here imports the proxy (dispatcher, app,
fastapi, uvicorn, httpx); matplotlib and the ONNX runtime are imported only when used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

DEFAULT_PROMPTS = Path("profiler/data/prompts.jsonl")


def _mean_std(text: str) -> tuple[float, float]:
    try:
        mean, std = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MEAN,STD in seconds, got {text!r}") from None
    return mean, std


def _mix(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        for part in text.split(","):
            name, weight = part.split("=")
            out[name.strip()] = float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected e.g. short=0.5,long=0.5, got {text!r}") from None
    return out


def _condition(text: str) -> tuple[str, float, float, float | None, bool, float]:
    """POLICY[:TAU_S[+SLOWDOWN[cv]]][@GAMMA][/BOUND_S], e.g. ``sjf:10.5``, ``sjf:1+3.2``, ``sjf:1+2.56cv``
    (adaptive: x (1 + CV^2) of measured service times), ``boost:25@0.02``, ``sjf:1+2.56cv/30`` (requests
    grouped by model, a switch put off at most 30 s)."""
    text, _, bound = text.partition("/")
    rest, _, gamma = text.partition("@")
    policy, _, guard = rest.partition(":")
    tau, _, slowdown = guard.partition("+")
    adaptive = slowdown.endswith("cv")
    slowdown = slowdown.removesuffix("cv")
    try:
        return (
            policy,
            math.inf if tau in ("", "inf") else float(tau),
            float(slowdown) if slowdown else 0.0,
            float(gamma) if gamma else None,
            adaptive,
            float(bound) if bound else 0.0,
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected POLICY[:TAU_S[+SLOWDOWN[cv]]][@GAMMA][/BOUND_S], got {text!r}"
        ) from None


def _add_workload_flags(p: argparse.ArgumentParser, *, with_rate: bool = True) -> None:
    g = p.add_argument_group("workload")
    if with_rate:
        g.add_argument(
            "--arrivals", choices=("poisson", "burst"), default="poisson", help="arrival process (default poisson)"
        )
        rate = g.add_mutually_exclusive_group()
        rate.add_argument(
            "--rate", type=float, help="Poisson arrival rate lambda, 1/s (default 0.12 if --rho is not given)"
        )
        rate.add_argument("--rho", type=float, help="target utilisation; lambda = rho * slots / E[S]")
    g.add_argument("--n", type=int, default=2000, help="requests per seed (default 2000)")
    g.add_argument("--seeds", type=int, default=5, help="number of seeds (default 5)")
    g.add_argument("--seed-base", type=int, default=0, help="first seed (default 0)")
    g.add_argument("--slots", type=int, default=1, help="parallel backend slots (default 1)")
    g.add_argument(
        "--models", type=int, default=1,
        help="models the requests ask for, in equal shares; each slot holds one at a time (default 1)",
    )  # fmt: skip
    g.add_argument(
        "--switch-s", type=float, default=0.0,
        help="seconds a slot takes to load a model it does not hold (default 0; with --models 2, e.g. 5)",
    )  # fmt: skip
    g.add_argument(
        "--max-wait", type=_seconds_list, default=(), metavar="S,S,...",
        help="queue deadlines, seconds after arrival, drawn uniformly per request; a request not sent by "
        "then is withdrawn (default: none)",
    )  # fmt: skip
    g.add_argument(
        "--service", choices=("normal", "lognormal", "replay", "prompts"), default="normal",
        help="service-time model (default normal, the paper's)",
    )  # fmt: skip
    g.add_argument(
        "--short", type=_mean_std, default=(3.5, 0.8), metavar="MEAN,STD", help="Short service s (default 3.5,0.8)"
    )
    g.add_argument("--medium", type=_mean_std, default=None, metavar="MEAN,STD", help="Medium service s (default none)")
    g.add_argument(
        "--long", type=_mean_std, default=(8.9, 2.0), metavar="MEAN,STD", help="Long service s (default 8.9,2.0)"
    )
    g.add_argument("--mix", type=_mix, default=None, metavar="C=W,...", help="class mix (default short=0.5,long=0.5)")
    g.add_argument(
        "--floor", type=float, default=0.05, help="normal draws are clipped at this many seconds (default 0.05)"
    )
    g.add_argument("--replay", type=Path, help="measured service times: CSV (class,service_s) or JSON")
    g.add_argument(
        "--prompts",
        type=Path,
        default=DEFAULT_PROMPTS,
        help=f"prompt JSONL for --service prompts (default {DEFAULT_PROMPTS})",
    )
    g.add_argument("--c0", type=float, default=0.3, help="prompts cost model: seconds per request (default 0.3)")
    g.add_argument(
        "--c-tok", type=float, default=0.02, help="prompts cost model: seconds per output token (default 0.02)"
    )
    pr = p.add_argument_group("predictor")
    pr.add_argument(
        "--predictor", choices=("oracle", "noisy", "label", "onnx"), default="oracle", help="scores (default oracle)"
    )
    pr.add_argument(
        "--accuracy",
        type=float,
        default=0.8,
        help="noisy: target Short-vs-Long pairwise accuracy; label: fraction of right labels (default 0.8)",
    )
    pr.add_argument("--model", type=Path, default=None, help="onnx: model path (default: the shipped model)")
    pr.add_argument(
        "--spread", type=Path, default=None,
        help="onnx: order by expected tokens exp(m + v/2), v from this LogSpread JSON "
        "(benchmarks/bench_expected_key.py --spread FILE writes one; default: the median)",
    )  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument(
        "--out", type=Path, default=Path("results/sim"), help="directory for JSON/CSV/MD (default results/sim)"
    )
    o.add_argument("--plots", type=Path, default=None, help="directory for PNG plots (default: --out)")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--name", default=None, help="file name stem (default sim_<command>)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the simulate sub-subcommands on ``parser``."""
    sub = parser.add_subparsers(dest="sim_command", required=True, metavar="EXPERIMENT")
    p = sub.add_parser(
        "run", help="run chosen conditions on one workload", description="run chosen conditions on one workload"
    )
    _add_workload_flags(p)
    p.add_argument(
        "--conditions", nargs="+", type=_condition,
        default=[("fcfs", math.inf, 0.0, None, False, 0.0), ("sjf", math.inf, 0.0, None, False, 0.0)],
        metavar="POLICY[:TAU_S[+SLOWDOWN[cv]]][@GAMMA][/BOUND_S]",
        help="e.g. fcfs sjf:10.5 sjf:inf sjf:1+3.2 sjf:1+2.56cv sjf:1+2.56cv/30 boost:25@0.02 hrrn (default fcfs sjf:inf)",
    )  # fmt: skip
    p = sub.add_parser(
        "tau-sweep", help="paper 5.5: starvation timeout sweep", description="paper 5.5: starvation timeout sweep"
    )
    _add_workload_flags(p)
    p.add_argument(
        "--mu-short",
        default="3.5",
        help="mu_short in seconds, or 'fcfs' for the measured FCFS mean Short sojourn (default 3.5)",
    )
    p.add_argument(
        "--multiples", type=float, nargs="+", default=[0.5, 1, 2, 3, 5, 10], help="tau multiples of mu_short"
    )
    p = sub.add_parser(
        "spectrum",
        help="paper Fig. 3: SJF benefit vs utilisation",
        description="paper Fig. 3: SJF benefit vs utilisation",
    )
    _add_workload_flags(p, with_rate=False)
    p.add_argument("--rhos", type=float, nargs="+", default=[0.3, 0.5, 0.6, 0.74, 0.85], help="utilisations")
    p.add_argument("--tau-multiple", type=float, default=3.0, help="tau = this x mu_short (default 3)")
    p.add_argument("--mu-short", default="3.5", help="mu_short in seconds, or 'fcfs' (measured per rho) (default 3.5)")
    _add_compare(sub)
    _add_swaps(sub)


def _add_swaps(sub: Any) -> None:
    p = sub.add_parser(
        "swaps", help="model switches on mixed bursts and Poisson arrivals, against fcfs, the rule before "
        "weighing and the best order",
        description="model switches on mixed-length bursts and Poisson arrivals with 2 and 3 models: fcfs, the "
        "default with the switch rule before weighing, the default, and every order of small cases",
    )  # fmt: skip
    p.add_argument("--n", type=int, default=2000, help="Poisson workload: requests per seed (default 2000)")
    p.add_argument("--burst-n", type=int, default=24, help="burst workload: requests (default 24)")
    p.add_argument(
        "--small-n", type=int, default=7, help="small cases: requests, every order tried (default 7, at most 9)"
    )
    p.add_argument("--seeds", type=int, default=5, help="Poisson seeds; bursts run 4x as many (default 5)")
    p.add_argument("--small-cases", type=int, default=40, help="small cases per workload (default 40)")
    p.add_argument("--models", type=int, nargs="+", default=[2, 3], help="model counts (default 2 3)")
    p.add_argument("--switch-s", type=float, default=3.0, help="seconds a load takes (default 3)")
    p.add_argument("--out", type=Path, default=Path("results/sim"), help="directory for JSON/MD (default results/sim)")
    p.add_argument("--name", default="sim_swaps", help="file name stem (default sim_swaps)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_swaps(args: argparse.Namespace) -> int:
    from clairvoyant.tools.progress import progress_bar
    from clairvoyant.tools.sim import report, swaps

    if not 1 <= args.small_n <= 9:
        raise SystemExit("clairvoyant simulate swaps: --small-n must be 1 to 9 (every order is tried)")
    total = swaps.runs(seeds=args.seeds, small_cases=args.small_cases, models=args.models)
    with progress_bar(total=total, desc=args.name, unit="run", disable=args.no_progress, file=sys.stderr) as bar:
        data = swaps.swaps(
            n=args.n, burst_n=args.burst_n, small_n=args.small_n, seeds=args.seeds, small_cases=args.small_cases,
            models=args.models, switch_s=args.switch_s, progress=bar.update,
        )  # fmt: skip
    text = swaps.swaps_markdown(data)
    out: Path = args.out
    report.write_json(out / f"{args.name}.json", data)
    (out / f"{args.name}.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / (args.name + '.json')}, {out / (args.name + '.md')}")
    return 0


def _add_compare(sub: Any) -> None:
    p = sub.add_parser("compare", help="every policy on the paper, heavy-tailed and two-tenant workloads",
                       description="every policy on the paper, heavy-tailed and two-tenant workloads")  # fmt: skip
    p.add_argument("--n", type=int, default=2000, help="requests per seed (default 2000)")
    p.add_argument("--seeds", type=int, default=5, help="number of seeds (default 5)")
    p.add_argument(
        "--prompts",
        type=Path,
        default=DEFAULT_PROMPTS,
        help=f"prompt file for the heavy workload (default {DEFAULT_PROMPTS})",
    )
    p.add_argument("--model", type=Path, default=None, help="ONNX model for the real predictor (default: shipped)")
    p.add_argument("--c0", type=float, default=0.3, help="heavy workload: seconds per request (default 0.3)")
    p.add_argument("--c-tok", type=float, default=0.02, help="heavy workload: seconds per answer token (default 0.02)")
    p.add_argument(
        "--workloads", nargs="+", default=["paper", "heavy", "tenants"],
        choices=["paper", "heavy", "tenants", "models", "deadlines"],
    )  # fmt: skip
    p.add_argument(
        "--switch-s",
        type=float,
        default=5.0,
        help="models and deadlines workloads: seconds to load a model (default 5)",
    )
    p.add_argument("--out", type=Path, default=Path("results/sim"), help="directory for JSON/MD (default results/sim)")
    p.add_argument("--name", default="sim_compare", help="file name stem (default sim_compare)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_compare(args: argparse.Namespace) -> int:
    from clairvoyant.tools.progress import progress_bar
    from clairvoyant.tools.sim import compare, report

    prompts = args.prompts if "heavy" in args.workloads else None
    if prompts is not None and not prompts.is_file():
        raise SystemExit(f"clairvoyant simulate: prompts file {prompts} not found (--prompts)")
    with progress_bar(desc=args.name, unit="run", disable=args.no_progress, file=sys.stderr) as bar:
        data = compare.compare(
            n=args.n, seeds=range(args.seeds), prompts=prompts, model=args.model, c0_s=args.c0, c_tok_s=args.c_tok,
            workloads=args.workloads, progress=bar.update, switch_s=args.switch_s,
        )  # fmt: skip
    text = compare.compare_markdown(data)
    out: Path = args.out
    report.write_json(out / f"{args.name}.json", compare.compare_json(data))
    (out / f"{args.name}.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / (args.name + '.json')}, {out / (args.name + '.md')}")
    return 0


def _service(args: argparse.Namespace) -> Any:
    from clairvoyant.tools.sim import workload as wl

    params = {"short": args.short, "long": args.long}
    if args.medium is not None:
        params["medium"] = args.medium
    if args.service == "replay":
        if args.replay is None:
            raise SystemExit("clairvoyant simulate: --service replay needs --replay FILE")
        return wl.ReplayService(wl.load_replay(args.replay), args.mix)
    if args.service == "prompts":
        if not args.prompts.is_file():
            raise SystemExit(f"clairvoyant simulate: prompts file {args.prompts} not found (--prompts)")
        return wl.PromptService(wl.load_prompts(args.prompts), args.c0, args.c_tok)
    mix = args.mix or {"short": 0.5, "long": 0.5, **({"medium": 0.0} if args.medium is None else {})}
    if args.service == "lognormal":
        return wl.LognormalService(params, mix)
    return wl.NormalService(params, mix, args.floor)


def _scorer(args: argparse.Namespace, service: Any) -> Any:
    from clairvoyant.tools.sim import predictors as pr

    if args.predictor == "oracle":
        return pr.OracleScorer()
    if args.predictor == "noisy":
        return pr.NoisyScorer(args.accuracy)
    if args.predictor == "label":
        return pr.LabelScorer(args.accuracy)
    if args.service != "prompts":
        raise SystemExit("clairvoyant simulate: --predictor onnx needs --service prompts")
    from clairvoyant.prediction.predictor import OnnxPredictor

    spread = None
    if args.spread is not None:
        try:
            spread = pr.LogSpread.from_dict(json.loads(args.spread.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"clairvoyant simulate: --spread {args.spread}: {type(exc).__name__}: {exc}") from None
    return pr.PredictorScorer(OnnxPredictor(args.model), service.records, spread=spread)


def _condition_name(
    policy: str, tau: float, slowdown: float, gamma: float | None, adaptive: bool = False, bound_s: float = 0.0
) -> str:
    if math.isinf(tau) and policy == "fcfs" and gamma is None:
        return policy
    name = f"{policy} tau={tau:g}" + (f"+{slowdown:g}{'x(1+CV2)' if adaptive else ''}xS" if slowdown else "")
    name += f" gamma={gamma:g}" if gamma is not None else ""
    return name + (f" switch bound {bound_s:g} s" if bound_s else "")


def _seconds_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds separated by commas, got {text!r}") from None
    if any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"queue deadlines must be >= 0 seconds, got {text!r}")
    return values


def _mu_short(text: str) -> float | str:
    if text == "fcfs":
        return text
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"clairvoyant simulate: --mu-short must be seconds or 'fcfs', got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """Run the chosen experiment; write JSON/CSV/MD (+ PNG) files and print the tables. Returns 0."""
    from clairvoyant.tools.progress import progress_bar
    from clairvoyant.tools.sim import experiments as ex
    from clairvoyant.tools.sim import report

    if args.sim_command == "compare":
        return _run_compare(args)
    if args.sim_command == "swaps":
        return _run_swaps(args)
    service = _service(args)
    scorer = _scorer(args, service)
    seeds = tuple(range(args.seed_base, args.seed_base + args.seeds))
    command = args.sim_command
    if command != "spectrum" and args.arrivals == "poisson" and args.rate is None and args.rho is None:
        args.rate = 0.12
    setup = ex.Setup(
        service, args.n, seeds, getattr(args, "arrivals", "poisson"), getattr(args, "rate", None),
        getattr(args, "rho", None), args.slots, scorer, args.models, args.switch_s, tuple(args.max_wait),
    )  # fmt: skip
    if command == "run":
        runs = len(args.conditions)
    elif command == "tau-sweep":
        runs = len(args.multiples) + 2
    else:
        runs = 3 * len(args.rhos)
    name = args.name or f"sim_{command.replace('-', '_')}"
    with progress_bar(total=runs * len(seeds), desc=name, unit="run", disable=args.no_progress, file=sys.stderr) as bar:
        if command == "run":
            from clairvoyant.scheduling.policy import PolicyParams

            conds = [
                ex.Condition(
                    _condition_name(p, t, m, g, a, b),
                    p,
                    t,
                    slowdown=m,
                    adaptive_slowdown=a,
                    params=PolicyParams(boost_gamma_per_s=g) if g is not None else PolicyParams(),
                    model_switch_bound_s=b,
                )  # fmt: skip
                for p, t, m, g, a, b in args.conditions
            ]
            results = ex.run_conditions(setup, conds, bar.update)
            result: dict[str, Any] = {
                "experiment": "run", "setup": setup.describe(), "conditions": [r.as_dict() for r in results],
            }  # fmt: skip
            if conds[0].policy == "fcfs":
                result["change_vs_fcfs"] = ex.changes_vs(results[1:], results[0])
        elif command == "tau-sweep":
            result = ex.tau_sweep(
                setup, mu_short_s=_mu_short(args.mu_short), multiples=args.multiples, progress=bar.update
            )
        else:
            result = ex.spectrum(
                setup, rhos=args.rhos, tau_multiple=args.tau_multiple, mu_short_s=_mu_short(args.mu_short),
                progress=bar.update,
            )  # fmt: skip
    result["options"] = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")
    }
    text = _tables(result, report)
    out: Path = args.out
    report.write_json(out / f"{name}.json", result)
    if command == "spectrum":
        rows = [r for p in result["points"] for r in report.summary_rows("spectrum", p["conditions"], rho=p["rho"])]
        seed_rows = [r for p in result["points"] for r in report.seed_rows("spectrum", p["conditions"], rho=p["rho"])]
    else:
        rows = report.summary_rows(command, result["conditions"])
        seed_rows = report.seed_rows(command, result["conditions"])
    report.write_csv(out / f"{name}.csv", rows)
    report.write_csv(out / f"{name}_seeds.csv", seed_rows)
    (out / f"{name}.md").write_text(text + "\n")
    written = [out / f"{name}.{ext}" for ext in ("json", "csv", "md")]
    if not args.no_plots:
        from clairvoyant.tools.sim import plots

        plot = {"run": plots.plot_run, "tau-sweep": plots.plot_tau_sweep, "spectrum": plots.plot_spectrum}[command]
        written.append(plot(result, (args.plots or out) / f"{name}.png"))
    print(text)
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def _tables(result: dict[str, Any], report: Any) -> str:
    setup = result.get("setup", {})
    lines = [f"setup: {_setup_line(setup)}"]
    if result["experiment"] == "spectrum":
        accs = [c["summary"].get("accuracy", {}).get("mean") for p in result["points"] for c in p["conditions"][:1]]
        lines += _accuracy_line(accs)
        lines += ["", report.spectrum_table(result)]
        return "\n".join(lines)
    accs = [result["conditions"][0]["summary"].get("accuracy", {}).get("mean")]
    lines += _accuracy_line(accs)
    if result["experiment"] == "tau-sweep":
        lines.append(
            f"mu_short = {result['mu_short_s']:.3f} s ({result['mu_short_source']}); measured FCFS mean Short "
            f"sojourn = {result['fcfs_mean_short_sojourn_s']:.3f} s, mean Short wait = {result['fcfs_mean_short_wait_s']:.3f} s"
        )
    if setup.get("models", 1) > 1 or setup.get("max_wait_s"):
        lines += ["", "model switches, sojourn (s) and deadlines, mean ± std over seeds:"]
        lines += [report.switch_table(result["conditions"])]
    lines += ["", "sojourn (s), mean ± std over seeds:", report.conditions_table(result["conditions"], "sojourn")]
    lines += ["", "wait (s), mean ± std over seeds:", report.conditions_table(result["conditions"], "wait")]
    if "change_vs_fcfs" in result:
        lines += ["", "change vs FCFS (per seed, mean ± std):", report.changes_table(result)]
    return "\n".join(lines)


def _accuracy_line(accs: list[Any]) -> list[str]:
    vals = [a for a in accs if a is not None and not math.isnan(a)]
    if not vals:
        return []
    return [
        f"achieved Short-vs-Long pairwise ranking accuracy: {min(vals):.4f}"
        + (f"..{max(vals):.4f}" if len(vals) > 1 else "")
    ]


def _setup_line(setup: dict[str, Any]) -> str:
    parts = [f"n={setup.get('n')}", f"seeds={setup.get('seeds')}", f"arrivals={setup.get('arrivals')}"]
    if setup.get("rate_per_s") is not None:
        parts.append(f"lambda={setup['rate_per_s']:.4g}/s rho={setup['rho_nominal']:.3f}")
    parts += [
        f"E[S]={setup.get('mean_service_s', math.nan):.3f}s",
        f"slots={setup.get('slots')}",
        f"predictor={setup.get('predictor')}",
    ]
    if setup.get("models", 1) > 1:
        parts.append(f"models={setup['models']} switch={setup.get('switch_s', 0.0):g}s")
    if setup.get("max_wait_s"):
        parts.append("deadlines=" + ",".join(f"{d:g}" for d in setup["max_wait_s"]) + "s")
    return " ".join(parts)
