"""What the backend really produced for one request: read from the relayed answer, never buffered.

A ``UsageTap`` is fed every chunk the proxy relays. It keeps only a bounded tail of the body
(``TAIL_BYTES``) and, for streams, a count of content-bearing events; when the answer has ended,
``UsageTap.usage`` reads the counts the backends put at the END of their answers, the output length
from the first of these that is present (durations from wherever they are):

- OpenAI (and llama.cpp's OpenAI endpoints): ``usage.completion_tokens`` / ``usage.prompt_tokens``
  (streams carry it in the last event only with ``stream_options.include_usage``);
- llama.cpp: ``timings`` (``predicted_n``, ``predicted_ms``, ``prompt_n``, ``prompt_ms``,
  ``cache_n``), and ``tokens_predicted`` (its native /completion endpoint);
- Ollama: the final object's ``eval_count``, ``eval_duration``, ``prompt_eval_count``,
  ``prompt_eval_duration`` and ``load_duration`` (all durations in ns);
- else, for a stream, the number of content-bearing events (one per generated token on
  llama.cpp and Ollama, an estimate elsewhere).

A stream's answer is whole once its end event has passed (``ended``: OpenAI's ``data: [DONE]``,
Ollama's ``"done": true``), before the body's own end. Nothing here raises on any body: an
unreadable tail gives a ``Usage`` with ``output_tokens=None`` (no observation), or a chunk count
for a stream. A compressed body (``Content-Encoding: gzip``; neither llama.cpp nor Ollama
compresses by default) is unreadable, so no observation.

Keys are found by searching the tail for ``"<key>":`` and decoding the JSON value after it.
That cannot be fooled by generated text: inside a JSON string every ``"`` is escaped, so the
byte sequence ``"key":`` only occurs as a real key. The tail holds prompt or answer text;
it is never logged.
"""

from __future__ import annotations

import json
import json.scanner
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["TAIL_BYTES", "Usage", "UsageSource", "UsageTap", "non_negative_int"]

# The end of a body kept for reading the counts (at most twice this is held between trims).
# llama.cpp's last stream event, with its generation_settings, is ~2.5 KB; OpenAI's usage event and
# Ollama's final object (without /api/generate's `context`) are well under 1 KB.
TAIL_BYTES = 8 * 1024
# A stream event longer than this is counted from its first bytes only (the content key comes early).
_EVENT_PREFIX_BYTES = 4 * 1024

UsageSource = Literal[
    "openai_usage",  # usage.completion_tokens
    "llamacpp_timings",  # timings.predicted_n
    "llamacpp_tokens_predicted",  # tokens_predicted (native /completion)
    "ollama_eval_count",  # eval_count of Ollama's final object
    "stream_events",  # counted content-bearing stream events (no backend count)
    "none",  # nothing readable: not an observation
]

# A stream event that carries generated text (or reasoning, or tool-call arguments): one of these
# keys with a NON-empty string value. OpenAI/llama.cpp chat `content`, completions `text`,
# Ollama /api/generate `response`, reasoning and thinking deltas, tool-call `arguments` deltas.
_CONTENT_EVENT = re.compile(rb'"(?:content|text|response|reasoning_content|reasoning|thinking|arguments)"\s*:\s*"(?!")')
# A default decoder's scanner (what its ``scan_once`` is), called directly: ``raw_decode`` is a
# Python frame around it that turns its StopIteration into a ValueError; ``_last_value`` catches both.
# A stream's end event: SSE's ``data: [DONE]`` line (OpenAI, llama.cpp, vLLM), an NDJSON object
# with ``"done": true`` (Ollama; the key comes before its long ``context``). Generated text cannot
# fake either: a JSON string escapes its quotes and newlines.
_SSE_END = re.compile(rb"data: ?\[DONE\]\r?$")
_NDJSON_END = re.compile(rb'"done"\s*:\s*true')
_SCAN = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # typeshed: the context is any decoder
_WHITESPACE = " \t\r\n"


