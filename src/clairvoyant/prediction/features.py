"""The only feature code anywhere: lexical features of a prompt, used by training and serving alike.

A feature set is versioned by name; a model card records the name and the feature names, and the
predictor refuses a model whose card does not match ``FEATURE_SETS[name].names``. Changing what a
feature computes means a new feature-set name, never an edit in place.

``paper19``: the paper's 19 features (section 3.2) in the paper's order, with the reference
implementation's defects fixed: the verb is the *leading* instruction verb (after openers such as
"please", "can you"), not the first match anywhere; keywords match whole words ("information" is not
"format", "listen" is not "list"); ``prompt_token_len`` is ``len(instruction) // 4`` in code points.

``rich_v1``: ``paper19`` followed by conversation and structure features (history size, turns,
system prompt, lines, code fences and symbols, requested quantities such as "10 ideas" or
"2000-word") and counts of curated word groups.

``rich_v2``: exactly ``rich_v1`` on a 600-character scan window (first 500 + last 100 characters),
so that a long prompt costs what a short one does; lengths (``prompt_token_len``, history, system)
still use the whole text, ``word_count`` counts the window.

``rich_v3`` (the shipped regressor's): ``rich_v2`` plus ``lexicon_log_tokens``, a linear word
lexicon's estimate of the answer's log tokens: ``intercept + sum(weights of the distinct known
terms) / sqrt(number of known terms)`` over the words and word bigrams of the rich_v2 window (a ridge
regression on term presence, fit on the ShareGPT training split: ``clairvoyant.tools.training.lexicon``).
The lexicon file is pinned by sha256: a new lexicon means a new feature-set name.

Words: the scanned text is UTF-8 encoded, ASCII-lower-cased, ASCII punctuation except ``#+_`` is
turned into spaces, and the result is split on whitespace (so "step-by-step" is three words,
"what's" is "what" + "s", "c++" and "c#" stay whole). Non-ASCII words never match the English
keyword sets. Everything runs in C-level str/bytes/set operations (one regex only when a trigger
word is present); the keyword and lexicon sum over the window's words and word pairs is one set of
dict lookups and one integer ``sum`` (``_term_total``). tests/test_features_reference.py pins every
value against golden outputs of the code the shipped model was trained with.

No input raises: empty text, lone surrogates, control characters and any script are all valid.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path

import numpy as np

__all__ = [
    "FEATURE_SETS",
    "SCAN_HEAD_CHARS",
    "SCAN_TAIL_CHARS",
    "VERBS",
    "FeatureSet",
    "Prompt",
    "get_feature_set",
    "Lexicon",
    "leading_verb",
    "lexicon_terms",
    "load_lexicon",
    "scan_words",
    "words_of",
]

SCAN_HEAD_CHARS = 16_000
SCAN_TAIL_CHARS = 4_000
# rich_v2 = rich_v1 computed on a 600-character scan window (first 500 + last 100 characters; the
# whole of ~75% of ShareGPT prompts). Word features of a long paste come from its start and end
# only, so the per-request cost is bounded by the cost of a 600-character prompt: that is what
# keeps the predictor's p99 under 0.1 ms. Group cross-validation on the training split: 0.870
# ranking accuracy for rich_v2 vs 0.868 for rich_v1 (std 0.015): no accuracy is lost.
RICH_V2_HEAD_CHARS = 500
RICH_V2_TAIL_CHARS = 100


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a request is featurized from (built by ``clairvoyant.prediction.dialects``).

    instruction: the text of the last user turn (or the completion prompt).
    context_chars: characters of everything the model reads, instruction included.
    turns: number of messages, the instruction's included (1 for a bare prompt).
    system_chars: characters of system prompts.
    """

    instruction: str
    context_chars: int = -1  # -1: same as the instruction
    turns: int = 1
    system_chars: int = 0


# --------------------------------------------------------------------------------------------
# Tokenizing into words (bytes)

# ASCII punctuation that separates words; '#', '+' and '_' stay inside words (c#, c++, snake_case).
_SEPARATORS = set(string.punctuation) - set("#+_")
_WORD_TABLE = bytes(32 if chr(i) in _SEPARATORS else i for i in range(256))


