"""`clairvoyant serve`: run the proxy (proxy/server.py: Granian embedded, with graceful shutdown)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any, get_args

from clairvoyant.config import CLI_FLAGS, ENV_PREFIX, Settings

__all__ = ["add_arguments", "run"]


def _flag_type(name: str) -> dict[str, Any]:
    if name == "policy":
        from clairvoyant.scheduling.policy import POLICY_NAMES  # the registry's names

        return {"choices": list(POLICY_NAMES)}
    annotation = Settings.model_fields[name].annotation
    choices = get_args(annotation)
    if choices and all(isinstance(c, str) for c in choices):
        return {"choices": list(choices)}
    if len(choices) == 2 and type(None) in choices:  # `X | None`: the flag gives an X
        annotation = next(c for c in choices if c is not type(None))
    if annotation in (int, float, Path):
        return {"type": annotation}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if name == "backends":  # repeated: one URL each (a [[backends]] table says more)
        return {"action": "append", "metavar": "URL"}
    return {}


class _DeprecatedModelFlag(argparse.Action):
    """``--model``: the former name of ``--predictor``. It still sets the predictor file, and says
    that it is deprecated (``calibrate --model`` names the LLM, which made the two easy to confuse)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        flag = CLI_FLAGS[self.dest]
        print(f"{parser.prog}: warning: --model is deprecated; use {flag} (the ONNX predictor file)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _help(name: str) -> str:
    field = Settings.model_fields[name]
    if name == "backends":  # the flag takes one URL; the description speaks of the config file's tables
        description = (
            "A backend's base URL; repeat the flag for a pool (a [[backends]] table in the config file also sets its "
            "name, kind, slots, models and api_key)."
        )
    else:
        description = field.description or ""
    if field.default_factory is not None:  # no plain default: say what the factory makes
        made = field.get_default(call_default_factory=True)
        default = str(made) if made else "none"
    else:
        default = "unset" if field.default is None else str(field.default)
    return f"{description} (default {default}; {ENV_PREFIX}{name.upper()})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help=f"TOML config file (see configs/); also {ENV_PREFIX}CONFIG")
    for name, flag in CLI_FLAGS.items():
        parser.add_argument(flag, dest=name, help=_help(name), **_flag_type(name))
    parser.add_argument(
        "--model",
        dest="model_path",
        type=Path,
        action=_DeprecatedModelFlag,
        help=f"deprecated: {CLI_FLAGS['model_path']}",
    )


def run(args: argparse.Namespace) -> int:
    from clairvoyant.config import load_settings
    from clairvoyant.logs import configure_logging
    from clairvoyant.prediction.predictor import OnnxPredictor
    from clairvoyant.proxy.app import create_app
    from clairvoyant.proxy.server import ProxyServer

    # Logging first, so that the settings' own warnings (unknown CLAIRVOYANT_* variables) are formatted;
    # the level comes from the settings once they are known.
    configure_logging("warning")
    flags = {name: getattr(args, name) for name in CLI_FLAGS}
    if flags["backends"]:
        flags["backends"] = [{"url": url} for url in flags["backends"]]
    settings = load_settings(args.config, **flags)
    configure_logging(settings.log_level, settings.log_format)
    # Load the model before binding the port: a bad model stops start-up with a clear message.
    predictor = OnnxPredictor(settings.model_path)
    logging.getLogger(__name__).info("predictor %s (feature set %s)", predictor.model_path, predictor.feature_set_name)
    app = create_app(settings, predictor=predictor)
    # What is loaded by now lives as long as the process: out of the cyclic collector's way, so that
    # its full collections stop rescanning it (the model and the package: a pause that grows with
    # the heap, under load every few hundred requests).
    gc.collect()
    gc.freeze()
    config = args.config or os.environ.get(f"{ENV_PREFIX}CONFIG")
    reload_settings = None if not config else (lambda: load_settings(config, **flags))  # SIGHUP: the file's keys
    return ProxyServer(app, settings, reload_settings=reload_settings).run()
