"""Structured logging for every process: ``twt.*`` loggers, text and JSON output.

Events are logged as a short dotted name plus typed fields, the Python
rendering of the Rust crate's ``tracing`` spans::

    log_event(logger, logging.INFO, "worker.ready", tenant="acme", instance=0, pid=4242)

renders as ``... INFO twt.supervisor worker.ready tenant=acme instance=0 pid=4242``
with the text formatter, and as one JSON object per line with the JSON one.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import IO, Literal

__all__ = [
    "JsonFormatter",
    "LogFormat",
    "TextFormatter",
    "configure_logging",
    "get_logger",
    "log_event",
]

LogFormat = Literal["text", "json"]
_FIELDS_ATTR = "twt_fields"
_ROOT = "twt"


def get_logger(name: str) -> logging.Logger:
    """The ``twt.<name>`` logger (``twt`` itself for an empty name)."""
    return logging.getLogger(f"{_ROOT}.{name}" if name else _ROOT)


def log_event(logger: logging.Logger, level: int, event: str, /, **fields: object) -> None:
    """Log ``event`` with structured ``fields`` (cheap when the level is disabled)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={_FIELDS_ATTR: fields}, stacklevel=2)


def _fields_of(record: logging.LogRecord) -> dict[str, object]:
    fields = getattr(record, _FIELDS_ATTR, None)
    return fields if isinstance(fields, dict) else {}


def _text_value(value: object) -> str:
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    """``2026-11-29T22:21:41.123Z INFO twt.supervisor worker.ready tenant=acme pid=42``."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [f"{ts}.{int(record.msecs):03d}Z", record.levelname, record.name, record.getMessage()]
        parts.extend(f"{k}={_text_value(v)}" for k, v in _fields_of(record).items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``event``, ``pid`` and the fields.

    A field named like one of those keys (``pid=4242`` logged by the
    supervisor about a worker) is kept as ``field_<name>`` instead of being
    dropped. Values JSON cannot encode are written as ``str(value)``.
    """

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        for key, value in _fields_of(record).items():
            obj[f"field_{key}" if key in obj else key] = value
        try:
            return json.dumps(obj, default=str, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):  # e.g. a dict with tuple keys, or a NaN
            return json.dumps({k: _json_safe(v) for k, v in obj.items()}, separators=(",", ":"))


def _json_safe(value: object) -> object:
    if value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return str(value)


def configure_logging(
    fmt: LogFormat = "text", level: int | str = logging.INFO, stream: IO[str] | None = None
) -> None:
    """Route every ``twt.*`` logger to ``stream`` (stderr) in the given format.

    Idempotent: a second call replaces the handler it installed before, or keeps it when it
    already writes ``fmt`` to the same stream (a worker forked from the fork server, which
    configured the defaults: :mod:`worker.preload`), and sets the level only when it changes
    (``setLevel`` clears every logger's cache: ~0.5 ms of a forked worker's start, its pages
    copied on write).
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', not {fmt!r}")
    root = logging.getLogger(_ROOT)
    target = stream if stream is not None else sys.stderr
    formatter = JsonFormatter if fmt == "json" else TextFormatter
    kept = False
    for handler in list(root.handlers):
        if not getattr(handler, "_twt_handler", False):
            continue
        if (not kept and isinstance(handler, logging.StreamHandler) and handler.stream is target
                and type(handler.formatter) is formatter):
            kept = True
        else:
            root.removeHandler(handler)
    if not kept:
        handler = logging.StreamHandler(target)
        handler.setFormatter(formatter())
        handler._twt_handler = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    number = logging.getLevelName(level) if isinstance(level, str) else level
    if root.level != number or not isinstance(number, int):
        root.setLevel(level)
    root.propagate = False