def _scan_window(text: str, head: int = SCAN_HEAD_CHARS, tail: int = SCAN_TAIL_CHARS) -> str:
    if len(text) <= head + tail:
        return text
    return text[:head] + "\n" + text[-tail:]


def _words(text: str) -> list[bytes]:
    # surrogatepass: a lone surrogate (legal in a JSON string) must not raise.
    return text.encode("utf-8", "surrogatepass").lower().translate(_WORD_TABLE).split()


def words_of(text: str) -> list[str]:
    """The words the keyword features see, in order (a debugging and test aid)."""
    return [w.decode("utf-8", "replace") for w in scan_words(text, SCAN_HEAD_CHARS, SCAN_TAIL_CHARS)]


def _bset(words: str) -> frozenset[bytes]:
    return frozenset(w.encode() for w in words.split())


# --------------------------------------------------------------------------------------------
# The leading verb

# The paper's 13 verb categories, in the paper's column order.
VERBS: tuple[str, ...] = tuple(
    "what write explain summarize how list implement compare describe generate why define other".split()
)
_VERB_INDEX = {v: i for i, v in enumerate(VERBS)}
_VERB_OF: dict[bytes, int] = {v.encode(): i for i, v in enumerate(VERBS) if v != "other"}
# Spellings of the same category ("what's" tokenizes to "what" + "s").
_VERB_OF.update({b"whats": 0, b"summarise": 3})
_OTHER = _VERB_INDEX["other"]

# Openers skipped before the leading verb, matched word by word (longest first).
_OPENER_PHRASES = tuple(
    phrase.strip()
    for phrase in """i would like you to, i'd like you to, i want you to, i need you to, can you please,
    could you please, would you please, will you please, can you, could you, would you, will you, can u,
    could u, help me, please, pls, plz, kindly, hey, hi, hello, ok, okay, so, now, also, and, then, dear,
    chatgpt, gpt, assistant""".split(",")
)
_OPENERS: dict[bytes, tuple[tuple[bytes, ...], ...]] = {}
for _phrase in sorted(_OPENER_PHRASES, key=lambda p: -len(p.split())):
    _ws = tuple(_words(_phrase))
    _OPENERS[_ws[0]] = _OPENERS.get(_ws[0], ()) + (_ws,)
del _phrase, _ws
_LEAD_WORDS = 24  # openers are looked for among the first words only


def _lead_index(words: list[bytes]) -> int:
    """Index in ``words`` of the first word after the openers (len(words) if none)."""
    i, n = 0, len(words)
    while i < n:
        candidates = _OPENERS.get(words[i])
        if candidates is None or i >= _LEAD_WORDS:
            return i
        for opener in candidates:
            k = len(opener)
            if tuple(words[i : i + k]) == opener:
                i += k
                break
        else:
            return i
    return i


def leading_verb(text: str) -> str:
    """The verb category of the first instruction word after openers ("please", "can you", ...)."""
    words = _words(text[:2000])
    i = _lead_index(words)
    return VERBS[_VERB_OF.get(words[i], _OTHER) if i < len(words) else _OTHER]


# --------------------------------------------------------------------------------------------
# paper19

