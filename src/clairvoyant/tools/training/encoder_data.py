"""The encoder's training data: which ShareGPT rows each fine-tuning pass reads, in which order.

Rows: the English training side of the leak-free natural split (``dataset.build_natural_split``,
seed 42: whole conversation groups on one side), in the split's order. Each row is the user text of
one turn (``Prompt.instruction``: what the encoder reads when serving) and its label, ln(cl100k
tokens of the reference answer). The held-out side and AlpacaEval are never read here.

Every draw is seeded, so the same split gives the same rows, batches and order:

- pass 1 (``pass1_rows``): every first turn and as many later turns (numpy seed 42), shuffled,
  cut into batches in that order; its rows' mean and standard deviation standardise the label;
- pass 2 (``pass2_batches``): the later turns pass 1 did not draw and every first turn again,
  shuffled (seed 7), then bucketed by length: chunks of 50 batches are sorted by word pieces and
  cut into batches, and the batch order is shuffled, so a batch pads to its own longest text;
- components (``components_rows``): 3,000 rows (seed 42) for the online learner's principal
  components;
- the kNN memory: every row.

torch-free: numpy and ``tokenizers`` (word-piece lengths) only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.tools.training.encoder_recipe import EncoderRecipe

__all__ = [
    "EncoderData",
    "TrainingRows",
    "components_rows",
    "pass1_rows",
    "pass2_batches",
    "prepare",
    "training_rows",
    "word_piece_lengths",
]

_ROWS_FILE, _TEXTS_FILE, _SUMMARY_FILE = "rows.npz", "texts.jsonl", "summary.json"


@dataclass(frozen=True)
class TrainingRows:
    """The English training-side rows, in the split's order."""

    texts: list[str]  # the turn's user text (Prompt.instruction)
    turns: np.ndarray  # int64: 0 for a conversation's first user turn
    log_tokens: np.ndarray  # float32: ln(max(1, cl100k tokens of the answer))
    split_fingerprint: str  # the split's sha256 (dataset.split_fingerprint)

    def __len__(self) -> int:
        return len(self.texts)


def training_rows(split: Any) -> TrainingRows:
    """The training side of a ``dataset.NaturalSplit`` (never its held-out side)."""
    return TrainingRows(
        texts=[p.prompt.instruction for p in split.train],
        turns=np.array([p.turn for p in split.train], dtype=np.int64),
        log_tokens=split.train_log_tokens.astype(np.float32),
        split_fingerprint=split.fingerprint(),
    )


def pass1_rows(turns: np.ndarray, seed: int, later_ratio: float = 1.0) -> np.ndarray:
    """Every first turn and ``later_ratio`` times as many later turns (drawn without replacement),
    shuffled: row indices in pass 1's order."""
    rng = np.random.default_rng(seed)
    first = np.flatnonzero(turns == 0)
    later = np.flatnonzero(turns > 0)
    later = rng.choice(later, size=min(len(later), int(len(first) * later_ratio)), replace=False)
    return rng.permutation(np.concatenate([first, later]))


def pass2_batches(
    turns: np.ndarray,
    pass1: np.ndarray,
    lengths: np.ndarray,
    *,
    seed: int,
    batch: int,
    chunk_batches: int,
) -> list[np.ndarray]:
    """Pass 2's batches of row indices, in order: the later turns not in ``pass1`` and every first
    turn, shuffled, bucketed by ``lengths`` (word pieces per row) within chunks of
    ``chunk_batches`` batches, the batch order shuffled."""
    first = np.flatnonzero(turns == 0)
    later = np.flatnonzero(turns > 0)
    unseen = np.setdiff1d(later, pass1)
    rng = np.random.default_rng(seed)
    rows = rng.permutation(np.concatenate([unseen, first]))
    row_lengths = lengths[rows]
    chunk = batch * chunk_batches
    batches: list[np.ndarray] = []
    for start in range(0, len(rows), chunk):
        part = np.arange(start, min(start + chunk, len(rows)))
        part = part[np.argsort(row_lengths[part], kind="stable")]
        batches += [rows[part[b : b + batch]] for b in range(0, len(part), batch)]
    return [batches[k] for k in rng.permutation(len(batches))]


def components_rows(n_rows: int, count: int, seed: int) -> np.ndarray:
    """``count`` row indices of ``n_rows`` (all of them when there are fewer), drawn without replacement."""
    return np.random.default_rng(seed).choice(n_rows, size=min(count, n_rows), replace=False)


def readable(text: str) -> str:
    """``text`` as valid UTF-8 (a lone surrogate from a JSON escape becomes U+FFFD): the tokenizer refuses them."""
    return text.encode("utf-8", "replace").decode("utf-8")


