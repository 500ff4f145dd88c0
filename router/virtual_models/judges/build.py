"""build_judge: a validated JudgeSpec plus the runtime it needs (send, session, price book)
becomes a judge. Pure kinds need nothing; ``verifier`` uses the session, ``llm`` the send."""
from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from router.cost.price_book import PriceBook
from router.virtual_models.answer import Send
from router.virtual_models.config import JudgeSpec
from router.virtual_models.judges.format import AllOf, JsonSchemaJudge, RegexJudge
from router.virtual_models.judges.llm_judge import LLMJudge
from router.virtual_models.judges.logprob import LogprobJudge
from router.virtual_models.judges.verdict import Judge
from router.virtual_models.judges.verifier import VerifierJudge
from router.virtual_models.scoring_http import ScoringEndpoint


@dataclass(slots=True)
class JudgeRuntime:
    """What I/O judges are built with: the router's ``send`` (LLM judge), its HTTP session
    (verifier; None: each verifier makes its own) and the price book (the LLM judge's cost)."""

    send: Send | None = None
    session: aiohttp.ClientSession | None = None
    price_book: PriceBook | None = None


def build_judge(spec: JudgeSpec, runtime: JudgeRuntime | None = None) -> Judge:
    """The judge ``spec`` describes (ValueError when an LLM judge has no ``send``)."""
    rt = runtime or JudgeRuntime()
    o = dict(spec.options)
    common = {"on_error": spec.on_error, "name": spec.name or spec.kind}
    if spec.kind == "logprob":
        return LogprobJudge(o["threshold"], o["quantile"], **common)
    if spec.kind == "regex":
        return RegexJudge(**o, **common)
    if spec.kind == "json_schema":
        return JsonSchemaJudge(**o, **common)
    if spec.kind == "verifier":
        endpoint = ScoringEndpoint(o["url"], o["timeout_s"], o.get("headers"), session=rt.session)
        return VerifierJudge(endpoint, o.get("threshold"), include_messages=o.get("include_messages", False),
                             **common)
    if spec.kind == "llm":
        if rt.send is None:
            raise ValueError(f"judge {common['name']}: an LLM judge needs the router's send function")
        return LLMJudge(o["model"], o["rubric"], rt.send, o["threshold"], o["scale"], o["max_tokens"],
                        rt.price_book, **common)
    if spec.kind == "all_of":
        return AllOf([build_judge(m, rt) for m in spec.members], **common)
    raise ValueError(f"unknown judge kind {spec.kind!r}")