CODE_WORDS = _bset(
    """code function def class script program implement algorithm debug refactor import variable
    loop recursion api sql regex react angular vue nextjs typescript javascript html css node express
    django flask component endpoint middleware query python java c++ c# golang rust kotlin php ruby
    bash shell json compile compiler bug exception"""
)
FORMAT_WORDS = _bset(
    """table tables list lists bullet bullets bulleted json csv markdown outline numbered enumerate
    format formatted structure structured yaml xml"""
)
# Subordinating conjunctions and relative pronouns (paper 3.2: a proxy for syntactic complexity).
CLAUSE_WORDS = _bset(
    """because although though while whereas when whenever if unless since after before until
    once which who whom whose that where"""
)
# clause_count: one pass of set probes over the words (True counts 1); a words.count per distinct
# clause word cost ~2x more on long windows (the predictor's p99).
_IS_CLAUSE_WORD = CLAUSE_WORDS.__contains__
# A length-constraint pattern can only match when one of these words is present (checked first,
# so the regex runs on few prompts). The regex sees the separator-normalized word stream.
_LENGTH_TRIGGERS = _bset(
    """brief briefly concise concisely short shortly succinct succinctly liner tl tldr detailed
    detail depth elaborate word words sentence sentences line lines paragraph paragraphs page pages
    than most under maximum max"""
)
# The paper's length-constraint regex (tests/test_features_reference.py keeps it as written), faster:
# - every alternative starts with a word character and a norm starts with a space, so "\b before
#   the match" is "a non-word byte just before it"; a pattern that starts with a character class
#   lets the regex engine skip to candidate positions (a leading \b defeats that): ~20% cheaper;
# - the alternatives are grouped by their first letters, so that at each candidate the engine
#   tests one byte per group instead of one per alternative: ~25% cheaper again on the longest windows
#   (the predictor's p99). Only whether there is a match is read, and the language is
#   the same, so the order of the alternatives does not matter.
# The test compares the two on near misses, and the golden outputs pin the extractor on ShareGPT.
_LENGTH_SEARCH = re.compile(
    rb"[^0-9A-Z_a-z](?:b(?:riefly|rief)|c(?:oncisely|oncise)|s(?:hortly|hort|uccinctly|uccinct)"
    rb"|one liner|t(?:l dr|ldr)|detailed|elaborate"
    rb"|in (?:detail|depth|(?:one|a single|\d+) (?:words?|sentences?|lines?|paragraphs?))"
    rb"|not? more than \d+|at most \d+|under \d+|less than \d+|fewer than \d+|max(?:imum of)? \d+"
    rb"|\d+ (?:words?|sentences?|paragraphs?|pages?))\b"
).search
_STEP_BY_STEP = b" step by step "


def _norm(words: list[bytes]) -> bytes:
    """The words joined by single spaces, with a space at each end (for the few regexes)."""
    return b" " + b" ".join(words) + b" "


_QUESTION_MARKS = frozenset("?？")


# The 13-column one-hot rows, prebuilt.
_VERB_ROWS: tuple[list[float | int], ...] = tuple(
    [1.0 if j == i else 0.0 for j in range(len(VERBS))] for i in range(len(VERBS))
)
_STEP_WORDS = frozenset((b"step",))


def _paper19(prompt: Prompt) -> list[float | int]:
    """rich_v1's first 19 columns: they are the paper's features, computed on the same window."""
    return _rich_values(prompt, SCAN_HEAD_CHARS, SCAN_TAIL_CHARS)[:19]


PAPER19_NAMES: tuple[str, ...] = (
    "prompt_token_len",
    "has_code_keyword",
    "has_length_constraint",
    "ends_with_question",
    "has_format_keyword",
    "clause_count",
) + tuple(f"verb_{v}" for v in VERBS)

# Feature groups for the drop-one ablation (paper Table 4): group name -> feature names.
PAPER19_GROUPS: dict[str, tuple[str, ...]] = {
    **{name: (name,) for name in PAPER19_NAMES[:6]},
    "instruction_verb": PAPER19_NAMES[6:],
}

# --------------------------------------------------------------------------------------------
# rich_v1: word groups (counts of distinct words present)

_RICH_GROUPS_WORDS = {
    "w_longform": """essay article articles blog post posts story stories report script outline plan chapter chapters
    book guide tutorial course curriculum lesson lessons proposal letter speech presentation slides
    email newsletter itinerary quiz questions examples website landing documentation readme
    description descriptions paper thesis novel episode scene lyrics song poem agenda schedule
    syllabus strategy campaign""",
    "w_code": """code function functions def class python javascript js typescript html css sql api implement
    algorithm script json node nodejs react database server query component program app application
    backend frontend endpoint java c++ c# golang rust php ruby bash regex array method variable
    print input output error import return unity flutter django flask spring docker kubernetes aws""",
    "w_detail": """detailed detail details comprehensive complete full thorough elaborate extensive depth expand
    longer long entire whole every each all steps include including additional more examples""",
    "w_brief": """brief briefly short shorter concise concisely summary summarize summarise tldr quick quickly
    simple simply sentence sentences one word yes no only just""",
    "w_continue": "continue continues finish proceed resume rest keep going further next",
    "w_chat": """thanks thank thx great awesome cool nice perfect ok okay hi hello hey good wow lol sure correct
    right exactly yes no love amazing""",
    "w_roleplay": "act pretend roleplay role imagine simulate persona character game play",
    "w_reply_constraint": "reply respond answer say confirm acknowledge understood ready wait remember only",
    "w_rewrite": """rewrite rephrase paraphrase improve edit fix correct proofread translate convert shorten polish
    revise grammar reword""",
    "w_create": """write create generate make build develop design produce draft compose give provide list show
    suggest add""",
    "w_question": "what why how who when where which is are does do did can could should would will was were whats",
    "w_personal": "i i'm im me my mine we our she her he him his they them am was were",
}
_RICH_GROUPS: tuple[tuple[str, frozenset[bytes]], ...] = tuple((n, _bset(w)) for n, w in _RICH_GROUPS_WORDS.items())

