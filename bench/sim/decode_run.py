"""Closed-form time of a run of decode-only steps (the fleet simulator's fast path).

While nothing but time changes a replica's batch (``b`` sequences decoding, none finishing or
needing a new block, no admission possible), step ``i`` of the run has the same shape as step 0
with ``b·i`` more context tokens. The latency model's roofline makes its duration

    t_i = overhead + max(c0 + c1·i, m0 + m1·i)

(compute and memory time, each affine in ``i``), so the sum over ``k`` steps is two arithmetic
series split where the lines cross — O(1) instead of ``k`` calls to ``step_time``.
"""
from __future__ import annotations

import math


def _affine_sum(a: float, b: float, i0: int, i1: int) -> float:
    """Sum of ``a + b·i`` for ``i0 <= i < i1``."""
    return (i1 - i0) * a + b * (i0 + i1 - 1) * (i1 - i0) / 2.0 if i1 > i0 else 0.0


def decode_run_time(overhead: float, c0: float, c1: float, m0: float, m1: float, k: int) -> float:
    """Seconds of ``k`` steps whose step ``i`` takes ``overhead + max(c0 + c1·i, m0 + m1·i)``."""
    total = overhead * k
    d0, d1 = c0 - m0, c1 - m1  # step i is compute-bound exactly when d0 + d1·i >= 0
    if d1 == 0.0:
        return total + (_affine_sum(c0, c1, 0, k) if d0 >= 0 else _affine_sum(m0, m1, 0, k))
    if d1 > 0:  # memory-bound first, compute-bound from ``cross`` on
        cross = min(k, max(0, math.ceil(-d0 / d1)))
        return total + _affine_sum(m0, m1, 0, cross) + _affine_sum(c0, c1, cross, k)
    cross = min(k, max(0, math.floor(d0 / -d1) + 1)) if d0 >= 0 else 0  # compute-bound first
    return total + _affine_sum(c0, c1, 0, cross) + _affine_sum(m0, m1, cross, k)


def decode_steps_done_by(elapsed: float, overhead: float, c0: float, c1: float, m0: float, m1: float,
                         k: int) -> int:
    """How many of the ``k`` steps have ended ``elapsed`` seconds after the run started."""
    lo, hi = 0, k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_run_time(overhead, c0, c1, m0, m1, mid) <= elapsed:
            lo = mid
        else:
            hi = mid - 1
    return lo
