"""Issue 8, brief TURN: what reading a long instruction's head and tail costs per request, side by side.

Two encoders on the same files, one run: the shipped card (first 64 + last 62 word pieces of a long instruction) and
a copy of it without tail_word_pieces (first 126 pieces, as before). For N held-out ShareGPT instructions longer than
128 word pieces and N shorter ones, alternating the two, one thread: EncoderModel.encode (clip + tokenize + run).

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/turn_encode_cost.py --n 200
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from clairvoyant.prediction.encoder import DEFAULT_ENCODER_CARD, EncoderModel
from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split, load_pairs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    shipped = EncoderModel()
    with tempfile.TemporaryDirectory() as tmp:
        card = json.loads(DEFAULT_ENCODER_CARD.read_text())
        for key in ("onnx_file", "tokenizer_file"):
            shutil.copy(DEFAULT_ENCODER_CARD.parent / card[key], Path(tmp) / card[key])
        card.pop("tail_word_pieces")
        (Path(tmp) / "encoder.card.json").write_text(json.dumps(card))
        first_only = EncoderModel(Path(tmp) / "encoder.card.json")
    split = build_natural_split(load_pairs(), NaturalConfig())
    texts = [p.prompt.instruction for p in split.test]
    rng = np.random.default_rng(0)
    rng.shuffle(texts)
    long = [t for t in texts if len(shipped.tokenizer.encode(shipped.clip(t)).ids) > 128][: args.n]
    short = [t for t in texts if len(shipped.tokenizer.encode(shipped.clip(t)).ids) <= 128][: args.n]
    for name, group in (("long (> 128 word pieces)", long), ("short", short)):
        times: dict[str, list[float]] = {"head+tail": [], "first only": []}
        for text in group:
            for label, enc in (("head+tail", shipped), ("first only", first_only)):
                started = time.perf_counter()
                enc.encode(text)
                times[label].append(time.perf_counter() - started)
        print(f"{name}, {len(group)} instructions: " + "; ".join(
            f"{k} p50 {1e3 * np.median(v):.2f} ms p90 {1e3 * np.percentile(v, 90):.2f} ms" for k, v in times.items()))


if __name__ == "__main__":
    main()
