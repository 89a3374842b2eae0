"""`clairvoyant predict --jsonl FILE`: score a JSONL file of prompts or chat bodies.

Input, one JSON object per line: ``{"prompt": "..."}`` (a completion body: string or list) or an
OpenAI chat body with ``messages``. The Prompt is built by ``clairvoyant.dialects``, exactly as the
proxy would. Output, one JSON line per input line, in order::

    {"line": 1, "p_short": ..., "p_medium": ..., "p_long": ..., "score": ..., "predicted_class": "short"}

A line that cannot be scored (not JSON, not an object, neither "prompt" nor "messages") yields an
error line in its place, ``{"line": N, "error": "..."}``; blank lines are scored as errors too, so
output line N always answers input line N. The exit status is 0 when every line was scored, 1 when
some lines were errors. Serving-only imports: no training dependency is loaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from clairvoyant.dialects import SCHEDULED_ENDPOINTS, prompt_from_body
from clairvoyant.features import Prompt

__all__ = ["add_arguments", "prompt_of_line", "run", "score_lines"]

logger = logging.getLogger(__name__)

_CHAT = SCHEDULED_ENDPOINTS["/v1/chat/completions"]
_COMPLETION = SCHEDULED_ENDPOINTS["/v1/completions"]
_BATCH = 512


class LineError(ValueError):
    """One input line cannot be scored; the message says why (never includes prompt text)."""


def prompt_of_line(line: str) -> Prompt:
    """The Prompt of one JSONL line; raises LineError with a clear reason."""
    if not line.strip():
        raise LineError("empty line")
    try:
        body = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise LineError(f"not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise LineError(f"expected a JSON object, got {type(body).__name__}")
    if "messages" in body:
        if not isinstance(body["messages"], list):
            raise LineError("'messages' must be an array")
        return prompt_from_body(_CHAT, body)
    if "prompt" in body:
        if not isinstance(body["prompt"], (str, list)):
            raise LineError("'prompt' must be a string or an array")
        return prompt_from_body(_COMPLETION, body)
    raise LineError("object has neither 'prompt' nor 'messages'")


def score_lines(predictor: Any, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """One result dict per input line, in order (scored in batches of 512 through one ONNX call)."""
    batch: list[tuple[int, Prompt | str]] = []

    def flush() -> Iterator[dict[str, Any]]:
        prompts = [p for _, p in batch if isinstance(p, Prompt)]
        predictions = iter(predictor.predict_many(prompts) if prompts else [])
        for number, item in batch:
            if isinstance(item, Prompt):
                yield {"line": number, **next(predictions).as_dict()}
            else:
                yield {"line": number, "error": item}
        batch.clear()

    for number, line in enumerate(lines, start=1):
        try:
            batch.append((number, prompt_of_line(line)))
        except LineError as exc:
            logger.warning("line %d: %s", number, exc)
            batch.append((number, str(exc)))
        if len(batch) >= _BATCH:
            yield from flush()
    yield from flush()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jsonl", required=True, type=Path, help="input file ('-' for stdin)")
    parser.add_argument("--model", type=Path, default=None, help="ONNX model (default: the shipped model)")
    parser.add_argument("--out", type=Path, default=None, help="output file (default: stdout)")


def _open_input(path: Path) -> IO[str]:
    if str(path) == "-":
        return sys.stdin
    return path.open("r", encoding="utf-8", errors="replace", newline="")


def run(args: argparse.Namespace) -> int:
    """Score ``--jsonl``; 0 if every line scored, 1 if any line was an error.

    Raises ``ModelError`` (reported by the CLI) if the model cannot be loaded, and
    ``ClairvoyantError`` if the input file cannot be read.
    """
    from clairvoyant.errors import ClairvoyantError
    from clairvoyant.predictor import OnnxPredictor

    predictor = OnnxPredictor(args.model)
    errors = total = 0
    try:
        source = _open_input(args.jsonl)
    except OSError as exc:
        raise ClairvoyantError(f"cannot read {args.jsonl}: {exc.strerror}") from None
    sink: IO[str] = args.out.open("w", encoding="utf-8") if args.out is not None else sys.stdout
    try:
        with source:
            # splitlines semantics of a text file: one record per '\n'-terminated line
            lines = (line.rstrip("\r\n") for line in source)
            for result in score_lines(predictor, lines):
                total += 1
                errors += "error" in result
                sink.write(json.dumps(result) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
        else:
            sink.flush()
    if errors:
        print(f"clairvoyant predict: {errors} of {total} lines could not be scored (see their 'error' field)",
              file=sys.stderr)
    return 1 if errors else 0
