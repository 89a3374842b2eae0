"""`clairvoyant predict --jsonl FILE`: score a JSONL file of prompts or chat bodies.

Input, one JSON object per line: ``{"prompt": "..."}`` (a completion body: string or list), a chat
body with ``messages``, or an Ollama body (``options``, ``system`` or ``context`` mark one). The
Prompt, the model and the output cap (``max_tokens``, ``n_predict``, Ollama ``options.num_predict``)
are read by ``clairvoyant.prediction.dialects``, exactly as the proxy would. Output, one JSON line per input
line, in order::

    {"line": 1, "p_short": ..., "p_medium": ..., "p_long": ..., "score": ..., "predicted_tokens": ...,
     "predicted_class": "short"}

``p_short``/``p_medium``/``p_long`` only for a class model; ``score`` is the queue key (lower =
sooner), ``predicted_tokens`` the calibrated output tokens after the cap.

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
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, Endpoint, cap_tokens_from_body, prompt_from_body
from clairvoyant.prediction.features import Prompt

__all__ = ["LineError", "LineRequest", "add_arguments", "prompt_of_line", "request_of_line", "run", "score_lines"]

logger = logging.getLogger(__name__)

_CHAT = SCHEDULED_ENDPOINTS["/v1/chat/completions"]
_COMPLETION = SCHEDULED_ENDPOINTS["/v1/completions"]
_OLLAMA_CHAT = SCHEDULED_ENDPOINTS["/api/chat"]
_OLLAMA_GENERATE = SCHEDULED_ENDPOINTS["/api/generate"]
# Fields only an Ollama body has: they select Ollama's reading of the prompt and cap.
_OLLAMA_FIELDS = ("options", "system", "context", "template", "keep_alive", "images", "raw")
_BATCH = 512


class LineError(ValueError):
    """One input line cannot be scored; the message says why (never includes prompt text)."""


@dataclass(frozen=True, slots=True)
class LineRequest:
    """What one JSONL line asks to score, read as the proxy reads a request body."""

    body: dict[str, Any]
    endpoint: Endpoint
    prompt: Prompt
    model: str | None
    cap_tokens: int | None


def prompt_of_line(line: str) -> Prompt:
    """The Prompt of one JSONL line; raises LineError with a clear reason."""
    return request_of_line(line).prompt


def request_of_line(line: str) -> LineRequest:
    """The request of one JSONL line; raises LineError with a clear reason."""
    if not line.strip():
        raise LineError("empty line")
    try:
        body = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise LineError(f"not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise LineError(f"expected a JSON object, got {type(body).__name__}")
    ollama = any(field in body for field in _OLLAMA_FIELDS)
    if "messages" in body:
        if not isinstance(body["messages"], list):
            raise LineError("'messages' must be an array")
        endpoint = _OLLAMA_CHAT if ollama else _CHAT
    elif "prompt" in body:
        if not isinstance(body["prompt"], (str, list)):
            raise LineError("'prompt' must be a string or an array")
        endpoint = _OLLAMA_GENERATE if ollama else _COMPLETION
    else:
        raise LineError("object has neither 'prompt' nor 'messages'")
    model = body.get("model")
    return LineRequest(
        body=body,
        endpoint=endpoint,
        prompt=prompt_from_body(endpoint, body),
        model=model if isinstance(model, str) and model else None,
        cap_tokens=cap_tokens_from_body(endpoint.dialect, body),
    )


def score_lines(predictor: Any, lines: Iterable[str], encoder: Any | None = None) -> Iterator[dict[str, Any]]:
    """One result dict per input line, in order (scored in batches of 512 through one ONNX call).
    ``encoder`` (an ``EncoderModel``): each prediction refined by it, as for a request that waits."""
    from clairvoyant.prediction.encoder import refined_by

    batch: list[tuple[int, LineRequest | str]] = []

    def flush() -> Iterator[dict[str, Any]]:
        requests = [r for _, r in batch if isinstance(r, LineRequest)]
        predictions = iter(
            predictor.predict_many(
                [r.prompt for r in requests],
                models=[r.model for r in requests],
                caps_tokens=[r.cap_tokens for r in requests],
            )
            if requests
            else []
        )
        for number, item in batch:
            if isinstance(item, LineRequest):
                prediction = next(predictions)
                if encoder is not None:
                    prediction = refined_by(encoder, predictor, prediction, item.prompt.instruction)
                yield {"line": number, **prediction.as_dict()}
            else:
                yield {"line": number, "error": item}
        batch.clear()

    for number, line in enumerate(lines, start=1):
        try:
            batch.append((number, request_of_line(line)))
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
    parser.add_argument(
        "--no-encoder", action="store_true", help="lexical predictions only (default: refined by the shipped encoder)"
    )


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
    from clairvoyant.prediction.encoder import encoder_for
    from clairvoyant.prediction.predictor import OnnxPredictor

    predictor = OnnxPredictor(args.model)
    encoder = None if args.no_encoder else encoder_for(predictor)
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
            for result in score_lines(predictor, lines, encoder):
                total += 1
                errors += "error" in result
                sink.write(json.dumps(result) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
        else:
            sink.flush()
    if errors:
        print(
            f"clairvoyant predict: {errors} of {total} lines could not be scored (see their 'error' field)",
            file=sys.stderr,
        )
    return 1 if errors else 0