@dataclass(slots=True)  # not frozen: a frozen dataclass sets each field through object.__setattr__ (one a request)
class Usage:
    """One completed request as the backend served it. ``None`` = the backend did not say. Not
    changed after it is made."""

    output_tokens: int | None  # generated tokens (None: unknown, not an observation)
    prompt_tokens: int | None  # tokens of the prompt as the backend counted them (cached ones included)
    generation_s: float | None  # backend-reported decode time, seconds
    prompt_s: float | None  # backend-reported prompt-evaluation time, seconds
    wall_s: float  # the proxy's own service time: request sent upstream -> last byte, seconds
    model: str | None  # backend model name: from the response, else from the request
    source: UsageSource  # where output_tokens came from
    stream_events: int  # content-bearing stream events counted (0 for a plain body)
    load_s: float | None = None  # backend-reported model load before this answer, seconds (Ollama's load_duration)

    @property
    def observed(self) -> bool:
        """True if this is a length the learner may use (backend-reported or counted)."""
        return self.output_tokens is not None and self.source != "none"

    @property
    def seconds_per_output_token(self) -> float | None:
        """Decode time per generated token, from the backend's own timing (None if not reported)."""
        if self.generation_s is None or not self.output_tokens:
            return None
        return self.generation_s / self.output_tokens


def _framing(content_type: str) -> Literal["sse", "ndjson", "body"]:
    content_type = content_type.lower()
    if "text/event-stream" in content_type:
        return "sse"
    if "ndjson" in content_type:
        return "ndjson"
    return "body"


