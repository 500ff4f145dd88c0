"""VerifierJudge: ask an HTTP verifier whether the answer is right.

Request ``POST url`` with ``{"prompt": ..., "response": ..., "model": ...}``; reply
``{"accept": true|false, "score": <number, optional>}``. With a ``threshold`` the score decides
(``score >= threshold``, a reply without a score is an error); without one, ``accept`` does.
A timeout, a refused connection, a non-2xx status or a malformed reply is a JudgeError: the
judge's ``on_error`` decides (accept / escalate / fail, see ``verdict``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from router.virtual_models.judges.verdict import Candidate, JudgeError, OnError, Verdict, threshold_verdict
from router.virtual_models.scoring_http import ScoringEndpoint, ScoringError, finite_score


@dataclass(slots=True)
class VerifierJudge:
    """An HTTP verifier (module docstring)."""

    endpoint: ScoringEndpoint
    threshold: float | None = None
    on_error: OnError = "escalate"
    name: str = "verifier"
    include_messages: bool = field(default=False)

    @property
    def needs_logprobs(self) -> bool:
        return False

    async def judge(self, candidate: Candidate) -> Verdict:
        payload: dict = {"prompt": candidate.prompt, "response": candidate.answer, "model": candidate.model}
        if self.include_messages and candidate.request is not None and "messages" in candidate.request:
            payload["messages"] = candidate.request["messages"]
        try:
            reply = await self.endpoint.post(payload)
            score = finite_score(reply, required=self.threshold is not None)
            if self.threshold is not None:
                return threshold_verdict(self.name, score, self.threshold)
            accept = reply.get("accept")
            if not isinstance(accept, bool):
                raise ScoringError("invalid_reply", f"'accept' must be true or false, got {accept!r}")
        except ScoringError as exc:
            raise JudgeError(exc.reason, str(exc)) from None
        return Verdict(accept, score, self.name, "accepted" if accept else "rejected")
