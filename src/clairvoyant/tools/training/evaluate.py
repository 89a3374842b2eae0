"""`clairvoyant evaluate`: how well a model's score ORDERS real answers, on ShareGPT and beyond it.

Figures, for the model and for each baseline:

- ShareGPT held-out split, natural mix: every English pair of the held-out conversation groups (the
  same group split as training: seed and test fraction from the card), all turns and first turns;
  Kendall tau_b between the score and the true answer tokens, and pairwise accuracy over the pairs
  whose true lengths differ by at least 2x (ties in the score count half).
- AlpacaEval dev (``--alpaca-eval PATH``, evaluation only, never trained on and never copied): each
  prompt's answers by four open models; tau_b and pairwise accuracy per model, and their mean.

Baselines: prompt length in characters; the paper preset (paper19 features, 3-class 300x6, score
P(Long)) trained here on the same natural training rows (classes Short < 200 <= Medium < 600 <= Long);
and the previous shipped model (``model/baselines/rich_v2_3class.onnx``), scored from its file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, prompt_from_body
from clairvoyant.prediction.features import Prompt, get_feature_set
from clairvoyant.prediction.length_classes import LONG_FROM_TOKENS, SHORT_BELOW_TOKENS
from clairvoyant.prediction.predictor import BlendWeights, card_path_for
from clairvoyant.tools.training import metrics
from clairvoyant.tools.training.dataset import NaturalConfig, NaturalSplit, build_natural_split, load_pairs
from clairvoyant.tools.training.labels import ClassBounds
from clairvoyant.tools.training.scoring import ModelScorer
from clairvoyant.tools.training.train import PRESETS, featurize, fit

__all__ = [
    "BASELINE_MODEL_PATH",
    "AlpacaEvalSet",
    "evaluate_model",
    "fit_length_rule",
    "keyword_scores",
    "load_alpaca_eval",
    "natural_config_from_card",
    "order_metrics",
    "report_paths",
    "write_report",
]

logger = logging.getLogger(__name__)

BASELINE_MODEL_PATH = Path(__file__).resolve().parents[2] / "model" / "baselines" / "rich_v2_3class.onnx"
PAPER_BASELINE_BOUNDS = ClassBounds(SHORT_BELOW_TOKENS, LONG_FROM_TOKENS)  # the shipped classes
_GENERATIVE_VERBS = ("write", "implement", "generate", "explain", "describe", "list", "compare")
_CHAT = SCHEDULED_ENDPOINTS["/v1/chat/completions"]


def report_paths(model_path: Path) -> tuple[Path, Path]:
    stem = model_path.with_suffix("")
    return Path(f"{stem}.evaluation.json"), Path(f"{stem}.evaluation.md")


def fit_length_rule(train_len: np.ndarray, train_labels: np.ndarray) -> tuple[float, int]:
    """(threshold, direction) of the rule score = direction * [len >= threshold] best on training rows."""
    best = (-1.0, 0.0, 1)
    for t in np.unique(train_len):
        above = (train_len >= t).astype(np.float64)
        for direction in (1, -1):
            acc = metrics.ranking_accuracy(direction * above, train_labels)
            if acc > best[0]:
                best = (acc, float(t), direction)
    return best[1], best[2]


def keyword_scores(x: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """1.0 where a code or format keyword or a generative leading verb is present, else 0.0."""
    cols = [names.index("has_code_keyword"), names.index("has_format_keyword")]
    cols += [names.index(f"verb_{v}") for v in _GENERATIVE_VERBS]
    return (x[:, cols].max(axis=1) > 0).astype(np.float64)


class AlpacaEvalSet:
    """The AlpacaEval dev file: prompts (as single-turn chat requests) and answer tokens per model."""

    def __init__(self, prompts: list[Prompt], lengths: np.ndarray, models: list[str], path: Path) -> None:
        self.prompts, self.lengths, self.models, self.path = prompts, lengths, models, path


def load_alpaca_eval(path: Path) -> AlpacaEvalSet:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no rows")
    models = sorted(rows[0]["output_tokens"])
    prompts = [prompt_from_body(_CHAT, {"messages": [{"role": "user", "content": r["prompt"]}]}) for r in rows]
    lengths = np.array([[int(r["output_tokens"][m]) for m in models] for r in rows], dtype=np.int64)
    return AlpacaEvalSet(prompts, lengths, models, Path(path))


def order_metrics(score: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
    return {
        "kendall_tau_b": metrics.kendall_tau(score, lengths),
        "pairwise_accuracy_2x": metrics.pairwise_accuracy(score, lengths),
    }


def _alpaca_metrics(score: np.ndarray, alpaca: AlpacaEvalSet) -> dict[str, Any]:
    per_model = {m: order_metrics(score, alpaca.lengths[:, j]) for j, m in enumerate(alpaca.models)}
    return {
        "per_model": per_model,
        "mean_kendall_tau_b": float(np.mean([v["kendall_tau_b"] for v in per_model.values()])),
        "mean_pairwise_accuracy_2x": float(np.mean([v["pairwise_accuracy_2x"] for v in per_model.values()])),
    }


def blend_weights_of(weights: BlendWeights, model: ModelScorer, prompts: list[Prompt]) -> np.ndarray:
    """Each prompt's blend weight by ``BlendWeights.for_history`` of its own feature row's
    ``history_chars``: the rule ``OnnxPredictor.refined`` applies when serving."""
    column = model.feature_set.names.index("history_chars") if "history_chars" in model.feature_set.names else None
    if column is None:
        if weights.first != weights.later:
            raise ValueError(f"{model.name}: feature set {model.feature_set.name} has no history_chars column")
        return np.full(len(prompts), weights.first)
    history = model.features(prompts)[:, column]
    return np.array([weights.for_history(float(h)) for h in history], dtype=np.float64)


def natural_config_from_card(card: dict[str, Any]) -> NaturalConfig:
    """The held-out split that matches the model's training groups (same seed and test fraction)."""
    data = card.get("data", {})
    return NaturalConfig(
        test_fraction=float(data.get("test_fraction", 0.2)),
        turns="all",
        seed=int(data.get("seed", 42)),
        english_only=True,
    )


