"""Logging: one format for everything the proxy logs (its own lines, its server's), text or JSON.

Every answer gets one ``request`` line (``log_request``) with its fields: scheduled, pass-through,
and the proxy's own rejections. In text form the fields follow the message as ``key=value``; in
JSON form each line is one object (``ts``, ``level``, ``logger``, ``msg`` and the fields), ready
for Loki or Elastic. httpx's and httpcore's per-call INFO lines are silenced. No prompt text is
ever a field (``log_prompts`` logs it separately, at debug level).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

__all__ = ["REQUEST_LOG", "LogFormat", "configure_logging", "log_request"]

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REQUEST_LOG = logging.getLogger("clairvoyant.requests")


def log_request(fields: dict[str, Any]) -> None:
    """The one line for one answered (or refused) request."""
    if REQUEST_LOG.isEnabledFor(logging.INFO):
        REQUEST_LOG.info("request", extra={"fields": fields})


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, then the fields as ``key=value``. A request line (fields, no exception) is
    built directly, with the timestamp's seconds formatted once per second: the same text as
    ``logging.Formatter`` makes, at about half the cost (one such line per request)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second = -1
        self._second_text = ""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        if not fields or record.exc_info or record.exc_text or record.stack_info or record.args:
            return super().format(record)
        second = int(record.created)
        if second != self._second:  # formatTime's "%Y-%m-%d %H:%M:%S" part, made once per second
            self._second_text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = second
        record.message = message = str(record.msg)
        record.asctime = asctime = (self.default_msec_format or "%s,%03d") % (self._second_text, record.msecs)
        pairs = [f"{k}={'-' if v is None else v}" for k, v in fields.items()]
        return f"{asctime} {record.levelname} {record.name}: {message} {' '.join(pairs)}"

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, log_format: LogFormat = "text") -> None:
    """Install the one handler on the root logger (the server's loggers propagate to it)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    # No format here reads the thread, process or multiprocessing names: not looked up per record.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("httpx", "httpcore"):  # one INFO line per upstream call otherwise
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    for name in ("_granian", "granian.access"):
        server_logger = logging.getLogger(name)
        server_logger.handlers[:] = []
        server_logger.propagate = True
    logging.getLogger("granian.access").disabled = True  # our request line replaces it
