"""Process logging: every logger writes one JSON object per line, secrets redacted.

``configure_logging`` puts one handler on the root logger and sends every other logger
(``isocost.*``, ``aiohttp.*``, ``asyncio``, warnings, uncaught exceptions) through it, so
nothing reaches stderr as plain text. A record becomes ``{"ts", "level", "logger", "msg",
...extra fields, "exc"?}``; a traceback is one escaped string field, never extra lines.

Redaction, because log lines leave the process: bearer and basic credentials and the
values of ``Authorization``, ``X-Api-Key`` and ``X-Admin-Token`` are replaced wherever they
appear; the message of an HTTP parse error (aiohttp quotes the raw request bytes there:
header values with keys, prompt bytes) is withheld, only its kind and status are kept;
every string is cut to a bounded length.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import traceback
from types import TracebackType

from aiohttp.http_exceptions import HttpProcessingError

from isocost.core.errors import ConfigError

__all__ = ["LOG_LEVELS", "JsonFormatter", "check_log_level", "configure_logging", "redact"]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_STANDARD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_MAX_FIELD_CHARS = 2000
_MAX_TRACEBACK_CHARS = 8000
_CREDENTIAL = re.compile(r"(?i)\b(bearer|basic)(\s+)[^\s'\",;]+")
_SECRET_HEADER = re.compile(
    r"(?i)\b(authorization|x-api-key|x-admin-token|api[-_]key)(['\"]?\s*[:=]\s*['\"]?)"
    r"[^\r\n'\",;]*"
)
_NOISY_LOGGERS = ("aiohttp", "asyncio", "isocost", "py.warnings")


def redact(text: str, limit: int = _MAX_FIELD_CHARS) -> str:
    """``text`` with credentials replaced, cut to ``limit`` characters."""
    text = _CREDENTIAL.sub(r"\1\2[redacted]", text)
    text = _SECRET_HEADER.sub(r"\1\2[redacted]", text)
    return text if len(text) <= limit else text[:limit] + "...[cut]"


def _exception_text(
    info: tuple[type[BaseException], BaseException, TracebackType | None],
) -> str:
    kind, exc, tb = info
    if isinstance(exc, HttpProcessingError):
        # Its message quotes the request's raw bytes: never log it.
        return f"{kind.__name__} (HTTP {exc.code}): message withheld, it quotes the request"
    return redact("".join(traceback.format_exception(kind, exc, tb)), _MAX_TRACEBACK_CHARS)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's extra fields
    and the exception, every string redacted (``redact``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(_message(record)),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in entry:
                entry[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info and record.exc_info[1] is not None:
            entry["exc"] = _exception_text(record.exc_info)
        if record.stack_info:
            entry["stack"] = redact(record.stack_info, _MAX_TRACEBACK_CHARS)
        return json.dumps(entry, default=lambda value: redact(str(value)))


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # a bad %-format in someone's log call must not lose the line
        return str(record.msg)


def check_log_level(level: str) -> str:
    """``level`` when it is one of ``LOG_LEVELS`` (any case); else a ConfigError naming
    them, for every command's ``--log-level`` alike (logging's own error is a traceback)."""
    if level.lower() not in LOG_LEVELS:
        raise ConfigError("--log-level", f"unknown level {level!r}; valid: {', '.join(LOG_LEVELS)}")
    return level


def configure_logging(level: str) -> None:
    """Route every logger of the process through one JSON handler on stderr at ``level``
    (checked by ``check_log_level``)."""
    check_log_level(level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_NOISY_LOGGERS):
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True
    logging.captureWarnings(True)

    def log_uncaught(
        kind: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        root.critical("uncaught exception", exc_info=(kind, exc, tb))

    sys.excepthook = log_uncaught
