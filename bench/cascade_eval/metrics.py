"""Accuracy vs share of strong calls, and RouteLLM's metrics on it (pure).

A policy decides per question whether the strong model answers (a cascade: when the judge
rejects the weak answer). Its point is ``(strong_share, accuracy)``. A judge with a score
gives a curve: escalate every question whose weak answer scores below ``t``, for every ``t``
(every distinct score, plus +inf = always escalate), so the curve runs from always-weak
(share 0) to always-strong (share 1).

RouteLLM's definitions (``routellm/evals/evaluate.py``), shares and accuracies as fractions:

- **AUC**: the trapezoidal area under accuracy over strong share, points sorted by share.
- **APGR** (average performance gap recovered): ``(AUC − weak·Δ) / ((strong − weak)·Δ)`` with
  ``Δ`` the share range the curve spans (1 here), i.e. the mean over the share axis of
  ``PGR = (accuracy − weak) / (strong − weak)``. Random routing scores 0.5.
- **CPT(x)** (call-performance threshold): the strong share at which the curve reaches
  ``weak + x·(strong − weak)``, by linear interpolation. RouteLLM calls ``np.interp`` with the
  accuracies as x-coordinates, which numpy defines only for increasing accuracies; on such a
  curve that is exactly the first crossing, which is what :func:`cpt` returns for any curve.

RouteLLM places its points at ten score quantiles; here every distinct score is a point (the
exact curve of the judge; with few distinct scores, as a format check has, the two agree).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One threshold's outcome: escalate scores below ``threshold``."""

    threshold: float
    strong_share: float
    accuracy: float


def pgr(accuracy: float, weak: float, strong: float) -> float:
    """Performance gap recovered: 0 at the weak model's accuracy, 1 at the strong one's."""
    return (accuracy - weak) / (strong - weak) if strong != weak else 0.0


def point(escalate: Sequence[bool], weak_correct: Sequence[bool], strong_correct: Sequence[bool],
          threshold: float = math.nan) -> CurvePoint:
    """The outcome of escalating exactly the questions flagged in ``escalate``."""
    n = len(escalate)
    if not n or len(weak_correct) != n or len(strong_correct) != n:
        raise ValueError("escalate, weak_correct and strong_correct must be equally long and non-empty")
    correct = sum(s if e else w for e, w, s in zip(escalate, weak_correct, strong_correct))
    return CurvePoint(threshold, sum(escalate) / n, correct / n)


def cascade_curve(scores: Sequence[float], weak_correct: Sequence[bool],
                  strong_correct: Sequence[bool]) -> list[CurvePoint]:
    """Every threshold's point, sorted by strong share (escalate when ``score < threshold``)."""
    thresholds = sorted(set(scores)) + [math.inf]
    points = [point([s < t for s in scores], weak_correct, strong_correct, t) for t in thresholds]
    return sorted(points, key=lambda p: (p.strong_share, p.accuracy))


def auc(points: Sequence[CurvePoint]) -> float:
    """Trapezoidal area under accuracy over strong share."""
    pts = sorted(points, key=lambda p: p.strong_share)
    return sum((b.strong_share - a.strong_share) * (a.accuracy + b.accuracy) / 2 for a, b in zip(pts, pts[1:]))


def apgr(points: Sequence[CurvePoint], weak: float, strong: float) -> float:
    """RouteLLM's APGR of a curve."""
    span = max(p.strong_share for p in points) - min(p.strong_share for p in points)
    if span == 0 or strong == weak:
        return 0.0
    return (auc(points) - weak * span) / ((strong - weak) * span)


def cpt(points: Sequence[CurvePoint], weak: float, strong: float, x: float) -> float | None:
    """The strong share at which the curve first reaches ``weak + x·(strong − weak)`` (None: never)."""
    target = weak + x * (strong - weak)
    pts = sorted(points, key=lambda p: (p.strong_share, p.accuracy))
    if pts[0].accuracy >= target:
        return pts[0].strong_share
    for a, b in zip(pts, pts[1:]):
        if b.accuracy >= target > a.accuracy:
            return a.strong_share + (b.strong_share - a.strong_share) * (target - a.accuracy) / (b.accuracy - a.accuracy)
    return None


def random_accuracy(share: float, weak: float, strong: float) -> float:
    """Expected accuracy of routing a random ``share`` of questions to the strong model."""
    return weak + share * (strong - weak)


def best_gain_over_random(points: Sequence[CurvePoint], weak: float, strong: float) -> CurvePoint:
    """The point where the policy beats random routing at the same share by the most:
    ``max PGR − share`` (ties: the smaller share). Used to choose a threshold on the tuning half."""
    return max(points, key=lambda p: (round(pgr(p.accuracy, weak, strong) - p.strong_share, 12), -p.strong_share))
