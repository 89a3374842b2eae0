"""`clairvoyant calibrate`: measure this backend's mean Short service time and print what to set.

    clairvoyant calibrate                                   # Ollama on 127.0.0.1:11434, its first model
    clairvoyant calibrate --backend http://127.0.0.1:8081   # llama.cpp's llama-server (OpenAI API)

Sends a few built-in Short prompts (questions with a one-line answer, written for this module; no
dataset needed) to the backend **one at a time**, after one unmeasured warm-up request (Ollama
loads the model on first use), and reports mu_short, the mean Short *service* time: the wall time
of a request that waits for nothing. That is the quantity the paper's simulation sets tau from
(tau = 3 x mu_short, docs/simulation.md), not the sojourn time of a concurrent burst (which grows
with the burst: docs/benchmarks.md section 3).

The dialect is found by asking the backend: Ollama answers ``GET /api/tags`` and ``GET /api/version``
(then requests go to ``/api/chat``); otherwise ``GET /v1/models`` (llama.cpp, vLLM, any OpenAI-compatible server; requests
go to ``/v1/chat/completions``). Without ``--model`` the first model the backend lists is used.
Every answer is capped at the Short class's upper bound (``SHORT_BELOW_TOKENS - 1`` tokens), so a
chatty model cannot turn a Short measurement into a long one; the mean output tokens are printed
beside the time.

Errors: ``CalibrationError`` (a ``ClairvoyantError``: the CLI prints it and exits 2) when the
backend cannot be reached, lists no model, or fails a request.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from clairvoyant.config import ENV_PREFIX, Settings
from clairvoyant.errors import ClairvoyantError
from clairvoyant.prediction.length_classes import SHORT_BELOW_TOKENS

__all__ = ["SHORT_PROMPTS", "Calibration", "CalibrationError", "add_arguments", "advice", "measure", "run"]

Dialect = Literal["ollama", "openai"]

# Short prompts: each asks for a fact, a word or a sentence. Written for this module (no dataset).
SHORT_PROMPTS: tuple[str, ...] = (
    "What is the capital of Japan? Answer in one word.",
    "Is 17 a prime number? Answer yes or no.",
    "How many days are there in a leap year?",
    "Translate 'good morning' into French.",
    "What is 12 times 8?",
    "Give me a synonym for 'happy'.",
    "Which planet is closest to the Sun?",
    "What is the chemical symbol for gold?",
    "Name the largest ocean on Earth.",
    "Spell the word 'necessary' backwards.",
    "What colour do you get by mixing blue and yellow?",
    "In one sentence, what does a thermometer measure?",
)
DEFAULT_BACKEND = "http://127.0.0.1:11434"
MAX_TOKENS = SHORT_BELOW_TOKENS - 1  # the longest answer that is still Short
PAPER_TAU_MULTIPLE = 3.0  # the paper's tau = 3 x mu_short (3.4)


class CalibrationError(ClairvoyantError):
    """The backend could not be measured (unreachable, no model, a failed request)."""


@dataclass(frozen=True, slots=True)
class Calibration:
    """One measurement: Short requests sent one at a time, after ``warmup`` unmeasured ones."""

    backend: str
    dialect: Dialect
    model: str
    service_s: tuple[float, ...]  # wall time of each measured request, seconds
    output_tokens: tuple[int | None, ...]  # what the backend reported per request (None: not reported)
    slots: int | None  # the backend's parallel slots, when it says (llama.cpp /props total_slots)

    @property
    def mu_short_s(self) -> float:
        return statistics.fmean(self.service_s)

    @property
    def std_s(self) -> float:
        return statistics.stdev(self.service_s) if len(self.service_s) > 1 else 0.0

    @property
    def mean_output_tokens(self) -> float | None:
        known = [n for n in self.output_tokens if n is not None]
        return statistics.fmean(known) if known else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        default=DEFAULT_BACKEND,
        help=f"the backend's base URL, as for --upstream (default {DEFAULT_BACKEND}, Ollama)",
    )
    parser.add_argument(
        "--dialect",
        choices=["auto", "ollama", "openai"],
        default="auto",
        help="auto (default): Ollama if GET /api/tags answers, else OpenAI (/v1/chat/completions)",
    )
    parser.add_argument("--model", default=None, help="model to ask (default: the first one the backend lists)")
    parser.add_argument("--n", type=int, default=10, help="measured requests, one at a time (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests first (default 1: model load)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurement and the advice here")


def _get_json(client: Any, url: str) -> Any | None:
    import httpx

    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise CalibrationError(f"cannot reach the backend at {url}: {exc!r}") from exc
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def detect(client: Any, backend: str, dialect: str, model: str | None) -> tuple[Dialect, str, int | None]:
    """(dialect, model, slots): asks the backend what it is, which models it has and, for llama.cpp,
    how many parallel slots it runs."""
    tags = _get_json(client, f"{backend}/api/tags") if dialect in ("auto", "ollama") else None
    if dialect == "auto" and isinstance(tags, dict):
        # llama.cpp's server answers /api/tags too (an Ollama-style model list); only Ollama has /api/version.
        version = _get_json(client, f"{backend}/api/version")
        if not (isinstance(version, dict) and "version" in version):
            tags = None
    found: Dialect
    if isinstance(tags, dict) and isinstance(tags.get("models"), list):
        found = "ollama"
        names = [m.get("name") or m.get("model") for m in tags["models"] if isinstance(m, dict)]
    elif dialect == "ollama":
        raise CalibrationError(f"{backend}/api/tags did not answer as Ollama does; is this an Ollama server?")
    else:
        found = "openai"
        listing = _get_json(client, f"{backend}/v1/models")
        if not isinstance(listing, dict):
            raise CalibrationError(
                f"{backend} answers neither GET /api/tags (Ollama) nor GET /v1/models (OpenAI-compatible)"
            )
        names = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
    names = [n for n in names if isinstance(n, str) and n]
    if model is None:
        if not names:
            hint = " (ollama pull <model> first)" if found == "ollama" else ""
            raise CalibrationError(f"the backend at {backend} lists no model{hint}; or pass --model")
        model = names[0]
    slots = None
    if found == "openai":
        props = _get_json(client, f"{backend}/props")  # llama.cpp's server only
        if isinstance(props, dict) and isinstance(props.get("total_slots"), int):
            slots = props["total_slots"]
    return found, model, slots


def _request(dialect: Dialect, model: str, prompt: str) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": prompt}]
    if dialect == "ollama":
        return "/api/chat", {
            "model": model,
            "messages": messages,
            "stream": False,
            "options": {"num_predict": MAX_TOKENS},
        }
    return "/v1/chat/completions", {"model": model, "messages": messages, "stream": False, "max_tokens": MAX_TOKENS}


def _one(client: Any, backend: str, dialect: Dialect, model: str, prompt: str) -> tuple[float, int | None]:
    """Send one request; (wall seconds, output tokens the backend reported)."""
    import httpx

    from clairvoyant.prediction.usage import UsageTap

    path, body = _request(dialect, model, prompt)
    started = time.monotonic()
    try:
        response = client.post(f"{backend}{path}", json=body)
    except httpx.HTTPError as exc:
        raise CalibrationError(f"request to {backend}{path} failed: {exc!r}") from exc
    wall_s = time.monotonic() - started
    if response.status_code != 200:
        raise CalibrationError(
            f"{backend}{path} answered {response.status_code} for model {model!r}: {response.text[:200]}"
        )
    tap = UsageTap(response.headers.get("content-type", "application/json"))
    tap.feed(response.content)
    usage = tap.usage(wall_s=wall_s, request_model=model)
    return wall_s, usage.output_tokens if usage.observed else None


def measure(
    backend: str,
    *,
    dialect: str = "auto",
    model: str | None = None,
    n: int = 10,
    warmup: int = 1,
    timeout_s: float = 300.0,
    progress: Any = None,
) -> Calibration:
    """Measure ``n`` Short requests one at a time (prompts cycled from ``SHORT_PROMPTS``)."""
    import httpx

    if n < 1 or warmup < 0:
        raise CalibrationError("--n must be at least 1 and --warmup at least 0")
    backend = backend.rstrip("/")
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        found, model, slots = detect(client, backend, dialect, model)
        for i in range(warmup):
            _one(client, backend, found, model, SHORT_PROMPTS[-1 - i % len(SHORT_PROMPTS)])
        service: list[float] = []
        tokens: list[int | None] = []
        for i in range(n):
            wall_s, output = _one(client, backend, found, model, SHORT_PROMPTS[i % len(SHORT_PROMPTS)])
            service.append(wall_s)
            tokens.append(output)
            if progress is not None:
                progress(i + 1, n)
    return Calibration(backend, found, model, tuple(service), tuple(tokens), slots)


def _seconds(value: float) -> str:
    """Seconds for a setting: one decimal, never below 0.1 (tau must be positive)."""
    return f"{max(0.1, math.ceil(value * 10) / 10):g}"


def advice(cal: Calibration) -> dict[str, Any]:
    """What to set, from one measurement: the default rule's values and the paper's rule."""
    from clairvoyant.scheduling.slowdown import AdaptiveSlowdown

    fields = Settings.model_fields
    tau = float(fields["starvation_timeout_s"].default)
    base = float(fields["starvation_slowdown"].default)
    prior_cv2 = float(inspect.signature(AdaptiveSlowdown).parameters["prior_cv2"].default)
    m = base * (1 + prior_cv2)
    return {
        "default": {  # the shipped rule: nothing to tune, the slowdown follows measured service times
            f"{ENV_PREFIX}UPSTREAM_URL": cal.backend,
            f"{ENV_PREFIX}SLOTS": str(cal.slots) if cal.slots is not None else None,
            f"{ENV_PREFIX}STARVATION_TIMEOUT_S": f"{tau:g}",
            f"{ENV_PREFIX}STARVATION_SLOWDOWN": f"{base:g}",
        },
        "short_deadline_s": round(tau + m * cal.mu_short_s, 2),  # a Short request's, before 20 are measured
        "slowdown_m_before_data": m,
        "paper": {  # the paper's rule: tau = 3 x mu_short, no slowdown term
            f"{ENV_PREFIX}STARVATION_TIMEOUT_S": _seconds(PAPER_TAU_MULTIPLE * cal.mu_short_s),
            f"{ENV_PREFIX}STARVATION_SLOWDOWN": "0",
        },
    }


def report(cal: Calibration) -> str:
    tips = advice(cal)
    tokens = cal.mean_output_tokens
    token_text = f"{tokens:.0f} output tokens on average" if tokens is not None else "output tokens not reported"
    slots = tips["default"][f"{ENV_PREFIX}SLOTS"]
    lines = [
        f"backend {cal.backend} ({cal.dialect}), model {cal.model}: {len(cal.service_s)} Short requests, one at a time",
        f"mu_short = {cal.mu_short_s:.2f} s  (mean Short service time; std {cal.std_s:.2f} s, "
        f"min {min(cal.service_s):.2f} s, max {max(cal.service_s):.2f} s; {token_text})",
        "",
        "# Default rule (recommended): a request is overdue after tau + m x its predicted seconds, m = "
        f"{tips['default'][f'{ENV_PREFIX}STARVATION_SLOWDOWN']} x (1 + CV^2) of measured service times.",
        f"# It needs no tuning: here a Short request is overdue after about {tips['short_deadline_s']:g} s "
        f"(m = {tips['slowdown_m_before_data']:g} until 20 requests are measured). docs/scheduling.md",
    ]
    for key, value in tips["default"].items():
        if value is None:
            lines.append(f"{key}=<the backend's parallel slots, e.g. OLLAMA_NUM_PARALLEL; 1 if unset>")
        else:
            lines.append(f"{key}={value}")
    paper = tips["paper"]
    tau = paper[f"{ENV_PREFIX}STARVATION_TIMEOUT_S"]
    lines += [
        "",
        f"# Or the paper's rule, tau = {PAPER_TAU_MULTIPLE:g} x mu_short and no slowdown term "
        "(a burst older than tau is served FIFO: docs/simulation.md):",
        *(f"{key}={value}" for key, value in paper.items()),
        f"# as flags: clairvoyant serve --upstream {cal.backend} --tau {tau} --slowdown 0"
        + (f" --slots {slots}" if slots else ""),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from clairvoyant.tools.progress import progress

    # A bar on a terminal; piped or logged, one plain line per measured request.
    with progress(args.n, desc="measuring Short requests", unit="req") as bar:
        cal = measure(
            args.backend,
            dialect=args.dialect,
            model=args.model,
            n=args.n,
            warmup=args.warmup,
            timeout_s=args.timeout,
            progress=lambda done, total: bar.update(1),
        )
    print(report(cal))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**asdict(cal), "mu_short_s": cal.mu_short_s, "advice": advice(cal)}, indent=1))
        print(f"wrote {args.json}")
    return 0
