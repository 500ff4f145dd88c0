"""The route classifier over HTTP, and the whole ``route`` resolution with it.

``POST url`` with ``{"prompt": <the question>, "model": <the virtual model>}``; reply
``{"score": <finite number>}``. Any failure (deadline, connection, status, malformed reply)
sends the request to the classifier's ``on_error`` side; a route never fails a request
because its classifier did.
"""
from __future__ import annotations

from typing import Any, Mapping

import aiohttp

from router.virtual_models.answer import question_text
from router.virtual_models.config import ClassifierSpec, RouteModel
from router.virtual_models.route import (RouteDecision, decide_by_score, decide_on_classifier_error,
                                         match_rules, request_features)
from router.virtual_models.scoring_http import ScoringEndpoint, ScoringError, finite_score


class RouteClassifier:
    """One route's classifier endpoint."""

    def __init__(self, spec: ClassifierSpec, session: aiohttp.ClientSession | None = None) -> None:
        self.spec = spec
        self.endpoint = ScoringEndpoint(spec.url, spec.timeout_s, session=session)

    async def score(self, prompt: str, model: str) -> float:
        """The classifier's score (ScoringError / ScoringTimeout on failure)."""
        reply = await self.endpoint.post({"prompt": prompt, "model": model})
        score = finite_score(reply, required=True)
        assert score is not None
        return score

    async def close(self) -> None:
        await self.endpoint.close()


async def resolve_route(route: RouteModel, body: Mapping[str, Any], chat: bool,
                        headers: Mapping[str, str] | None = None,
                        classifier: RouteClassifier | None = None) -> RouteDecision:
    """The real model for this request: rules, then the classifier, then the default."""
    features = request_features(body, chat, headers)
    decision = match_rules(route, features)
    if decision is not None:
        return decision
    if route.classifier is None:
        return RouteDecision(route.default, "default")
    if classifier is None:
        raise ValueError(f"route {route.name} has a classifier: pass its RouteClassifier")
    try:
        score = await classifier.score(question_text(body, chat), route.name)
    except ScoringError as exc:
        return decide_on_classifier_error(route, exc.reason)
    return decide_by_score(route, score)
