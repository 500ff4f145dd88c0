"""LogprobJudge: accept when the answer's least confident tokens are confident enough.

The score is a low quantile (default the 10th percentile) of the per-token probabilities
``exp(logprob)``, not their sum or product. The sum of logprobs is the log-probability of the
whole sequence: it falls with every token, so a long correct answer scores below a short wrong
one and a threshold on it is a threshold on length. The mean logprob removes the length but is
dominated by the many near-certain tokens (punctuation, copied names, formulaic phrasing) and
barely moves when the one token that decides the answer — a digit, a name — was a coin flip.
A low quantile looks at the uncertain tail, and as a *fraction* of the tokens it stays
comparable between short and long answers; the minimum (quantile 0) is the extreme, one odd
token in a long answer sinks it.

Caveat (the source texts' 5.6.12): models are confidently wrong, so this judge is only as
good as the model's calibration; pair it with a format check or a verifier.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from router.virtual_models.judges.verdict import Candidate, JudgeError, OnError, Verdict, threshold_verdict


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) with linear interpolation between closest ranks (numpy's
    default ``linear`` method)."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class LogprobJudge:
    """Accept when the ``q``-quantile of the answer's token probabilities is >= ``threshold``."""

    threshold: float
    q: float = 0.1
    on_error: OnError = "escalate"
    name: str = "logprob"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold: a probability in [0, 1], got {self.threshold!r}")
        if not 0.0 <= self.q <= 1.0:
            raise ValueError(f"quantile: in [0, 1], got {self.q!r}")

    @property
    def needs_logprobs(self) -> bool:
        return True

    def score(self, token_logprobs: Sequence[float]) -> float:
        """The ``q``-quantile of ``exp(logprob)`` over the tokens."""
        return quantile([math.exp(min(0.0, lp)) for lp in token_logprobs], self.q)

    async def judge(self, candidate: Candidate) -> Verdict:
        """Raises JudgeError ``no_logprobs`` when the stage returned none (or no tokens)."""
        if not candidate.token_logprobs:
            raise JudgeError("no_logprobs", f"{candidate.model} returned no token logprobs")
        return threshold_verdict(self.name, self.score(candidate.token_logprobs), self.threshold)