class UsageTap:
    """Watches one relayed answer. ``feed`` is O(len(chunk)) and keeps at most a few KB.

    Not thread-safe: one tap per response, fed from the relay's task.
    """

    __slots__ = ("_framing", "_tail", "_partial", "_events", "_tail_bytes", "_ended", "_end_marker")

    def __init__(self, content_type: str, *, tail_bytes: int = TAIL_BYTES) -> None:
        self._framing = _framing(content_type)
        self._tail_bytes = tail_bytes
        self._tail = bytearray()
        self._partial = bytearray()  # the current, unterminated stream line (bounded)
        self._events = 0
        self._ended = False
        # A cheap test before a line is matched: a substring every end line holds.
        self._end_marker = b"[DONE]" if self._framing == "sse" else b'"done"'

    @property
    def is_stream(self) -> bool:
        return self._framing != "body"

    @property
    def ended(self) -> bool:
        """A stream's end event has been fed: the answer is whole (its counts with it)."""
        return self._ended

    @property
    def stream_events(self) -> int:
        """Content-bearing stream events so far (one a generated token on llama.cpp and Ollama)."""
        return self._events

    def feed(self, chunk: bytes) -> None:
        """Take one relayed chunk (any split of the body: events may span chunks)."""
        if not chunk:
            return
        tail = self._tail
        tail += chunk
        if len(tail) > 2 * self._tail_bytes:  # trim in batches: amortised O(1) per byte
            del tail[: len(tail) - self._tail_bytes]
        if self._framing != "body":
            self._count_events(chunk)

    def _count_events(self, chunk: bytes) -> None:
        # Runs for every chunk of a stream (a token each, from llama.cpp): the per-line work is
        # inlined (no method call a line); the same lines are searched within the same prefix.
        lines = chunk.split(b"\n")
        partial = self._partial
        room = _EVENT_PREFIX_BYTES - len(partial)
        if len(lines) == 1:
            if room > 0:
                partial += chunk[:room]
            return
        if room > 0:
            partial += lines[0][:room]  # the line an earlier chunk began ends here
        search = _CONTENT_EVENT.search
        events = self._events
        if search(partial, 0, _EVENT_PREFIX_BYTES) is not None:
            events += 1
        for line in lines[1:-1]:
            if search(line, 0, _EVENT_PREFIX_BYTES) is not None:
                events += 1
        self._events = events
        marker = self._end_marker
        if not self._ended and (marker in partial or marker in chunk):
            self._ended = self._is_end(partial) or any(self._is_end(line) for line in lines[1:-1])
        partial.clear()
        partial += lines[-1][:_EVENT_PREFIX_BYTES]

    def _is_end(self, line: bytes | bytearray) -> bool:
        if self._framing == "sse":
            return _SSE_END.match(line) is not None
        return _NDJSON_END.search(line, 0, _EVENT_PREFIX_BYTES) is not None

    def usage(self, *, wall_s: float, request_model: str | None = None) -> Usage:
        """The record, once the answer has ended. Never raises."""
        if self._partial:  # a last line without its newline
            if _CONTENT_EVENT.search(self._partial, 0, _EVENT_PREFIX_BYTES) is not None:
                self._events += 1
            self._partial.clear()
        try:
            body = self._tail
            if len(body) > self._tail_bytes:
                body = body[-self._tail_bytes :]
            return self._read(body.decode("utf-8", errors="replace"), wall_s, request_model)
        except Exception:  # noqa: BLE001 - an odd body must never become an error for the client
            output, source = self._counted()
            return Usage(output, None, None, None, wall_s, request_model, source, self._events)

    # -- reading the tail ----------------------------------------------------------------------
    def _read(self, tail: str, wall_s: float, request_model: str | None) -> Usage:
        usage = _last_value(tail, '"usage"')
        timings = _last_value(tail, '"timings"')
        if type(usage) is not dict:
            usage = {}
        if type(timings) is not dict:
            timings = {}
        eval_count = non_negative_int(_last_value(tail, '"eval_count"'))
        model = _last_value(tail, '"model"')
        model = model if isinstance(model, str) and model else request_model

        output: int | None = None
        load_s: float | None = None
        source: UsageSource = "none"
        prompt_tokens = non_negative_int(usage.get("prompt_tokens"))
        generation_s = _seconds(timings.get("predicted_ms"), 1e3)
        prompt_s = _seconds(timings.get("prompt_ms"), 1e3)
        if prompt_tokens is None:
            prompt_n, cache_n = non_negative_int(timings.get("prompt_n")), non_negative_int(timings.get("cache_n"))
            if prompt_n is not None:
                prompt_tokens = prompt_n + (cache_n or 0)

        if (n := non_negative_int(usage.get("completion_tokens"))) is not None:
            output, source = n, "openai_usage"
        elif (n := non_negative_int(timings.get("predicted_n"))) is not None:
            output, source = n, "llamacpp_timings"
        elif (n := non_negative_int(_last_value(tail, '"tokens_predicted"'))) is not None:
            output, source = n, "llamacpp_tokens_predicted"
        elif eval_count is not None:
            output, source = eval_count, "ollama_eval_count"

        if eval_count is not None:  # Ollama: durations in nanoseconds
            generation_s = (
                generation_s if generation_s is not None else _seconds(_last_value(tail, '"eval_duration"'), 1e9)
            )
            prompt_s = prompt_s if prompt_s is not None else _seconds(_last_value(tail, '"prompt_eval_duration"'), 1e9)
            load_s = _seconds(_last_value(tail, '"load_duration"'), 1e9)
            if prompt_tokens is None:
                prompt_tokens = non_negative_int(_last_value(tail, '"prompt_eval_count"'))

        if output is None:
            output, source = self._counted()
        return Usage(output, prompt_tokens, generation_s, prompt_s, wall_s, model, source, self._events, load_s)

    def _counted(self) -> tuple[int | None, UsageSource]:
        """Without a backend count: a stream's content-bearing events, if it had any."""
        return (self._events, "stream_events") if self.is_stream and self._events > 0 else (None, "none")


def _last_value(tail: str, needle: str) -> Any:
    """The JSON value of the LAST ``needle`` (a quoted key, ``'"usage"'``) in the tail that is a key
    (a ``:`` follows it) whose value decodes, else None."""
    size = len(tail)
    end = size
    while (at := tail.rfind(needle, 0, end)) >= 0:
        end = at
        rest = at + len(needle)
        while rest < size and tail[rest] in _WHITESPACE:
            rest += 1
        if rest >= size or tail[rest] != ":":  # a string value, not a key
            continue
        rest += 1
        while rest < size and tail[rest] in _WHITESPACE:
            rest += 1
        try:
            return _SCAN(tail, rest)[0]
        except (StopIteration, ValueError):  # nothing decodable there (json's raw_decode: ValueError)
            continue
    return None


def non_negative_int(value: Any) -> int | None:
    """A count or a cap from JSON: a non-negative integer (an integral float too), else None (bools,
    fractions, negatives and anything else refused)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and value >= 0 else None


def _seconds(value: Any, per_second: float) -> float | None:
    """A non-negative duration given in 1/``per_second`` seconds, in seconds; else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value) / per_second
    return None
