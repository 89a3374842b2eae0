"""Issue 8, brief GEMMA: an online residual kNN on top of the online learner, per backend model.

Protocol: exactly benchmarks/bench_replay_learning.py's (each AlpacaEval model's 406 prompts in a seeded random
order, each line scored before its own length is learned, refit every 8 observations; the figure is Kendall tau_b of
the second half's scores against the real lengths, learning minus --no-learn), plus the same for held-out ShareGPT
turns (``--sharegpt``). The learner is the shipped ``OnlineLearner`` with the default ``LearnerConfig``, untouched: the
kNN never feeds back into it, so ONE learner pass per (model, seed) serves the main figure and every grid point.

The variant. Per backend model a bounded memory (the learner's buffer bound, 1024, a ring: the most recent win) of
the observed requests' unit-normalised encoder embeddings (the graph's pooled ``embedding`` output, the one the
shipped kNN reads) and their residuals

    r = observed ln tokens - (prior + the learner's correction at observe time)

(uncensored observations only, like the learner's fit). A prediction adds

    kNN correction = sum_{j in k nearest by cosine} w_j r_j / (sum_j w_j + lambda),   w_j = max(cos_j, 0)

WHY the residual after the learner's correction, not after the prior alone: the kNN is added ON TOP of the learner's
correction, so it must model what the learner leaves. Residuals from the prior alone contain what the linear
correction already fixes (above all the model's mean shift from ShareGPT lengths, e.g. a verbose model): added on
top, that part is counted twice, and through the shrinkage W / (W + lambda) (W = sum of weights, which varies with
how dense a query's neighbourhood is) a constant shift becomes a query-dependent one, i.e. ranking noise. Residuals
after the learner's correction are about zero-mean once the learner has fitted, so the kNN only moves a prediction
where its neighbours were missed alike. The correction is the one in force when the request was observed (the fit
it was scored with: refits happen after an observation), which costs nothing to keep (the proxy computes it when
predicting); the first ``min_observations`` (16) residuals are from the prior alone (no fit yet).
WHY w = max(cos, 0): the shipped kNN graph's weighting (research/RESULTS.md h), and an anti-similar neighbour
should not vote with a flipped sign.

PRE-REGISTERED (this docstring is committed before any AlpacaEval figure of the variant was computed):
- grid: k in {8, 16, 32} x lambda in {1, 4, 16} (9 points). lambda is a pseudo-weight in cosine units: with k
  neighbours at cosine c the correction is k c / (k c + lambda) of their weighted mean residual, so lambda 1 barely
  shrinks a full neighbourhood, 16 halves a k-16 neighbourhood at cosine 1 and more at lower cosines or smaller k.
- pick rule: on seeds 0-4, per grid point, gain_m = the mean over seeds of (second-half tau with learner + kNN) -
  (second-half tau of --no-learn) for each of the four AlpacaEval models; pick the point with the highest
  min_m gain_m (rounded to 3 decimals), ties by the highest mean_m gain_m. Only AlpacaEval seeds 0-4 pick.
- then the pick, unchanged, on seeds 5-14 (confirmation, no re-picking), and the ShareGPT held-out row on both
  seed sets (a guard, never used to pick).
- ship rule: only if on BOTH seed sets the per-model minimum gain rises above main's (the learner alone), the mean
  gain does not drop below main's, and the ShareGPT gain does not drop by more than 0.003 vs main's.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/study_residual_knn.py \
        --data /work/shared/data/alpaca_eval_dev.jsonl --seeds 0 1 2 3 4 --sharegpt --json /tmp/gemma/s04.json
    ... --seeds 5 6 7 8 9 10 11 12 13 14 --sharegpt --only K,LAMBDA --json /tmp/gemma/s514.json
    ... --cost      (the served learner's cost per correction and per observe, with and without the kNN)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_replay_learning import SHAREGPT, _sharegpt_turns  # noqa: E402

from clairvoyant.prediction.encoder import encoder_for  # noqa: E402
from clairvoyant.prediction.features import Prompt  # noqa: E402
from clairvoyant.prediction.learner import LearnerConfig, OnlineLearner, kendall_tau_b  # noqa: E402
from clairvoyant.prediction.predictor import OnnxPredictor, log_tokens  # noqa: E402
from clairvoyant.tools.bulk_predict import request_of_line  # noqa: E402

KS = (8, 16, 32)
LAMBDAS = (1.0, 4.0, 16.0)
GRID = [(k, lam) for k in KS for lam in LAMBDAS]
BOUND = LearnerConfig().buffer_size  # 1024


class Memo:
    """The encoder's opinion (value, components, kNN ln tokens) and unit embedding per text, computed once."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self._values: dict[str, tuple[float, bytes, float | None, np.ndarray]] = {}
        self.dim = len(self.get("warm up")[3])

    def get(self, text: str) -> tuple[float, bytes, float | None, np.ndarray]:
        if text not in self._values:
            enc = self.encoder
            value, components, out = enc._run(text, enc._all)
            embedding = np.asarray(out[-1], dtype=np.float32).reshape(1, -1)
            knn = float(enc._knn.run(None, {"embedding": embedding})[0].reshape(-1)[0])
            unit = embedding[0] / np.linalg.norm(embedding[0])
            self._values[text] = (value, components, knn, unit.astype(np.float32))
        return self._values[text]


