"""What the probes against a real proxy process share: reading raw answers, percentiles, and the
table of targets and verdicts they print."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Row", "answer_complete", "header_value", "percentile", "print_table", "sse_outcome", "status_of"]


def status_of(raw: bytes) -> int | None:
    """The status code of a raw HTTP/1.x response, or None when ``raw`` holds no status line."""
    line = raw.split(b"\r\n", 1)[0]
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        return None
    return int(parts[1])


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def sse_outcome(text: str) -> str:
    """How an OpenAI SSE stream ended: "done" ([DONE] last), "error" (an error event last), "cut" otherwise."""
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    if not events:
        return "cut"
    if events[-1] == "[DONE]":
        return "done"
    try:
        last = json.loads(events[-1])
    except ValueError:
        return "cut"
    return "error" if isinstance(last, dict) and "error" in last else "cut"


def header_value(raw: bytes, name: str) -> str | None:
    """One header's value in a raw HTTP/1.x response head (None when absent)."""
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def answer_complete(raw: bytes) -> bool:
    """Whether ``raw`` holds a whole response with a Content-Length: its head and that many bytes."""
    _, sep, body = raw.partition(b"\r\n\r\n")
    length = header_value(raw, "content-length") if sep else None
    return length is not None and len(body) >= int(length)


@dataclass
class Row:
    case: str
    target: str
    measured: str
    ok: bool | None  # None: a figure stated, no target
    figures: dict[str, Any] = field(default_factory=dict)
    settings: str = ""  # the proxy's settings for the case (``ProxyProcess.stated``)

    def as_json(self) -> dict[str, Any]:
        verdict = None if self.ok is None else ("PASS" if self.ok else "FAIL")
        return {"case": self.case, "target": self.target, "measured": self.measured, "verdict": verdict,
                "settings": self.settings, "figures": self.figures}  # fmt: skip


def print_table(rows: list[Row]) -> None:
    print()
    print(f"{'case':58} {'verdict':7} measured  [target]")
    for row in rows:
        verdict = "-" if row.ok is None else ("PASS" if row.ok else "FAIL")
        print(f"{row.case:58} {verdict:7} {row.measured}  [{row.target}]")
        if row.settings:
            print(f"{'':58} {'':7} settings: {row.settings}")
