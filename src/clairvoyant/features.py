"""The only feature code anywhere: lexical features of a prompt, used by training and serving alike.

A feature set is versioned by name. ``paper19`` is the paper's 19 features (section 3.2) in the
paper's order, with the reference implementation's defects fixed:

- the verb is the *leading* instruction verb (after openers such as "please", "can you"),
  not the first match anywhere in the text;
- keywords match whole words ("information" is not "format", "stable" is not "table");
- ``prompt_token_len`` is always ``len(text) // 4`` in Unicode code points (never bytes).

Only the first ``SCAN_HEAD_CHARS`` and last ``SCAN_TAIL_CHARS`` characters are scanned for words,
so a megabyte prompt costs the same as a long one; lengths always use the whole text.

The model card records the feature-set name and its feature names; the predictor refuses a model
whose card does not match ``FEATURE_SETS[name].names``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "FEATURE_SETS",
    "VERBS",
    "FeatureSet",
    "Prompt",
    "get_feature_set",
    "leading_verb",
]

SCAN_HEAD_CHARS = 16_000
SCAN_TAIL_CHARS = 4_000


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a request is featurized from (built by ``clairvoyant.dialects``).

    instruction: the text of the last user turn (or the completion prompt).
    context_chars: characters of everything the model reads, instruction included.
    turns: number of messages, the instruction's included (1 for a bare prompt).
    system_chars: characters of system prompts.
    """

    instruction: str
    context_chars: int = -1  # -1: same as the instruction
    turns: int = 1
    system_chars: int = 0

    @property
    def total_chars(self) -> int:
        return len(self.instruction) if self.context_chars < 0 else self.context_chars


# The paper's 13 verb categories, in the paper's column order.
VERBS: tuple[str, ...] = (
    "what", "write", "explain", "summarize", "how", "list", "implement",
    "compare", "describe", "generate", "why", "define", "other",
)
_VERB_INDEX = {v: i for i, v in enumerate(VERBS)}
# Spellings that mean the same category; everything else is "other".
_VERB_ALIASES = {
    "what's": "what", "whats": "what", "summarise": "summarize", "how's": "how",
}
# Openers skipped before the leading verb. Multi-word openers are matched word by word.
_OPENERS: tuple[tuple[str, ...], ...] = tuple(
    tuple(o.split())
    for o in (
        "i would like you to", "i'd like you to", "i want you to", "i need you to",
        "can you please", "could you please", "would you please", "will you please",
        "can you", "could you", "would you", "will you", "can u", "could u",
        "help me", "please", "pls", "plz", "kindly", "hey", "hi", "hello", "ok", "okay",
        "so", "now", "also", "and", "then", "dear", "chatgpt", "gpt", "assistant",
    )
)
_LEAD_WORD_RE = re.compile(r"[a-z]+(?:'[a-z]+)?")
_LEAD_WINDOW = 200


def leading_verb(lower_text: str) -> str:
    """The verb category of the first instruction word, skipping openers. Input must be lower-cased."""
    words = _LEAD_WORD_RE.findall(lower_text[:_LEAD_WINDOW])
    i = 0
    progressed = True
    while progressed and i < len(words):
        progressed = False
        for opener in _OPENERS:
            n = len(opener)
            if tuple(words[i : i + n]) == opener:
                i += n
                progressed = True
                break
    if i >= len(words):
        return "other"
    word = words[i]
    word = _VERB_ALIASES.get(word, word)
    return word if word in _VERB_INDEX else "other"


_WORD_RE = re.compile(r"[a-z0-9_#+]+(?:'[a-z]+)?")

