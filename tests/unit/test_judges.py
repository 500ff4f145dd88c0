"""Judges: logprob quantile, regex and JSON-schema formats, AllOf, the LLM judge, failure policies."""
from __future__ import annotations

import math

import numpy as np
import pytest

from router.cost.price_book import HostedPrice, PriceBook
from router.virtual_models.answer import StageAnswer, StageError
from router.virtual_models.judges.format import AllOf, JsonSchemaJudge, RegexJudge
from router.virtual_models.judges.llm_judge import LLMJudge
from router.virtual_models.judges.logprob import LogprobJudge, quantile
from router.virtual_models.judges.verdict import (Candidate, JudgeError, JudgeUnavailable, Verdict, check_on_error,
                                                  decide)


def _cand(answer="", logprobs=None, prompt="q"):
    return Candidate(prompt=prompt, answer=answer, model="small", token_logprobs=logprobs)


def _lps(*probs):
    return tuple(math.log(p) for p in probs)


@pytest.mark.parametrize("values, q", [([3.0, 1.0, 2.0], 0.5), ([0.1] + [0.9] * 9, 0.1), ([5.0], 0.3),
                                       ([1.0, 2.0, 3.0, 4.0], 0.0), ([1.0, 2.0, 3.0, 4.0], 1.0)])
def test_quantile_interpolates_like_numpy(values, q):
    assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


async def test_the_logprob_score_is_a_low_quantile_of_token_probabilities():
    judge = LogprobJudge(threshold=0.5, q=0.1)
    # Ten tokens, one at 0.1: position 0.9 between 0.1 and 0.9 -> 0.1 + 0.8 * 0.9 = 0.82.
    verdict = await judge.judge(_cand("x", _lps(*([0.9] * 9 + [0.1]))))
    assert (verdict.accept, verdict.score, verdict.reason) == (True, pytest.approx(0.82), "accepted")
    assert judge.needs_logprobs


async def test_the_logprob_judge_is_not_biased_by_length():
    judge = LogprobJudge(threshold=0.5, q=0.1)
    long_sure = _lps(*([0.95] * 100))     # sum of logprobs -5.13: a sum threshold would reject it
    short_unsure = _lps(0.3, 0.99, 0.99)  # sum -1.22: a sum threshold would accept it
    assert sum(long_sure) < sum(short_unsure)
    assert (await judge.judge(_cand("a", long_sure))).accept is True
    short = await judge.judge(_cand("b", short_unsure))
    assert (short.accept, short.score) == (False, pytest.approx(0.3 + 0.69 * 0.2))


@pytest.mark.parametrize("policy, accept", [("accept", True), ("escalate", False)])
async def test_a_stage_without_logprobs_is_a_judge_failure_decided_by_policy(policy, accept):
    verdict = await decide(LogprobJudge(0.5, on_error=policy), _cand("x", None))
    assert (verdict.accept, verdict.failed, verdict.reason, verdict.score) == (accept, True, "no_logprobs", None)


async def test_the_fail_policy_fails_the_request():
    with pytest.raises(JudgeUnavailable, match="judge logprob failed \\(no_logprobs\\)"):
        await decide(LogprobJudge(0.5, on_error="fail"), _cand("x", ()))


def test_policies_and_thresholds_are_checked():
    with pytest.raises(ValueError, match="must be one of accept, escalate, fail"):
        check_on_error("reject")
    with pytest.raises(ValueError, match="threshold"):
        LogprobJudge(1.5)


@pytest.mark.parametrize("judge, answer, accept, reason", [
    (RegexJudge(r"^#### -?\d+$"), "so 9 * 2 = 18\n#### 18", True, "accepted"),
    (RegexJudge(r"^#### -?\d+$"), "the answer is 18", False, "no_match"),
    (RegexJudge(r"\d+", full_match=True), "  42 \n", True, "accepted"),
    (RegexJudge(r"\d+", full_match=True), "42 apples", False, "no_match"),
    (RegexJudge(r"i cannot", ignore_case=True, must_match=False), "I CANNOT help", False, "forbidden_match"),
    (RegexJudge(r"i cannot", ignore_case=True, must_match=False), "Sure: 42", True, "accepted"),
])
async def test_regex_judges(judge, answer, accept, reason):
    verdict = await judge.judge(_cand(answer))
    assert (verdict.accept, verdict.reason, verdict.score) == (accept, reason, 1.0 if accept else 0.0)


def test_a_bad_regex_is_refused_when_configured():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        RegexJudge("(unclosed")


SCHEMA = {"type": "object", "required": ["answer"],
          "properties": {"answer": {"type": "integer"}, "steps": {"type": "array", "items": {"type": "string"}}}}


