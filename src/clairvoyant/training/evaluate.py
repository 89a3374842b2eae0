"""Evaluation of a shipped model on its held-out split: metrics, baselines, ablation, transfer.

The split is rebuilt from the card's data config (deterministic) and must reproduce the card's
split fingerprint, so the numbers are on exactly the rows held out when the model was trained.

Baselines (paper 5.3): random scores; a prompt-length rule (Long iff prompt_token_len >= t, t and
the direction fit to maximize ranking accuracy on the training split); a keyword heuristic (Long
iff a code or format keyword or a generative leading verb is present). Ablation (paper Table 4):
retrain without one feature group at a time, same hyperparameters, same split.

Out-of-distribution checks, all on conversations no training row came from: the natural
(unbalanced) distribution of held-out English pairs, split into first and later turns; held-out
non-English pairs (the English filter kept them out of training); and a transfer run: a model
trained on first turns only, scored on later turns.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.features import get_feature_set
from clairvoyant.predictor import OnnxPredictor, card_path_for
from clairvoyant.training import metrics
from clairvoyant.training.dataset import DataConfig, Pair, SplitData, build_split, is_english, load_pairs
from clairvoyant.training.labels import ClassBounds
from clairvoyant.training.train import PRESETS, ModelConfig, featurize, fit

__all__ = ["evaluate_model", "fit_length_rule", "keyword_scores", "report_paths"]

logger = logging.getLogger(__name__)

_GENERATIVE_VERBS = ("write", "implement", "generate", "explain", "describe", "list", "compare")


def report_paths(model_path: Path) -> tuple[Path, Path]:
    stem = model_path.with_suffix("")
    return Path(f"{stem}.evaluation.json"), Path(f"{stem}.evaluation.md")


def data_config_from_card(card: dict[str, Any]) -> DataConfig:
    data = card["data"]
    return DataConfig(
        per_class=int(data["per_class"]), test_fraction=float(data["test_fraction"]), turns=str(data["turns"]),
        bounds=ClassBounds(**card["class_bounds"]), seed=int(data["seed"]), english_only=bool(data["english_only"]),
    )


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


def _score_model(config: ModelConfig, split_train: list[Pair], y_train: np.ndarray, rows: list[Pair],
                 keep: list[int] | None = None) -> np.ndarray:
    fs = get_feature_set(config.feature_set)
    x_train = featurize(fs, [p.prompt for p in split_train])
    x_rows = featurize(fs, [p.prompt for p in rows])
    if keep is not None:
        x_train, x_rows = x_train[:, keep], x_rows[:, keep]
    clf = fit(x_train, y_train, config)
    return np.asarray(clf.predict_proba(x_rows))


def _slice(name: str, probs: np.ndarray, labels: np.ndarray, lengths: np.ndarray, what: str) -> dict[str, Any]:
    return {"slice": name, "description": what, **metrics.summary(probs, labels, lengths),
            "class_counts": np.bincount(labels, minlength=3).tolist()}


def evaluate_model(model_path: Path, *, split: SplitData | None = None, ood_rows: int = 3000,
                   ablation: bool = True) -> dict[str, Any]:
    """The full report (a JSON-able dict) for the model at ``model_path``."""
    predictor = OnnxPredictor(model_path)
    card = predictor.card
    fs = predictor.feature_set
    config = data_config_from_card(card)
    if split is None:
        split = build_split(load_pairs(), config, progress=True)
    fingerprint = split.fingerprint()
    if fingerprint != card["data"].get("split_fingerprint"):
        raise RuntimeError("the rebuilt split does not match the card's split fingerprint: data or code changed")
    bounds = config.bounds
    y_tr, y_te = split.train_labels, split.test_labels
    x_te = featurize(fs, [p.prompt for p in split.test])
    p_model = predictor.predict_features(x_te)
    report: dict[str, Any] = {
        "model": str(model_path.name),
        "onnx_sha256": card.get("onnx_sha256"),
        "feature_set": fs.name,
        "class_bounds": bounds.as_dict(),
        "split_fingerprint": fingerprint,
        "tie_rule": "ranking accuracy counts tied (Short, Long) pairs as half correct",
        "data": {
            "turns": config.turns, "per_class": config.per_class, "test_fraction": config.test_fraction,
            "eligible_before_balancing": split.available,
            "train_rows": len(split.train), "test_rows": len(split.test),
            "long_rows_at_paper_bound_800": {
                "all_turns": int(np.sum(split.train_lengths >= 800) + np.sum(split.test_lengths >= 800)
                                 + np.sum(split.test_pool_lengths >= 800)),
                "note": "in the balanced sample plus the held-out pool; the packaged answers are capped near 800 tokens",
            },
        },
        "held_out": {"model": metrics.summary(p_model, y_te, split.test_lengths)},
    }

    # The paper preset, trained on the same training rows, scored on the same held-out rows.
    paper = PRESETS["paper"]
    p_paper = _score_model(paper, split.train, y_tr, split.test)
    report["held_out"]["paper_preset"] = {**metrics.summary(p_paper, y_te, split.test_lengths), "config": paper.as_dict()}

    # Baselines (ranking accuracy on the same held-out rows).
    p19 = get_feature_set("paper19")
    x19_tr = featurize(p19, [p.prompt for p in split.train])
    x19_te = featurize(p19, [p.prompt for p in split.test])
    rng = np.random.default_rng(0)
    threshold, direction = fit_length_rule(x19_tr[:, 0], y_tr)
    length_rule = direction * (x19_te[:, 0] >= threshold).astype(np.float64)
    report["baselines"] = {
        "random": {"ranking_accuracy": metrics.ranking_accuracy(rng.random(len(y_te)), y_te),
                   "note": "uniform random scores, seed 0 (expected 0.5)"},
        "prompt_length_rule": {
            "ranking_accuracy": metrics.ranking_accuracy(length_rule, y_te),
            "ranking_accuracy_continuous_length": metrics.ranking_accuracy(x19_te[:, 0], y_te),
            "threshold_prompt_token_len": threshold, "direction": "longer prompt -> Long" if direction > 0 else "longer prompt -> Short",
            "note": "threshold and direction fit on the training split; the rule's ties count half",
        },
        "keyword_heuristic": {
            "ranking_accuracy": metrics.ranking_accuracy(keyword_scores(x19_te, p19.names), y_te),
            "note": "Long iff a code/format keyword or a generative leading verb (" + ", ".join(_GENERATIVE_VERBS) + ")",
        },
    }

    # Drop-one-group ablation for the shipped configuration and for the paper preset.
    if ablation:
        shipped_cfg = ModelConfig(fs.name, **{k: card["hyperparameters"][k] for k in ("n_estimators", "max_depth", "learning_rate", "seed")})
        report["ablation"] = {}
        for label, cfg, feature_set in (("shipped", shipped_cfg, fs), ("paper_preset", paper, p19)):
            full = metrics.ranking_accuracy(
                p_model[:, 2] if label == "shipped" else p_paper[:, 2], y_te)
            rows = {}
            for group, names in feature_set.groups.items():
                keep = [i for i, n in enumerate(feature_set.names) if n not in names]
                probs = _score_model(cfg, split.train, y_tr, split.test, keep)
                acc = metrics.ranking_accuracy(probs[:, 2], y_te)
                rows[group] = {"ranking_accuracy": acc, "delta_pp": 100.0 * (acc - full)}
            report["ablation"][label] = {"full": full, "dropped": rows}

    # Out-of-distribution slices from held-out conversations.
    pool = split.test_pool
    order = np.random.default_rng(config.seed).permutation(len(pool))
    english_rows: list[int] = []
    other_rows: list[int] = []
    for i in order:
        if len(english_rows) >= ood_rows and len(other_rows) >= ood_rows // 3:
            break
        if is_english(pool[i].prompt.instruction):
            if len(english_rows) < ood_rows:
                english_rows.append(int(i))
        elif len(other_rows) < ood_rows // 3:
            other_rows.append(int(i))
    slices = []
    for name, idx, what in (
        ("heldout_natural_english", english_rows, "held-out conversations, English, every turn, natural class mix"),
        ("heldout_natural_english_first_turn", [i for i in english_rows if pool[i].turn == 0], "first user turns only"),
        ("heldout_natural_english_later_turns", [i for i in english_rows if pool[i].turn > 0], "second and later user turns"),
        ("heldout_non_english", other_rows, "held-out conversations the English filter rejected (never trained on)"),
    ):
        rows = [pool[i] for i in idx]
        lengths = split.test_pool_lengths[idx] if idx else np.zeros(0, dtype=np.int64)
        labels = bounds.classify(lengths)
        x_rows = featurize(fs, [p.prompt for p in rows]) if rows else np.zeros((0, fs.size), np.float32)
        probs = predictor.predict_features(x_rows) if rows else np.zeros((0, 3), np.float32)
        x19 = featurize(p19, [p.prompt for p in rows]) if rows else np.zeros((0, p19.size), np.float32)
        entry = _slice(name, probs, labels, lengths, what)
        entry["prompt_length_rule_ranking_accuracy"] = metrics.ranking_accuracy(
            direction * (x19[:, 0] >= threshold).astype(np.float64), labels) if rows else float("nan")
        slices.append(entry)

    # Transfer: trained on first turns only, scored on later turns (balanced held-out rows).
    first = [i for i, p in enumerate(split.train) if p.turn == 0]
    later = [i for i, p in enumerate(split.test) if p.turn > 0]
    if first and later and len(np.unique(y_tr[first])) == 3:
        first_turn_cfg = ModelConfig(fs.name, **{k: card["hyperparameters"][k] for k in ("n_estimators", "max_depth", "learning_rate", "seed")})
        probs = _score_model(first_turn_cfg, [split.train[i] for i in first], y_tr[first],
                             [split.test[i] for i in later])
        entry = _slice("transfer_first_turns_to_later_turns", probs, y_te[later], split.test_lengths[later],
                       f"rich model trained on the {len(first)} first-turn training rows only, scored on the "
                       f"{len(later)} later-turn held-out rows")
        slices.append(entry)
    report["out_of_distribution"] = slices
    return report


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if v != v else f"{v:.4f}"
    return str(v)


def render_markdown(report: dict[str, Any]) -> str:
    h = report["held_out"]
    b = report["baselines"]
    lines = [
        f"# Evaluation of {report['model']}",
        "",
        f"Feature set `{report['feature_set']}`; classes {json.dumps(report['class_bounds'])} (cl100k_base tokens); "
        f"split fingerprint `{report['split_fingerprint'][:16]}`. {report['tie_rule'].capitalize()}.",
        "",
        "## Data",
        f"Rows: {report['data']['train_rows']} train / {report['data']['test_rows']} held out, turns: "
        f"{report['data']['turns']}. Eligible rows per class before balancing: "
        f"{json.dumps(report['data']['eligible_before_balancing'])}.",
        "",
        "## Held-out split (balanced, conversations disjoint from training)",
        "| model | ranking accuracy | 3-class accuracy | Kendall tau_b (P(Long) vs length) | rows |",
        "|---|---|---|---|---|",
    ]
    for name in ("model", "paper_preset"):
        m = h[name]
        lines.append(f"| {name} | {_fmt(m['ranking_accuracy'])} | {_fmt(m['three_class_accuracy'])} | {_fmt(m['kendall_tau_b'])} | {m['rows']} |")
    lines += ["", "## Baselines (same held-out rows)", "| baseline | ranking accuracy | note |", "|---|---|---|"]
    for name, m in b.items():
        lines.append(f"| {name} | {_fmt(m['ranking_accuracy'])} | {m['note']} |")
    lr = b["prompt_length_rule"]
    lines.append(f"\nPrompt-length rule: threshold {lr['threshold_prompt_token_len']:.0f} tokens, {lr['direction']}; "
                 f"as a continuous score it reaches {_fmt(lr['ranking_accuracy_continuous_length'])}.")
    if "ablation" in report:
        lines += ["", "## Drop-one-group ablation (retrained, same split)"]
        for label, ab in report["ablation"].items():
            lines += [f"### {label} (full: {_fmt(ab['full'])})", "| dropped group | ranking accuracy | delta (pp) |", "|---|---|---|"]
            for group, row in ab["dropped"].items():
                lines.append(f"| {group} | {_fmt(row['ranking_accuracy'])} | {row['delta_pp']:+.2f} |")
    lines += ["", "## Out of distribution (conversations never trained on)",
              "| slice | rows | class counts | ranking accuracy | prompt-length rule | 3-class acc | Kendall tau_b | description |",
              "|---|---|---|---|---|---|---|---|"]
    for s in report["out_of_distribution"]:
        lines.append(f"| {s['slice']} | {s['rows']} | {s['class_counts']} | {_fmt(s['ranking_accuracy'])} | "
                     f"{_fmt(s.get('prompt_length_rule_ranking_accuracy', float('nan')))} | {_fmt(s['three_class_accuracy'])} | "
                     f"{_fmt(s['kendall_tau_b'])} | {s['description']} |")
    return "\n".join(lines) + "\n"


def write_report(model_path: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    """Write the JSON and markdown reports beside the model; copy the headline into its card."""
    from clairvoyant.training import card as card_md
    from clairvoyant.training.export import update_card

    json_path, md_path = report_paths(model_path)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(render_markdown(report))
    h, b = report["held_out"], report["baselines"]
    headline = {
        "held_out_ranking_accuracy": h["model"]["ranking_accuracy"],
        "held_out_three_class_accuracy": h["model"]["three_class_accuracy"],
        "held_out_kendall_tau_b": h["model"]["kendall_tau_b"],
        "paper_preset_ranking_accuracy": h["paper_preset"]["ranking_accuracy"],
        "prompt_length_rule_ranking_accuracy": b["prompt_length_rule"]["ranking_accuracy"],
        "keyword_heuristic_ranking_accuracy": b["keyword_heuristic"]["ranking_accuracy"],
        "random_ranking_accuracy": b["random"]["ranking_accuracy"],
        "out_of_distribution_ranking_accuracy": {s["slice"]: s["ranking_accuracy"] for s in report["out_of_distribution"]},
        "report": md_path.name,
    }
    if card_path_for(model_path).exists():
        update_card(model_path, "evaluation", headline)
        card_md.write_markdown(model_path)
    return json_path, md_path