class ResidualMemory:
    """One model's ring of (unit embedding, residual), at most ``bound`` rows."""

    def __init__(self, dim: int, bound: int = BOUND) -> None:
        self.unit = np.zeros((bound, dim), dtype=np.float32)
        self.residual = np.zeros(bound, dtype=np.float64)
        self.count = 0
        self.next = 0
        self.bound = bound

    def add(self, unit: np.ndarray, residual: float) -> None:
        self.unit[self.next] = unit
        self.residual[self.next] = residual
        self.next = (self.next + 1) % self.bound
        self.count = min(self.count + 1, self.bound)

    def corrections(self, query: np.ndarray, grid: list[tuple[int, float]]) -> list[float]:
        """The kNN correction at every (k, lambda) of ``grid`` (0.0 with an empty memory)."""
        n = self.count
        if n == 0:
            return [0.0] * len(grid)
        cos = self.unit[:n] @ query
        order = np.argsort(-cos, kind="stable")
        out = []
        for k, lam in grid:
            top = order[:k]
            w = np.maximum(cos[top], 0.0).astype(np.float64)
            out.append(float(w @ self.residual[top] / (w.sum() + lam)))
        return out


def replay(
    predictor: OnnxPredictor,
    memo: Memo,
    prompts: list[Prompt],
    lengths: list[int],
    model: str,
    grid: list[tuple[int, float]],
) -> dict[str, list[float]]:
    """One learner pass: the static, the learner's and every grid point's scores per line, scored before learning."""
    # the learner alone (its own kNN off: this study computes the variant itself, for every grid point at once)
    learner = OnlineLearner.for_predictor(predictor, LearnerConfig(knn_neighbours=0), memo.encoder)
    memory = ResidualMemory(memo.dim)
    calibration = predictor.calibration
    previous = predictor.corrector
    predictor.corrector = learner
    scores: dict[str, list[float]] = {"static": [], "main": [], **{f"{k},{lam:g}": [] for k, lam in grid}}
    try:
        for prompt, observed in zip(prompts, lengths):
            value, components, knn, unit = memo.get(prompt.instruction)
            lexical = predictor.predict(prompt, model=model)
            prediction = predictor.refined(lexical, value, memo.encoder.blend_weights, components, knn)
            prior = prediction.prior_log_tokens
            row = np.frombuffer(prediction.feature_row, dtype=np.float32)
            correction = learner.correction(model, row, prior)
            scores["static"].append(calibration.score_of_extended(prior))
            scores["main"].append(prediction.score)
            for (k, lam), extra in zip(grid, memory.corrections(unit, grid)):
                scores[f"{k},{lam:g}"].append(calibration.score_of_extended(prior + correction + extra))
            learner.observe(prediction, observed)
            memory.add(unit, log_tokens(observed) - (prior + correction))
            if learner.refit_due:
                learner.refit()
    finally:
        predictor.corrector = previous
    return scores


WINDOW: tuple[int, int] | None = None  # --lines A B: a diagnostic window of lines instead of the second half


