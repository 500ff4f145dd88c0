"""The virtual_models schema: a full example parses; every mistake names its key."""
from __future__ import annotations

import re

import pytest

from router.virtual_models.config import (CascadeModel, RouteModel, VirtualModelError, load_virtual_models,
                                          parse_virtual_models)
from router.virtual_models.judges.build import JudgeRuntime, build_judge
from router.virtual_models.judges.format import AllOf, JsonSchemaJudge, RegexJudge
from router.virtual_models.judges.llm_judge import LLMJudge
from router.virtual_models.judges.logprob import LogprobJudge
from router.virtual_models.judges.verifier import VerifierJudge

EXAMPLE = """
virtual_models:
  auto:
    route:
      default: small
      rules:
        - model: large
          when: {min_prompt_chars: 4000}
        - model: large
          when: {keywords: [Prove, derive], tools: true}
        - model: large
          when: {header: {name: X-Tier, equals: premium}}
      classifier: {url: "http://clf:9000/score", threshold: 0.6, above: large, timeout_s: 0.2}
  smart:
    cascade:
      stages:
        - model: small
          judge:
            kind: all_of
            judges:
              - {kind: regex, pattern: '^#### -?\\d+$'}
              - {kind: verifier, url: "http://verifier:9001/verify", timeout_s: 0.5, on_error: accept}
        - model: medium
          judge: {kind: logprob, threshold: 0.4, quantile: 0.05, name: conf}
        - model: large
      max_escalations: 2
"""


def test_the_documented_example_parses(tmp_path):
    path = tmp_path / "vm.yaml"
    path.write_text(EXAMPLE)
    models = load_virtual_models(path)
    auto, smart = models["auto"], models["smart"]
    assert isinstance(auto, RouteModel) and isinstance(smart, CascadeModel)
    assert auto.default == "small" and len(auto.rules) == 3
    assert auto.rules[1].keywords == ("prove", "derive") and auto.rules[1].tools is True
    assert auto.rules[2].header.name == "x-tier" and auto.rules[2].header.equals == "premium"
    assert (auto.classifier.above, auto.classifier.below, auto.classifier.timeout_s) == ("large", "small", 0.2)
    assert [s.model for s in smart.stages] == ["small", "medium", "large"] and smart.max_escalations == 2
    assert smart.stages[0].judge.kind == "all_of" and not smart.stages[0].judge.needs_logprobs
    assert smart.stages[1].judge.needs_logprobs and smart.stages[2].judge is None


async def test_judges_are_built_from_their_specs():
    smart = parse_virtual_models({"smart": {"cascade": {"stages": [
        {"model": "s", "judge": {"kind": "all_of", "judges": [
            {"kind": "regex", "pattern": "x"}, {"kind": "verifier", "url": "http://v/verify"},
            {"kind": "json_schema", "schema": {"type": "object"}},
            {"kind": "llm", "model": "judge", "rubric": "strict", "threshold": 0.5}]}},
        {"model": "m", "judge": {"kind": "logprob", "threshold": 0.3, "on_error": "fail", "name": "lp"}},
        {"model": "l"}]}}})["smart"]

    async def send(model, body):
        raise AssertionError("not called")

    top = build_judge(smart.stages[0].judge, JudgeRuntime(send=send))
    assert isinstance(top, AllOf)
    assert [type(j) for j in top.judges] == [RegexJudge, VerifierJudge, JsonSchemaJudge, LLMJudge]
    lp = build_judge(smart.stages[1].judge)
    assert isinstance(lp, LogprobJudge) and (lp.threshold, lp.q, lp.on_error, lp.name) == (0.3, 0.1, "fail", "lp")
    with pytest.raises(ValueError, match="needs the router's send function"):
        build_judge(smart.stages[0].judge.members[3])
    await top.judges[1].endpoint.close()


def _cascade(*stages, **extra):
    return {"m": {"cascade": {"stages": list(stages), **extra}}}


J = {"kind": "regex", "pattern": "x"}