_QUESTION_LEADS = _bset("what why how who when where which is are does do did can could should would will whats")
_CONTINUE_LEADS = _bset("continue finish proceed resume go keep more next rest")
_CREATE_LEADS = _bset("write create generate make build develop design produce draft compose give provide list")
_CONTEXT_LEADS = _bset("i my we our here this the")

_UNIT_SIZES = ((b"word", 1), (b"sentence", 20), (b"line", 10), (b"paragraph", 120), (b"page", 450))
_UNIT_WORDS = {unit + plural: n for unit, n in _UNIT_SIZES for plural in (b"", b"s")}
_ITEM_WORDS = _bset(
    """ideas examples questions tips ways steps points reasons names titles options suggestions
    items facts things strategies methods topics questions headlines slogans sentences prompts
    answers words lines paragraphs pages chapters days weeks posts tweets emails variations
    versions alternatives keywords bullet bullets benefits features"""
)
_QUANTITY_TRIGGERS = _ITEM_WORDS | frozenset(_UNIT_WORDS)
_NUMBER_WORDS = {
    **{
        w.encode(): n for n, w in enumerate("one two three four five six seven eight nine ten eleven twelve".split(), 1)
    },
    **{b"fifteen": 15, b"twenty": 20, b"thirty": 30, b"forty": 40, b"fifty": 50, b"hundred": 100, b"a": 1},
}


def _alternation(words: Iterable[bytes]) -> bytes:
    """A regex alternation of ``words`` grouped by first byte ("b(?:ullets|ullet)|c(?:hapters)|..."),
    longest first within a group: the same language as the flat alternation, but the engine tests one
    byte per group instead of one per word. Only for alternatives that must match a whole word (each
    is followed by a space here), where the order of the alternatives cannot change a match."""
    groups: dict[bytes, list[bytes]] = {}
    for w in sorted(words, key=lambda w: (-len(w), w)):
        groups.setdefault(w[:1], []).append(re.escape(w[1:]))
    return b"|".join(
        re.escape(first) + (b"(?:" + b"|".join(rest) + b")" if rest != [b""] else b"")
        for first, rest in sorted(groups.items())
    )


_QUANTITY_RE = re.compile(
    rb" (\d{1,6}|" + _alternation(_NUMBER_WORDS) + rb") (?:[a-z]+ )?(" + _alternation(_QUANTITY_TRIGGERS) + rb")(?= )"
)
_QUANTITY_CAP = 100_000.0


def _quantity_values(norm: bytes, words: list[bytes]) -> tuple[float, float]:
    """(largest requested count, largest requested text size in words) in ``norm``, the
    ``_norm(words)``; 0 when none.

    The count is the largest number directly before (or one word before) any quantity noun,
    text units included: "10 ideas" -> 10, "2000-word essay" -> 2000 (and 2000 words of size).

    The regex runs only on the stretch of ``norm`` from two words before the first quantity noun to
    the last one (over a whole 600-character window it cost ~12 us). That is exact: a
    match ends at a noun and starts at most two words before it, so none lies outside the stretch,
    and findall finds no match before it that could overlap one inside.
    """
    first, last = len(norm), 0
    for noun in _QUANTITY_TRIGGERS.intersection(words):
        spaced = b" " + noun + b" "
        first = min(first, norm.find(spaced))
        last = max(last, norm.rfind(spaced) + len(spaced))
    if last == 0:
        return 0.0, 0.0
    before = norm.rfind(b" ", 0, first)  # the space before the word before the first noun; -1: none
    start = max(norm.rfind(b" ", 0, before), 0) if before > 0 else 0  # (a negative end would count from the end)
    items = size = 0.0
    for number, noun in _QUANTITY_RE.findall(norm, start, last):
        value = float(number) if number.isdigit() else float(_NUMBER_WORDS[number])
        value = min(value, _QUANTITY_CAP)
        unit = _UNIT_WORDS.get(noun)
        if unit is not None:
            size = max(size, value * unit)
        if noun in _ITEM_WORDS:
            items = max(items, value)
    return items, size


