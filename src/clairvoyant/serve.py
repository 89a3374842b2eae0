"""`clairvoyant serve`: run the proxy on uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (see configs/); also CLAIRVOYANT_CONFIG")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8080)")
    parser.add_argument("--upstream", dest="upstream_url", help="backend base URL (default http://127.0.0.1:11434)")
    parser.add_argument("--policy", choices=["sjf", "fcfs"], help="scheduling policy (default sjf)")
    parser.add_argument("--tau", dest="starvation_timeout_s", type=float, help="starvation timeout in seconds (default 15)")
    parser.add_argument("--slots", type=int, help="requests in flight upstream at once (default 1)")
    parser.add_argument("--max-queue", type=int, help="waiting requests before 503 (default 256)")
    parser.add_argument("--disconnect-mode", choices=["abort", "drain"], help="on a client leaving mid-generation")
    parser.add_argument("--model", dest="model_path", type=Path, help="ONNX model (default: the shipped one)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from clairvoyant.app import create_app
    from clairvoyant.config import load_settings

    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "command", "_run")}
    settings = load_settings(args.config, **overrides)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)
    return 0
