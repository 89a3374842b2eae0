"""Run workloads end to end: conditions x runs, one fresh in-process proxy per condition.

Conditions (``CONDITIONS``):

* ``direct``: straight to the backend, no proxy (the reference; the backend itself is FCFS).
* ``fcfs``: through the proxy with ``policy=fcfs``.
* ``sjf``: through the proxy with ``policy=sjf`` and the ONNX predictor (``model_path``).
* ``oracle``: through the proxy with ``policy=sjf`` and ``allow_oracle=True``; each request carries
  its TRUE answer length in the benchmark-only ``clairvoyant`` field, which becomes the score.

Within run ``r`` the conditions go in an order rotated by ``r`` so machine noise (other work on the
shared cores, warm caches) does not favour one condition. Every condition of a run sends the same
requests (same prompts, same forced lengths, same arrival offsets): comparisons are paired.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from clairvoyant.tools.bench.client import Dialect, RequestResult, RequestSpec, send

__all__ = [
    "CONDITIONS",
    "BenchConfig",
    "proxy_server",
    "wait_idle",
    "result_rows",
    "run_cells",
    "run_workload",
]

logger = logging.getLogger(__name__)

CONDITIONS = ("fcfs", "direct", "sjf", "oracle")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """How to reach the backend and configure each proxy."""

    backend_url: str
    dialect: Dialect = "openai"
    model: str = "SmolLM2-135M-Instruct"
    model_path: Path | None = None  # the predictor for ``sjf``; None = the shipped model
    tau_s: float = math.inf  # the proxy's starvation timeout
    conditions: tuple[str, ...] = CONDITIONS


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def proxy_server(settings: Any, **app_kwargs: Any) -> Iterator[str]:
    """Run ``create_app(settings)`` on the proxy's server (real Granian) in a thread on a free loopback port; yield its URL.

    Raises RuntimeError if it does not start within 30 s (a model that fails to load fails here).
    """
    from clairvoyant.proxy.app import create_app
    from clairvoyant.proxy.server import ProxyServer, serve_in_thread

    port = _free_port()
    server = ProxyServer(create_app(settings, **app_kwargs), settings, host="127.0.0.1", port=port)
    thread = serve_in_thread(server)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        thread.join(timeout=15)


def _proxy_settings(config: BenchConfig, condition: str) -> Any:
    from clairvoyant.config import Settings

    return Settings(
        upstream_url=config.backend_url,
        policy="fcfs" if condition == "fcfs" else "sjf",
        starvation_timeout_s=config.tau_s,
        starvation_slowdown=0.0,  # the benchmarks measure the paper's rule (tau alone)
        starvation_slowdown_adaptive=False,
        allow_oracle=condition == "oracle",
        bench_upstream_fields=True,  # forced lengths reach the backend, not the predictor
        model_path=config.model_path,
        max_queue=10_000,
        log_level="warning",
    )


@contextmanager
def target_for(config: BenchConfig, condition: str) -> Iterator[str]:
    """The URL requests of ``condition`` go to: the backend itself, or a fresh proxy in front of it."""
    if condition not in CONDITIONS:
        raise ValueError(f"unknown condition {condition!r}; choose from {', '.join(CONDITIONS)}")
    if condition == "direct":
        yield config.backend_url
        return
    with proxy_server(_proxy_settings(config, condition)) as url:
        yield url


async def _run(
    base_url: str,
    specs: Sequence[RequestSpec],
    *,
    dialect: Dialect,
    model: str,
    oracle: bool,
    hide_length: bool,
    on_done: Callable[[RequestResult], None] | None,
) -> list[RequestResult]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        origin = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            delay = origin + spec.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            result = await send(
                client,
                base_url,
                spec,
                dialect=dialect,
                model=model,
                oracle=oracle,
                hide_length=hide_length,
                origin=origin,
            )
            if on_done is not None:
                on_done(result)
            return result

        return list(await asyncio.gather(*(one(s) for s in specs)))


def run_workload(
    base_url: str,
    specs: Sequence[RequestSpec],
    *,
    dialect: Dialect = "openai",
    model: str = "SmolLM2-135M-Instruct",
    oracle: bool = False,
    hide_length: bool = False,
    on_done: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send ``specs`` at their offsets (all at once for a burst) and wait for every answer.

    ``hide_length``: the forced length travels in the proxy's own field, unseen by its predictor
    (for every condition through the proxy; see ``client.build_body``)."""
    return asyncio.run(
        _run(base_url, specs, dialect=dialect, model=model, oracle=oracle, hide_length=hide_length, on_done=on_done)
    )


