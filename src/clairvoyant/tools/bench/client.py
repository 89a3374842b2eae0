"""One benchmark request: build the body, stream the answer, time it client side.

Output lengths are forced so service times are known, and only through fields the scheduler never
reads: on llama.cpp ``n_predict`` + ``ignore_eos`` (never ``max_tokens``, which a scheduler could
read); on Ollama ``options.num_predict``, which caps the length but cannot force it (Ollama has no
``ignore_eos``), so an answer may end earlier. The oracle condition adds the proxy's benchmark-only
field ``{"clairvoyant": {"output_tokens": TRUE_LENGTH}}``, which the proxy strips before forwarding.

Times are ``time.perf_counter`` seconds: TTFT is the first chunk that carries answer text, end-to-end
is the end of the stream, both from the moment the request is sent.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

__all__ = ["Dialect", "RequestResult", "RequestSpec", "build_body", "endpoint_for", "send"]

Dialect = Literal["openai", "ollama"]
ORACLE_FIELD = "clairvoyant"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload."""

    index: int  # position in the workload (stable across conditions)
    key: str  # prompt reference (BenchPrompt.key)
    cls: str  # class of the TRUE answer length
    answer_tokens: int  # the TRUE answer length (cl100k tokens)
    n_predict: int  # the forced output length (ceil(answer_tokens * length_scale))
    prompt_chars: int
    text: str
    offset_s: float = 0.0  # send time after the workload starts (0 for a burst)


@dataclass(slots=True)
class RequestResult:
    """What the client saw for one request; times in seconds."""

    index: int
    key: str
    cls: str
    answer_tokens: int
    n_predict: int
    offset_s: float  # scheduled send time after the workload start
    sent_s: float  # actual send time after the workload start
    ttft_s: float | None  # first answer text, from the send
    e2e_s: float | None  # end of the stream, from the send
    done_s: float | None  # end of the stream, after the workload start
    completion_tokens: int | None  # as reported by the backend (usage / eval_count), if it did
    status: int | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.e2e_s is not None


def endpoint_for(dialect: Dialect) -> str:
    return "/v1/chat/completions" if dialect == "openai" else "/api/chat"


def build_body(
    spec: RequestSpec, dialect: Dialect, *, model: str, oracle: bool = False, hide_length: bool = False
) -> dict[str, Any]:
    """The streamed chat body for ``spec``; ``oracle`` adds the true length for the proxy.

    The answer's length is forced (llama.cpp ``n_predict`` + ``ignore_eos``, Ollama ``num_predict``).
    The proxy reads those fields as the client's cap, which would tell the scheduler the true
    length; ``hide_length`` (every condition through the proxy) puts them in the proxy's own field
    instead, added to the body only after prediction (setting ``bench_upstream_fields``).
    """
    messages = [{"role": "user", "content": spec.text}]
    body: dict[str, Any]
    length: dict[str, Any]
    if dialect == "openai":
        body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "temperature": 0.0,
            "seed": 0,
            "stream_options": {"include_usage": True},
        }
        length = {"n_predict": spec.n_predict, "ignore_eos": True}  # llama.cpp: exact length
    else:
        body = {"model": model, "messages": messages, "stream": True}
        length = {"options": {"num_predict": spec.n_predict, "temperature": 0.0, "seed": 0}}
    proxy: dict[str, Any] = {}
    if hide_length:
        proxy["upstream"] = length
    else:
        body.update(length)
    if oracle:
        proxy["output_tokens"] = spec.answer_tokens
    if proxy:
        body[ORACLE_FIELD] = proxy
    return body


def _openai_event(line: str) -> tuple[bool, int | None]:
    """(carries answer text, completion tokens if this is the usage chunk) for one SSE line."""
    if not line.startswith("data:"):
        return False, None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return False, None
    try:
        event = json.loads(data)
    except ValueError:
        return False, None
    tokens = None
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        tokens = usage["completion_tokens"]
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            return True, tokens
    return False, tokens


def _ollama_event(line: str) -> tuple[bool, int | None]:
    try:
        event = json.loads(line)
    except ValueError:
        return False, None
    tokens = event.get("eval_count") if event.get("done") else None
    message = event.get("message") or {}
    text = message.get("content") or event.get("response")
    return bool(text), tokens if isinstance(tokens, int) else None


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    spec: RequestSpec,
    *,
    dialect: Dialect,
    model: str,
    oracle: bool = False,
    hide_length: bool = False,
    origin: float,
    request_id: str | None = None,
) -> RequestResult:
    """Send ``spec`` now, stream the answer to its end, and time it. Never raises for HTTP or
    transport errors: they are recorded in ``error`` (``CancelledError`` propagates).

    ``origin`` is the workload's start (``time.perf_counter()``), for ``sent_s`` and ``done_s``.
    ``request_id``: sent as ``X-Request-Id`` (how the proxy's /queue names the request).
    """
    body = json.dumps(build_body(spec, dialect, model=model, oracle=oracle, hide_length=hide_length)).encode()
    parse = _openai_event if dialect == "openai" else _ollama_event
    url = base_url.rstrip("/") + endpoint_for(dialect)
    ttft = e2e = done = None
    tokens: int | None = None
    status: int | None = None
    error: str | None = None
    sent = time.perf_counter()
    try:
        headers = {"content-type": "application/json"}
        if request_id is not None:
            headers["x-request-id"] = request_id
        async with client.stream("POST", url, content=body, headers=headers) as response:
            status = response.status_code
            if status != 200:
                error = f"HTTP {status}: {(await response.aread())[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    has_text, count = parse(line)
                    if has_text and ttft is None:
                        ttft = time.perf_counter() - sent
                    if count is not None:
                        tokens = count
        end = time.perf_counter()
        if error is None:
            e2e, done = end - sent, end - origin
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return RequestResult(
        index=spec.index,
        key=spec.key,
        cls=spec.cls,
        answer_tokens=spec.answer_tokens,
        n_predict=spec.n_predict,
        offset_s=spec.offset_s,
        sent_s=sent - origin,
        ttft_s=ttft,
        e2e_s=e2e,
        done_s=done,
        completion_tokens=tokens,
        status=status,
        error=error,
    )