# code_symbol_count counts "{", ";", "=", "()", "</" and "->": the single bytes in one pass (the
# length lost when translate deletes them), the pairs with bytes.count.
_CODE_SYMBOL_BYTES = b"{;="
_CODE_SYMBOL_PAIRS = (b"()", b"</", b"->")


# Every keyword the rich extractor looks up, in one table: word -> an int whose byte k counts the
# word's membership of keyword set k (the 12 word groups, then the paper19 and trigger sets below).
# One intersection of the window's words with that table plus one C-level ``sum`` gives every count
# and flag at once; ``int.to_bytes`` splits the sum into its bytes. No byte can carry into the next:
# a byte's total is at most the size of its set, which _keyword_fields checks is below 256.
_CODE_FIELD, _FORMAT_FIELD, _LENGTH_FIELD, _STEP_FIELD, _QUANTITY_FIELD, _CLAUSE_FIELD = range(12, 18)


def _keyword_fields(sets: Sequence[frozenset[bytes]]) -> dict[bytes, int]:
    fields: dict[bytes, int] = {}
    for k, words in enumerate(sets):
        if len(words) > 255:
            raise ValueError(f"keyword set {k} has {len(words)} words; a byte counts at most 255")
        for w in words:
            fields[w] = fields.get(w, 0) + (1 << (8 * k))
    return fields


_KEYWORD_FIELDS = _keyword_fields(
    [group for _, group in _RICH_GROUPS]
    + [CODE_WORDS, FORMAT_WORDS, _LENGTH_TRIGGERS, _STEP_WORDS, _QUANTITY_TRIGGERS, CLAUSE_WORDS]
)
_N_FIELDS = _CLAUSE_FIELD + 1
_N_GROUPS = len(_RICH_GROUPS)  # the group counts are bytes 0 .. _N_GROUPS - 1

# rich_v3 folds its lexicon into the same sums (``_lexicon_table``): above the keyword bytes, a
# 32-bit count of the known lexicon terms, and above that the exact sum of their weights, each
# weight an integer multiple of 2**-scale_bits (every finite float is one). The fields below
# never borrow from the signed weight sum on top: ``total & _FIELDS_MASK`` and the shifts recover
# each part of any total, negative ones included.
_COUNT_SHIFT = 8 * _N_FIELDS
_COUNT_MASK = (1 << 32) - 1
_WEIGHT_SHIFT = _COUNT_SHIFT + 32
_FIELDS_MASK = (1 << _COUNT_SHIFT) - 1


@dataclass(frozen=True, slots=True)
class _KeywordTable:
    """The per-term lookups of one rich feature set, in one dict (a single hash table touched per
    word: on a busy machine the cache misses cost more than the instructions): a word maps to its
    packed int (keyword bytes, plus the lexicon count and weight for rich_v3), a word pair
    ``(w1, w2)`` to its packed lexicon count and weight."""

    terms: dict[bytes | tuple[bytes, ...], int]
    lexicon: bool = False  # True: look up word pairs and append the lexicon column
    scale: int = 1  # 2**scale_bits: the weight sum is (total >> _WEIGHT_SHIFT) / scale
    intercept: float = 0.0


_PLAIN_TABLE = _KeywordTable({word: packed for word, packed in _KEYWORD_FIELDS.items()})


_COUNT_CAP = 1e12  # keeps every value finite in float32 whatever a hand-built Prompt carries


def _term_total(words: list[bytes], table: _KeywordTable) -> int:
    """The packed sum of the table's values over the distinct words of ``words`` that are terms and,
    with a lexicon, over its distinct adjacent word pairs that are terms: each distinct term counts
    once, however often it occurs. A word (bytes) never equals a pair (a tuple), so one set holds
    both; ``filter(None, ...)`` drops the unknown terms (None) and adds nothing else (no term's
    value is 0)."""
    terms = table.terms
    distinct: set[bytes | tuple[bytes, ...]] = set(words)
    if table.lexicon:
        distinct.update(zip(words, islice(words, 1, None)))
    total: int = sum(filter(None, map(terms.get, distinct)))
    return total


