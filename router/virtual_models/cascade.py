"""CascadeRunner: small model first, a judge on its answer, the next model when it rejects.

For each reachable stage (``max_escalations`` + 1 of them, fewer if the request lowers the
cap) the runner sends the client's *original* request to the stage's model through ``send``
(in the router: the cache-aware proxy, so the stage model's pool routes it like any request
and a shared system prompt stays warm there), non-streaming, with logprobs when the stage's
judge needs them. The judge decides (its failures by its ``on_error`` policy); a rejected
answer is dropped — the result never references its body, so no byte of it can reach the
client — and the next stage is asked. The last reachable stage answers unjudged.

A stage that fails upstream (``StageError`` retryable: 5xx, timeout, no worker) is skipped
like a rejection while a later stage remains; a client error (4xx) ends the cascade at once,
since every stage would repeat it. Costs: each stage's usage priced with the price book
(cached tokens at the stage model's price, so a cold escalation shows), plus the judges' own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from router.cost.price_book import PriceBook
from router.cost.pricing import Usage, price_usage
from router.virtual_models.answer import (Send, StageAnswer, StageError, answer_text, client_wants_logprobs,
                                          question_text, stage_request, strip_logprobs, token_logprobs)
from router.virtual_models.config import CascadeModel
from router.virtual_models.judges.build import JudgeRuntime, build_judge
from router.virtual_models.judges.verdict import Candidate, Judge, JudgeUnavailable, Verdict, decide

OUTCOMES = ("accepted", "escalated", "final", "stage_error", "judge_unavailable")


class CascadeRequestError(ValueError):
    """The request cannot go through a cascade (the HTTP edge answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class StageRecord:
    """What one stage did. ``outcome``: accepted | escalated | final | stage_error |
    judge_unavailable; ``verdict`` is None for the final stage and failed stages. No answer
    text is kept."""

    model: str
    outcome: str
    latency_s: float
    verdict: Verdict | None = None
    usage: Usage | None = None
    cost_usd: float | None = None
    no_cache_usd: float | None = None
    worker_id: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The stage in the usage extension."""
        out: dict[str, Any] = {"model": self.model, "outcome": self.outcome, "latency_s": round(self.latency_s, 6)}
        if self.worker_id is not None:
            out["worker"] = self.worker_id
        if self.usage is not None:
            out.update(prompt_tokens=self.usage.prompt_tokens, cached_tokens=self.usage.cached_tokens,
                       completion_tokens=self.usage.completion_tokens)
        if self.cost_usd is not None:
            out["cost_usd"] = round(self.cost_usd, 9)
        if self.verdict is not None:
            v = self.verdict
            out["judge"] = {"name": v.judge, "accept": v.accept, "score": v.score, "reason": v.reason,
                            "failed": v.failed, "latency_s": round(v.latency_s, 6), "cost_usd": round(v.cost_usd, 9)}
        if self.error is not None:
            out["error"] = self.error
        return out


class CascadeFailed(Exception):
    """No stage could answer. ``status``/``code`` for the HTTP edge, ``stages`` for metrics,
    ``body`` the upstream's OpenAI error when a stage refused the request as a client error."""

    def __init__(self, message: str, status: int, code: str, stages: list[StageRecord],
                 body: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.stages = stages
        self.body = body


@dataclass(slots=True)
class CascadeResult:
    """The accepted answer (``body``, as the client gets it) and every stage's record."""

    cascade: str
    body: dict[str, Any]
    answered_by: str
    stages: list[StageRecord] = field(default_factory=list)

    @property
    def escalations(self) -> int:
        """Stages asked after the first."""
        return len(self.stages) - 1

    @property
    def judge_cost_usd(self) -> float:
        return sum(s.verdict.cost_usd for s in self.stages if s.verdict is not None)

    @property
    def cost_usd(self) -> float | None:
        """Stages plus judges; None when a stage that ran is not in the price book."""
        if any(s.usage is not None and s.cost_usd is None for s in self.stages):
            return None
        return sum(s.cost_usd or 0.0 for s in self.stages) + self.judge_cost_usd

    def extension(self) -> dict[str, Any]:
        """``usage.prefixlb``: which stages ran, which answered, the judges, the cost."""
        cost = self.cost_usd
        return {"virtual_model": self.cascade, "answered_by": self.answered_by, "escalations": self.escalations,
                "cost_usd": None if cost is None else round(cost, 9), "stages": [s.as_dict() for s in self.stages]}

    def headers(self) -> dict[str, str]:
        """Response headers: stages and outcomes, the answering model, the last judge score, the cost."""
        out = {"X-Prefixlb-Cascade": ",".join(f"{s.model}:{s.outcome}" for s in self.stages),
               "X-Prefixlb-Answered-By": self.answered_by}
        scores = [s.verdict.score for s in self.stages if s.verdict is not None and s.verdict.score is not None]
        if scores:
            out["X-Prefixlb-Judge-Score"] = f"{scores[-1]:.6g}"
        cost = self.cost_usd
        if cost is not None:
            out["X-Prefixlb-Cost-USD"] = f"{cost:.9f}"
        return out


def check_cascade_request(body: Mapping[str, Any], chat: bool) -> None:
    """Refuse what a cascade cannot judge: several choices, several prompts."""
    n = body.get("n", 1)
    if n not in (None, 1):
        raise CascadeRequestError("a cascade judges one answer: 'n' must be 1", "n")
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        raise CascadeRequestError("a cascade takes one prompt, not a batch", "prompt")


class CascadeRunner:
    """One cascade virtual model with its built judges, its ``send`` and price book."""

    def __init__(self, model: CascadeModel, judges: Sequence[Judge | None], send: Send,
                 price_book: PriceBook | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if len(judges) != len(model.stages):
            raise ValueError("one judge (or None) per stage")
        self.model = model
        self.judges = list(judges)
        self.send = send
        self.price_book = price_book
        self.clock = clock

    @classmethod
    def build(cls, model: CascadeModel, send: Send, runtime: JudgeRuntime | None = None,
              price_book: PriceBook | None = None) -> "CascadeRunner":
        """A runner with each stage's judge built from its spec."""
        rt = runtime or JudgeRuntime(send=send, price_book=price_book)
        return cls(model, [None if s.judge is None else build_judge(s.judge, rt) for s in model.stages], send,
                   price_book)

    def _record(self, model: str, answer: StageAnswer, latency: float) -> StageRecord:
        usage = answer.usage
        price = self.price_book.get(model) if self.price_book is not None else None
        priced = price_usage(usage, price) if price is not None else None
        return StageRecord(model, "final", latency, usage=usage,
                           cost_usd=None if priced is None else priced.total_usd,
                           no_cache_usd=None if priced is None else priced.no_cache_usd, worker_id=answer.worker_id)

    async def run(self, body: Mapping[str, Any], chat: bool, max_escalations: int | None = None) -> CascadeResult:
        """Answer ``body`` (raises CascadeRequestError, CascadeFailed)."""
        check_cascade_request(body, chat)
        cap = self.model.max_escalations if max_escalations is None else min(max_escalations, self.model.max_escalations)
        reachable = list(zip(self.model.stages, self.judges))[:max(0, cap) + 1]
        wants_logprobs = client_wants_logprobs(body, chat)
        question = question_text(body, chat)
        records: list[StageRecord] = []
        for i, (stage, judge) in enumerate(reachable):
            final = i == len(reachable) - 1
            judge = None if final else judge
            request = stage_request(body, stage.model, chat, judge is not None and judge.needs_logprobs)
            started = self.clock()
            try:
                answer = await self.send(stage.model, request)
            except StageError as exc:
                records.append(StageRecord(stage.model, "stage_error", self.clock() - started, error=str(exc)))
                if exc.retryable and not final:
                    continue
                raise CascadeFailed(str(exc), exc.status, "stage_failed" if exc.retryable else "invalid_request",
                                    records, exc.body) from exc
            record = self._record(stage.model, answer, self.clock() - started)
            records.append(record)
            if judge is not None:
                candidate = Candidate(question, answer_text(answer.body), stage.model, token_logprobs(answer.body), body)
                try:
                    record.verdict = await decide(judge, candidate, self.clock)
                except JudgeUnavailable as exc:
                    record.outcome = "judge_unavailable"
                    raise CascadeFailed(str(exc), 503, "judge_unavailable", records) from exc
                if not record.verdict.accept:
                    record.outcome = "escalated"
                    continue  # the rejected answer is not kept anywhere
                record.outcome = "accepted"
            out = answer.body
            if not wants_logprobs:
                strip_logprobs(out)
            result = CascadeResult(self.model.name, out, stage.model, records)
            usage = out.get("usage")
            if isinstance(usage, dict):
                usage["prefixlb"] = result.extension()
            return result
        raise CascadeFailed("no stage answered", 502, "stage_failed", records)  # unreachable: the last raises
