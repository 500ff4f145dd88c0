"""CascadeRunner over a scripted send: escalation, logprobs asked and stripped, failure policies,
no byte of a rejected answer in the result, and E[cost] = c_s + (1 - p) c_l."""
from __future__ import annotations

import json
import math

import pytest

from router.cost.price_book import HostedPrice, PriceBook
from router.virtual_models.answer import StageAnswer, StageError
from router.virtual_models.cascade import CascadeFailed, CascadeRequestError, CascadeRunner
from router.virtual_models.config import parse_virtual_models
from router.virtual_models.judges.format import RegexJudge
from router.virtual_models.judges.logprob import LogprobJudge


def _model(*judges_and_models, cap=None):
    stages = []
    items = list(judges_and_models)
    while items:
        model = items.pop(0)
        stage = {"model": model}
        if items and isinstance(items[0], dict):
            stage["judge"] = items.pop(0)
        stages.append(stage)
    spec = {"stages": stages}
    if cap is not None:
        spec["max_escalations"] = cap
    return parse_virtual_models({"smart": {"cascade": spec}})["smart"]


def _answer(model, text, chat=True, logprobs=(), usage=(10, 5, 0)):
    prompt, completion, cached = usage
    if chat:
        lp = {"content": [{"token": "t", "logprob": v, "bytes": [116], "top_logprobs": []} for v in logprobs]} \
            if logprobs else None
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": "stop"}
    else:
        lp = {"tokens": ["t"] * len(logprobs), "token_logprobs": list(logprobs), "top_logprobs": None,
              "text_offset": list(range(len(logprobs)))} if logprobs else None
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": "stop"}
    return {"id": "x", "object": "chat.completion" if chat else "text_completion", "created": 1, "model": model,
            "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                           "total_tokens": prompt + completion,
                                           "prompt_tokens_details": {"cached_tokens": cached}}}


class Script:
    """A send that answers each model from a table and records what it was sent."""

    def __init__(self, answers):
        self.answers = answers
        self.sent = []

    async def __call__(self, model, body):
        self.sent.append((model, json.loads(json.dumps(body))))
        reply = self.answers[model]
        if isinstance(reply, Exception):
            raise reply
        return StageAnswer(model, json.loads(json.dumps(reply)), worker_id=f"{model}-w1")


REGEX = {"kind": "regex", "pattern": r"^#### \d+$"}
LOGPROB = {"kind": "logprob", "threshold": 0.5}
BODY = {"model": "smart", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}],
        "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 64}


async def test_an_accepted_small_answer_is_returned_and_the_large_model_is_never_asked():
    send = Script({"small": _answer("small", "#### 18"), "large": _answer("large", "eighteen")})
    result = await CascadeRunner.build(_model("small", REGEX, "large"), send).run(BODY, chat=True)
    assert result.answered_by == "small" and result.body["choices"][0]["message"]["content"] == "#### 18"
    assert [m for m, _ in send.sent] == ["small"]
    assert [(s.model, s.outcome) for s in result.stages] == [("small", "accepted")]
    # The stage got the original request, not streamed, for its own model.
    sent = send.sent[0][1]
    assert sent["messages"] == BODY["messages"] and sent["model"] == "small"
    assert sent["stream"] is False and "stream_options" not in sent and "logprobs" not in sent


async def test_a_rejected_answer_escalates_and_no_byte_of_it_is_returned():
    send = Script({"small": _answer("small", "SECRET-WRONG-ANSWER"), "large": _answer("large", "#### 42")})
    result = await CascadeRunner.build(_model("small", REGEX, "large"), send).run(BODY, chat=True)
    assert result.answered_by == "large" and result.escalations == 1
    assert [(s.model, s.outcome) for s in result.stages] == [("small", "escalated"), ("large", "final")]
    everything = json.dumps([result.body, result.extension(), result.headers()])
    assert "SECRET-WRONG-ANSWER" not in everything
    assert result.headers()["X-Prefixlb-Cascade"] == "small:escalated,large:final"
    assert result.headers()["X-Prefixlb-Answered-By"] == "large"
    assert result.body["usage"]["prefixlb"]["stages"][0]["judge"]["reason"] == "no_match"
    # The large model got the client's original request too.
    assert send.sent[1][1]["messages"] == BODY["messages"]