@pytest.mark.parametrize("answer, accept, reason", [
    ('{"answer": 18}', True, "accepted"),
    ('```json\n{"answer": 18, "steps": ["16-7"]}\n```', True, "accepted"),
    ('{"answer": "18"}', False, "schema_violation: answer: '18' is not of type 'integer'"),
    ('{"answer": 1, "steps": [3]}', False, "schema_violation: steps/0: 3 is not of type 'string'"),
    ('{"steps": []}', False, "schema_violation: (root): 'answer' is a required property"),
    ("The answer is 18.", False, "invalid_json"),
])
async def test_json_schema_judges(answer, accept, reason):
    verdict = await JsonSchemaJudge(SCHEMA).judge(_cand(answer))
    assert (verdict.accept, verdict.reason) == (accept, reason)


def test_a_fenced_answer_is_refused_when_fences_are_not_allowed():
    assert JsonSchemaJudge(SCHEMA, allow_code_fence=False).evaluate('```json\n{"answer": 1}\n```').reason == "invalid_json"


def test_an_invalid_schema_is_refused_when_configured():
    with pytest.raises(ValueError, match="not a valid JSON Schema at properties/answer/type"):
        JsonSchemaJudge({"type": "object", "properties": {"answer": {"type": "integr"}}})


class _Counting:
    """A judge that records its calls and answers with a fixed verdict."""

    def __init__(self, name, accept, score):
        self.name, self.accept, self.score, self.calls = name, accept, score, 0
        self.on_error = "escalate"
        self.needs_logprobs = False

    async def judge(self, candidate):
        self.calls += 1
        return Verdict(self.accept, self.score, self.name, "accepted" if self.accept else "rejected")


async def test_all_of_stops_at_the_first_rejection_and_keeps_the_lowest_score():
    a, b, c = _Counting("a", True, 0.9), _Counting("b", False, 0.2), _Counting("c", True, 1.0)
    verdict = await AllOf([a, b, c]).judge(_cand("x"))
    assert (verdict.accept, verdict.score, verdict.reason) == (False, 0.2, "b: rejected")
    assert (a.calls, b.calls, c.calls) == (1, 1, 0)
    ok = await AllOf([_Counting("a", True, 0.9), RegexJudge("x")]).judge(_cand("x"))
    assert (ok.accept, ok.score) == (True, 0.9)
    assert AllOf([RegexJudge("x"), LogprobJudge(0.5)]).needs_logprobs


PRICES = PriceBook({"judge-m": HostedPrice(input_per_mtok=1e6, output_per_mtok=2e6)})


def _sender(reply: str, calls: list):
    async def send(model, body):
        calls.append((model, body))
        return StageAnswer(model, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}],
                                   "usage": {"prompt_tokens": 30, "completion_tokens": 2}})
    return send


async def test_the_llm_judge_rates_with_a_rubric_and_its_tokens_are_priced():
    calls: list = []
    judge = LLMJudge("judge-m", "Be strict about arithmetic.", _sender("8", calls), threshold=0.7,
                     price_book=PRICES)
    verdict = await judge.judge(_cand("#### 18", prompt="How many eggs?"))
    assert (verdict.accept, verdict.score, verdict.cost_usd) == (True, 0.8, 30 + 2 * 2)
    assert (verdict.judge_model, verdict.usage.prompt_tokens) == ("judge-m", 30)
    model, body = calls[0]
    assert model == "judge-m" and body["messages"][0] == {"role": "system", "content": "Be strict about arithmetic."}
    assert "How many eggs?" in body["messages"][1]["content"] and "#### 18" in body["messages"][1]["content"]


async def test_a_low_llm_rating_escalates():
    verdict = await LLMJudge("judge-m", "r", _sender("Score: 3/10", []), threshold=0.7).judge(_cand("a"))
    assert (verdict.accept, verdict.score, verdict.cost_usd) == (False, 0.3, 0.0)  # unpriced model


@pytest.mark.parametrize("reply", ["excellent!", "11", "-2"])
async def test_a_useless_llm_rating_is_a_failure_that_still_costs(reply):
    verdict = await decide(LLMJudge("judge-m", "r", _sender(reply, []), price_book=PRICES), _cand("a"))
    assert (verdict.failed, verdict.reason, verdict.accept, verdict.cost_usd) == (True, "unparseable_rating", False, 34.0)


async def test_a_failed_judge_model_call_is_a_judge_failure():
    async def send(model, body):
        raise StageError("no worker serves judge-m", 503)

    with pytest.raises(JudgeError, match="judge_model_error"):
        await LLMJudge("judge-m", "r", send).judge(_cand("a"))
