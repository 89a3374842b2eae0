"""Online learning on AlpacaEval dev: second-half Kendall tau_b with learning minus --no-learn.

    nice -n 10 python benchmarks/bench_replay_learning.py --data /work/shared/data/alpaca_eval_dev.jsonl \
        [--model model/predictor.onnx] [--seeds 0 1 2 3 4] [--json benchmarks/replay_learning_results.json]

For each of the file's four models, its lines become replay lines (``{"prompt", "output_tokens":
that model's length, "model"}``), shuffled in a seeded random order, and are replayed through
``clairvoyant.tools.replay.replay_lines`` (the function behind ``clairvoyant replay``) twice: with a fresh
online learner and with ``--no-learn`` (the static model). Every line is scored before its own
length is learned. The figure is Kendall tau_b between the scores of the second half of the lines
and their real lengths; the target (issue 8) is learning minus static >= +0.05, per model and mean.

The data file is evaluation data (non-commercial licence): it is passed by path and never copied.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clairvoyant.prediction.encoder import encoder_for  # noqa: E402
from clairvoyant.prediction.learner import LearnerConfig, OnlineLearner, kendall_tau_b  # noqa: E402
from clairvoyant.prediction.predictor import OnnxPredictor  # noqa: E402
from clairvoyant.tools.replay import replay_lines  # noqa: E402

TARGET_GAIN = 0.05


class _Memo:
    """The encoder's value per text, computed once: every replay scores the same 406 prompts."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.blend_weight = encoder.blend_weight
        self.blend_weights = encoder.blend_weights
        self.components = encoder.components
        self.card = encoder.card
        self._values: dict[str, tuple[float, bytes]] = {}

    def encode(self, text: str) -> tuple[float, bytes]:
        if text not in self._values:
            self._values[text] = self.encoder.encode(text)
        return self._values[text]


def _second_half_tau(results: list[dict], lengths: list[int]) -> float:
    half = len(results) // 2
    scores = np.array([r["score"] for r in results[half:]])
    return kendall_tau_b(scores, np.array(lengths[half:], dtype=float))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="alpaca_eval_dev.jsonl (passed by path)")
    parser.add_argument("--model", type=Path, default=None, help="ONNX model (default: the shipped model)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--refit-every", type=int, default=LearnerConfig().refit_every)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--no-encoder", action="store_true", help="lexical predictions only (as `replay --no-encoder`)")
    args = parser.parse_args(argv)

    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    models = list(rows[0]["output_tokens"])
    predictor = OnnxPredictor(args.model)
    encoder = None if args.no_encoder else _Memo(encoder_for(predictor))
    config = LearnerConfig(refit_every=args.refit_every)
    figures: dict[str, dict[str, list[float]]] = {}
    for model in models:
        per_seed: dict[str, list[float]] = {"static": [], "learned": [], "full_static": []}
        for seed in args.seeds:
            order = np.random.default_rng(seed).permutation(len(rows))
            lines = [
                json.dumps(
                    {"prompt": rows[i]["prompt"], "output_tokens": rows[i]["output_tokens"][model], "model": model}
                )
                for i in order
            ]
            lengths = [rows[i]["output_tokens"][model] for i in order]
            static = list(replay_lines(predictor, None, lines, encoder=encoder))
            learned = list(
                replay_lines(predictor, OnlineLearner.for_predictor(predictor, config, encoder), lines, encoder=encoder)
            )
            assert not any("error" in r for r in static + learned)
            per_seed["static"].append(_second_half_tau(static, lengths))
            per_seed["learned"].append(_second_half_tau(learned, lengths))
            per_seed["full_static"].append(
                kendall_tau_b(np.array([r["score"] for r in static]), np.array(lengths, float))
            )
        figures[model] = per_seed

    print(
        f"model: {predictor.model_path} (card schema {predictor.card.get('schema', 1)}, "
        f"{predictor.output.kind}, score {predictor.output.score}); seeds {args.seeds}; "
        f"refit every {config.refit_every} observations; {len(rows)} lines per replay; "
        + ("lexical only" if encoder is None else f"refined by the encoder (blend weights {encoder.blend_weights})")
    )
    print("second-half Kendall tau_b, mean (min..max) over seeds")
    header = f"{'model':28s} {'--no-learn':>22s} {'learning':>22s} {'gain':>22s}"
    print(header)
    print("-" * len(header))
    gains_by_model = []

    def cell(values: np.ndarray) -> str:
        return f"{values.mean():+.3f} ({values.min():+.3f}..{values.max():+.3f})"

    for model, per_seed in figures.items():
        static, learned = np.array(per_seed["static"]), np.array(per_seed["learned"])
        gains = learned - static
        gains_by_model.append(gains.mean())
        print(f"{model:28s} {cell(static):>22s} {cell(learned):>22s} {cell(gains):>22s}")
    mean_static = np.mean([np.mean(f["static"]) for f in figures.values()])
    mean_learned = np.mean([np.mean(f["learned"]) for f in figures.values()])
    mean_gain = float(np.mean(gains_by_model))
    print(f"{'mean of the models':28s} {mean_static:>+22.3f} {mean_learned:>+22.3f} {mean_gain:>+22.3f}")
    met = mean_gain >= TARGET_GAIN and min(gains_by_model) >= TARGET_GAIN
    print(f"target: gain >= +{TARGET_GAIN:.2f} per model and mean: {'MET' if met else 'NOT MET'}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "model": str(predictor.model_path),
                    "onnx_sha256": predictor.onnx_sha256,
                    "encoder": None if encoder is None else encoder.card.onnx_sha256,
                    "seeds": args.seeds,
                    "refit_every": config.refit_every,
                    "lines": len(rows),
                    "per_model": figures,
                    "mean": {"static": float(mean_static), "learned": float(mean_learned), "gain": mean_gain},
                    "target_met": bool(met),
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
