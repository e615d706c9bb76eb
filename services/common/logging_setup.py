"""One-line structured logs for every Tandem process.

Modules log with ``logging.getLogger(__name__)`` and pass request context through ``extra=``::

    logger.info("prefill done", extra={"request_id": rid, "num_tokens": n})

Each entry point calls :func:`configure_logging` once at start-up (never at import). Two formats:

- text (default)::

    2025-01-01T12:00:00.123Z INFO services.prefill.worker: prefill done request_id=abc num_tokens=12

- JSON (``json=True``), one object per line for log shippers::

    {"ts": "2025-01-01T12:00:00.123Z", "level": "INFO", "logger": "services.prefill.worker",
     "message": "prefill done", "request_id": "abc", "num_tokens": 12}

Messages are kept on one line (newlines escaped) so ``grep request_id=abc`` finds a request's whole
story. A traceback is the exception: in text mode it follows on the next lines, in JSON mode it is
the ``exc`` field.
"""

from __future__ import annotations

import json as jsonlib
import logging
import sys
import time
from typing import Any, TextIO

from services.common.errors import InvalidArgumentError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys()
    | {"message", "asctime", "taskName"}
)

# Libraries that are chatty at INFO.
_QUIET_LOGGERS = ("aiohttp.access", "asyncio", "grpc._cython.cygrpc")


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: v
        for k, v in vars(record).items()
        if k not in _STANDARD_ATTRS and not k.startswith("_")
    }


def _one_line(text: str) -> str:
    """``text`` on one line with every control character escaped: a client's text (a model
    name, an error naming its input) can neither forge a log line nor drive a terminal."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    if any(_is_control(c) for c in text):
        text = "".join(f"\\x{ord(c):02x}" if _is_control(c) else c for c in text)
    return text


def _is_control(c: str) -> bool:
    return c < " " or "\x7f" <= c <= "\x9f"


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    if not text or any(c in text for c in ' "=') or any(_is_control(c) for c in text):
        return jsonlib.dumps(text, ensure_ascii=True)  # every control character as \uXXXX
    return text


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger>: <message> key=value ...`` (+ traceback lines)."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            _timestamp(record),
            record.levelname,
            f"{record.name}:",
            _one_line(record.getMessage()),
        ]
        parts.extend(f"{k}={_text_value(v)}" for k, v in _extras(record).items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _extras(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return jsonlib.dumps(entry, ensure_ascii=False, default=repr)


class _TandemHandler(logging.StreamHandler):
    """Marks the handler this module installed, so reconfiguring replaces it."""


def configure_logging(
    level: str = "INFO", json: bool = False, stream: TextIO | None = None
) -> None:
    """Install Tandem's log handler on the root logger and set the level. Safe to call again.

    A handler installed by an earlier call is replaced; handlers others installed stay.

    Args:
        level: DEBUG, INFO, WARNING, ERROR or CRITICAL (case-insensitive).
        json: one JSON object per line instead of text.
        stream: where to write; standard error by default.

    Raises:
        InvalidArgumentError: an unknown level.
    """
    name = level.upper()
    if name not in LEVELS:
        raise InvalidArgumentError(
            f"log level must be one of {', '.join(LEVELS)}, got {level!r}", param="log_level"
        )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _TandemHandler)]:
        root.removeHandler(old)
        old.close()
    handler = _TandemHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    root.addHandler(handler)
    root.setLevel(name)
    quiet = max(logging.WARNING, logging.getLevelName(name))
    for noisy in _QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(quiet)
