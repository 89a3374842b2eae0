"""The compiled term sum (prediction/_term_sum.c) equals the Python one, which tests/test_features_reference.py
pins against the frozen reference extractor; it is built wherever a C compiler is, and refuses bad input."""

from __future__ import annotations

import random
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clairvoyant.prediction import features
from clairvoyant.prediction.features import _KeywordTable, _python_term_total, _rich_v3_table, _term_total

term_sum = pytest.importorskip("clairvoyant.prediction._term_sum") if features._term_sum is None else features._term_sum


def test_the_extension_is_built_where_a_compiler_is() -> None:
    # `pip install` builds it (setup.py, optional=True); a silently skipped build would leave serving on the slow path
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the Python sum is the one in use")
    assert features._term_sum is not None
    assert _rich_v3_table().compiled is not None and features._PLAIN_TABLE.compiled is not None


# words of the shipped lexicon and keyword sets (so many are terms and many pairs are), near misses and strangers
_TERMS = [t for t in _rich_v3_table().terms if isinstance(t, bytes)]
_VOCABULARY = sorted(_TERMS)[::37] + [
    b"x",
    b"zzzz",
    b"\xc3\xa9t\xc3\xa9",
    b"a" * 40,
    b"step",
    b"by",
    b"write",
    b"essay",
]
_PAIRS = [t for t in _rich_v3_table().terms if isinstance(t, tuple)]


def _words(rng: random.Random, n: int) -> list[bytes]:
    out: list[bytes] = []
    while len(out) < n:
        if rng.random() < 0.3:
            out.extend(rng.choice(_PAIRS))  # a known pair, so the pair lookups find terms
        else:
            word = rng.choice(_VOCABULARY)
            out.append(bytes(word) if rng.random() < 0.5 else word)  # equal bytes, not always the same object
    return out[:n]


@pytest.mark.parametrize("table", [_rich_v3_table(), features._PLAIN_TABLE], ids=["rich_v3", "keywords"])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 50, 300, 1023, 1024, 1025, 5000])  # 1024: the hashes' stack buffer
def test_compiled_sum_equals_the_python_sum(table: _KeywordTable, n: int) -> None:
    rng = random.Random(n)
    for _ in range(20):
        words = _words(rng, n)
        assert _term_total(words, table) == _python_term_total(words, table)


def test_each_distinct_term_counts_once() -> None:
    table = _rich_v3_table()
    terms = table.terms
    a, b = _PAIRS[0]
    expected = terms.get(a, 0) + terms.get(b, 0) + terms[(a, b)] + terms.get((b, a), 0)
    assert _term_total([a, b, a, b], table) == expected  # words {a, b}, pairs {(a, b), (b, a)}
    assert _term_total([bytes(a), bytes(b), bytes(a), bytes(b)], table) == expected  # equal bytes, new objects
    plain = features._PLAIN_TABLE.terms
    assert _term_total([a, b], features._PLAIN_TABLE) == plain.get(a, 0) + plain.get(b, 0)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.binary(min_size=1, max_size=12), st.integers(min_value=-(2**200), max_value=2**200).filter(bool), max_size=30),
       st.lists(st.integers(min_value=0, max_value=40), max_size=80))  # fmt: skip
def test_any_table_and_any_words_match_python(weights: dict[bytes, int], picks: list[int]) -> None:
    # a table of words and of every pair of its first words, with values of any sign and size
    keys = list(weights)
    terms: dict[bytes | tuple[bytes, ...], int] = dict(weights)
    for i, first in enumerate(keys[:6]):
        for j, second in enumerate(keys[:6]):
            terms[(first, second)] = (i + 1) * (j - 3) * 2**150 + 1 if (i + 1) * (j - 3) else 7
    table = _KeywordTable(terms, lexicon=True)
    vocabulary = keys + [b"unknown", b""]
    words = [vocabulary[p % len(vocabulary)] for p in picks]
    assert _term_total(words, table) == _python_term_total(words, table)
    plain = _KeywordTable(dict(weights))
    assert _term_total(words, plain) == _python_term_total(words, plain)


def test_bad_input_is_refused_not_crashed() -> None:
    table = _rich_v3_table().compiled
    with pytest.raises(TypeError):
        term_sum.term_sum(table, [b"a", "b"], True)
    with pytest.raises(TypeError):
        term_sum.term_sum(table, (b"a",), True)
    with pytest.raises(ValueError, match="PyCapsule"):
        term_sum.term_sum(object(), [b"a"], True)
    with pytest.raises(ValueError, match="twice"):
        term_sum.compile_terms([b"a", b"a"], [bytes(8), bytes(8)], 1)
    with pytest.raises(TypeError):
        term_sum.compile_terms([b"a"], [bytes(7)], 1)  # not limbs * 8 bytes
    with pytest.raises(ValueError):
        term_sum.compile_terms([b"a"], [bytes(8)], 0)
