"""LLMJudge: a model of the fleet rates the answer against a rubric; its cost counts.

The judge model gets the rubric as the system message and the question and answer as the
user message, and must reply with a number from 0 to ``scale``; ``score = number / scale``
is accepted at ``>= threshold``. It is asked through the same ``send`` the cascade uses (the
router's cache-aware proxy), so a long rubric stays cached on the judge model's workers, and
its tokens are priced with the price book and added to the request's cost — also when its
reply is useless (no number, out of range), which is a JudgeError (``unparseable_rating``)
for the ``on_error`` policy, as is a failed call (``judge_model_error``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from router.cost.price_book import PriceBook
from router.cost.pricing import Usage, price_usage
from router.virtual_models.answer import Send, StageError, answer_text
from router.virtual_models.judges.verdict import Candidate, JudgeError, OnError, Verdict, threshold_verdict

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
PROMPT = "Question:\n{question}\n\nAnswer:\n{answer}\n\nRate the answer from 0 to {scale}. Reply with the number only."


@dataclass(slots=True)
class LLMJudge:
    """A rubric-driven rating by ``model`` (module docstring)."""

    model: str
    rubric: str
    send: Send
    threshold: float = 0.7
    scale: int = 10
    max_tokens: int = 8
    price_book: PriceBook | None = None
    on_error: OnError = "escalate"
    name: str = "llm"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold: in [0, 1] (a fraction of the scale), got {self.threshold!r}")
        if self.scale < 1:
            raise ValueError("scale: must be >= 1")

    @property
    def needs_logprobs(self) -> bool:
        return False

    def request(self, candidate: Candidate) -> dict:
        """The chat request the judge model gets."""
        return {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens, "messages": [
            {"role": "system", "content": self.rubric},
            {"role": "user", "content": PROMPT.format(question=candidate.prompt, answer=candidate.answer,
                                                      scale=self.scale)}]}

    def _cost(self, usage: Usage) -> float:
        price = self.price_book.get(self.model) if self.price_book is not None else None
        return price_usage(usage, price).total_usd if price is not None else 0.0

    def rating(self, reply: str) -> float | None:
        """The reply's first number as a fraction of the scale, or None when there is none in range."""
        m = _NUMBER.search(reply)
        if m is None:
            return None
        value = float(m.group())
        return value / self.scale if 0.0 <= value <= self.scale else None

    async def judge(self, candidate: Candidate) -> Verdict:
        try:
            answer = await self.send(self.model, self.request(candidate))
        except StageError as exc:
            raise JudgeError("judge_model_error", str(exc), judge_model=self.model) from None
        usage = answer.usage
        cost = self._cost(usage)
        score = self.rating(answer_text(answer.body))
        if score is None:
            raise JudgeError("unparseable_rating", f"{self.model} replied {answer_text(answer.body)[:80]!r}",
                             cost_usd=cost, usage=usage, judge_model=self.model)
        verdict = threshold_verdict(self.name, score, self.threshold)
        return Verdict(verdict.accept, score, self.name, verdict.reason, cost_usd=cost, usage=usage,
                       judge_model=self.model)
