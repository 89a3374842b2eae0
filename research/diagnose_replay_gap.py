"""Issue 8, brief QWEN: why does Qwen1.5 gain least from the online learner? A diagnosis of the shipped learner.

One replay per (model, seed), exactly bench_replay_learning.py's protocol with the shipped LearnerConfig, recording
per line the prior (refined), the ridge's correction and the kNN's (as scored), a second kNN memory fed residuals
after the prior alone (the kNN with the ridge off), and the observed length; then, per model: the length
distribution, the agreement with the other models, the second-half gain of each part alone and of both, the
residual tails, and the gain by window of lines.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/diagnose_replay_gap.py --seeds 0 1 ... 14
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "research"))

from study_residual_knn import Memo, ResidualMemory  # noqa: E402

from clairvoyant.prediction.encoder import encoder_for  # noqa: E402
from clairvoyant.prediction.learner import LearnerConfig, OnlineLearner  # noqa: E402
from clairvoyant.prediction.learner import kendall_tau_b as kt  # noqa: E402
from clairvoyant.prediction.predictor import OnnxPredictor, log_tokens  # noqa: E402
from clairvoyant.tools.bulk_predict import request_of_line  # noqa: E402


def record(predictor: OnnxPredictor, memo: Memo, rows: list[dict], model: str, seed: int) -> dict[str, np.ndarray]:
    order = np.random.default_rng(seed).permutation(len(rows))
    learner = OnlineLearner.for_predictor(predictor, LearnerConfig(), memo.encoder)
    ridge_off = ResidualMemory(memo.dim)  # residuals after the prior alone
    predictor.corrector = learner
    out: dict[str, list[float]] = {k: [] for k in ("prior", "lin", "knn", "knn0", "obs", "main")}
    try:
        for i in order:
            prompt = request_of_line(json.dumps({"prompt": rows[i]["prompt"]})).prompt
            observed = int(rows[i]["output_tokens"][model])
            value, components, knn, unit = memo.get(prompt.instruction)
            lexical = predictor.predict(prompt, model=model)
            prediction = predictor.refined(lexical, value, memo.encoder.blend_weights, components, knn)
            prior = prediction.prior_log_tokens
            row = np.frombuffer(prediction.feature_row, dtype=np.float32)
            values = (
                prior,
                learner._linear_correction(model, row, prior),
                learner._knn_correction(model, row[learner.n_features :]),
                ridge_off.corrections(unit, [(16, 16.0)])[0],
                log_tokens(observed),
                prediction.score,
            )
            for key, v in zip(out, values):
                out[key].append(v)
            learner.observe(prediction, observed)
            ridge_off.add(unit, log_tokens(observed) - prior)
            if learner.refit_due:
                learner.refit()
    finally:
        predictor.corrector = None
    return {k: np.array(v) for k, v in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/work/shared/data/alpaca_eval_dev.jsonl"))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(15)))
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    models = list(rows[0]["output_tokens"])
    predictor = OnnxPredictor(None)
    memo = Memo(encoder_for(predictor))
    score = np.vectorize(predictor.calibration.score_of_extended)
    lengths = {m: np.array([r["output_tokens"][m] for r in rows], dtype=float) for m in models}

    print("lengths (tokens): median, p10, p90, share < 50, share >= 800, min, max, sd and skew of ln length")
    for m in models:
        n, ln = lengths[m], np.log(lengths[m])
        skew = float(((ln - ln.mean()) ** 3).mean() / ln.std() ** 3)
        print(
            f"{m[:24]:24s} {np.median(n):5.0f} {np.percentile(n, 10):5.0f} {np.percentile(n, 90):5.0f} "
            f"{np.mean(n < 50):.3f} {np.mean(n >= 800):.3f} {n.min():4.0f} {n.max():5.0f} {ln.std():.3f} {skew:+.2f}"
        )
    print("tau_b with each other model:")
    for m in models:
        print(f"{m[:24]:24s} " + " ".join(f"{kt(lengths[m], lengths[o]):.3f}" for o in models if o != m))

    print(f"\nseeds {args.seeds}; second-half tau_b of --no-learn, and gains of: ridge alone, kNN alone (residuals")
    print("after the prior), both (main); residual (after the ridge) tails; share of its squares from |r| > 1.5")
    windows = ((16, 100), (100, 203), (203, 305), (305, 406))
    for m in models:
        taus: dict[str, list[float]] = {k: [] for k in ("static", "lin", "knn0", "main")}
        resid: list[np.ndarray] = []
        by_window: list[list[float]] = [[] for _ in windows]
        for seed in args.seeds:
            r = record(predictor, memo, rows, m, seed)
            h = len(r["obs"]) // 2
            half = slice(h, None)
            static = score(r["prior"])
            taus["static"].append(kt(static[half], r["obs"][half]))
            taus["lin"].append(kt(score(r["prior"] + r["lin"])[half], r["obs"][half]))
            taus["knn0"].append(kt(score(r["prior"] + r["knn0"])[half], r["obs"][half]))
            taus["main"].append(kt(r["main"][half], r["obs"][half]))
            resid.append((r["obs"] - r["prior"] - r["lin"])[half])
            for j, (a, b) in enumerate(windows):
                by_window[j].append(kt(r["main"][a:b], r["obs"][a:b]) - kt(static[a:b], r["obs"][a:b]))
        st = np.mean(taus["static"])
        res = np.concatenate(resid)
        big = np.abs(res) > 1.5
        print(
            f"{m[:24]:24s} static {st:.3f} ridge {np.mean(taus['lin']) - st:+.3f} kNN {np.mean(taus['knn0']) - st:+.3f} "
            f"main {np.mean(taus['main']) - st:+.3f} | resid sd {res.std():.3f} q01 {np.quantile(res, 0.01):+.2f} "
            f"q05 {np.quantile(res, 0.05):+.2f} q99 {np.quantile(res, 0.99):+.2f} |r|>1.5 {big.mean():.3f} "
            f"SS share {np.sum(res[big] ** 2) / np.sum(res**2):.2f}"
        )
        print(f"{'':24s} gain by lines: " + "  ".join(f"{a + 1}-{b}: {np.mean(g):+.3f}" for (a, b), g in zip(windows, by_window)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