async def test_logprobs_are_asked_for_the_judge_and_stripped_when_the_client_did_not_ask():
    send = Script({"small": _answer("small", "ok", logprobs=(-0.01, -0.02)), "large": _answer("large", "l")})
    runner = CascadeRunner.build(_model("small", LOGPROB, "large"), send)
    result = await runner.run(BODY, chat=True)
    assert send.sent[0][1]["logprobs"] is True
    assert result.answered_by == "small" and result.body["choices"][0]["logprobs"] is None
    low, high = math.exp(-0.02), math.exp(-0.01)  # the 0.1-quantile of the two token probabilities
    assert result.headers()["X-Prefixlb-Judge-Score"] == f"{low + 0.1 * (high - low):.6g}" == "0.981184"
    asked = await runner.run({**BODY, "logprobs": True, "top_logprobs": 2}, chat=True)
    assert asked.body["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.01
    assert send.sent[-1][1]["top_logprobs"] == 2


async def test_completions_ask_for_logprobs_with_an_integer():
    send = Script({"small": _answer("small", "ok", chat=False, logprobs=(-3.0, -3.0)),
                   "large": _answer("large", "big", chat=False)})
    result = await CascadeRunner.build(_model("small", LOGPROB, "large"), send).run(
        {"model": "smart", "prompt": "Q?"}, chat=False)
    assert send.sent[0][1]["logprobs"] == 0
    assert result.answered_by == "large"  # exp(-3) = 0.05 < 0.5
    assert result.stages[0].verdict.score == pytest.approx(0.0498, abs=1e-4)
    assert send.sent[1][1].get("logprobs") is None  # the last stage has no judge: no logprobs


@pytest.mark.parametrize("policy, answered_by", [("accept", "small"), ("escalate", "large")])
async def test_a_stage_without_logprobs_follows_the_judges_policy(policy, answered_by):
    send = Script({"small": _answer("small", "ok"), "large": _answer("large", "l")})
    model = _model("small", {**LOGPROB, "on_error": policy}, "large")
    result = await CascadeRunner.build(model, send).run(BODY, chat=True)
    assert result.answered_by == answered_by
    assert result.stages[0].verdict.failed and result.stages[0].verdict.reason == "no_logprobs"


async def test_the_fail_policy_fails_the_request_with_503_and_the_stage_records():
    send = Script({"small": _answer("small", "ok"), "large": _answer("large", "l")})
    model = _model("small", {**LOGPROB, "on_error": "fail"}, "large")
    with pytest.raises(CascadeFailed) as info:
        await CascadeRunner.build(model, send).run(BODY, chat=True)
    assert (info.value.status, info.value.code) == (503, "judge_unavailable")
    assert [(s.model, s.outcome) for s in info.value.stages] == [("small", "judge_unavailable")]


async def test_an_upstream_failure_skips_to_the_next_stage_a_client_error_does_not():
    send = Script({"small": StageError("no worker", 503), "large": _answer("large", "l")})
    result = await CascadeRunner.build(_model("small", REGEX, "large"), send).run(BODY, chat=True)
    assert [(s.model, s.outcome) for s in result.stages] == [("small", "stage_error"), ("large", "final")]
    error = {"error": {"message": "max_tokens too large", "type": "invalid_request_error"}}
    send = Script({"small": StageError("bad request", 400, retryable=False, body=error), "large": _answer("large", "l")})
    with pytest.raises(CascadeFailed) as info:
        await CascadeRunner.build(_model("small", REGEX, "large"), send).run(BODY, chat=True)
    assert (info.value.status, info.value.code, info.value.body) == (400, "invalid_request", error)
    assert [m for m, _ in send.sent] == ["small"]


async def test_a_failing_last_stage_fails_the_cascade():
    send = Script({"small": _answer("small", "wrong"), "large": StageError("timeout", 504)})
    with pytest.raises(CascadeFailed) as info:
        await CascadeRunner.build(_model("small", REGEX, "large"), send).run(BODY, chat=True)
    assert (info.value.status, info.value.code) == (504, "stage_failed")
    assert [s.outcome for s in info.value.stages] == ["escalated", "stage_error"]


async def test_the_escalation_cap_makes_an_earlier_stage_answer_unjudged():
    send = Script({"small": _answer("small", "wrong"), "medium": _answer("medium", "also wrong"),
                   "large": _answer("large", "#### 1")})
    model = _model("small", REGEX, "medium", REGEX, "large")
    runner = CascadeRunner.build(model, send)
    assert (await runner.run(BODY, chat=True)).answered_by == "large"
    capped = await runner.run(BODY, chat=True, max_escalations=1)
    assert [(s.model, s.outcome) for s in capped.stages] == [("small", "escalated"), ("medium", "final")]
    assert (await runner.run(BODY, chat=True, max_escalations=0)).answered_by == "small"
    limited = _model("small", REGEX, "medium", REGEX, "large", cap=1)
    assert (await CascadeRunner.build(limited, send).run(BODY, chat=True)).answered_by == "medium"


@pytest.mark.parametrize("body, param", [({**BODY, "n": 2}, "n"), ({"model": "smart", "prompt": ["a", "b"]}, "prompt")])
async def test_requests_a_cascade_cannot_judge_are_refused(body, param):
    runner = CascadeRunner.build(_model("small", REGEX, "large"), Script({}))
    with pytest.raises(CascadeRequestError) as info:
        await runner.run(body, chat="messages" in body)
    assert info.value.param == param


# c_s = 1, c_l = 20 (section 5.6.11): one prompt token priced at 1 and 20 USD.
BOOK = PriceBook({"small": HostedPrice(1e6, 0.0), "large": HostedPrice(20e6, 0.0)})


@pytest.mark.parametrize("accepted_of_10, expected", [(7, 7.0), (9, 3.0), (5, 11.0), (0, 21.0), (10, 1.0)])
async def test_the_mean_cost_is_c_s_plus_one_minus_p_times_c_l(accepted_of_10, expected):
    runner = CascadeRunner.build(_model("small", {"kind": "regex", "pattern": "^#### "}, "large"), None, price_book=BOOK)
    costs = []
    for i in range(10):
        text = "#### 1" if i < accepted_of_10 else "no"
        runner.send = Script({"small": _answer("small", text, usage=(1, 0, 0)),
                              "large": _answer("large", "#### 2", usage=(1, 0, 0))})
        costs.append((await runner.run(BODY, chat=True)).cost_usd)
    assert sum(costs) / 10 == pytest.approx(expected)


async def test_the_large_models_cached_tokens_are_priced_at_its_read_price():
    book = PriceBook({"small": HostedPrice(1e6, 0.0), "large": HostedPrice(20e6, 0.0, cache_read_multiplier=0.1)})
    send = Script({"small": _answer("small", "no", usage=(100, 0, 0)), "large": _answer("large", "l", usage=(100, 0, 80))})
    result = await CascadeRunner.build(_model("small", REGEX, "large"), send, price_book=book).run(BODY, chat=True)
    # small: 100 x 1; large: 20 uncached x 20 + 80 cached x 2.
    assert result.cost_usd == pytest.approx(100 + 20 * 20 + 80 * 2)
    assert result.stages[1].no_cache_usd == pytest.approx(2_000)
    assert result.headers()["X-Prefixlb-Cost-USD"] == "660.000000000"


async def test_an_unpriced_model_leaves_the_cost_unknown():
    send = Script({"small": _answer("small", "no"), "large": _answer("large", "l")})
    result = await CascadeRunner.build(_model("small", REGEX, "large"), send,
                                       price_book=PriceBook({"small": HostedPrice(1.0, 1.0)})).run(BODY, chat=True)
    assert result.cost_usd is None and "X-Prefixlb-Cost-USD" not in result.headers()


def test_a_runner_needs_one_judge_per_stage():
    with pytest.raises(ValueError, match="one judge"):
        CascadeRunner(_model("small", REGEX, "large"), [RegexJudge("x")], Script({}))
    assert isinstance(CascadeRunner.build(_model("small", LOGPROB, "large"), Script({})).judges[0], LogprobJudge)
