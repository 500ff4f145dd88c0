"""Trace replay: Mooncake JSONL (with prefix information) and Azure CSV (arrivals and lengths).

Mooncake: each ``hash_id`` stands for one 512-token block of the prompt; ids are chained (an id
fixes its whole prefix), so each id becomes the content id of a 512-token segment and requests
that share ids share a byte-identical prefix. The last block holds the rest of
``input_length`` (``input_length - 512·(len(hash_ids) - 1)`` tokens). ``output_length`` becomes
``max_tokens`` (sent with ``ignore_eos``).

Azure: ``TIMESTAMP,ContextTokens,GeneratedTokens``; every prompt is distinct (no sharing).
"""
from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

from bench.workloads.base import RequestSpec, Workload, WorkloadError

MOONCAKE_BLOCK_TOKENS = 512
_AZURE = 7 << 40


def mooncake(path: str | Path, num_requests: int | None = None, seed: int = 0) -> Workload:
    """Replay a Mooncake-format trace (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``)."""
    requests: list[RequestSpec] = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc}") from exc
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if num_requests is not None and len(requests) >= num_requests:
                break
            try:
                row = json.loads(line)
                ids = [int(h) for h in row["hash_ids"]]
                length = int(row["input_length"])
                out = int(row["output_length"])
                ts = float(row["timestamp"]) / 1000.0
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(f"{path}:{lineno}: not a Mooncake record ({exc})") from exc
            if not ids or length <= 0 or length > MOONCAKE_BLOCK_TOKENS * len(ids):
                raise WorkloadError(f"{path}:{lineno}: input_length {length} does not fit {len(ids)} blocks")
            last = length - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)
            segments = tuple((h, MOONCAKE_BLOCK_TOKENS) for h in ids[:-1]) + ((ids[-1], last),)
            requests.append(RequestSpec(len(requests), ts, segments, max(1, out)))
    requests.sort(key=lambda r: (r.arrival_s, r.index))
    t0 = requests[0].arrival_s if requests else 0.0
    requests = [RequestSpec(i, r.arrival_s - t0, r.segments, r.max_tokens) for i, r in enumerate(requests)]
    return Workload(f"mooncake:{Path(path).name}", requests, params={"trace": str(path), "num_requests": num_requests})


def _azure_time(text: str) -> float:
    # Timestamps carry 7 fractional digits; datetime takes at most 6.
    head, _, frac = text.strip().partition(".")
    base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def azure(path: str | Path, num_requests: int | None = None, seed: int = 0) -> Workload:
    """Replay an Azure LLM inference trace: arrivals and lengths, every prompt distinct."""
    requests: list[RequestSpec] = []
    try:
        fh = open(path, encoding="utf-8", newline="")
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc}") from exc
    with fh:
        reader = csv.DictReader(fh)
        t0: float | None = None
        for row in reader:
            if num_requests is not None and len(requests) >= num_requests:
                break
            try:
                t = _azure_time(row["TIMESTAMP"])
                context = int(row["ContextTokens"])
                generated = int(row["GeneratedTokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(f"{path}:{reader.line_num}: not an Azure record ({exc})") from exc
            t0 = t if t0 is None else t0
            i = len(requests)
            requests.append(RequestSpec(i, t - t0, ((_AZURE + (seed << 32) + i, max(1, context)),),
                                        max(1, generated)))
    requests.sort(key=lambda r: (r.arrival_s, r.index))
    return Workload(f"azure:{Path(path).name}", requests, params={"trace": str(path), "num_requests": num_requests})
