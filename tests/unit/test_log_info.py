"""``protocol/log_format.py``'s ``log_info``: the line it writes without a ``LogRecord`` is the line
``logger.info`` writes through logging, byte for byte, in both formats; any other logging set-up
gets logging's own path."""
from __future__ import annotations

import io
import logging
import time

import pytest

from protocol.log_format import JSONFormatter, TextFormatter, _direct_handler, log_info

ACCESS = ("event=access request_id=%s model=%s path=%s stream=%s status=%d worker=%s reason=%s attempts=%d "
          "ttfb_ms=%s duration_ms=%.1f prompt_tokens=%s cached_tokens=%s predicted_cached_tokens=%d")
ARGS = [("0123abcd", "llama-3-8b", "/v1/completions", False, 200, "sim-0", "affinity", 1, "1.2", 1.53, 24, 0, 16),
        ("r 2", "m=1 x", "/v1/chat/completions", True, 499, None, "spread", 2, "-", 0.04, "-", "-", 0),
        ("é☃", "123", "/v1/completions", False, 503, "w\"q", "1e5", 0, "-", 12345.678, 7, None, -1)]
TIMES = [1_760_000_000.0, 1_760_000_000.9995, 1_760_000_001.0004, 1_760_003_599.123456, 1_760_000_000.5]


def _isolated(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    """``prefixlb.router.access`` in a logger tree of its own (pytest's handlers sit on the real
    root), set up as ``configure_logging`` sets up the real one."""
    manager = logging.Manager(logging.RootLogger(logging.INFO))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    manager.root.addHandler(handler)
    logger = manager.getLogger("prefixlb.router.access")
    manager.getLogger("prefixlb.router")  # a placeholder becomes a logger in between
    return logger, stream


@pytest.mark.parametrize("formatter", [TextFormatter, JSONFormatter])
def test_direct_lines_are_logging_s_own_in_both_formats(formatter, monkeypatch):
    direct_logger, direct = _isolated(formatter())
    logged_logger, logged = _isolated(formatter())
    assert _direct_handler(direct_logger) is not None  # the path under test, not logging's
    for created in TIMES:
        monkeypatch.setattr(time, "time", lambda: created)
        for args in ARGS:
            log_info(direct_logger, ACCESS, *args)
            logged_logger.info(ACCESS, *args)
    assert direct.getvalue() == logged.getvalue()
    assert direct.getvalue().count("\n") == len(TIMES) * len(ARGS)


def test_a_line_below_the_level_is_not_written():
    logger, stream = _isolated(TextFormatter())
    logger.setLevel(logging.WARNING)
    log_info(logger, ACCESS, *ARGS[0])
    assert stream.getvalue() == ""


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_another_handler_or_a_filter_gets_logging_s_own_path():
    logger, stream = _isolated(TextFormatter())
    extra = _Collect()
    logger.addHandler(extra)
    log_info(logger, ACCESS, *ARGS[0])
    assert [r.getMessage() for r in extra.records] == [ACCESS % ARGS[0]]
    assert stream.getvalue().endswith(ACCESS % ARGS[0] + "\n")  # and propagated to the root's handler

    logger.removeHandler(extra)
    logger.addFilter(lambda record: False)
    log_info(logger, ACCESS, *ARGS[1])
    assert ACCESS % ARGS[1] not in stream.getvalue()


def test_a_message_that_does_not_format_is_reported_by_logging(capsys):
    logger, stream = _isolated(TextFormatter())
    log_info(logger, "event=x a=%d b=%d c=%d", 1, 2)  # too few arguments
    assert stream.getvalue() == ""
    assert "--- Logging error ---" in capsys.readouterr().err
