"""Closed forms for a run of decode-only steps (the fleet simulator's fast path).

While nothing but time changes a replica's batch (``b`` sequences decoding, none finishing or
needing a new block, no admission possible), step ``i`` of the run has the same shape as step 0
with ``b·i`` more context tokens. The latency model's roofline makes its duration

    t_i = overhead + max(c0 + c1·i, m0 + m1·i)

(compute and memory time, each affine in ``i``): on each side of the index where the two lines
cross, ``t_i`` is one affine function of ``i``. So, in O(1) instead of ``k`` steps:

- the run's duration is two arithmetic series (:func:`decode_run_time`);
- the replica's measured decode step time, an exponential moving average that the engine
  updates after every step (``worker.engine.stats.SpeedMeter``), follows a linear recurrence on each
  piece, ``e' = (1 - α)·e + α·(A + B·i)``, whose exact solution is
  ``e_i = A + B·(i - 1/α) + (1 - α)^i·(e_0 - A + B/α)`` (:func:`observe_decode_run`; equal to
  folding the steps one by one up to float rounding, and done step by step whenever the meter's
  outlier clipping could act).
"""
from __future__ import annotations

import math

from worker.engine.stats import SpeedMeter


def _pieces(c0: float, c1: float, m0: float, m1: float, k: int) -> tuple[tuple[float, float, int, int], ...]:
    """``(a, b, i0, i1)``: on ``i0 <= i < i1`` step ``i``'s roofline term ``max(..)`` is ``a + b·i``."""
    d0, d1 = c0 - m0, c1 - m1  # step i is compute-bound exactly when d0 + d1·i >= 0
    if d1 == 0.0:
        return ((c0, c1, 0, k),) if d0 >= 0 else ((m0, m1, 0, k),)
    if d1 > 0:  # memory-bound first, compute-bound from ``cross`` on
        cross = min(k, max(0, math.ceil(-d0 / d1)))
        return (m0, m1, 0, cross), (c0, c1, cross, k)
    cross = min(k, max(0, math.floor(d0 / -d1) + 1)) if d0 >= 0 else 0  # compute-bound first
    return (c0, c1, 0, cross), (m0, m1, cross, k)


def decode_run_time(overhead: float, c0: float, c1: float, m0: float, m1: float, k: int) -> float:
    """Seconds of ``k`` steps whose step ``i`` takes ``overhead + max(c0 + c1·i, m0 + m1·i)``."""
    # :func:`_pieces` written out (this runs several times per simulated request); each piece is
    # the arithmetic series sum over its i0 <= i < i1 of a + b·i.
    total = overhead * k
    d0, d1 = c0 - m0, c1 - m1
    if d1 == 0.0:
        a, b = (c0, c1) if d0 >= 0 else (m0, m1)
        return total + (k * a + b * (k - 1) * k / 2.0 if k > 0 else 0.0)
    if d1 > 0:
        cross = min(k, max(0, math.ceil(-d0 / d1)))
        a0, b0, a1, b1 = m0, m1, c0, c1
    else:
        cross = min(k, max(0, math.floor(d0 / -d1) + 1)) if d0 >= 0 else 0
        a0, b0, a1, b1 = c0, c1, m0, m1
    first = cross * a0 + b0 * (cross - 1) * cross / 2.0 if cross > 0 else 0.0
    second = (k - cross) * a1 + b1 * (cross + k - 1) * (k - cross) / 2.0 if k > cross else 0.0
    return total + first + second


def decode_steps_done_by(elapsed: float, overhead: float, c0: float, c1: float, m0: float, m1: float,
                         k: int) -> int:
    """How many of the ``k`` steps have ended ``elapsed`` seconds after the run started."""
    return _steps_done_by(elapsed, overhead, c0, c1, m0, m1, k)[0]


def decode_run_cut(elapsed: float, overhead: float, c0: float, c1: float, m0: float, m1: float,
                   k: int) -> tuple[int, float] | None:
    """The run cut after its step in progress ``elapsed`` seconds in: ``(m, seconds)``, its first
    ``m = decode_steps_done_by(...) + 1`` steps and their :func:`decode_run_time`; None when that
    is all ``k`` of them (nothing to cut)."""
    done, seconds = _steps_done_by(elapsed, overhead, c0, c1, m0, m1, k)
    m = done + 1
    if m >= k:
        return None
    if seconds is None:
        seconds = decode_run_time(overhead, c0, c1, m0, m1, m)
    return m, seconds


def _steps_done_by(elapsed: float, overhead: float, c0: float, c1: float, m0: float, m1: float,
                   k: int) -> tuple[int, float | None]:
    """``(done, seconds)``: :func:`decode_steps_done_by`, and the :func:`decode_run_time` of
    ``done + 1`` steps where the search computed it (None where not)."""
    # Steps never get shorter (c1, m1 >= 0), so at most elapsed / (first step) of them fit: start
    # from that bound, which the run's slow growth makes nearly exact, and step down.
    first = overhead + max(c0, m0)
    if c1 >= 0 and m1 >= 0 and first > 0:
        guess = min(k, int(elapsed / first) + 1)
        above: float | None = None  # the run time of guess + 1 steps, once computed
        for _ in range(3):
            if guess <= 0:
                return max(guess, 0), above if guess == 0 else None
            seconds = decode_run_time(overhead, c0, c1, m0, m1, guess)
            if seconds <= elapsed:
                return guess, above
            above = seconds
            guess -= 1
    lo, hi = 0, k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_run_time(overhead, c0, c1, m0, m1, mid) <= elapsed:
            lo = mid
        else:
            hi = mid - 1
    return lo, None


def observe_decode_run(speed: SpeedMeter, overhead: float, c0: float, c1: float, m0: float, m1: float, k: int,
                       batch: int) -> None:
    """Fold the run's ``k`` steps into ``speed`` as ``k`` calls of ``speed.observe(t_i, 0, batch)`` would."""
    if k <= 0:
        return
    # max() and min() written out (b if b > a else a is max(a, b), a if b < a... min): a call each
    # of the millions of runs a simulation folds.
    first = overhead + (m0 if m0 > c0 else c0)
    c_last, m_last = c0 + c1 * (k - 1), m0 + m1 * (k - 1)
    last = overhead + (m_last if m_last > c_last else c_last)
    est = speed.decode_step_s if speed.decode_measured else first
    # The estimate stays between its start and the samples, which grow with i (c1, m1 >= 0): if
    # no sample is max_jump off any such value, the meter's clipping never acts. (The margin
    # keeps rounding from deciding.)
    jump = speed.max_jump * (1.0 - 1e-9)
    if batch <= 0 or c1 < 0 or m1 < 0 or first <= 0 or (last if last > est else est) > jump * first or \
            last > jump * (first if first < est else est):
        for i in range(k):
            speed.observe(overhead + max(c0 + c1 * i, m0 + m1 * i), 0, batch)
        return
    alpha = speed.alpha
    keep = 1.0 - alpha
    start = 0 if speed.decode_measured else 1  # an unmeasured meter takes its first sample as is
    for a, b, i0, i1 in _pieces(c0, c1, m0, m1, k):
        if start > i0:
            i0 = start
        if i1 <= i0:
            continue
        base = overhead + a
        est = base + b * (i1 - 1.0 / alpha) + keep ** (i1 - i0) * (est - base - b * (i0 - 1.0 / alpha))
    speed.decode_step_s = est
    speed.decode_measured = True
