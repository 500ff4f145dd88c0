"""The summary of a run: exactly the keys other tools read from ``summary.json``.

Definitions (all over successful requests unless stated):

- ``requests``: all requests sent; ``errors``: those that failed.
- ``hit_rate`` = cached ÷ prompt tokens, as reported by the workers (``usage``).
- ``ttft_ms`` / ``e2e_ms``: ``{p50, p90, p99, mean}``; percentiles interpolate linearly between
  the two nearest ranks (numpy's default ``linear`` method).
- ``req_per_s`` / ``output_tokens_per_s``: successful requests / completion tokens divided by
  the makespan, from the first send to the last completion.
- ``per_worker``: ``{worker_id: {requests, prompt_tokens, cached_tokens}}``.
- ``imbalance`` = max ÷ mean of per-worker *uncached* prompt tokens (the prefill work each
  worker did); workers of the fleet that got nothing count as zero when the fleet is known.
  1.0 is perfect balance; 1.0 also when nobody prefilled anything.

Not in the summary (its keys are a contract other tools read): :func:`send_lag` -- over an
open-loop HTTP replay, how late each request left after its scheduled arrival (workload time);
the load generator falling behind the trace shows there (TTFT counts from the actual send).
``report.md`` prints it.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence, TypeVar

from bench.records import RequestRecord

T = TypeVar("T")

SUMMARY_KEYS = ("requests", "errors", "prompt_tokens", "cached_tokens", "hit_rate", "ttft_ms",
                "e2e_ms", "req_per_s", "output_tokens_per_s", "per_worker", "imbalance")


def rotated(items: Sequence[T], r: int) -> list[T]:
    """Round ``r``'s order of ``items`` in interleaved rounds: rotated left by ``r``, so each goes
    first in turn (no target always measured on the box as the one before left it)."""
    k = r % len(items)
    return [*items[k:], *items[:k]]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """``{p50, p90, p99, mean}`` of ``values`` (NaN for an empty list)."""
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else math.nan,
    }


def imbalance(uncached_per_worker: Iterable[float]) -> float:
    """max ÷ mean of per-worker uncached prompt tokens (1.0 for no work at all)."""
    values = list(uncached_per_worker)
    if not values or sum(values) == 0:
        return 1.0
    return max(values) / (sum(values) / len(values))


def summarize(records: Sequence[RequestRecord], fleet: Iterable[str] = ()) -> dict:
    """The ``summary.json`` of a run; ``fleet`` names workers that exist even if they got nothing."""
    ok = [r for r in records if r.ok]
    per_worker: dict[str, dict[str, int]] = {w: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
                                             for w in fleet}
    for r in ok:
        row = per_worker.setdefault(r.worker_id or "unknown",
                                    {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
        row["requests"] += 1
        row["prompt_tokens"] += r.prompt_tokens
        row["cached_tokens"] += r.cached_tokens
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    makespan = (max(r.done_s for r in ok) - min(r.sent_s for r in ok)) if ok else 0.0
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "e2e_ms": distribution([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "req_per_s": len(ok) / makespan if makespan > 0 else 0.0,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / makespan if makespan > 0 else 0.0,
        "per_worker": dict(sorted(per_worker.items())),
        "imbalance": imbalance(v["prompt_tokens"] - v["cached_tokens"] for v in per_worker.values()),
    }


def send_lag(records: Sequence[RequestRecord]) -> dict[str, float] | None:
    """``{p50, p90, p99, mean}`` of the open-loop send lag (ms), None when nothing was scheduled."""
    lags = [r.send_lag_ms for r in records if r.send_lag_ms is not None]
    return distribution(lags) if lags else None
