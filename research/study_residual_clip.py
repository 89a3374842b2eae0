"""Issue 8, brief QWEN: a clipped (Huber-style) residual for the online learner's ridge target and its kNN memory.

DIAGNOSIS (main f395ea7, seeds 0-14, research/diagnose_replay_gap.py; a diagnosis of main, no figure of the variant):
- The static prior already orders Qwen1.5 best (second-half tau_b 0.456 vs 0.390 / 0.428 / 0.382 for Llama3 /
  Mistral / gemma), so there is less left to win; but its answers agree with the other models' as well as any
  (tau 0.50-0.63), so the room is there.
- Qwen1.5's lengths have the heaviest LOW tail: ln-length sd 1.02 (0.81-0.94 the others), skew of ln length -2.20
  (-0.95..-1.58); 12 of its 406 answers are 1-13 tokens (the others' shortest: 3, 10, 9 tokens).
- Residuals after the linear correction (second half, pooled over seeds 0-14): Qwen's 1% quantile is -3.16 ln
  tokens (-1.80..-2.01 the others), and the 5% of its residuals with |r| > 1.5 carry 55% of its residual sum of
  squares (27% / 34% / 38% for Llama3 / Mistral / gemma). A squared-loss ridge (and a weighted-mean kNN) is pulled
  by a handful of one-word answers whose prompts look like any other; those pulls are ranking noise for the rest.
- Turning each part off (second-half gain over --no-learn, seeds 0-14): ridge alone +0.091 / +0.057 / +0.046 /
  +0.043; kNN alone (residuals after the prior, k 16, shrinkage 16) +0.025 / +0.014 / +0.026 / +0.021; both (main)
  +0.100 / +0.059 / +0.055 / +0.046. The ridge carries most of the gain; the kNN adds 0.002-0.009.
- Gain by lines (main, seeds 0-14): Qwen -0.018 (lines 17-100), +0.034, +0.039, +0.056 (lines 306-406); gemma
  alike. The weak models gain late: their fits are noisy early, which outliers make worse.

THE VARIANT (one family, the same rule for every model; no model name anywhere). Huber's pseudo-observation, made
online: when an observation arrives, with y = observed - prior ln tokens and yhat = the linear correction in force
(0 before the first fit), the learner keeps

    y* = yhat + clip(y - yhat, -c, c)

as the ridge's target (in the ring and its moments, so a refit and an eviction use the same value), and the
clipped residual clip(y - yhat, -c, c) as the kNN memory's residual (the kNN's residual is already y - yhat). c is
in ln tokens: an answer more than e^c times longer or shorter than the fit expected counts as if it were e^c off.
The sufficient statistics, the refit's cost and the child-process contract (the kNN residual travels with the
observation) stay as they are; the rolling quality keeps the raw observed lengths. c = inf is main.

PRE-REGISTERED (this docstring is committed before any AlpacaEval figure of the variant):
- grid: c in {0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0} ln tokens (9 points; the residual sd after the
  correction is 0.60-0.77, so 0.5 clips about half the observations, 3.0 about 1% of Qwen's and almost none of
  the others').
- protocol: exactly benchmarks/bench_replay_learning.py's (each model's 406 AlpacaEval prompts in a seeded random
  order, refined by the encoder, each scored before its own length is learned, refit every 8; second-half tau_b
  with learning minus --no-learn), the shipped LearnerConfig otherwise (kNN k 16, shrinkage 16).
- pick rule: on seeds 0-14 (seen before), per grid point the mean gain over seeds per model; pick the point with
  the highest per-model MINIMUM of those means (rounded to 3 decimals), ties by the mean over models.
- confirmation, no re-picking: seeds 30-59 (never used), the pick vs main in the same run, plus the ShareGPT
  held-out row (a guard, never used to pick).
- ship rule: on seeds 30-59 the per-model minimum rises over main, the mean over models does not drop, and the
  ShareGPT held-out gain drops by no more than 0.003. Whether each model reaches +0.05 on 30-59 is reported either way.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/study_residual_clip.py \
        --seeds 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 --json /tmp/qwen/clip_s014.json
    ... --seeds 30 31 ... 59 --sharegpt --only C --json /tmp/qwen/clip_s3059.json

OUTCOME OF THE ABOVE (research/residual_clip_seeds0-14.log, residual_clip_seeds30-59.log): the pick c = 1 met its
ship rule on seeds 30-59 (min model +0.054 -> +0.058, mean +0.072 -> +0.075, ShareGPT -0.013 -> -0.005). BUT the
pseudo-observation is kept as it was clipped, against the fit in force THEN (the prior alone before the first
fit): a deployment whose model is far (> c) from the prior has its first observations clipped toward the prior
and they pull the fit back until evicted. tests/test_learner.py's biased prior (x e^1.5, 400 observations, one
refit) then keeps 0.37 of mean |error| instead of < 0.3; with a refit every 8 and a bias of e^2.5 / e^4 the error
after 100 observations is 0.54 / 1.72 against main's 0.34 / 0.49. Learning a biased prior is a requirement of issue 8,
so this variant is NOT shipped as it stands.

FOLLOW-UP, PRE-REGISTERED before any AlpacaEval figure of it (it is registered AFTER the figures above, with the same
grid and rules, which is why it is confirmed on seeds that nobody has used, 60-89): the same Huber
pseudo-target, but made AT EACH REFIT against the fit in force then, over the rows the ring keeps (one IRLS step per
refit; the ring keeps the raw observations, so nothing clipped is kept; the first fit is unclipped). The Gram
matrix still comes from the moments; only the target's sums (sum y*, Z'y*, y*'y*) are recomputed from the rows, one
1024 x 65 pass per model. The kNN memory's residual is clipped at observe time as above (the kNN is a memory, not a fit).
- grid: the same 9 values of c; `--at refit`.
- pick rule: the same, on seeds 0-14.
- confirmation, no re-picking: seeds 60-89 (never used by anyone), the pick vs main in the same run, plus ShareGPT;
  seeds 30-59 are reported too (seen once, by the variant above).
- ship rule: on seeds 60-89 the per-model minimum rises over main, the mean does not drop, ShareGPT drops by no more
  than 0.003, AND tests/test_learner.py's biased-prior test passes unchanged. Else nothing ships.

    ... --at refit --seeds 0 ... 14 ;  ... --at refit --seeds 60 ... 89 --sharegpt --only C ; the same for 30 ... 59

OUTCOME (research/residual_clip_refit_seeds*.log): the pick rule picked c = 1 on seeds 0-14 (min model +0.046 ->
+0.054, mean +0.065 -> +0.068). Seeds 60-89: min model +0.050 -> +0.057, mean +0.073 -> +0.076, ShareGPT -0.011 ->
-0.005; the biased-prior test passes unchanged: SHIPPED (LearnerConfig.residual_clip = 1.0). Seeds 30-59: +0.054 ->
+0.058, +0.072 -> +0.074, ShareGPT -0.013 -> -0.006. The "observe" runs above need commit 6889062 (`--at observe`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "research"))

from bench_replay_learning import SHAREGPT, _sharegpt_turns  # noqa: E402
from study_residual_knn import Memo  # noqa: E402

from clairvoyant.prediction.encoder import encoder_for  # noqa: E402
from clairvoyant.prediction.features import Prompt  # noqa: E402
from clairvoyant.prediction.learner import LearnerConfig, OnlineLearner, kendall_tau_b  # noqa: E402
from clairvoyant.prediction.predictor import OnnxPredictor  # noqa: E402
from clairvoyant.tools.bulk_predict import request_of_line  # noqa: E402

GRID = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)
CLIP_AT = "observe"  # --at


def replays(
    predictor: OnnxPredictor, memo: Memo, prompts: list[Prompt], lengths: list[int], model: str, clips: list[float]
) -> dict[str, list[float]]:
    """The static scores and, per clip (inf: main), one learner pass's scores, each line scored before it is learned
    (``score_then_learn``'s steps; the lexical prediction and the encoder's opinion computed once for all passes)."""
    lexical = [predictor.predict(p, model=model) for p in prompts]
    opinions = [memo.get(p.instruction)[:3] for p in prompts]
    weights = memo.encoder.blend_weights
    scores: dict[str, list[float]] = {}
    predictor.corrector = None
    scores["static"] = [predictor.refined(lx, v, weights, c, k).score for lx, (v, c, k) in zip(lexical, opinions)]
    for clip in clips:
        config = LearnerConfig(residual_clip=clip)
        learner = OnlineLearner.for_predictor(predictor, config, memo.encoder)
        predictor.corrector = learner
        out = scores[name_of(clip)] = []
        try:
            for lx, (v, c, k), observed in zip(lexical, opinions, lengths):
                prediction = predictor.refined(lx, v, weights, c, k)
                out.append(prediction.score)
                learner.observe(prediction, observed)
                if learner.refit_due:
                    learner.refit()
        finally:
            predictor.corrector = None
    return scores


def name_of(clip: float) -> str:
    return "main" if clip == math.inf else f"c={clip:g}"


def second_half_tau(scores: list[float], lengths: list[int]) -> float:
    h = len(scores) // 2
    return kendall_tau_b(np.array(scores[h:]), np.array(lengths[h:], dtype=float))


def cost(models: int, refits: int) -> None:
    """CPU seconds of one refit (``OnlineLearner.refit``, the child's work) with the clip off and on, interleaved:
    ``models`` full buffers (1024 rows of the shipped prior's 48 counts + 16 components; synthetic rows), each refit
    after 8 new observations (a GCV search once a quarter of a buffer is new, as served). Single-threaded BLAS is
    not forced: the child runs with the machine's defaults."""
    predictor = OnnxPredictor(None)
    encoder = encoder_for(predictor)
    from clairvoyant.prediction.predictor import Prediction

    rng = np.random.default_rng(0)
    learners = {clip: OnlineLearner.for_predictor(predictor, LearnerConfig(residual_clip=clip), encoder) for clip in
                (math.inf, 1.0)}  # fmt: skip
    width = next(iter(learners.values())).n_features
    counts = next(iter(learners.values())).n_counts

    def observation(model: int) -> tuple[Prediction, int]:
        row = rng.gamma(1.0, 3.0, size=width).astype(np.float32)
        row[counts:] = rng.normal(0, 1, size=width - counts)
        return Prediction(5.0, 150.0, None, float(rng.normal(5, 0.5)), row.tobytes(), f"m{model}"), int(rng.integers(1, 2000))

    for _ in range(1024):
        for model in range(models):
            prediction, tokens = observation(model)
            for learner in learners.values():
                learner.observe(prediction, tokens)
    for learner in learners.values():
        learner.refit()
        learner.refit()  # a fit in force: the next refits clip against it
    times: dict[float, list[float]] = {clip: [] for clip in learners}
    for _ in range(refits):
        batch = [observation(int(rng.integers(models))) for _ in range(8)]
        for clip, learner in learners.items():
            for prediction, tokens in batch:
                learner.observe(prediction, tokens)
            started = time.process_time()
            learner.refit()
            times[clip].append(time.process_time() - started)
    for clip, values in times.items():
        t = np.array(values) * 1e3
        print(f"clip {clip:g}: refit of {models} full models, CPU ms p50 {np.median(t):.2f} p90 "
              f"{np.percentile(t, 90):.2f} max {t.max():.2f} ({refits} refits)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/work/shared/data/alpaca_eval_dev.jsonl"))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(15)))
    parser.add_argument("--sharegpt", action="store_true")
    parser.add_argument("--only", type=float, default=None, help="one clip c (the confirmation run)")
    parser.add_argument("--json", type=Path, default=None)
    # "observe" (the first variant) ran at commit 6889062 of branch qwen; its code is gone (not shipped)
    parser.add_argument("--at", choices=("refit",), default="refit", help="where the clip is made")
    parser.add_argument("--cost", type=int, nargs="?", const=17, default=None, help="refit CPU cost for N models")
    args = parser.parse_args()
    if args.cost:
        cost(args.cost, 200)
        return 0
    global CLIP_AT
    CLIP_AT = args.at
    clips = [math.inf] + ([args.only] if args.only is not None else list(GRID))
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    models = list(rows[0]["output_tokens"])
    predictor = OnnxPredictor(None)
    memo = Memo(encoder_for(predictor))
    taus: dict[str, dict[str, list[float]]] = {}
    started = time.perf_counter()
    for model in models + ([SHAREGPT] if args.sharegpt else []):
        per: dict[str, list[float]] = {}
        for seed in args.seeds:
            if model == SHAREGPT:
                prompts, lengths = _sharegpt_turns(len(rows), seed)
            else:
                order = np.random.default_rng(seed).permutation(len(rows))
                prompts = [request_of_line(json.dumps({"prompt": rows[i]["prompt"]})).prompt for i in order]
                lengths = [int(rows[i]["output_tokens"][model]) for i in order]
            for name, values in replays(predictor, memo, prompts, lengths, model, clips).items():
                per.setdefault(name, []).append(second_half_tau(values, lengths))
        taus[model] = per
        print(f"# {model} done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    names = [name_of(c) for c in clips]
    print(f"clip made at {args.at}; seeds {args.seeds}; gain = second-half tau_b minus --no-learn; per model: mean over seeds (min over seeds)")
    header = f"{'variant':8s}" + "".join(f"{m[:18]:>22s}" for m in models) + f"{'min model':>11s}{'mean':>8s}"
    print(header + (f"{'ShareGPT':>22s}" if args.sharegpt else ""))
    summary = {}
    for name in names:
        gains = {m: np.array(taus[m][name]) - np.array(taus[m]["static"]) for m in models}
        means = [float(gains[m].mean()) for m in models]
        line = f"{name:8s}" + "".join(f"{gains[m].mean():+.3f} ({gains[m].min():+.3f}){'':5s}" for m in models)
        line += f"{min(means):+11.3f}{np.mean(means):+8.3f}"
        entry: dict[str, Any] = {"per_model_mean": dict(zip(models, means)), "min_model": min(means)}
        entry["mean"] = float(np.mean(means))
        if name != "main":  # paired by seed against main
            entry["seeds_up_vs_main"] = {
                m: int(np.sum(np.array(taus[m][name]) > np.array(taus[m]["main"]))) for m in models
            }
        if args.sharegpt:
            g = np.array(taus[SHAREGPT][name]) - np.array(taus[SHAREGPT]["static"])
            line += f"{g.mean():+12.3f} ({g.min():+.3f})"
            entry["sharegpt"] = float(g.mean())
        summary[name] = entry
        print(line)
    for name in names[1:]:
        print(f"{name}: seeds up vs main, per model: {summary[name]['seeds_up_vs_main']} of {len(args.seeds)}")
    candidates = names[1:]
    pick = max(candidates, key=lambda n: (round(summary[n]["min_model"], 3), summary[n]["mean"]))
    print(f"pick rule (highest per-model minimum, ties by mean) among {candidates}: {pick}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"seeds": args.seeds, "taus": taus, "summary": summary, "pick": pick}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
