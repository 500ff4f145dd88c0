"""Resolving a ``route`` virtual model: which real model answers this request (pure).

Rules are tried in order and the first whose every condition holds names the model; when no
rule matches, the classifier's score decides (``score >= threshold`` -> ``above``), and
without a classifier the route's ``default`` answers. The classifier call itself is I/O and
lives in :mod:`router.virtual_models.classifier`; this module only says whether it is needed
and what its score (or failure) means.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from router.virtual_models.answer import all_text
from router.virtual_models.config import RouteModel, RouteRule


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the rules look at: the characters and text of every message (or the prompt),
    whether tools are given, and the request headers (lower-cased names)."""

    prompt_chars: int
    text: str
    has_tools: bool
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The real model and why: ``rule:<i>``, ``classifier:above|below``,
    ``classifier_error:<reason>``, or ``default``; ``score`` is the classifier's."""

    model: str
    reason: str
    score: float | None = None


def request_features(body: Mapping[str, Any], chat: bool, headers: Mapping[str, str] | None = None) -> RequestFeatures:
    """The features of a validated OpenAI request body."""
    text = all_text(body, chat)
    return RequestFeatures(len(text), text, bool(body.get("tools")),
                           {k.lower(): v for k, v in (headers or {}).items()})


def rule_matches(rule: RouteRule, f: RequestFeatures) -> bool:
    """True when every condition ``rule`` gives holds for ``f``."""
    if rule.min_prompt_chars is not None and f.prompt_chars < rule.min_prompt_chars:
        return False
    if rule.max_prompt_chars is not None and f.prompt_chars > rule.max_prompt_chars:
        return False
    if rule.keywords:
        lowered = f.text.lower()
        if not any(k in lowered for k in rule.keywords):
            return False
    if rule.regex is not None and rule.regex.search(f.text) is None:
        return False
    if rule.tools is not None and rule.tools != f.has_tools:
        return False
    if rule.header is not None:
        value = f.headers.get(rule.header.name)
        if value is None:
            return False
        if rule.header.equals is not None and value != rule.header.equals:
            return False
        if rule.header.matches is not None and rule.header.matches.search(value) is None:
            return False
    return True


def match_rules(route: RouteModel, f: RequestFeatures) -> RouteDecision | None:
    """The first matching rule's decision, or None."""
    for i, rule in enumerate(route.rules):
        if rule_matches(rule, f):
            return RouteDecision(rule.model, f"rule:{i}")
    return None


def decide_by_score(route: RouteModel, score: float) -> RouteDecision:
    """What the classifier's ``score`` means for ``route`` (which must have a classifier)."""
    c = route.classifier
    assert c is not None
    if score >= c.threshold:
        return RouteDecision(c.above, "classifier:above", score)
    return RouteDecision(c.below, "classifier:below", score)


def decide_on_classifier_error(route: RouteModel, reason: str) -> RouteDecision:
    """The model that answers when the classifier failed (its ``on_error`` side)."""
    c = route.classifier
    assert c is not None
    return RouteDecision(c.above if c.on_error == "above" else c.below, f"classifier_error:{reason}")

