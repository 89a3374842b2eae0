"""What the proxy reads from OpenAI and Ollama request bodies: the one place that decides the text
a request is featurized from.

The rule, for every scheduled endpoint:

- instruction = the text of the LAST user turn (OpenAI/Ollama chat), or the prompt (completions,
  /api/generate). Text parts of list-of-parts content are joined with newlines; images and other
  non-text parts are skipped. A completion prompt given as a list of strings is joined with
  newlines; token-id prompts have no text (their length still counts in ``context_chars``, at
  4 characters a token), and so do the token ids of Ollama's ``context`` (an earlier exchange).
- context_chars = characters of all message texts and system prompts (what the model reads).
- turns = number of messages (1 for a bare prompt); system_chars = characters of system prompts.

The output cap (``cap_tokens``): the smallest of OpenAI's ``max_tokens`` and
``max_completion_tokens`` and llama.cpp's ``n_predict`` (OpenAI dialect), or Ollama's
``options.num_predict``. A negative value means unlimited; a value of the wrong type (a string, a
boolean, a fraction, a non-object ``options``) is ignored rather than refused: the backend
decides whether the body is valid, and the cap only ever lowers a prediction.

Nothing here raises on odd *text* (empty, huge, non-English, control characters); only a body that
is not JSON, or lacks a field the endpoint requires, is refused with ``BadRequest``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

from clairvoyant.errors import BadRequest, RequestError
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.usage import non_negative_int

__all__ = [
    "PROXY_FIELD",
    "SCHEDULED_ENDPOINTS",
    "Dialect",
    "Endpoint",
    "ParsedRequest",
    "cap_tokens_from_body",
    "dialect_of_path",
    "parse_request",
    "prompt_from_body",
    "PRIORITY_FIELD",
    "error_body",
    "with_upstream_fields",
    "stream_error_event",
]

# The one body field only the proxy understands; removed before forwarding.
PROXY_FIELD = "clairvoyant"


class Dialect(str, Enum):
    OPENAI = "openai"
    OLLAMA = "ollama"


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    dialect: Dialect
    kind: str  # "chat" or "completion"
    stream_default: bool


SCHEDULED_ENDPOINTS: dict[str, Endpoint] = {
    e.path: e
    for e in (
        Endpoint("/v1/chat/completions", Dialect.OPENAI, "chat", False),
        Endpoint("/v1/completions", Dialect.OPENAI, "completion", False),
        Endpoint("/api/chat", Dialect.OLLAMA, "chat", True),
        Endpoint("/api/generate", Dialect.OLLAMA, "completion", True),
    )
}


def dialect_of_path(path: str) -> Dialect:
    return Dialect.OLLAMA if path.startswith("/api/") else Dialect.OPENAI


@dataclass(slots=True)  # not frozen: a frozen dataclass sets each field through object.__setattr__ (one a request)
class ParsedRequest:
    """A scheduled request body, read once. Not changed after it is made."""

    endpoint: Endpoint
    prompt: Prompt
    stream: bool
    model: str | None
    forward_body: bytes  # what goes upstream: the original bytes unless a proxy field was removed
    proxy_options: dict[str, Any]  # the removed proxy field (e.g. the benchmark's oracle length)
    cap_tokens: int | None = None  # the body's own output-token cap, if any (see the module docstring)
    priority: int | None = None  # the client's priority class (body field), unclamped; None = not given


def _content_text(content: Any) -> str:
    """Text of an OpenAI/Ollama message content: a string, or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "\n".join(texts)
    return ""


def _chat_prompt(messages: list[Any]) -> Prompt:
    instruction = ""
    context = system = turns = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        turns += 1
        text = _content_text(message.get("content"))
        context += len(text)
        role = message.get("role")
        if role in ("system", "developer"):
            system += len(text)
        elif role == "user":
            instruction = text
    return Prompt(instruction=instruction, context_chars=context, turns=turns, system_chars=system)


def _completion_prompt(prompt: Any, system: Any = None, context_ids: Any = None) -> Prompt:
    """``context_ids``: Ollama's /api/generate ``context``, the token ids of the earlier exchange."""
    system_text = system if isinstance(system, str) else ""
    history = 4 * len(context_ids) if isinstance(context_ids, list) else 0
    if isinstance(prompt, str):
        text, extra = prompt, 0
    elif isinstance(prompt, list):
        strings = [p for p in prompt if isinstance(p, str)]
        token_ids = sum(1 for p in prompt if isinstance(p, int))
        token_ids += sum(len(p) for p in prompt if isinstance(p, list))
        text, extra = "\n".join(strings), 4 * token_ids
    else:
        text, extra = "", 0
    return Prompt(
        instruction=text,
        context_chars=len(text) + extra + len(system_text) + history,
        turns=1,
        system_chars=len(system_text),
    )


