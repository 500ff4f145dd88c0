"""What a judge sees and says, and what happens when it cannot say.

A judge either returns a :class:`Verdict` or raises :class:`JudgeError` (it could not decide:
no logprobs, a verifier timeout, an unparseable rating). :func:`decide` turns the error into a
verdict with the judge's ``on_error`` policy, the one place that policy applies:

- ``accept``: keep the answer (fail open: cheap, risks quality);
- ``escalate``: treat the answer as rejected, the next stage answers (fail safe: costs more);
- ``fail``: the request fails with :class:`JudgeUnavailable` (fail closed; the HTTP edge
  answers 503 ``judge_unavailable``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping, Protocol

from router.cost.pricing import Usage

OnError = Literal["accept", "escalate", "fail"]
ON_ERROR: tuple[str, ...] = ("accept", "escalate", "fail")


class JudgeError(Exception):
    """The judge could not decide; ``reason`` is a short machine-readable word, ``cost_usd``
    what it spent trying (an LLM judge's tokens are paid even when its reply is useless)."""

    def __init__(self, reason: str, detail: str = "", cost_usd: float = 0.0, usage: Usage | None = None,
                 judge_model: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.cost_usd = cost_usd
        self.usage = usage
        self.judge_model = judge_model


class JudgeUnavailable(Exception):
    """A judge failed and its policy is ``fail``: the request cannot be answered."""

    def __init__(self, judge: str, reason: str) -> None:
        super().__init__(f"judge {judge} failed ({reason}) and its policy is to fail the request")
        self.judge = judge
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Candidate:
    """One stage's answer as a judge sees it: the question (completion prompt or last user
    message), the answer text, the model, the per-token logprobs when the stage returned them,
    and the original request body (for judges that want the whole conversation)."""

    prompt: str
    answer: str
    model: str
    token_logprobs: tuple[float, ...] | None = None
    request: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """``accept`` or not, a score when the judge has one (higher = better), why, and what
    judging cost: wall time, money and tokens (an LLM judge's own call, ``judge_model``).
    ``failed``: the judge could not decide and this verdict is its ``on_error`` policy."""

    accept: bool
    score: float | None
    judge: str
    reason: str
    latency_s: float = 0.0
    cost_usd: float = 0.0
    failed: bool = False
    usage: Usage | None = None
    judge_model: str | None = None


class Judge(Protocol):
    """What the cascade needs from a judge."""

    name: str
    on_error: OnError

    @property
    def needs_logprobs(self) -> bool:
        """True when the stage must return per-token logprobs for this judge."""
        ...

    async def judge(self, candidate: Candidate) -> Verdict:
        """The verdict on ``candidate`` (or raise :class:`JudgeError`)."""
        ...


def check_on_error(value: Any, where: str = "on_error") -> OnError:
    """``value`` if it is a known policy, else ValueError naming the choices."""
    if value not in ON_ERROR:
        raise ValueError(f"{where}: must be one of {', '.join(ON_ERROR)}, got {value!r}")
    return value


def threshold_verdict(judge: str, score: float, threshold: float) -> Verdict:
    """Accept when ``score >= threshold``."""
    accept = score >= threshold
    return Verdict(accept, score, judge, "accepted" if accept else "below_threshold")


async def decide(judge: Judge, candidate: Candidate, clock=time.monotonic) -> Verdict:
    """``judge``'s verdict on ``candidate``, its failure turned into a verdict by its policy,
    with the wall time it took."""
    started = clock()
    try:
        verdict = await judge.judge(candidate)
    except JudgeError as exc:
        if judge.on_error == "fail":
            raise JudgeUnavailable(judge.name, exc.reason) from exc
        return Verdict(judge.on_error == "accept", None, judge.name, exc.reason,
                       latency_s=clock() - started, cost_usd=exc.cost_usd, failed=True, usage=exc.usage,
                       judge_model=exc.judge_model)
    return replace(verdict, latency_s=clock() - started)
