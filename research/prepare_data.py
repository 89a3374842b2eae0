"""Cache for the step-1 candidate study: every ShareGPT pair's features, label and split side.

Writes /tmp/rcache/sharegpt.npz (never committed: derived from the training data) with, per pair:
log-token label, turn, test-side flag (the leak-free group split of training/dataset.py, seed 42,
test fraction 0.2), English flag, rich_v2 and paper19 feature matrices; plus the AlpacaEval
dev file's features (evaluation only) in /tmp/rcache/alpaca.npz. Prompts' instruction texts go
to /tmp/rcache/texts.jsonl for the encoder runs.

    PYTHONPATH=src nice -n 10 python research/prepare_data.py --alpaca /work/shared/data/alpaca_eval_dev.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, prompt_from_body
from clairvoyant.tools.training.dataset import _is_test_group, is_english, load_pairs
from clairvoyant.tools.training.labels import count_tokens
from clairvoyant.tools.training.train import featurize

OUT = Path("/tmp/rcache")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--alpaca", type=Path, required=True)
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    pairs = load_pairs()
    tokens = count_tokens([p.answer for p in pairs])
    test = np.array([_is_test_group(p.group, 42, 0.2) for p in pairs])
    turn = np.array([p.turn for p in pairs])
    english = np.array([is_english(p.prompt.instruction) for p in pairs])
    x_rich = featurize("rich_v2", [p.prompt for p in pairs])
    x_p19 = featurize("paper19", [p.prompt for p in pairs])
    groups = np.array([p.group for p in pairs])
    np.savez_compressed(OUT / "sharegpt.npz", tokens=tokens, test=test, turn=turn, english=english,
                        x_rich=x_rich, x_p19=x_p19, groups=groups)
    with (OUT / "texts.jsonl").open("w") as fh:
        for p in pairs:
            fh.write(json.dumps({"instruction": p.prompt.instruction}) + "\n")
    rows = [json.loads(line) for line in args.alpaca.read_text().splitlines() if line.strip()]
    models = sorted(rows[0]["output_tokens"])
    chat = SCHEDULED_ENDPOINTS["/v1/chat/completions"]
    prompts = [prompt_from_body(chat, {"messages": [{"role": "user", "content": r["prompt"]}]}) for r in rows]
    np.savez_compressed(OUT / "alpaca.npz", x_rich=featurize("rich_v2", prompts), x_p19=featurize("paper19", prompts),
                        lengths=np.array([[r["output_tokens"][m] for m in models] for r in rows]),
                        models=np.array(models))
    with (OUT / "alpaca_texts.jsonl").open("w") as fh:
        for r in rows:
            fh.write(json.dumps({"instruction": r["prompt"]}) + "\n")
    print(len(pairs), "pairs;", int(test.sum()), "test;", int(english.sum()), "english;", len(rows), "alpaca rows")


if __name__ == "__main__":
    main()
