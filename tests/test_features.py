"""clairvoyant.prediction.features: the one feature extractor (paper19, the rich sets, their term sum)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lexicon_reference import lexicon_score

from clairvoyant.prediction import features
from clairvoyant.prediction.features import (
    FEATURE_SETS,
    SCAN_HEAD_CHARS,
    VERBS,
    Prompt,
    get_feature_set,
    leading_verb,
    words_of,
)

P19 = get_feature_set("paper19")
RICH = get_feature_set("rich_v1")
RICH2 = get_feature_set("rich_v2")


def feat(text: str, name: str, fs=P19, **prompt_kw: int) -> float:
    return float(fs.extract(Prompt(text, **prompt_kw))[fs.names.index(name)])


# ---------------------------------------------------------------------------- the registry


def test_paper19_names_are_the_papers_order() -> None:
    assert P19.names[:6] == (
        "prompt_token_len",
        "has_code_keyword",
        "has_length_constraint",
        "ends_with_question",
        "has_format_keyword",
        "clause_count",
    )
    assert P19.names[6:] == tuple(f"verb_{v}" for v in VERBS)
    assert VERBS == (
        "what",
        "write",
        "explain",
        "summarize",
        "how",
        "list",
        "implement",
        "compare",
        "describe",
        "generate",
        "why",
        "define",
        "other",
    )
    assert P19.size == 19


def test_rich_v1_extends_paper19_and_names_are_unique() -> None:
    assert RICH.names[:19] == P19.names
    assert len(set(RICH.names)) == RICH.size == 48
    for fs in FEATURE_SETS.values():
        grouped = [n for names in fs.groups.values() for n in names]
        assert sorted(grouped) == sorted(fs.names), fs.name  # ablation groups cover every column once


def test_unknown_feature_set_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="paper19"):
        get_feature_set("paper20")


# ---------------------------------------------------------------------------- the leading verb


@pytest.mark.parametrize(
    ("text", "verb"),
    [
        ("Write a Python function to reverse a list", "write"),  # the reference said "list"
        ("Please write a poem", "write"),
        ("Can you please explain recursion?", "explain"),
        ("could you summarise this article", "summarize"),
        ("I want you to list ten cities", "list"),
        ("Hi! Hello, ok so now what is love", "what"),
        ("What's the capital of France?", "what"),
        ("Translate this to French: explain", "other"),  # translate is not a category
        ("My code does not compile, explain why", "other"),  # not leading
        ("  \n\t WHY is the sky blue", "why"),
        ("please", "other"),
        ("", "other"),
        ("1. describe a cat", "other"),
        ("implement quicksort", "implement"),
        ("define entropy", "define"),
    ],
)
def test_leading_verb_is_the_first_instruction_word_after_openers(text: str, verb: str) -> None:
    assert leading_verb(text) == verb
    fs_row = P19.extract(Prompt(text))
    assert fs_row[6:].sum() == 1.0
    assert P19.names[6 + int(np.argmax(fs_row[6:]))] == f"verb_{verb}"


# ---------------------------------------------------------------------------- whole-word keywords


@pytest.mark.parametrize(
    ("text", "name", "expected"),
    [
        ("Give me the information", "has_format_keyword", 0.0),  # "information" is not "format"
        ("The horse is stable", "has_format_keyword", 0.0),  # "stable" is not "table"
        ("Put it in a table", "has_format_keyword", 1.0),
        ("Listen to me", "has_format_keyword", 0.0),  # "listen" is not "list"
        ("make a list.", "has_format_keyword", 1.0),
        ("explain it step-by-step", "has_format_keyword", 1.0),
        ("a decoder for barcodes", "has_code_keyword", 0.0),  # "barcodes" is not "code"
        ("fix my code, please", "has_code_keyword", 1.0),
        ("in C++ or C#", "has_code_keyword", 1.0),
        ("some text ```x = 1```", "has_code_keyword", 1.0),
        ("The shortage of rice", "has_length_constraint", 0.0),  # "shortage" is not "short"
        ("answer briefly", "has_length_constraint", 1.0),
        ("in 3 sentences", "has_length_constraint", 1.0),
        ("a 2000-word essay", "has_length_constraint", 1.0),
        ("no more than 50 words", "has_length_constraint", 1.0),
        ("tl;dr of this", "has_length_constraint", 1.0),
        ("is it?  \n", "ends_with_question", 1.0),
        ("is it? no.", "ends_with_question", 0.0),
        ("这是什么？", "ends_with_question", 1.0),
    ],
)
def test_keyword_traps(text: str, name: str, expected: float) -> None:
    assert feat(text, name) == expected


def test_clause_count_counts_whole_words_with_repeats() -> None:
    assert feat("if it rains, which it will, and if not, because", "clause_count") == 4.0  # if, which, if, because
    assert feat("thatcher whichever", "clause_count") == 0.0


def test_prompt_token_len_is_code_points_over_four_everywhere() -> None:
    assert feat("abcdefgh", "prompt_token_len") == 2.0
    assert feat("é" * 8, "prompt_token_len") == 2.0  # not bytes (16 // 4 = 4)
    assert feat("日本語のテキスト", "prompt_token_len") == 2.0
    assert feat("abc", "prompt_token_len", fs=RICH) == 0.0


def test_words_split_on_punctuation_but_keep_cpp_and_csharp() -> None:
    assert words_of("Hello, World! step-by-step; c++ c# snake_case what's") == [
        "hello",
        "world",
        "step",
        "by",
        "step",
        "c++",
        "c#",
        "snake_case",
        "what",
        "s",
    ]


# ---------------------------------------------------------------------------- rich_v1


def test_rich_requested_quantities() -> None:
    row = RICH.extract(Prompt("Write a 2000-word essay with 10 creative ideas"))
    assert row[RICH.names.index("requested_words")] == 2000.0
    assert row[RICH.names.index("requested_items")] == 10.0
    assert feat("write three paragraphs", "requested_words", fs=RICH) == 360.0
    assert feat("give me five blog titles", "requested_items", fs=RICH) == 5.0
    assert feat("what is 2 + 2", "requested_items", fs=RICH) == 0.0


def test_rich_conversation_features_come_from_the_prompt_counts() -> None:
    row = RICH.extract(Prompt("continue", context_chars=1008, turns=5, system_chars=200))
    names = RICH.names
    assert row[names.index("history_chars")] == 1008 - 8 - 200
    assert row[names.index("turns")] == 5.0
    assert row[names.index("system_chars")] == 200.0
    assert row[names.index("mean_history_message_chars")] == 800 / 4
    assert row[names.index("lead_continue")] == 1.0
    bare = RICH.extract(Prompt("continue"))
    assert bare[names.index("history_chars")] == 0.0 and bare[names.index("mean_history_message_chars")] == 0.0


# ---------------------------------------------------------------------------- odd input


@pytest.mark.parametrize("fs", list(FEATURE_SETS.values()), ids=lambda fs: fs.name)
@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "\x00\x01\x1b[31m\x7f",
        "\ud800 lone surrogate \udfff",
        "😀" * 50,
        "Привет, как дела?",
        "مرحبا",
        "a" * 10,
        "\n" * 1000,
        "?",
    ],
)
def test_odd_text_never_raises_and_is_finite(fs, text: str) -> None:
    row = fs.extract(Prompt(text, context_chars=-1, turns=0, system_chars=-5))
    assert row.shape == (fs.size,) and row.dtype == np.float32
    assert np.isfinite(row).all()
    assert row[fs.names.index("verb_other")] == 1.0


@pytest.mark.parametrize("fs", list(FEATURE_SETS.values()), ids=lambda fs: fs.name)
def test_megabyte_prompt_uses_full_length_but_bounded_scan(fs) -> None:
    head = "Write a detailed essay. "
    text = head + ("lorem ipsum dolor sit amet " * 40_000) + " Is that ok?"
    assert len(text) > 1_000_000
    row = fs.extract(Prompt(text))
    assert row[0] == len(text) // 4
    assert row[fs.names.index("verb_write")] == 1.0
    assert row[fs.names.index("ends_with_question")] == 1.0
    # A keyword in the unscanned middle is not seen: the scan is bounded.
    middle = "x " * SCAN_HEAD_CHARS + " python " + "y " * SCAN_HEAD_CHARS
    assert feat(middle, "has_code_keyword", fs=fs) == 0.0


def test_extract_into_extract_and_extract_many_agree() -> None:
    prompts = [Prompt("Write code"), Prompt("hi", context_chars=50, turns=3), Prompt("")]
    for fs in FEATURE_SETS.values():
        many = fs.extract_many(prompts)
        buf = np.full(fs.size, 7.0, dtype=np.float32)  # stale values must be overwritten
        for i, p in enumerate(prompts):
            np.testing.assert_array_equal(many[i], fs.extract(p))
            np.testing.assert_array_equal(fs.extract_into(p, buf), many[i])
        assert fs.extract_many([]).shape == (0, fs.size)


# ---------------------------------------------------------------------------- golden cases

GOLDEN_PAPER19 = {
    "Write a Python function to reverse a list": [10, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    "Can you explain, briefly, why the sky is blue when the sun sets?": [
        16,
        0,
        1,
        1,
        0,
        1,
        0,
        0,
        1,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
    ],
    "hi": [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
}


@pytest.mark.parametrize("text", list(GOLDEN_PAPER19))
def test_golden_paper19(text: str) -> None:
    np.testing.assert_array_equal(P19.extract(Prompt(text)), np.array(GOLDEN_PAPER19[text], dtype=np.float32))


def test_golden_rich_v1() -> None:
    text = 'Please write a detailed blog post of 1500 words about "Python" decorators:\n```def f(): pass```'
    row = RICH.extract(Prompt(text, context_chars=len(text) + 300, turns=3, system_chars=100))
    got = {n: float(v) for n, v in zip(RICH.names, row) if v}
    assert got == {
        "prompt_token_len": 23.0,
        "has_code_keyword": 1.0,
        "has_length_constraint": 1.0,
        "verb_write": 1.0,
        "history_chars": 200.0,
        "turns": 3.0,
        "system_chars": 100.0,
        "mean_history_message_chars": 100.0,
        "line_count": 1.0,
        "code_fence_count": 2.0,
        "code_symbol_count": 1.0,
        "word_count": 15.0,
        "requested_words": 1500.0,
        "requested_items": 1500.0,
        "w_longform": 2.0,
        "w_code": 2.0,
        "w_detail": 1.0,
        "w_create": 1.0,
        "lead_create": 1.0,
        "is_ascii": 1.0,
        "quote_count": 2.0,
    }


def test_rich_v2_is_rich_v1_on_a_600_character_window() -> None:
    assert RICH2.names == RICH.names and RICH2.groups == RICH.groups
    short = Prompt("Write a detailed essay about 10 ideas?", context_chars=500, turns=3)
    np.testing.assert_array_equal(RICH2.extract(short), RICH.extract(short))
    # A keyword 600 characters in is seen by rich_v1 only; lengths still use the whole text.
    text = "Tell me about this. " + "lorem " * 100 + " python code " + "ipsum " * 100 + "Thanks."
    v1, v2 = RICH.extract(Prompt(text)), RICH2.extract(Prompt(text))
    code = RICH.names.index("has_code_keyword")
    assert v1[code] == 1.0 and v2[code] == 0.0
    assert v1[0] == v2[0] == len(text) // 4
    assert v2[RICH.names.index("word_count")] < v1[RICH.names.index("word_count")]


def test_golden_rich_v2_long_prompt() -> None:
    text = (
        "Please summarize the following article in 3 bullet points:\n"
        + "The committee met. " * 200
        + "What do you think?"
    )
    row = RICH2.extract(Prompt(text))
    got = {n: float(v) for n, v in zip(RICH2.names, row) if v}
    assert got == {
        "prompt_token_len": 969.0,
        "has_format_keyword": 1.0,
        "ends_with_question": 1.0,
        "verb_summarize": 1.0,
        "turns": 1.0,
        "line_count": 2.0,
        "word_count": 96.0,
        "requested_items": 3.0,
        "w_brief": 1.0,
        "w_longform": 1.0,
        "w_question": 2.0,
        "is_ascii": 1.0,
    }


# ---------------------------------------------------------------------------- rich_v3


def test_lexicon_column_is_the_documented_formula() -> None:
    import math

    from clairvoyant.prediction.features import Lexicon, scan_words

    lexicon = Lexicon("t", 5.0, {b"essay": 0.8, b"detailed essay": 0.4, b"hi": -1.0})
    words = scan_words("Write a DETAILED essay, essay!")  # known: essay, "detailed essay" (each counted once)
    assert words == [b"write", b"a", b"detailed", b"essay", b"essay"]
    assert lexicon_score(lexicon, words) == pytest.approx(5.0 + (0.8 + 0.4) / math.sqrt(2))
    assert lexicon_score(lexicon, scan_words("hi")) == pytest.approx(4.0)
    assert lexicon_score(lexicon, []) == 5.0


def test_rich_v3_is_rich_v2_plus_the_shipped_lexicon_column() -> None:
    from clairvoyant.prediction.features import load_lexicon, scan_words

    v2, v3 = get_feature_set("rich_v2"), get_feature_set("rich_v3")
    assert v3.names == v2.names + ("lexicon_log_tokens",)
    lexicon = load_lexicon()
    for text in ("Write a 2000-word essay about the history of Rome", "hi", "", "\ud800 x" * 3, "y " * 5000):
        row = v3.extract(Prompt(text))
        np.testing.assert_array_equal(row[:-1], v2.extract(Prompt(text)))
        assert row[-1] == np.float32(lexicon_score(lexicon, scan_words(text)))
    essay = v3.extract(Prompt("Write a detailed 2000-word essay about the history of Rome"))[-1]
    short = v3.extract(Prompt("Translate 'hello' into French. Answer with one word."))[-1]
    assert essay > short
    with pytest.raises(RuntimeError, match="sha256"):
        load_lexicon(sha256="0" * 64)


# ---------------------------------------------------------------------------- the term sum

# Words of the shipped lexicon and keyword sets (so many are terms and many pairs are), near misses and strangers.
_RICH_V3_TERMS = features._rich_v3_table().terms
_VOCABULARY = sorted(t for t in _RICH_V3_TERMS if isinstance(t, bytes))[::37] + [
    b"x", b"zzzz", b"\xc3\xa9t\xc3\xa9", b"a" * 40, b"step", b"by", b"write", b"essay",
]  # fmt: skip
_PAIRS = [t for t in _RICH_V3_TERMS if isinstance(t, tuple)]


def _plain_term_total(words: list[bytes], table: features._KeywordTable) -> int:
    """The term sum's contract, written plainly: each distinct word that is a term once, and with a
    lexicon each distinct adjacent pair that is a term once."""
    terms = table.terms
    total = sum(terms[w] for w in set(words) if w in terms)
    if table.lexicon:
        total += sum(terms[p] for p in set(zip(words, words[1:])) if p in terms)
    return total


def _words(rng: random.Random, n: int) -> list[bytes]:
    out: list[bytes] = []
    while len(out) < n:
        if rng.random() < 0.3:
            out.extend(rng.choice(_PAIRS))  # a known pair, so the pair lookups find terms
        else:
            word = rng.choice(_VOCABULARY)
            out.append(bytes(word) if rng.random() < 0.5 else word)  # equal bytes, not always the same object
    return out[:n]


@pytest.mark.parametrize("table", [features._rich_v3_table(), features._PLAIN_TABLE], ids=["rich_v3", "keywords"])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 50, 300, 5000])
def test_the_term_sum_is_its_plain_definition(table: features._KeywordTable, n: int) -> None:
    rng = random.Random(n)
    for _ in range(20):
        words = _words(rng, n)
        assert features._term_total(words, table) == _plain_term_total(words, table)


def test_each_distinct_term_counts_once() -> None:
    table = features._rich_v3_table()
    terms = table.terms
    a, b = _PAIRS[0]
    expected = terms.get(a, 0) + terms.get(b, 0) + terms[(a, b)] + terms.get((b, a), 0)
    assert features._term_total([a, b, a, b], table) == expected  # words {a, b}, pairs {(a, b), (b, a)}
    assert features._term_total([bytes(a), bytes(b), bytes(a), bytes(b)], table) == expected  # equal bytes, new objects
    plain = features._PLAIN_TABLE.terms
    assert features._term_total([a, b], features._PLAIN_TABLE) == plain.get(a, 0) + plain.get(b, 0)  # no pairs


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.binary(min_size=1, max_size=12), st.integers(min_value=-(2**200), max_value=2**200).filter(bool), max_size=30),
       st.lists(st.integers(min_value=0, max_value=40), max_size=80))  # fmt: skip
def test_any_table_and_any_words_sum_by_the_definition(weights: dict[bytes, int], picks: list[int]) -> None:
    # a table of words and of every pair of its first words, with values of any sign and size
    keys = list(weights)
    terms: dict[bytes | tuple[bytes, ...], int] = dict(weights)
    for i, first in enumerate(keys[:6]):
        for j, second in enumerate(keys[:6]):
            terms[(first, second)] = (i + 1) * (j - 3) * 2**150 + 1 if (i + 1) * (j - 3) else 7
    vocabulary = keys + [b"unknown", b""]
    words = [vocabulary[p % len(vocabulary)] for p in picks]
    for table in (features._KeywordTable(terms, lexicon=True), features._KeywordTable(dict(weights))):
        assert features._term_total(words, table) == _plain_term_total(words, table)
