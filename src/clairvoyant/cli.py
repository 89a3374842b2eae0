"""The `clairvoyant` command: serve, status, predict, replay, train, evaluate, ...

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
those modules import their heavy dependencies inside ``run`` so that ``--help`` stays fast and the
serving path never imports training dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from clairvoyant import __version__
from clairvoyant.errors import ClairvoyantError

__all__ = ["main"]

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("clairvoyant.proxy.serve", "run the scheduling proxy"),
    "backend": ("clairvoyant.tools.backend", "run a small real llama.cpp server (SmolLM2) to try the proxy against"),
    "status": ("clairvoyant.tools.status", "what a running proxy is doing: slots, running, queue with ETAs, learner"),
    "keys": ("clairvoyant.tools.keys", "make a client API key (or hash one) for the api_keys setting"),
    "calibrate": ("clairvoyant.tools.calibrate", "measure the backend's mean Short service time; print what to set"),
    "predict": ("clairvoyant.tools.bulk_predict", "score a JSONL file of prompts or chat bodies"),
    "replay": ("clairvoyant.tools.replay", "replay requests with their real lengths through the online learner"),
    "train": ("clairvoyant.tools.training.commands_train", "train the length predictor and export it to ONNX"),
    "train-encoder": (
        "clairvoyant.tools.training.commands_train_encoder",
        "fine-tune the encoder, export it and its kNN to ONNX, write their card",
    ),
    "evaluate": ("clairvoyant.tools.training.commands_evaluate", "evaluate a model on the held-out split"),
    "simulate": ("clairvoyant.tools.sim.command", "discrete-event simulation of the scheduling queue"),
    "demo": ("clairvoyant.tools.demo", "embedded llama.cpp + the proxy: a mixed burst under fcfs and sjf"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clairvoyant", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"clairvoyant {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ClairvoyantError as exc:
        print(f"clairvoyant {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
