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
_NUMBER_START = "-0123456789"
_RESERVED = frozenset({"time", "level", "logger", "message", "exception"})
_JSON = json.JSONEncoder(ensure_ascii=False, default=str)  # json.dumps(..., ensure_ascii=False, default=str)


def _value(text: str) -> Any:
    if text == "-":
        return None
    if text[:1] in _NUMBER_START and _NUMBER.match(text):  # (most values start with neither)
        return float(text) if "." in text or "e" in text or "E" in text else int(text)
    return text


def message_fields(message: str) -> dict[str, Any]:
    """The ``key=value`` pairs of a log message (later keys win; reserved names are skipped)."""
    return {k: _value(v) for k, v in _PAIR.findall(message) if k not in _RESERVED}


class JSONFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        return self.line(record.created, record.levelname, record.name, record.getMessage(),
                         self.formatException(record.exc_info) if record.exc_info else None)

    def line(self, created: float, levelname: str, name: str, message: str, exception: str | None = None) -> str:
        """A record's line from its parts (``format``'s, and :func:`log_info`'s without a record)."""
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": levelname.lower(), "logger": name, "message": message, **message_fields(message)}
        if exception is not None:
            out["exception"] = exception
        return _JSON.encode(out)


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, with the time's seconds formatted once per second (the access log writes
    a line per request; ``time.strftime`` was a sixth of a line's cost). The same text as
    ``logging.Formatter``'s default ``asctime``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second: int | None = None
        self._text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        return self.asctime(record.created, record.msecs)

    def asctime(self, created: float, msecs: float) -> str:
        """``asctime`` of a record created at ``created`` (``msecs``: its milliseconds, as a
        ``LogRecord`` counts them)."""
        second = int(created)
        if second != self._second:
            self._text = time.strftime(self.default_time_format, self.converter(created))
            self._second = second
        return self.default_msec_format % (self._text, msecs)

    def line(self, created: float, levelname: str, name: str, message: str) -> str:
        """A record's line from its parts (:func:`log_info`'s, without a record): ``TEXT_FORMAT``
        as ``logging.Formatter`` fills it in, msecs as ``LogRecord`` counts them."""
        msecs = int((created - int(created)) * 1000) + 0.0
        return f"{self.asctime(created, msecs)} {levelname} {name} {message}"


def configure_logging(level: str, log_format: str) -> None:
    """Send the process's logs to stderr at ``level`` in ``log_format`` (text or json)."""
    # No format of ours names a thread, process or source line: a record skips looking them up
    # (the logging HOWTO's "Optimization"; every access-log line pays for them otherwise).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # type: ignore[attr-defined]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


_INFO = logging.getLevelName(logging.INFO)


def log_info(logger: logging.Logger, msg: str, *args: object) -> None:
    """``logger.info(msg, *args)``: the same line, on the same stream, under the same lock. When
    the process logs as :func:`configure_logging` set it up (one standard ``StreamHandler`` on the
    root with a formatter of ours, and nothing else on the way: no filter, no other handler, no
    logger or record class of someone else's) the line is written without a ``LogRecord`` and the
    handler chain (the access log writes one a request); otherwise, or when the message does not
    format, by ``logger.info`` itself. A failed write is reported as the handler reports it."""
    if not logger.isEnabledFor(logging.INFO):
        return
    handler = _direct_handler(logger)
    if handler is None or len(args) == 1:  # (one argument may be a mapping, which logging treats apart)
        logger.info(msg, *args)
        return
    created = time.time()
    formatter = handler.formatter
    try:
        line = formatter.line(created, _INFO, logger.name, msg % args if args else msg)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - a message that does not format: logging's own path reports it
        logger.info(msg, *args)
        return
    handler.acquire()
    try:
        handler.stream.write(line + handler.terminator)  # as StreamHandler.emit
        handler.flush()
    except RecursionError:
        raise
    except Exception:  # noqa: BLE001 - as StreamHandler.emit
        handler.handleError(logger.makeRecord(logger.name, logging.INFO, "(unknown file)", 0, msg, args, None))
    finally:
        handler.release()


def _direct_handler(logger: logging.Logger) -> logging.StreamHandler | None:
    """The one handler a record of ``logger`` at INFO would reach, when :func:`log_info` can write
    its line itself (see there); else None."""
    if type(logger) is not logging.Logger or logger.filters or logger.disabled \
            or logging.getLogRecordFactory() is not logging.LogRecord:
        return None
    c = logger
    while c.parent is not None:
        if c.handlers or not c.propagate:
            return None
        c = c.parent
    if len(c.handlers) != 1:
        return None
    handler = c.handlers[0]
    if type(handler) is not logging.StreamHandler or handler.filters or handler.level > logging.INFO \
            or type(handler.formatter) not in (TextFormatter, JSONFormatter):
        return None
    return handler
