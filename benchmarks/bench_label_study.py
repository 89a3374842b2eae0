"""The label study: k-fold over instructions on the multi-model file (labels x losses x features).

    python benchmarks/bench_label_study.py --data alpaca_eval_multi.jsonl [--folds 5] [--seed 0]
        [--model model/predictor.onnx] [--compare OTHER.onnx ...] [--quick] [--fixed-only] [--json FILE]

Prints, for each feature set (the product's rich_v3 rows, the shipped encoder's pooled embedding,
both), method (XGBoost squared error / pseudo-Huber / rank:pairwise, ridge) and label (one model's
answer; the mean of 3 models; the mean, median and trimmed mean of the ln lengths of all models),
the mean Kendall tau_b against single models' lengths on instructions it was not fitted on
(``clairvoyant.tools.training.label_study``). Beside them, on the same check folds: the shipped
model (its lexical score, and the served blend with the encoder and its kNN), any ``--compare``
model, and the consensus of n other models (the ceiling of a prompt-only predictor).

The data file is evaluation data (non-commercial licence): it is passed by path, never copied, and
nothing fitted here is shipped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness.results import add_json_option, write_json  # noqa: E402

from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, prompt_from_body  # noqa: E402
from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH, BlendWeights  # noqa: E402
from clairvoyant.tools.training import label_study  # noqa: E402
from clairvoyant.tools.training.evaluate import blend_weights_of  # noqa: E402
from clairvoyant.tools.training.scoring import ModelScorer  # noqa: E402


def _served_scores(model_path: Path, prompts: list[Any], encoder: Any, enc: np.ndarray, knn: Any) -> dict[str, Any]:
    model = ModelScorer(model_path)
    raw = model.score_prompts(prompts)
    prior = model.predicted_log_tokens(raw)
    out = {f"{model_path.name} lexical": raw}
    if prior is not None and encoder is not None:
        weights = encoder.blend_weights
        w = blend_weights_of(weights, model, prompts)
        out[f"{model_path.name} + encoder + kNN (served)"] = BlendWeights.blend(prior, enc, w, knn, weights.knn)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="alpaca_eval_multi.jsonl")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--compare", type=Path, nargs="*", default=[], help="other model files, scored alike")
    parser.add_argument("--quick", action="store_true", help="squared and ridge only, labels one and mean")
    parser.add_argument("--fixed-only", action="store_true", help="only the fixed scorers and the ceiling")
    add_json_option(parser, "label_study")
    args = parser.parse_args(argv)

    from clairvoyant.prediction.encoder import EncoderModel
    from clairvoyant.prediction.features import get_feature_set

    started = time.monotonic()
    data = label_study.load_multi(args.data)
    chat = SCHEDULED_ENDPOINTS["/v1/chat/completions"]
    prompts = [prompt_from_body(chat, {"messages": [{"role": "user", "content": p}]}) for p in data.prompts]
    lexical = get_feature_set("rich_v3").extract_many(prompts)
    encoder = EncoderModel()
    enc_values, embeddings, knn_values = [], [], []
    for p in prompts:
        value, columns, knn = encoder.opinion(p.instruction)
        enc_values.append(value)
        knn_values.append(knn)
        embeddings.append(np.frombuffer(columns, dtype=np.float32)[encoder.components :])
    embedding = np.stack(embeddings)
    enc, knn = np.array(enc_values), np.array(knn_values) if encoder.card.knn is not None else None
    print(
        f"{len(data.prompts)} instructions x {len(data.models)} models; {args.folds}-fold over instructions "
        f"(seed {args.seed}); tau_b = mean over models of Kendall tau_b on the check fold, mean over folds (sd)"
    )
    fixed: dict[str, np.ndarray] = {}
    for path in [args.model, *args.compare]:
        fixed.update(_served_scores(path, prompts, encoder, enc, knn))
    fixed["encoder alone"] = enc
    if knn is not None:
        fixed["kNN alone"] = knn
    fixed_rows = label_study.scored_the_same_way(data, fixed, folds=args.folds, seed=args.seed)
    print("\n| trained on ShareGPT (fixed scorers) | tau_b | sd |\n|---|---|---|")
    for name, (tau, sd) in fixed_rows.items():
        print(f"| {name} | {tau:.4f} | {sd:.4f} |")
    ceilings = {n: label_study.consensus_ceiling(data, others=n, seed=args.seed) for n in (1, 3, 14, 50)}
    print("\n| consensus of n other models (not a predictor) | tau_b |\n|---|---|")
    for n, tau in ceilings.items():
        print(f"| {n} | {tau:.4f} |")

    if args.fixed_only:
        write_json(args.json, {"fixed": {k: {"tau_b": v[0], "sd": v[1]} for k, v in fixed_rows.items()}})
        return 0
    features = {"lexical": lexical, "embedding": embedding, "both": np.hstack([lexical, embedding])}
    labels = ("one", "mean") if args.quick else label_study.LABELS
    methods = ("squared", "ridge") if args.quick else label_study.METHODS
    rows = label_study.run_study(
        data,
        features,
        labels=labels,
        methods=methods,
        folds=args.folds,
        seed=args.seed,
        progress=lambda line: print("  " + line, flush=True),
    )
    print(
        "\n| features | method | "
        + " | ".join(f"label {lab}" for lab in labels)
        + " |\n|---|---|"
        + "---|" * len(labels)
    )
    by_key = {(r.features, r.method, r.label): r for r in rows}
    for feature_name in features:
        for method in methods:
            cells = [by_key[(feature_name, method, lab)] for lab in labels]
            print(
                f"| {feature_name} | {method} | "
                + " | ".join(f"{c.mean_tau:.4f} ({c.fold_sd:.3f})" for c in cells)
                + " |"
            )
    print(f"\n({time.monotonic() - started:.0f} s)")
    write_json(
        args.json,
        {
            "data": args.data.name,
            "folds": args.folds,
            "seed": args.seed,
            "fixed": {k: {"tau_b": v[0], "sd": v[1]} for k, v in fixed_rows.items()},
            "consensus_ceiling": ceilings,
            "study": [
                {"features": r.features, "method": r.method, "label": r.label, "tau_b": r.mean_tau, "sd": r.fold_sd}
                for r in rows
            ],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
