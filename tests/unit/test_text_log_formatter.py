"""``protocol/log_format.py``'s text lines: the time formatted once per second reads exactly as
``logging.Formatter``'s own."""
from __future__ import annotations

import logging
import random

from protocol.log_format import TEXT_FORMAT, TextFormatter


def test_text_lines_are_logging_s_own_whatever_the_times_and_their_order():
    ours, reference = TextFormatter(), logging.Formatter(TEXT_FORMAT)
    rng = random.Random(7)
    base = 1_760_000_000
    times = [base + rng.random() * 86_400 for _ in range(2_000)]  # jumps, both ways
    times += [base + 5 + i * 0.0007 for i in range(3_000)]  # many a second, crossing seconds
    times += [base + 9.9995, base + 10.0, base + 10.0004, base + 9.9999]
    for i, created in enumerate(times):
        record = logging.LogRecord("prefixlb.router.access", logging.INFO, __file__, 1, "event=access n=%d", (i,), None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert ours.format(record) == reference.format(record)