def _rich_values(prompt: Prompt, head: int, tail_chars: int, table: _KeywordTable = _PLAIN_TABLE) -> list[float | int]:
    """rich_v1 (and, with a lexicon ``table``, rich_v3) on the given scan window, in one pass of
    C-level operations: ``_paper19_values``, the word-group loops and the lexicon folded into the
    keyword tables above (tests/test_features_reference.py pins it value for value against the
    golden outputs of the earlier, plainer code)."""
    text = prompt.instruction
    n_chars = len(text)
    window = text if n_chars <= head + tail_chars else text[:head] + "\n" + text[-tail_chars:]
    raw = window.encode("utf-8", "surrogatepass").lower()
    words = raw.translate(_WORD_TABLE).split()
    n_words = len(words)
    total = _term_total(words, table)
    counts = (total & _FIELDS_MASK).to_bytes(_N_FIELDS, "little") if total else _NO_KEYWORDS
    # _lead_index, with its common case (no opener) inlined
    i = 0 if (not n_words or words[0] not in _OPENERS) else _lead_index(words)
    lead = words[i] if i < n_words else b""
    tail = text[-256:].rstrip()
    norm = _norm(words) if (counts[_LENGTH_FIELD] or counts[_STEP_FIELD] or counts[_QUANTITY_FIELD]) else b""
    turns: float = prompt.turns  # capped below by a float constant
    turns = (turns if turns < _COUNT_CAP else _COUNT_CAP) if turns > 1 else 1
    system: float = prompt.system_chars
    system = (system if system < _COUNT_CAP else _COUNT_CAP) if system > 0 else 0
    context = prompt.context_chars
    history: float = (context - n_chars - system) if context >= 0 else -system
    history = (history if history < _COUNT_CAP else _COUNT_CAP) if history > 0 else 0
    items, size = _quantity_values(norm, words) if counts[_QUANTITY_FIELD] else (0.0, 0.0)
    fences = raw.count(b"```")  # not `b"```" in raw`: bytes.__contains__ first tries the operand as an int
    values: list[float | int] = [
        n_chars // 4,
        1.0 if (counts[_CODE_FIELD] or fences) else 0.0,
        1.0 if (counts[_LENGTH_FIELD] and _LENGTH_SEARCH(norm) is not None) else 0.0,
        1.0 if (tail and tail[-1] in _QUESTION_MARKS) else 0.0,
        1.0 if (counts[_FORMAT_FIELD] or (counts[_STEP_FIELD] and norm.find(_STEP_BY_STEP) >= 0)) else 0.0,
        sum(map(_IS_CLAUSE_WORD, words)) if counts[_CLAUSE_FIELD] else 0.0,
        *_VERB_ROWS[_VERB_OF.get(lead, _OTHER)],
        history,
        turns,
        system,
        history / (turns - 1) if turns > 1 else 0.0,
        raw.count(b"\n"),
        fences,
        len(raw) - len(raw.translate(None, _CODE_SYMBOL_BYTES)) + sum(map(raw.count, _CODE_SYMBOL_PAIRS)),
        n_words,
        items,
        size,
        *counts[:_N_GROUPS],
        *_LEAD_FLAGS.get(lead, _NO_LEAD_FLAGS),
        1.0 if text.isascii() else 0.0,
        1.0 if tail.endswith(":") else 0.0,
        raw.count(b'"'),
    ]
    if table.lexicon:  # intercept + fsum(weights) / sqrt(known), exactly (see _lexicon_table)
        known = (total >> _COUNT_SHIFT) & _COUNT_MASK
        values.append(
            table.intercept + (total >> _WEIGHT_SHIFT) / table.scale / math.sqrt(known) if known else table.intercept
        )
    return values


_NO_KEYWORDS = bytes(_N_FIELDS)


# lead word -> (lead_question, lead_continue, lead_create, lead_context)
_LEAD_SETS = (_QUESTION_LEADS, _CONTINUE_LEADS, _CREATE_LEADS, _CONTEXT_LEADS)
_LEAD_FLAGS = {w: tuple(1.0 if w in leads else 0.0 for leads in _LEAD_SETS) for w in frozenset().union(*_LEAD_SETS)}
_NO_LEAD_FLAGS = (0.0, 0.0, 0.0, 0.0)


