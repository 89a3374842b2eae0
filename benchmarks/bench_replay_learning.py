"""Online learning on AlpacaEval dev: second-half Kendall tau_b with learning minus --no-learn.

    nice -n 10 python benchmarks/bench_replay_learning.py --data alpaca_eval_dev.jsonl \
        [--sharegpt] [--setting min_penalty_factor=0.001] [--model model/predictor.onnx] [--seeds 0 1 2 3 4] \
        [--json FILE]

For each of the file's four models, its lines become replay lines (``{"prompt", "output_tokens":
that model's length, "model"}``), shuffled in a seeded random order, and are replayed through
``clairvoyant.tools.replay.replay_lines`` (the function behind ``clairvoyant replay``) twice: with a fresh
online learner and with ``--no-learn`` (the static model). Every line is scored before its own
length is learned. The figure is Kendall tau_b between the scores of the second half of the lines
and their real lengths; learning should add at least +0.05 over the static model, per model and mean.

``--sharegpt`` also runs the same protocol on held-out ShareGPT turns (the natural split's test
side, which the shipped model never trained on; English, first and later turns as they come, each
with its history's size), a fresh seeded sample of as many turns as the AlpacaEval file has lines
per seed, their reference answers counted in cl100k tokens: a learner setting that helps AlpacaEval
and hurts there is fitted to AlpacaEval. ``--setting name=value`` (repeatable) replays with a
``LearnerConfig`` other than the default, to compare learner settings (never the shipped prior,
which is not trained on this file).

The data file is evaluation data (non-commercial licence): it is passed by path and never copied.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clairvoyant.prediction.encoder import encoder_for  # noqa: E402
from clairvoyant.prediction.features import Prompt  # noqa: E402
from clairvoyant.prediction.learner import LearnerConfig, OnlineLearner, kendall_tau_b  # noqa: E402
from clairvoyant.prediction.predictor import OnnxPredictor  # noqa: E402
from clairvoyant.tools.replay import replay_lines, score_then_learn  # noqa: E402

TARGET_GAIN = 0.05


class _Memo:
    """The encoder's value per text, computed once: every replay scores the same 406 prompts."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.blend_weights = encoder.blend_weights
        self.components = encoder.components
        self.card = encoder.card
        self._values: dict[str, tuple[float, bytes]] = {}
        self._opinions: dict[str, tuple[float, bytes, float | None]] = {}

    def encode(self, text: str) -> tuple[float, bytes]:
        if text not in self._values:
            self._values[text] = self.encoder.encode(text)
        return self._values[text]

    def opinion(self, text: str) -> tuple[float, bytes, float | None]:
        if text not in self._opinions:
            self._opinions[text] = self.encoder.opinion(text)
        return self._opinions[text]


SHAREGPT = "ShareGPT held-out"


def _sharegpt_turns(count: int, seed: int) -> tuple[list[Prompt], list[int]]:
    """A seeded random sample of ``count`` held-out ShareGPT turns, in a random order, and their
    answers' cl100k tokens (English check on the sample only: the whole split's takes minutes)."""
    from clairvoyant.tools.training.dataset import NaturalConfig, _is_test_group, is_english, load_pairs
    from clairvoyant.tools.training.labels import count_tokens

    split = NaturalConfig()
    global _PAIRS
    if _PAIRS is None:
        _PAIRS = [p for p in load_pairs() if _is_test_group(p.group, split.seed, split.test_fraction)]
    picked = []
    for i in np.random.default_rng(seed).permutation(len(_PAIRS)):
        if is_english(_PAIRS[i].prompt.instruction):
            picked.append(_PAIRS[i])
            if len(picked) == count:
                break
    return [p.prompt for p in picked], [int(n) for n in count_tokens([p.answer for p in picked])]


_PAIRS: list | None = None


def _replay_prompts(
    predictor: OnnxPredictor, learner: OnlineLearner | None, prompts: list[Prompt], lengths: list[int], encoder: Any
) -> list[dict]:
    """``replay_lines`` for prompts that carry their history's size (a replay line's body would need
    the messages themselves): each one scored, then learned, a refit when due."""
    previous = predictor.corrector
    predictor.corrector = learner
    results = []
    try:
        for prompt, observed in zip(prompts, lengths):
            prediction = score_then_learn(predictor, learner, encoder, prompt, observed, SHAREGPT)
            results.append({"score": prediction.score})
    finally:
        predictor.corrector = previous
    return results