def result_rows(
    results: Sequence[RequestResult],
    *,
    mode: str,
    rho: float | None,
    run: int,
    condition: str,
    position: int,
) -> list[dict[str, Any]]:
    """Flat CSV/JSON rows; ``position`` is the condition's place in the run's rotated order."""
    finish_rank = {
        r.index: i
        for i, r in enumerate(sorted((r for r in results if r.done_s is not None), key=lambda r: r.done_s or 0.0))
    }
    rows = []
    for result in results:
        row = {
            "mode": mode,
            "rho": "" if rho is None else rho,
            "run": run,
            "condition": condition,
            "position": position,
            **asdict(result),
            "ok": result.ok,
            "finish_rank": finish_rank.get(result.index, ""),
        }
        rows.append(row)
    return rows


def wait_idle(backend_url: str, *, timeout_s: float = 120.0, settle_s: float = 0.5) -> None:
    """Wait until llama.cpp's ``/metrics`` shows nothing processing or deferred, then ``settle_s`` more.

    Each condition then starts on an idle backend with no connection of the previous one still being
    served. Backends without that endpoint (Ollama) only get the pause.
    """
    deadline = time.monotonic() + timeout_s
    try:
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                response = client.get(f"{backend_url}/metrics")
                if response.status_code != 200:
                    break
                busy = [
                    line
                    for line in response.text.splitlines()
                    if line.startswith(("llamacpp:requests_processing", "llamacpp:requests_deferred"))
                    and float(line.rsplit(" ", 1)[-1]) > 0
                ]
                if not busy:
                    break
                time.sleep(0.2)
    except httpx.HTTPError:
        pass
    time.sleep(settle_s)


def run_cells(
    config: BenchConfig,
    workloads: Sequence[tuple[str, float | None, int, list[RequestSpec]]],
    *,
    progress: bool = True,
    checkpoint: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run each ``(mode, rho, run, specs)`` under every condition in rotated order; return all rows.

    ``checkpoint`` gets the rows so far after each condition (to save partial results).
    """
    from tqdm import tqdm

    total = sum(len(specs) for *_, specs in workloads) * len(config.conditions)
    rows: list[dict[str, Any]] = []
    with tqdm(total=total, unit="req", disable=not progress, dynamic_ncols=True) as bar:
        for mode, rho, run, specs in workloads:
            k = run % len(config.conditions)
            order = config.conditions[k:] + config.conditions[:k]
            for position, condition in enumerate(order):
                where = mode if rho is None else f"{mode} rho={rho:g}"
                bar.set_description(f"{where} run {run} {condition}")
                wait_idle(config.backend_url)
                with target_for(config, condition) as url:
                    results = run_workload(
                        url,
                        specs,
                        dialect=config.dialect,
                        model=config.model,
                        oracle=condition == "oracle",
                        hide_length=condition != "direct",
                        on_done=lambda _: bar.update(1),
                    )
                failed = [r for r in results if not r.ok]
                if failed:
                    logger.warning(
                        "%s run %d %s: %d of %d requests failed, first: %s",
                        where,
                        run,
                        condition,
                        len(failed),
                        len(results),
                        failed[0].error,
                    )
                rows.extend(result_rows(results, mode=mode, rho=rho, run=run, condition=condition, position=position))
                if checkpoint is not None:
                    checkpoint(rows)
    return rows
