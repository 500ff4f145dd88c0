"""One line per request: what the load generator (or the fleet simulator) saw, as JSONL.

All times are in *workload time*: with ``--time-scale X`` the simulated workers run X times
faster than real time, and the load generator multiplies what it measures by X, so a record
reads as if the fleet had run in real time. ``sent_s`` counts from the start of the run.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable


@dataclass(slots=True)
class RequestRecord:
    """The outcome of one request. ``error`` is None on success; times are in ms except ``sent_s``."""

    index: int
    sent_s: float
    worker_id: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    session: str | None = None
    send_lag_ms: float | None = None  # open loop: how late it left after its scheduled arrival

    @property
    def ok(self) -> bool:
        """True when the request succeeded."""
        return self.error is None

    @property
    def done_s(self) -> float:
        """When the last token arrived (s from the start of the run)."""
        return self.sent_s + (self.e2e_ms or 0.0) / 1000.0


def write_jsonl(records: Iterable[RequestRecord], path: str | Path) -> None:
    """Write records as one JSON object per line."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(dataclasses.asdict(r), separators=(",", ":")) + "\n")


def read_jsonl(path: str | Path) -> list[RequestRecord]:
    """Read records written by :func:`write_jsonl` (unknown keys are ignored)."""
    names = {f.name for f in dataclasses.fields(RequestRecord)}
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                out.append(RequestRecord(**{k: v for k, v in row.items() if k in names}))
    return out