CODE_WORDS = frozenset(
    """code function def class script program implement algorithm debug refactor import variable
    loop recursion api sql regex react angular vue nextjs typescript javascript html css node express
    django flask component endpoint middleware query python java c++ c# golang rust kotlin php ruby
    bash shell json compile compiler bug exception""".split()
)
FORMAT_WORDS = frozenset(
    """table tables list lists bullet bullets bulleted json csv markdown outline numbered enumerate
    format formatted structure structured yaml xml""".split()
)
_FORMAT_PHRASE_RE = re.compile(r"\bstep[ -]by[ -]step\b")
_LENGTH_RE = re.compile(
    r"\b(?:brief(?:ly)?|concise(?:ly)?|short(?:ly)?|succinct(?:ly)?|one[- ]liner|tl;?dr|detailed|"
    r"in detail|in depth|elaborate|in (?:one|a single|\d+) (?:word|words|sentence|sentences|line|lines|paragraph|paragraphs)|"
    r"(?:no more than|not more than|at most|under|less than|fewer than|maximum of|max) \d+|"
    r"\d+[- ](?:word|words|sentence|sentences|paragraph|paragraphs|page|pages))\b"
)
# Subordinating conjunctions and relative pronouns (paper 3.2: a proxy for syntactic complexity).
CLAUSE_WORDS = frozenset(
    """because although though while whereas when whenever if unless since after before until
    once which who whom whose that where""".split()
)


def _scan_window(text: str) -> str:
    if len(text) <= SCAN_HEAD_CHARS + SCAN_TAIL_CHARS:
        return text
    return text[:SCAN_HEAD_CHARS] + "\n" + text[-SCAN_TAIL_CHARS:]


def _ends_with_question(text: str) -> bool:
    stripped = text.rstrip()
    return bool(stripped) and stripped[-1] in "?？"


def _paper19(prompt: Prompt, out: np.ndarray) -> None:
    text = prompt.instruction
    lower = _scan_window(text).lower()
    words = _WORD_RE.findall(lower)
    word_set = set(words)
    out[0] = len(text) // 4
    out[1] = 1.0 if (word_set & CODE_WORDS or "```" in lower) else 0.0
    out[2] = 1.0 if _LENGTH_RE.search(lower) else 0.0
    out[3] = 1.0 if _ends_with_question(text) else 0.0
    out[4] = 1.0 if (word_set & FORMAT_WORDS or _FORMAT_PHRASE_RE.search(lower)) else 0.0
    out[5] = sum(1 for w in words if w in CLAUSE_WORDS)
    out[6:19] = 0.0
    out[6 + _VERB_INDEX[leading_verb(lower)]] = 1.0


PAPER19_NAMES: tuple[str, ...] = (
    "prompt_token_len", "has_code_keyword", "has_length_constraint", "ends_with_question",
    "has_format_keyword", "clause_count",
) + tuple(f"verb_{v}" for v in VERBS)

# Feature groups for the drop-one ablation (paper Table 4): group name -> feature names.
PAPER19_GROUPS: dict[str, tuple[str, ...]] = {
    "prompt_token_len": ("prompt_token_len",),
    "has_code_keyword": ("has_code_keyword",),
    "has_length_constraint": ("has_length_constraint",),
    "ends_with_question": ("ends_with_question",),
    "has_format_keyword": ("has_format_keyword",),
    "clause_count": ("clause_count",),
    "instruction_verb": tuple(f"verb_{v}" for v in VERBS),
}


@dataclass(frozen=True)
class FeatureSet:
    """A named, versioned feature vector. ``extract`` allocates; ``extract_into`` fills a buffer."""

    name: str
    names: tuple[str, ...]
    groups: dict[str, tuple[str, ...]]
    _fill: Callable[[Prompt, np.ndarray], None]

    @property
    def size(self) -> int:
        return len(self.names)

    def extract_into(self, prompt: Prompt, out: np.ndarray) -> np.ndarray:
        """Write the features of ``prompt`` into ``out`` (float32, shape [size]) and return it."""
        self._fill(prompt, out)
        return out

    def extract(self, prompt: Prompt) -> np.ndarray:
        return self.extract_into(prompt, np.zeros(self.size, dtype=np.float32))

    def extract_many(self, prompts: Sequence[Prompt]) -> np.ndarray:
        matrix = np.zeros((len(prompts), self.size), dtype=np.float32)
        for row, prompt in zip(matrix, prompts):
            self._fill(prompt, row)
        return matrix


FEATURE_SETS: dict[str, FeatureSet] = {
    "paper19": FeatureSet("paper19", PAPER19_NAMES, PAPER19_GROUPS, _paper19),
}


def get_feature_set(name: str) -> FeatureSet:
    try:
        return FEATURE_SETS[name]
    except KeyError:
        known = ", ".join(sorted(FEATURE_SETS))
        raise KeyError(f"unknown feature set {name!r}; known: {known}") from None