@pytest.mark.parametrize("data, message", [
    ({"m": {"route": {"default": "a"}, "cascade": {}}}, "virtual_models.m: give exactly one of 'route' or 'cascade'"),
    ({"m": {"router": {}}}, "virtual_models.m: unknown key(s) 'router'"),
    (_cascade({"model": "a", "judge": J}), "virtual_models.m.cascade.stages: a cascade needs a list of at least two stages"),
    (_cascade({"model": "a"}, {"model": "b"}), "virtual_models.m.cascade.stages[0]: every stage but the last needs a 'judge'"),
    (_cascade({"model": "a", "judge": J}, {"model": "b", "judge": J}),
     "virtual_models.m.cascade.stages[1].judge: the last stage's answer is always returned"),
    (_cascade({"model": "a", "judge": J}, {"model": "b"}, max_escalations=2),
     "virtual_models.m.cascade.max_escalations: at most 1 with 2 stages, got 2"),
    (_cascade({"model": "m", "judge": J}, {"model": "b"}), "stages[0].model: 'm' is a virtual model"),
    (_cascade({"model": "a", "judge": {"kind": "magic"}}, {"model": "b"}), "stages[0].judge.kind: unknown judge kind 'magic'"),
    (_cascade({"model": "a", "judge": {"kind": "logprob"}}, {"model": "b"}), "stages[0].judge.threshold: expected a number"),
    (_cascade({"model": "a", "judge": {"kind": "logprob", "threshold": 2}}, {"model": "b"}),
     "stages[0].judge.threshold: must be <= 1"),
    (_cascade({"model": "a", "judge": {"kind": "logprob", "threshold": 0.5, "quantil": 0.1}}, {"model": "b"}),
     "stages[0].judge: unknown key(s) 'quantil'"),
    (_cascade({"model": "a", "judge": {"kind": "regex", "pattern": "("}}, {"model": "b"}),
     "stages[0].judge: pattern: not a valid regular expression"),
    (_cascade({"model": "a", "judge": {"kind": "json_schema", "schema": {"type": "nope"}}}, {"model": "b"}),
     "stages[0].judge: schema: not a valid JSON Schema"),
    (_cascade({"model": "a", "judge": {"kind": "verifier", "url": "ftp://x"}}, {"model": "b"}),
     "stages[0].judge.url: expected an http(s) URL"),
    (_cascade({"model": "a", "judge": {"kind": "verifier", "url": "http://x", "timeout_s": 0}}, {"model": "b"}),
     "stages[0].judge.timeout_s: must be > 0"),
    (_cascade({"model": "a", "judge": {"kind": "regex", "pattern": "x", "on_error": "reject"}}, {"model": "b"}),
     "stages[0].judge.on_error: must be one of accept, escalate, fail"),
    (_cascade({"model": "a", "judge": {"kind": "all_of", "judges": []}}, {"model": "b"}),
     "stages[0].judge.judges: expected a non-empty list"),
    (_cascade({"model": "a", "judge": {"kind": "llm", "model": "j"}}, {"model": "b"}), "stages[0].judge.rubric"),
    ({"m": {"route": {"default": "a"}}}, "virtual_models.m.route: a route needs 'rules' or a 'classifier'"),
    ({"m": {"route": {"default": "a", "rules": [{"model": "b", "when": {}}]}}}, "rules[0].when: needs at least one condition"),
    ({"m": {"route": {"default": "a", "rules": [{"model": "b", "when": {"lenght": 3}}]}}},
     "rules[0].when: unknown key(s) 'lenght'"),
    ({"m": {"route": {"default": "a", "rules": [{"model": "b", "when": {"min_prompt_chars": 9, "max_prompt_chars": 3}}]}}},
     "min_prompt_chars (9) exceeds max_prompt_chars (3)"),
    ({"m": {"route": {"default": "a", "rules": [{"model": "b", "when": {"header": {"name": "x"}}}]}}},
     "header: give exactly one of 'equals', 'matches', 'present'"),
    ({"m": {"route": {"default": "a", "rules": [{"model": "b", "when": {"keywords": "prove"}}]}}},
     "keywords: expected a list of non-empty strings"),
    ({"m": {"route": {"default": "m", "rules": [{"model": "b", "when": {"tools": True}}]}}},
     "route.default: 'm' is a virtual model"),
    ({"m": {"route": {"default": "a", "classifier": {"url": "http://c", "threshold": 0.5}}}},
     "classifier: missing 'above'"),
    ({"m": {"route": {"default": "a", "classifier": {"url": "http://c", "threshold": 0.5, "above": "b",
                                                      "on_error": "fail"}}}},
     "classifier.on_error: must be 'below' or 'above'"),
    (["not", "a", "mapping"], "virtual_models: expected a mapping"),
])
def test_configuration_errors_name_the_key(data, message):
    with pytest.raises(VirtualModelError, match=re.escape(message)):
        parse_virtual_models(data)


def test_no_virtual_models_is_an_empty_mapping():
    assert parse_virtual_models(None) == {}
