"""How ``prefixlb router`` and ``prefixlb worker`` write their logs: ``--log-format text|json``.

Every log line of the servers is one event in ``key=value`` form (``event=access request_id=...
status=200 ttfb_ms=41.2``). ``text`` writes it as is, after the time, level and logger; ``json``
writes one JSON object per line with ``time`` (ISO 8601, UTC), ``level``, ``logger``,
``message`` (the line as text) and each ``key=value`` of the message as a field of its own --
numbers as numbers, ``-`` as null -- plus ``exception`` (the traceback) when there is one, for
log pipelines that index fields.
"""
from __future__ import annotations

import json
import logging
import re
import sys
import time
from datetime import datetime, timezone
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_PAIR = re.compile(r"(?:^|(?<=\s))([a-z_][a-z0-9_]*)=(\S*)")
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?$")
_RESERVED = frozenset({"time", "level", "logger", "message", "exception"})


def _value(text: str) -> Any:
    if text == "-":
        return None
    if _NUMBER.match(text):
        return float(text) if any(c in text for c in ".eE") else int(text)
    return text


def message_fields(message: str) -> dict[str, Any]:
    """The ``key=value`` pairs of a log message (later keys win; reserved names are skipped)."""
    return {k: _value(v) for k, v in _PAIR.findall(message) if k not in _RESERVED}


class JSONFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "message": message,
            **message_fields(message)}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, with the time's seconds formatted once per second (the access log writes
    a line per request; ``time.strftime`` was a sixth of a line's cost). The same text as
    ``logging.Formatter``'s default ``asctime``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second: int | None = None
        self._text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        second = int(record.created)
        if second != self._second:
            self._text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = second
        return self.default_msec_format % (self._text, record.msecs)


def configure_logging(level: str, log_format: str) -> None:
    """Send the process's logs to stderr at ``level`` in ``log_format`` (text or json)."""
    # No format of ours names a thread, process or source line: a record skips looking them up
    # (the logging HOWTO's "Optimization"; every access-log line pays for them otherwise).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # type: ignore[attr-defined]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
