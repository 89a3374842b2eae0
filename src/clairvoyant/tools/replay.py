"""`clairvoyant replay FILE.jsonl`: the offline interface of the online learner.

Each input line is a request body as ``clairvoyant predict --jsonl`` reads it (``{"prompt": ...}``,
``{"messages": [...]}`` or an Ollama body, read by ``clairvoyant.prediction.dialects``) plus
``"output_tokens": N``, the length the backend produced, and optionally ``"model"``. Lines are
taken in file order, and each one is handled exactly as the proxy handles a request:

1. it is scored with the learner's current correction (its own length not yet learned);
2. its length is observed (``OnlineLearner.observe``, censored if it reached the request's cap);
3. when a refit is due (every ``refit_every`` observations) the learner refits before the next
   line: the proxy's learner process does the same between requests, a few milliseconds later.

Output, one JSON line per input line, in order, and nothing else on stdout::

    {"line": 1, "score": ..., "predicted_tokens": ..., "p_short": ..., "p_medium": ..., "p_long": ...}

(p_* only for a class model). A bad line gets ``{"line": N, "error": "..."}`` in its place and
teaches nothing. Every line is refined by the shipped encoder, as the proxy refines a request that
waits, unless ``--no-encoder`` (or the model is a class model). ``--no-learn`` scores with the static prior (and ignores ``--state``). ``--state
FILE`` starts from a saved learner state (refused with a log line if corrupt or made for another
model: the replay then starts from the prior) and saves the final state to FILE, atomically,
replacing a refused one. Exit status: 0 if every line was used, 1 if some were errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from clairvoyant.tools.bulk_predict import LineError, request_of_line

__all__ = ["add_arguments", "replay_lines", "run", "score_then_learn"]

logger = logging.getLogger(__name__)


def _output_tokens(body: dict[str, Any]) -> int:
    value = body.get("output_tokens")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LineError("'output_tokens' must be a non-negative integer")
    return value


def score_then_learn(
    predictor: Any,
    learner: Any | None,
    encoder: Any | None,
    prompt: Any,
    observed: int,
    model: str | None,
    cap_tokens: int | None = None,
) -> Any:
    """One request as the proxy handles it: scored with the learner's current correction (refined
    by ``encoder`` if given, as a waiting request is), then its observed length learned and a refit
    made if due. Returns the prediction as it was made, before its own length was learned."""
    from clairvoyant.prediction.encoder import refined_by

    prediction = predictor.predict(prompt, model=model, cap_tokens=cap_tokens)
    if encoder is not None:
        prediction = refined_by(encoder, predictor, prediction, prompt.instruction)
    if learner is not None:
        learner.observe(prediction, observed)
        if learner.refit_due:
            learner.refit()
    return prediction


def replay_lines(
    predictor: Any,
    learner: Any | None,
    lines: Iterable[str],
    model_name: str | None = None,
    encoder: Any | None = None,
) -> Iterator[dict[str, Any]]:
    """One result per line, in order: scored first, then learned (``learner`` None: static).

    ``predictor`` is an ``OnnxPredictor``; the learner is attached to it as its corrector for the
    duration (and detached afterwards). ``model_name``: the model of lines that name none.
    ``encoder`` (an ``EncoderModel``): each line is refined by it, as the proxy refines a request
    that waits (replay orders every line, so every line is one that waits).
    """
    previous = predictor.corrector
    predictor.corrector = learner
    try:
        for number, line in enumerate(lines, start=1):
            try:
                request = request_of_line(line)
                observed = _output_tokens(request.body)
            except LineError as exc:
                logger.warning("line %d: %s", number, exc)
                yield {"line": number, "error": str(exc)}
                continue
            model = request.model or model_name
            prediction = score_then_learn(
                predictor, learner, encoder, request.prompt, observed, model, request.cap_tokens
            )
            result: dict[str, Any] = {
                "line": number,
                "score": prediction.score,
                "predicted_tokens": prediction.predicted_tokens,
            }
            if prediction.probabilities is not None:
                result["p_short"], result["p_medium"], result["p_long"] = prediction.probabilities
            yield result
    finally:
        predictor.corrector = previous


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="JSONL of request bodies with 'output_tokens' ('-' for stdin)")
    parser.add_argument("--no-learn", action="store_true", help="score with the static model (no online learning)")
    parser.add_argument("--model-name", default=None, help="the backend model of lines that name none")
    parser.add_argument(
        "--state", type=Path, default=None, help="learner state file: loaded at start if valid, saved at the end"
    )
    parser.add_argument("--model", type=Path, default=None, help="ONNX model (default: the shipped model)")
    parser.add_argument(
        "--no-encoder", action="store_true", help="lexical predictions only (default: refined by the shipped encoder)"
    )


def run(args: argparse.Namespace) -> int:
    """Replay ``args.file``; 0 if every line was used, 1 if any was an error. Raises ``ModelError``
    if the model cannot be loaded and ``ClairvoyantError`` if the input cannot be read."""
    from clairvoyant.errors import ClairvoyantError
    from clairvoyant.prediction.encoder import encoder_for
    from clairvoyant.prediction.learner import OnlineLearner, PriorIdentity
    from clairvoyant.prediction.predictor import OnnxPredictor

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="clairvoyant replay: %(message)s")
    predictor = OnnxPredictor(args.model)
    encoder = None if args.no_encoder else encoder_for(predictor)
    learner = None
    if not args.no_learn:
        identity = PriorIdentity.of(predictor, encoder)
        learner = OnlineLearner.load(args.state, identity) if args.state is not None else OnlineLearner(identity)
        if learner.refit_due or learner.observed_total:
            learner.refit()  # restored observations
    try:
        source: IO[str] = (
            sys.stdin if str(args.file) == "-" else args.file.open("r", encoding="utf-8", errors="replace", newline="")
        )
    except OSError as exc:
        raise ClairvoyantError(f"cannot read {args.file}: {exc.strerror}") from None
    errors = total = 0
    with source:
        lines = (line.rstrip("\r\n") for line in source)
        for result in replay_lines(predictor, learner, lines, args.model_name, encoder):
            total += 1
            errors += "error" in result
            sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    if learner is not None and args.state is not None:
        try:
            learner.save(args.state)
        except OSError as exc:
            raise ClairvoyantError(f"cannot save the learner state to {args.state}: {exc.strerror}") from None
    if errors:
        print(f"clairvoyant replay: {errors} of {total} lines were errors (see their 'error' field)", file=sys.stderr)
    return 1 if errors else 0