def _setting(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    types = {f.name: f.type for f in dataclasses.fields(LearnerConfig)}
    if name not in types:
        raise argparse.ArgumentTypeError(f"no LearnerConfig field {name!r} (fields: {', '.join(types)})")
    return name, (float if types[name] in (float, "float") else int)(value)


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
    parser.add_argument(
        "--setting", type=_setting, action="append", default=[], help="a LearnerConfig field, name=value (repeatable)"
    )
    parser.add_argument("--sharegpt", action="store_true", help="also replay held-out ShareGPT turns (same protocol)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--no-encoder", action="store_true", help="lexical predictions only (as `replay --no-encoder`)")
    args = parser.parse_args(argv)

    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    models = list(rows[0]["output_tokens"])
    predictor = OnnxPredictor(args.model)
    encoder = None if args.no_encoder else _Memo(encoder_for(predictor))
    config = LearnerConfig(refit_every=args.refit_every, **dict(args.setting))
    figures: dict[str, dict[str, list[float]]] = {}
    for model in models + ([SHAREGPT] if args.sharegpt else []):
        per_seed: dict[str, list[float]] = {"static": [], "learned": [], "full_static": []}
        for seed in args.seeds:
            if model == SHAREGPT:
                prompts, lengths = _sharegpt_turns(len(rows), seed)
                static = _replay_prompts(predictor, None, prompts, lengths, encoder)
                learned = _replay_prompts(
                    predictor, OnlineLearner.for_predictor(predictor, config, encoder), prompts, lengths, encoder
                )
                per_seed["static"].append(_second_half_tau(static, lengths))
                per_seed["learned"].append(_second_half_tau(learned, lengths))
                per_seed["full_static"].append(
                    kendall_tau_b(np.array([r["score"] for r in static]), np.array(lengths, float))
                )
                continue
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
        + (f"learner settings {dict(args.setting)}; " if args.setting else "")
        + ("lexical only" if encoder is None else f"refined by the encoder (blend weights {encoder.blend_weights})")
    )
    print("second-half Kendall tau_b, mean (min..max) over seeds")
    header = f"{'model':28s} {'--no-learn':>22s} {'learning':>22s} {'gain':>22s}"
    print(header)
    print("-" * len(header))
    gains_by_model = []

    def cell(values: np.ndarray) -> str:
        return f"{values.mean():+.3f} ({values.min():+.3f}..{values.max():+.3f})"

    def row(model: str, per_seed: dict[str, list[float]]) -> float:
        static, learned = np.array(per_seed["static"]), np.array(per_seed["learned"])
        gains = learned - static
        print(f"{model:28s} {cell(static):>22s} {cell(learned):>22s} {cell(gains):>22s}")
        return float(gains.mean())

    for model in models:
        gains_by_model.append(row(model, figures[model]))
    mean_static = np.mean([np.mean(figures[m]["static"]) for m in models])
    mean_learned = np.mean([np.mean(figures[m]["learned"]) for m in models])
    mean_gain = float(np.mean(gains_by_model))
    print(f"{'mean of the models':28s} {mean_static:>+22.3f} {mean_learned:>+22.3f} {mean_gain:>+22.3f}")
    if args.sharegpt:
        row(SHAREGPT, figures[SHAREGPT])
    met = mean_gain >= TARGET_GAIN and min(gains_by_model) >= TARGET_GAIN
    print(f"target: gain >= +{TARGET_GAIN:.2f} per model and mean: {'MET' if met else 'NOT MET'}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "model": str(predictor.model_path),
                    "onnx_sha256": predictor.onnx_sha256,
                    "encoder": None if encoder is None else encoder.card.onnx.sha256,
                    "seeds": args.seeds,
                    "refit_every": config.refit_every,
                    "learner": dataclasses.asdict(config),
                    "lines": len(rows),
                    "per_model": {m: figures[m] for m in models},
                    "sharegpt_held_out": figures.get(SHAREGPT),
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