RICH_V1_EXTRA: tuple[str, ...] = (
    *"""history_chars turns system_chars mean_history_message_chars line_count code_fence_count
    code_symbol_count word_count requested_items requested_words""".split(),
    *(name for name, _ in _RICH_GROUPS),
    *"lead_question lead_continue lead_create lead_context is_ascii ends_with_colon quote_count".split(),
)
RICH_V1_NAMES: tuple[str, ...] = PAPER19_NAMES + RICH_V1_EXTRA
RICH_V1_GROUPS: dict[str, tuple[str, ...]] = {
    **PAPER19_GROUPS,
    "conversation": RICH_V1_EXTRA[:4],
    "structure": tuple(
        "line_count code_fence_count code_symbol_count word_count ends_with_colon quote_count is_ascii".split()
    ),
    "requested_quantity": ("requested_items", "requested_words"),
    "word_groups": tuple(name for name, _ in _RICH_GROUPS),
    "lead_word": ("lead_question", "lead_continue", "lead_create", "lead_context"),
}


# --------------------------------------------------------------------------------------------
# rich_v3: rich_v2 + a learned word lexicon


@dataclass(frozen=True)
class Lexicon:
    """Weights of words and word bigrams (UTF-8 bytes, bigram = ``b"w1 w2"``) -> log tokens."""

    name: str
    intercept_log_tokens: float
    weights: dict[bytes, float]

    def to_json(self, extra: dict[str, object] | None = None) -> str:
        terms = {t.decode("utf-8", "surrogatepass"): round(w, 6) for t, w in sorted(self.weights.items())}
        body = {"name": self.name, "intercept_log_tokens": self.intercept_log_tokens, **(extra or {}), "weights": terms}
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Lexicon:
        data = json.loads(text)
        weights = {t.encode("utf-8", "surrogatepass"): float(w) for t, w in data["weights"].items()}
        return cls(str(data["name"]), float(data["intercept_log_tokens"]), weights)


def lexicon_terms(words: Iterable[bytes]) -> set[bytes]:
    """The distinct words and word bigrams a lexicon looks up (training builds its vocabulary from these)."""
    words = list(words)
    terms = set(words)
    terms.update(map(b" ".join, zip(words, words[1:])))
    return terms


def scan_words(text: str, head: int = RICH_V2_HEAD_CHARS, tail: int = RICH_V2_TAIL_CHARS) -> list[bytes]:
    """The words of the rich_v2 scan window as the extractor sees them (bytes, lower-cased)."""
    return _words(_scan_window(text, head, tail))


LEXICON_DIR = Path(__file__).parent / "lexicons"
# The shipped lexicon file, pinned: a different file is a different feature set.
RICH_V3_LEXICON = "rich_v3.json"
RICH_V3_LEXICON_SHA256 = "107363506241f09933300b4a5c3938cb9787e7ceaa55647ce64dbc10dee9c642"


@functools.cache
def load_lexicon(sha256: str = RICH_V3_LEXICON_SHA256) -> Lexicon:
    """The rich_v3 lexicon file; raises RuntimeError if its sha256 is not ``sha256`` (the pinned one)."""
    raw = (LEXICON_DIR / RICH_V3_LEXICON).read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != sha256:
        raise RuntimeError(
            f"lexicon {RICH_V3_LEXICON} has sha256 {digest}, feature set rich_v3 expects {sha256}: "
            "the file was changed; a new lexicon needs a new feature-set name"
        )
    return Lexicon.from_json(raw.decode("utf-8"))