def word_piece_lengths(texts: Sequence[str], tokenizer_path: Path, max_word_pieces: int, max_chars: int) -> np.ndarray:
    """Word pieces of each text as training reads it: its first ``max_chars`` characters,
    truncated to ``max_word_pieces`` pieces, [CLS] and [SEP] included."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.enable_truncation(max_word_pieces)
    tokenizer.no_padding()
    encoded = tokenizer.encode_batch([readable(t[:max_chars]) for t in texts])
    return np.array([len(e.ids) for e in encoded], dtype=np.int64)


@dataclass(frozen=True)
class EncoderData:
    """What the fine-tuning, components and kNN steps read (``prepare`` makes it; ``save``/``load``)."""

    rows: TrainingRows
    pass1: np.ndarray  # row indices, pass 1's order
    mean: float  # of pass 1's labels: the standardisation of both passes
    std: float
    pass2: list[np.ndarray]  # pass 2's batches of row indices, in order
    components: np.ndarray  # row indices for the principal components

    def summary(self) -> dict[str, Any]:
        """Counts and the standardisation, as the card reports them."""
        later = self.rows.turns > 0
        pass2_rows = np.concatenate(self.pass2) if self.pass2 else np.zeros(0, dtype=np.int64)
        return {
            "rows": len(self.rows),
            "first_turns": int((~later).sum()),
            "later_turns": int(later.sum()),
            "pass1_rows": len(self.pass1),
            "pass1_later_turns": int(later[self.pass1].sum()),
            "pass2_rows": len(pass2_rows),
            "pass2_batches": len(self.pass2),
            "pass2_unseen_later_turns": int(later[pass2_rows].sum()),
            "components_rows": len(self.components),
            "label_mean": self.mean,
            "label_std": self.std,
            "split_fingerprint": self.rows.split_fingerprint,
        }

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        offsets = np.cumsum([0] + [len(b) for b in self.pass2])
        np.savez(
            folder / _ROWS_FILE,
            turns=self.rows.turns,
            log_tokens=self.rows.log_tokens,
            pass1=self.pass1,
            pass2=np.concatenate(self.pass2) if self.pass2 else np.zeros(0, dtype=np.int64),
            pass2_offsets=offsets,
            components=self.components,
        )
        with (folder / _TEXTS_FILE).open("w", encoding="utf-8") as fh:
            for text in self.rows.texts:
                fh.write(json.dumps(text) + "\n")
        (folder / _SUMMARY_FILE).write_text(json.dumps(self.summary(), indent=1) + "\n")

    @classmethod
    def load(cls, folder: Path) -> EncoderData:
        """Raises FileNotFoundError when the prepare step has not written ``folder``."""
        arrays = np.load(folder / _ROWS_FILE)
        summary = json.loads((folder / _SUMMARY_FILE).read_text())
        with (folder / _TEXTS_FILE).open(encoding="utf-8") as fh:
            texts = [json.loads(line) for line in fh]
        offsets = arrays["pass2_offsets"]
        flat = arrays["pass2"]
        return cls(
            rows=TrainingRows(texts, arrays["turns"], arrays["log_tokens"], str(summary["split_fingerprint"])),
            pass1=arrays["pass1"],
            mean=float(summary["label_mean"]),
            std=float(summary["label_std"]),
            pass2=[flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])],
            components=arrays["components"],
        )


def prepare(rows: TrainingRows, tokenizer_path: Path, recipe: EncoderRecipe) -> EncoderData:
    """Every draw of the recipe over ``rows`` (deterministic). Raises ValueError for rows without
    both first and later turns, or fewer than the kNN's neighbours."""
    first = int((rows.turns == 0).sum())
    if first == 0 or first == len(rows) or len(rows) < recipe.knn_neighbours:
        raise ValueError(
            f"{len(rows)} training rows ({first} first turns): the recipe needs first and later turns "
            f"and at least {recipe.knn_neighbours} rows"
        )
    one = pass1_rows(rows.turns, recipe.pass1.seed, recipe.pass1.later_ratio)
    labels = rows.log_tokens[one]
    lengths = word_piece_lengths(rows.texts, tokenizer_path, recipe.max_word_pieces, recipe.max_chars)
    two = pass2_batches(
        rows.turns,
        one,
        lengths,
        seed=recipe.pass2.seed,
        batch=recipe.pass2.batch,
        chunk_batches=recipe.pass2.chunk_batches,
    )
    return EncoderData(
        rows=rows,
        pass1=one,
        mean=float(labels.mean()),
        std=float(labels.std()),
        pass2=two,
        components=components_rows(len(rows), recipe.components_rows, recipe.components_seed),
    )