def prompt_from_body(endpoint: Endpoint, body: dict[str, Any]) -> Prompt:
    """The Prompt a body is featurized from (see the module docstring). Never raises on odd text."""
    if endpoint.kind == "chat":
        messages = body.get("messages")
        return _chat_prompt(messages if isinstance(messages, list) else [])
    if endpoint.dialect is Dialect.OLLAMA:
        return _completion_prompt(body.get("prompt"), body.get("system"), body.get("context"))
    return _completion_prompt(body.get("prompt"))


# OpenAI-dialect cap fields (llama.cpp's server takes n_predict on every endpoint).
_OPENAI_CAP_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")


def cap_tokens_from_body(dialect: Dialect, body: dict[str, Any]) -> int | None:
    """The output-token cap a request body sets, or None (see the module docstring). Never raises."""
    if dialect is Dialect.OLLAMA:
        options = body.get("options")
        return non_negative_int(options.get("num_predict")) if isinstance(options, dict) else None
    caps = [cap for field in _OPENAI_CAP_FIELDS if (cap := non_negative_int(body.get(field))) is not None]
    return min(caps) if caps else None


def _require(body: dict[str, Any], field: str, types: tuple[type, ...], what: str) -> None:
    if field not in body or body[field] is None:
        raise BadRequest(f"'{field}' is a required property", param=field)
    if not isinstance(body[field], types) or isinstance(body[field], bool):
        raise BadRequest(f"'{field}' must be {what}", param=field)


def _validate(endpoint: Endpoint, body: dict[str, Any]) -> None:
    if endpoint.dialect is Dialect.OPENAI:
        if endpoint.kind == "chat":
            _require(body, "messages", (list,), "an array of messages")
            if not body["messages"]:
                raise BadRequest("'messages' must contain at least one message", param="messages")
            for i, message in enumerate(body["messages"]):
                if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                    raise BadRequest(f"'messages.{i}' must be an object with a 'role'", param=f"messages.{i}")
        else:
            _require(body, "prompt", (str, list), "a string or an array")
    else:
        _require(body, "model", (str,), "a string")
        if endpoint.kind == "chat" and "messages" in body and body["messages"] is not None:
            if not isinstance(body["messages"], list):
                raise BadRequest("'messages' must be an array", param="messages")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", param="stream")


PRIORITY_FIELD = "priority"  # vLLM's convention: integer, lower = sooner, default 0


def parse_request(endpoint: Endpoint, raw: bytes, *, keep_priority: bool = False) -> ParsedRequest:
    """Decode and validate a scheduled request body, once.

    The proxy's own field, and ``priority`` unless ``keep_priority`` (a backend such as vLLM that
    takes it), are removed from the forwarded body. Raises ``BadRequest`` for a body that is not a
    JSON object, lacks a required field, or has a non-integer priority.
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    _validate(endpoint, body)
    stream = body.get("stream")
    priority = body.get(PRIORITY_FIELD)
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise BadRequest(f"'{PRIORITY_FIELD}' must be an integer", param=PRIORITY_FIELD)
    stripped = PROXY_FIELD in body
    proxy_options = body.pop(PROXY_FIELD, None)
    if PRIORITY_FIELD in body and not keep_priority:
        del body[PRIORITY_FIELD]
        stripped = True
    model = body.get("model")
    return ParsedRequest(
        endpoint=endpoint,
        prompt=prompt_from_body(endpoint, body),
        stream=endpoint.stream_default if stream is None else bool(stream),
        # interned: the requests that name one model share its name (a waiting request holds it)
        model=sys.intern(model) if isinstance(model, str) else None,
        forward_body=json.dumps(body).encode() if stripped else raw,  # ASCII escapes: lone surrogates survive
        proxy_options=proxy_options if isinstance(proxy_options, dict) else {},
        cap_tokens=cap_tokens_from_body(endpoint.dialect, body),
        priority=priority,
    )


# -- error framing: every answer the proxy itself gives is in the client's dialect --


def with_upstream_fields(forward_body: bytes, fields: dict[str, Any]) -> bytes:
    """``forward_body`` with ``fields`` added at its top level (a benchmark's forced length)."""
    body = json.loads(forward_body)
    body.update(fields)
    return json.dumps(body).encode()


def error_body(dialect: Dialect, exc: RequestError) -> bytes:
    """The error in the client's own dialect (OpenAI's error object, or Ollama's {"error": str})."""
    if dialect is Dialect.OLLAMA:
        return json.dumps({"error": exc.message}).encode()
    return json.dumps(
        {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}
    ).encode()


def stream_error_event(dialect: Dialect, content_type: str, exc: RequestError) -> bytes:
    """A final error in a stream's own framing: an SSE event, an NDJSON line, or nothing for a
    plain body (it is truncated)."""
    if "text/event-stream" in content_type:
        return b"data: " + error_body(dialect, exc) + b"\n\n"
    if "ndjson" in content_type:
        return error_body(dialect, exc) + b"\n"
    return b""