def second_half_tau(scores: list[float], lengths: list[int]) -> float:
    start, stop = WINDOW if WINDOW is not None else (len(scores) // 2, len(scores))
    return kendall_tau_b(np.array(scores[start:stop]), np.array(lengths[start:stop], dtype=float))


def cost(repeats: int) -> None:
    """The served learner's cost per call, where it runs (the event loop): ``correction`` of a refined row (counts,
    components, then the 384-d embedding) with a full kNN memory (1024 rows), and ``observe`` of such a row, by the
    shipped learner (kNN on) and by one with the kNN off (``knn_neighbours=0``: the linear correction alone), fed
    the same rows. Interleaved, one call of each kind per round, so the memory is as cold as between two requests;
    synthetic rows."""
    predictor = OnnxPredictor(None)
    encoder = encoder_for(predictor)
    on = OnlineLearner.for_predictor(predictor, LearnerConfig(), encoder)
    off = OnlineLearner.for_predictor(predictor, LearnerConfig(knn_neighbours=0), encoder)
    rng = np.random.default_rng(0)
    width = on.n_features + encoder.embedding_width
    rows = rng.gamma(1.0, 3.0, size=(BOUND + repeats, width)).astype(np.float32)
    rows[:, on.n_counts :] = rng.normal(0, 1, size=(len(rows), width - on.n_counts))
    from clairvoyant.prediction.predictor import Prediction

    predictions = [Prediction(5.0, 150.0, None, 5.0, row.tobytes(), "m", None) for row in rows]
    for learner in (on, off):  # a full memory and a fitted correction
        for p in predictions[:BOUND]:
            learner.observe(p, int(rng.integers(10, 1000)))
        learner.refit()
    assert on._buckets["m"].knn.count == BOUND and off._buckets["m"].knn is None
    times: dict[str, list[float]] = {"correction, kNN off": [], "correction, kNN on": [],
                                     "observe, kNN off": [], "observe, kNN on": []}  # fmt: skip
    clock = time.perf_counter
    for i in range(BOUND, BOUND + repeats):
        for name, learner in (("off", off), ("on", on)):
            t = clock()
            learner.correction("m", rows[i], 5.0)
            times[f"correction, kNN {name}"].append(clock() - t)
        for name, learner in (("off", off), ("on", on)):
            t = clock()
            learner.observe(predictions[i], 100)
            times[f"observe, kNN {name}"].append(clock() - t)
    for name, values in times.items():
        t = np.array(values) * 1e6
        print(f"{name:22s} p50 {np.median(t):7.1f} us  p99 {np.percentile(t, 99):7.1f} us  ({repeats} calls)")
    knn = on._buckets["m"].knn
    print(f"kNN memory per model: {knn.unit.nbytes / 1e6:.2f} MB embeddings (float32) + {knn.residual.nbytes} B")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/work/shared/data/alpaca_eval_dev.jsonl"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--sharegpt", action="store_true")
    parser.add_argument("--only", default=None, help="one grid point K,LAMBDA (the confirmation run)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--lines", type=int, nargs=2, default=None, help="diagnostic: tau over lines [A, B) instead")
    parser.add_argument("--cost", type=int, nargs="?", const=3000, default=None)
    args = parser.parse_args()
    if args.cost:
        cost(args.cost)
        return 0
    global WINDOW
    WINDOW = tuple(args.lines) if args.lines else None
    grid = GRID
    if args.only:
        k, lam = args.only.split(",")
        grid = [(int(k), float(lam))]
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
            scores = replay(predictor, memo, prompts, lengths, model, grid)
            for name, values in scores.items():
                per.setdefault(name, []).append(second_half_tau(values, lengths))
        taus[model] = per
        print(f"# {model} done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    names = ["main"] + [f"{k},{lam:g}" for k, lam in grid]
    print(
        f"seeds {args.seeds}; lines {WINDOW or 'second half'}; gain = tau_b minus --no-learn; per model: mean over seeds (min over seeds)"
    )
    header = f"{'variant':10s}" + "".join(f"{m[:18]:>22s}" for m in models) + f"{'min model':>11s}{'mean':>8s}"
    if args.sharegpt:
        header += f"{'ShareGPT':>22s}"
    print(header)
    summary = {}
    for name in names:
        gains = {m: np.array(taus[m][name]) - np.array(taus[m]["static"]) for m in models}
        means = [float(gains[m].mean()) for m in models]
        line = f"{name:10s}" + "".join(f"{gains[m].mean():+.3f} ({gains[m].min():+.3f}){'':5s}" for m in models)
        line += f"{min(means):+11.3f}{np.mean(means):+8.3f}"
        entry = {"per_model_mean": dict(zip(models, means)), "min_model": min(means), "mean": float(np.mean(means))}
        entry["per_model_min_seed"] = {m: float(gains[m].min()) for m in models}
        if args.sharegpt:
            g = np.array(taus[SHAREGPT][name]) - np.array(taus[SHAREGPT]["static"])
            line += f"{g.mean():+12.3f} ({g.min():+.3f})"
            entry["sharegpt"] = float(g.mean())
        summary[name] = entry
        print(line)
    candidates = [n for n in names if n != "main"]
    pick = max(candidates, key=lambda n: (round(summary[n]["min_model"], 3), summary[n]["mean"]))
    print(f"pick rule (highest per-model minimum, ties by mean) among the grid: {pick}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"seeds": args.seeds, "taus": taus, "summary": summary, "pick": pick}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
