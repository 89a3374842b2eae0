"""The lexicon column's formula, written plainly: the oracle for the extractor's folded integer sum
(``clairvoyant.prediction.features._lexicon_table``)."""

from __future__ import annotations

import math

from clairvoyant.prediction.features import Lexicon


def lexicon_score(lexicon: Lexicon, words: list[bytes]) -> float:
    """intercept + sum of the weights of the distinct known terms / sqrt(their number). Terms are
    the words and the adjacent pairs ``b"w1 w2"``; fsum is exact, so the set's order cannot matter."""
    terms = set(words) | {first + b" " + second for first, second in zip(words, words[1:])}
    known = [lexicon.weights[term] for term in terms if term in lexicon.weights]
    if not known:
        return lexicon.intercept_log_tokens
    return lexicon.intercept_log_tokens + math.fsum(known) / math.sqrt(len(known))