def evaluate_model(
    model_path: Path,
    *,
    alpaca_eval: Path | None = None,
    split: NaturalSplit | None = None,
    baseline_model: Path | None = BASELINE_MODEL_PATH,
    paper_baseline: bool = True,
    threads: int = 2,
    encoder: Path | None = None,
) -> dict[str, Any]:
    """The transfer report (a JSON-able dict) of the model at ``model_path``; with ``encoder`` (an
    encoder card) also the model refined by the encoder, as a waiting request is served."""
    model = ModelScorer(model_path)
    config = natural_config_from_card(model.card)
    if split is None:
        split = build_natural_split(load_pairs(), config)
    trained_on_this_split = model.card.get("data", {}).get("split_fingerprint") == split.fingerprint()
    alpaca = load_alpaca_eval(alpaca_eval) if alpaca_eval is not None else None
    test_prompts = [p.prompt for p in split.test]
    first = np.array([p.turn == 0 for p in split.test], dtype=bool)

    def section(score_held_out: np.ndarray, score_alpaca: np.ndarray | None, note: str) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "note": note,
            "sharegpt_held_out": order_metrics(score_held_out, split.test_lengths),
            "sharegpt_held_out_first_turns": order_metrics(score_held_out[first], split.test_lengths[first]),
            "sharegpt_held_out_later_turns": order_metrics(score_held_out[~first], split.test_lengths[~first]),
        }
        if alpaca is not None and score_alpaca is not None:
            entry["alpaca_eval"] = _alpaca_metrics(score_alpaca, alpaca)
        return entry

    scorers: dict[str, dict[str, Any]] = {}
    raw_test = model.score_prompts(test_prompts)
    raw_alpaca = model.score_prompts(alpaca.prompts) if alpaca else None
    scorers["model"] = section(raw_test, raw_alpaca, f"{model.name}: {model.kind}, score {model.score_meaning}")
    predicted = model.predicted_log_tokens(raw_test)
    if predicted is not None:
        scorers["model"]["sharegpt_held_out"]["log_tokens_mae"] = float(
            np.mean(np.abs(predicted - split.test_log_tokens))
        )
        if alpaca is not None and raw_alpaca is not None:
            pa = model.predicted_log_tokens(raw_alpaca)
            scorers["model"]["alpaca_eval"]["log_tokens_mae_per_model"] = {
                m: float(np.mean(np.abs(pa - np.log(np.maximum(alpaca.lengths[:, j], 1)))))
                for j, m in enumerate(alpaca.models)
            }

    if encoder is not None and predicted is not None:
        from clairvoyant.prediction.encoder import EncoderModel

        enc = EncoderModel(encoder)
        weights = enc.blend_weights
        enc_test, knn_test = enc.opinions_many([p.instruction for p in test_prompts])
        enc_alpaca, knn_alpaca = enc.opinions_many([p.instruction for p in alpaca.prompts]) if alpaca else (None, None)
        w_test = blend_weights_of(weights, model, test_prompts)
        # the served formula (BlendWeights.blend, as OnnxPredictor.refined applies it)
        served_test = BlendWeights.blend(predicted, enc_test, w_test, knn_test, weights.knn)
        served_alpaca = None
        if enc_alpaca is not None and raw_alpaca is not None:
            prior_alpaca = model.predicted_log_tokens(raw_alpaca)
            assert prior_alpaca is not None
            w_alpaca = blend_weights_of(weights, model, alpaca.prompts)
            served_alpaca = BlendWeights.blend(prior_alpaca, enc_alpaca, w_alpaca, knn_alpaca, weights.knn)
        knn_note = (
            f"; then + v x (kNN ln tokens - that), v {weights.knn:g} for every request (the card's knn block: "
            f"the 16 nearest of {enc.card.raw['knn'].get('rows', '?')} training-side ShareGPT instructions "
            "in the encoder's embedding space, cosine-weighted)"
            if knn_test is not None
            else ""
        )
        scorers["model_with_encoder"] = section(
            served_test,
            served_alpaca,
            f"{model.name} refined by the encoder {encoder.name} as a waiting request is served: "
            f"prior + w x (encoder ln tokens - prior), on the calibrated ln-token scale; w {weights.first:g} "
            f"for a request without conversation history, {weights.later:g} for one with it "
            f"(its feature row's history_chars > 0){knn_note}",
        )
        if knn_test is not None:
            without = BlendWeights.blend(predicted, enc_test, w_test)
            without_alpaca = None
            if served_alpaca is not None and enc_alpaca is not None and prior_alpaca is not None:
                without_alpaca = BlendWeights.blend(prior_alpaca, enc_alpaca, w_alpaca)
            scorers["model_with_encoder_without_knn"] = section(
                without, without_alpaca, "model_with_encoder without its kNN term (the refined prior before it)"
            )
            scorers["knn_alone"] = section(
                knn_test, knn_alpaca, "the kNN's ln tokens alone (cosine-weighted mean of the 16 nearest training rows)"
            )
        scorers["encoder_alone"] = section(
            enc_test,
            enc_alpaca,
            "the encoder's ln tokens alone (its text: the last user turn, as the card reads it: a long one's head and tail word pieces)",
        )
        scorers["model_with_encoder"]["sharegpt_held_out"]["log_tokens_mae"] = float(
            np.mean(np.abs(served_test - split.test_log_tokens))
        )

    scorers["prompt_length"] = section(
        np.array([len(p.instruction) for p in test_prompts], dtype=np.float64),
        np.array([len(p.instruction) for p in alpaca.prompts], dtype=np.float64) if alpaca else None,
        "characters of the last user message (longer = later)",
    )

    if paper_baseline:
        paper = PRESETS["paper"]
        fs19 = get_feature_set("paper19")
        labels = PAPER_BASELINE_BOUNDS.classify(split.train_lengths)
        clf = fit(featurize(fs19, [p.prompt for p in split.train]), labels, paper, threads=threads)
        scorers["paper_preset"] = section(
            clf.predict_proba(featurize(fs19, test_prompts))[:, 2],
            clf.predict_proba(featurize(fs19, alpaca.prompts))[:, 2] if alpaca else None,
            "paper19, 3-class 300x6 lr 0.1, P(Long), trained here on the same natural training rows "
            f"(classes {PAPER_BASELINE_BOUNDS.as_dict()})",
        )

    if baseline_model is not None and Path(baseline_model).is_file():
        base = ModelScorer(Path(baseline_model))
        scorers["previous_shipped"] = section(
            base.score_prompts(test_prompts),
            base.score_prompts(alpaca.prompts) if alpaca else None,
            f"{base.name}: the previous shipped model (rich_v2, balanced 3-class, P(Long))",
        )

    return {
        "model": model.name,
        "onnx_sha256": model.card.get("onnx_sha256"),
        "kind": model.kind,
        "score": model.score_meaning,
        "feature_set": model.feature_set.name,
        "split": {
            **config.as_dict(),
            "held_out_rows": len(split.test),
            "held_out_first_turn_rows": int(first.sum()),
            "split_fingerprint": split.fingerprint(),
            "model_trained_on_this_split": trained_on_this_split,
        },
        "alpaca_eval": (
            {
                "file": alpaca.path.name,
                "prompts": len(alpaca.prompts),
                "models": alpaca.models,
                "note": "evaluation only: never trained on, passed by path, never copied",
            }
            if alpaca
            else {"skipped": "pass --alpaca-eval PATH to measure transfer"}
        ),
        "metric_notes": [
            "Kendall tau_b between the score (lower = sooner) and the true answer tokens (scipy, variant b).",
            "pairwise_accuracy_2x: over every pair whose true lengths differ by >= 2x, the share the score "
            "orders the same way; tied scores count half.",
        ],
        "scorers": scorers,
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if v != v else f"{v:.3f}"
    return str(v)


def render_markdown(report: dict[str, Any]) -> str:
    s = report["scorers"]
    split = report["split"]
    lines = [
        f"# Evaluation of {report['model']}",
        "",
        f"{report['kind']}, score `{report['score']}` (lower = sooner), feature set `{report['feature_set']}`.",
        "",
        "## How well the score orders real answers",
        "",
        f"ShareGPT held-out split, natural mix: {split['held_out_rows']} English pairs of held-out conversation "
        f"groups ({split['held_out_first_turn_rows']} first turns); split fingerprint `{split['split_fingerprint'][:16]}`"
        + (", the model's own training split." if split["model_trained_on_this_split"] else "."),
        "",
    ]
    alpaca = report["alpaca_eval"]
    if "skipped" in alpaca:
        lines += [f"AlpacaEval: skipped ({alpaca['skipped']}).", ""]
        lines += [
            "| scorer | ShareGPT tau_b | ShareGPT first turns tau_b | ShareGPT later turns tau_b | "
            "ShareGPT pairwise acc (>=2x) |",
            "|---|---|---|---|---|",
        ]
        for name, e in s.items():
            lines.append(
                f"| {name} | {_fmt(e['sharegpt_held_out']['kendall_tau_b'])} | "
                f"{_fmt(e['sharegpt_held_out_first_turns']['kendall_tau_b'])} | "
                f"{_fmt(e['sharegpt_held_out_later_turns']['kendall_tau_b'])} | "
                f"{_fmt(e['sharegpt_held_out']['pairwise_accuracy_2x'])} |"
            )
    else:
        models = alpaca["models"]
        lines += [
            f"AlpacaEval dev: {alpaca['prompts']} instructions x {len(models)} models ({alpaca['note']}).",
            "",
            "| scorer | AlpacaEval mean tau_b | "
            + " | ".join(f"{m} tau_b" for m in models)
            + " | AlpacaEval mean pairwise acc (>=2x) | ShareGPT tau_b | ShareGPT first turns tau_b | "
            "ShareGPT later turns tau_b | ShareGPT pairwise acc (>=2x) |",
            "|---|---|" + "---|" * len(models) + "---|---|---|---|---|",
        ]
        for name, e in s.items():
            a = e["alpaca_eval"]
            lines.append(
                f"| {name} | **{_fmt(a['mean_kendall_tau_b'])}** | "
                + " | ".join(_fmt(a["per_model"][m]["kendall_tau_b"]) for m in models)
                + f" | {_fmt(a['mean_pairwise_accuracy_2x'])} | {_fmt(e['sharegpt_held_out']['kendall_tau_b'])} | "
                f"{_fmt(e['sharegpt_held_out_first_turns']['kendall_tau_b'])} | "
                f"{_fmt(e['sharegpt_held_out_later_turns']['kendall_tau_b'])} | "
                f"{_fmt(e['sharegpt_held_out']['pairwise_accuracy_2x'])} |"
            )
    lines += ["", "## Scorers"] + [f"- **{name}**: {e['note']}" for name, e in s.items()]
    mae = s["model"]["sharegpt_held_out"].get("log_tokens_mae")
    if mae is not None:
        lines += [
            "",
            "## Calibration",
            f"Mean |ln predicted tokens - ln true tokens| on the ShareGPT held-out rows: {mae:.3f} "
            f"(a factor of {np.exp(mae):.2f}).",
        ]
        per = s["model"].get("alpaca_eval", {}).get("log_tokens_mae_per_model")
        if per:
            lines.append(
                "On AlpacaEval (other models, other length scales: the online learner's job): "
                + ", ".join(f"{m} {v:.3f}" for m, v in per.items())
                + "."
            )
    lines += ["", "## Metrics"] + [f"- {n}" for n in report["metric_notes"]]
    return "\n".join(lines) + "\n"


def write_report(model_path: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    """Write the JSON and markdown reports beside the model; copy the headline into its card."""
    from clairvoyant.tools.training import card as card_md
    from clairvoyant.tools.training.export import update_card

    json_path, md_path = report_paths(model_path)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(render_markdown(report))
    headline: dict[str, Any] = {"report": md_path.name}
    for name, e in report["scorers"].items():
        headline[f"{name}_sharegpt_held_out_kendall_tau_b"] = e["sharegpt_held_out"]["kendall_tau_b"]
        if "alpaca_eval" in e:
            headline[f"{name}_alpaca_eval_mean_kendall_tau_b"] = e["alpaca_eval"]["mean_kendall_tau_b"]
    if card_path_for(model_path).exists():
        update_card(model_path, "evaluation", headline)
        card_md.write_markdown(model_path)
    return json_path, md_path