def _lexicon_table(lexicon: Lexicon, fields: dict[bytes, int] = _KEYWORD_FIELDS) -> _KeywordTable:
    """The keyword table with ``lexicon`` folded in (the layout is above ``_KeywordTable``).

    The column is ``intercept + fsum(weights) / sqrt(known)``. Here each weight is the
    integer ``weight * 2**scale_bits``, so one ``sum`` of ints adds them exactly, and
    ``int / 2**scale_bits`` rounds that exact sum to the nearest float, which is what ``fsum``
    returns: the same float, bit for bit (tests/test_features_reference.py compares them).
    """
    # One dict probe per term: words keyed by bytes, bigrams by (w1, w2) tuples, which zip builds in C
    # (no b" ".join per pair). Words never hold a space, so a term that is not one word or two words
    # joined by one space can never match and is left out.
    ratios: dict[bytes | tuple[bytes, ...], tuple[int, int]] = {}
    for term, weight in lexicon.weights.items():
        parts = term.split(b" ")
        if len(parts) > 2:
            continue
        if not math.isfinite(weight):
            raise ValueError(f"lexicon {lexicon.name} has a non-finite weight for {term!r}")
        ratios[parts[0] if len(parts) == 1 else tuple(parts)] = weight.as_integer_ratio()  # (n, 2**k)
    scale_bits = max((d.bit_length() - 1 for _, d in ratios.values()), default=0)
    one = 1 << _COUNT_SHIFT
    terms: dict[bytes | tuple[bytes, ...], int] = {word: packed for word, packed in fields.items()}
    for key, (n, d) in ratios.items():
        packed = one + ((n << (scale_bits - (d.bit_length() - 1))) << _WEIGHT_SHIFT)
        terms[key] = terms.get(key, 0) + packed
    return _KeywordTable(terms, True, 1 << scale_bits, lexicon.intercept_log_tokens)


@functools.cache
def _rich_v3_table() -> _KeywordTable:
    return _lexicon_table(load_lexicon())


def _rich_v3_values(prompt: Prompt) -> list[float | int]:
    return _rich_values(prompt, RICH_V2_HEAD_CHARS, RICH_V2_TAIL_CHARS, _rich_v3_table())


RICH_V3_NAMES: tuple[str, ...] = RICH_V1_NAMES + ("lexicon_log_tokens",)
RICH_V3_GROUPS: dict[str, tuple[str, ...]] = {**RICH_V1_GROUPS, "lexicon": ("lexicon_log_tokens",)}


# --------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class FeatureSet:
    """A named, versioned feature vector.

    Contract: every method accepts any Prompt (any text, any size) without raising, and fills
    every one of the ``size`` columns with a finite float32 value.
    """

    name: str
    names: tuple[str, ...]
    groups: dict[str, tuple[str, ...]]
    # the raw extractor: the row as a list of ``size`` Python numbers (the predictor packs it
    # straight into its bound buffer)
    values: Callable[[Prompt], list[float | int]]

    @property
    def size(self) -> int:
        return len(self.names)

    def extract_into(self, prompt: Prompt, out: np.ndarray) -> np.ndarray:
        """Write the features of ``prompt`` into ``out`` (float32, shape [size]) and return it."""
        out[:] = self.values(prompt)
        return out

    def extract(self, prompt: Prompt) -> np.ndarray:
        return np.array(self.values(prompt), dtype=np.float32)

    def extract_many(self, prompts: Sequence[Prompt]) -> np.ndarray:
        if not prompts:
            return np.zeros((0, self.size), dtype=np.float32)
        return np.array([self.values(p) for p in prompts], dtype=np.float32)


FEATURE_SETS: dict[str, FeatureSet] = {
    "paper19": FeatureSet("paper19", PAPER19_NAMES, PAPER19_GROUPS, _paper19),
    "rich_v1": FeatureSet(
        "rich_v1",
        RICH_V1_NAMES,
        RICH_V1_GROUPS,
        partial(_rich_values, head=SCAN_HEAD_CHARS, tail_chars=SCAN_TAIL_CHARS),
    ),
    "rich_v2": FeatureSet(
        "rich_v2",
        RICH_V1_NAMES,
        RICH_V1_GROUPS,
        partial(_rich_values, head=RICH_V2_HEAD_CHARS, tail_chars=RICH_V2_TAIL_CHARS),
    ),
    "rich_v3": FeatureSet("rich_v3", RICH_V3_NAMES, RICH_V3_GROUPS, _rich_v3_values),
}
assert all(len(set(fs.names)) == fs.size for fs in FEATURE_SETS.values())


def get_feature_set(name: str) -> FeatureSet:
    """The feature set registered as ``name``; KeyError naming the known sets otherwise."""
    try:
        return FEATURE_SETS[name]
    except KeyError:
        known = ", ".join(sorted(FEATURE_SETS))
        raise KeyError(f"unknown feature set {name!r}; known: {known}") from None
