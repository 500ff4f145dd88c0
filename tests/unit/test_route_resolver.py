"""The route resolver: rules in order, every condition of a rule, then classifier or default."""
from __future__ import annotations

import pytest

from router.virtual_models.config import parse_virtual_models
from router.virtual_models.route import (RouteDecision, decide_by_score, decide_on_classifier_error, match_rules,
                                         request_features)

ROUTE = parse_virtual_models({"auto": {"route": {
    "default": "small",
    "rules": [
        {"model": "long", "when": {"min_prompt_chars": 100}},
        {"model": "prover", "when": {"keywords": ["prove", "theorem"], "tools": False}},
        {"model": "tooled", "when": {"tools": True}},
        {"model": "steps", "when": {"regex": r"(?i)\bstep by step\b", "max_prompt_chars": 50}},
        {"model": "premium", "when": {"header": {"name": "X-Tier", "equals": "gold"}}},
        {"model": "beta", "when": {"header": {"name": "x-beta", "present": True}}},
        {"model": "eu", "when": {"header": {"name": "x-region", "matches": "^eu-"}}},
    ],
    "classifier": {"url": "http://c/score", "threshold": 0.6, "above": "large", "on_error": "above"},
}}})["auto"]


def _chat(text, tools=None, system=None):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    body = {"model": "auto", "messages": messages}
    if tools:
        body["tools"] = tools
    return body


TOOL = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]


@pytest.mark.parametrize("body, headers, expected", [
    (_chat("x" * 100), {}, RouteDecision("long", "rule:0")),
    # The system prompt counts towards the length.
    (_chat("short", system="s" * 95), {}, RouteDecision("long", "rule:0")),
    (_chat("Please PROVE it"), {}, RouteDecision("prover", "rule:1")),
    # Keywords match, but the rule also wants no tools: the tools rule takes it.
    (_chat("prove it", tools=TOOL), {}, RouteDecision("tooled", "rule:2")),
    (_chat("Go Step By Step"), {}, RouteDecision("steps", "rule:3")),
    (_chat("hi"), {"X-TIER": "gold"}, RouteDecision("premium", "rule:4")),
    (_chat("hi"), {"X-Tier": "silver"}, None),
    (_chat("hi"), {"x-beta": ""}, RouteDecision("beta", "rule:5")),
    (_chat("hi"), {"x-region": "eu-west"}, RouteDecision("eu", "rule:6")),
    (_chat("hi"), {"x-region": "us-east"}, None),
    ({"model": "auto", "prompt": "a theorem"}, {}, RouteDecision("prover", "rule:1")),
])
def test_the_first_rule_whose_conditions_all_hold_decides(body, headers, expected):
    chat = "messages" in body
    assert match_rules(ROUTE, request_features(body, chat, headers)) == expected


@pytest.mark.parametrize("score, expected", [(0.6, RouteDecision("large", "classifier:above", 0.6)),
                                             (0.59, RouteDecision("small", "classifier:below", 0.59))])
def test_the_classifier_score_decides_at_its_threshold(score, expected):
    assert decide_by_score(ROUTE, score) == expected


def test_a_failed_classifier_sends_the_request_to_its_on_error_side():
    assert decide_on_classifier_error(ROUTE, "timeout") == RouteDecision("large", "classifier_error:timeout")
