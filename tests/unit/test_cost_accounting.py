"""What the router records of each answer (CostAccounting), and the small pure pieces of serving
virtual models: the escalation-cap header, what /v1/models says of a virtual model, and the
client's error when a cascade fails."""
from __future__ import annotations

import pytest

from protocol.openai_api import OpenAIError
from router.cost.accounting import CostAccounting
from router.cost.price_book import HostedPrice, PriceBook
from router.http.virtual import _failure, describe_virtual, parse_max_escalations
from router.virtual_models.cascade import CascadeFailed
from router.virtual_models.config import parse_virtual_models

USAGE = {"prompt_tokens": 1000, "completion_tokens": 100, "prompt_tokens_details": {"cached_tokens": 600}}


def test_an_answer_is_priced_with_its_cached_tokens_beside_the_no_cache_counterfactual():
    costs = CostAccounting(PriceBook({"m": HostedPrice(1.0, 2.0)}, "book"))
    priced = costs.record("m", "session:a", USAGE)
    # 400 plain + 600 read at 0.1x, 100 out at 2 USD/Mtok; without the cache all 1000 at 1 USD/Mtok.
    assert priced.total_usd == pytest.approx((400 + 60 + 200) / 1e6)
    assert priced.no_cache_usd == pytest.approx((1000 + 200) / 1e6)
    snap = costs.snapshot()
    assert snap["price_book"] == "book"
    assert snap["models"]["m"]["cached_tokens"] == 600 and snap["models"]["m"]["requests"] == 1
    assert snap["tenants"]["session:a"]["total"]["saved_usd"] == pytest.approx(540 / 1e6)


def test_a_model_the_book_does_not_list_counts_its_tokens_but_no_money_and_no_usage_counts_nothing():
    costs = CostAccounting()
    assert costs.record("m", "_anonymous", USAGE) is None
    assert costs.record("m", "_anonymous", None) is None
    snap = costs.snapshot()
    assert snap["price_book"] is None
    assert (snap["models"]["m"]["requests"], snap["models"]["m"]["unpriced_requests"]) == (1, 1)
    assert snap["models"]["m"]["cost_usd"] == 0.0 and snap["models"]["m"]["prompt_tokens"] == 1000


@pytest.mark.parametrize("value, cap", [(None, None), ("0", 0), ("2", 2)])
def test_the_escalation_cap_header_is_a_non_negative_integer(value, cap):
    assert parse_max_escalations(value) == cap


@pytest.mark.parametrize("value", ["-1", "one", "1.5", ""])
def test_a_bad_escalation_cap_is_a_400(value):
    with pytest.raises(OpenAIError) as info:
        parse_max_escalations(value)
    assert (info.value.status, info.value.param) == (400, "X-Prefixlb-Max-Escalations")


def test_models_describes_a_virtual_model_by_the_real_models_behind_it():
    vms = parse_virtual_models({
        "smart": {"cascade": {"stages": [{"model": "s", "judge": {"kind": "logprob", "threshold": 0.5}},
                                         {"model": "m", "judge": {"kind": "regex", "pattern": "x"}},
                                         {"model": "l"}], "max_escalations": 1}},
        "auto": {"route": {"default": "s", "rules": [{"model": "l", "when": {"tools": True}}],
                           "classifier": {"url": "http://c/score", "threshold": 0.5, "above": "m"}}}})
    assert describe_virtual(vms["smart"]) == {"kind": "cascade", "stages": ["s", "m", "l"], "max_escalations": 1}
    assert describe_virtual(vms["auto"]) == {"kind": "route", "models": ["l", "m", "s"]}


def test_a_stage_client_error_reaches_the_client_as_the_stage_said_it():
    upstream = {"error": {"message": "not recorded", "type": "invalid_request_error", "param": "messages",
                          "code": "prompt_not_recorded"}}
    error = _failure(CascadeFailed("not recorded", 400, "invalid_request", [], upstream))
    assert (error.status, error.code, error.param, error.message) == (400, "prompt_not_recorded", "messages",
                                                                      "not recorded")


def test_a_cascade_no_stage_could_answer_is_a_server_error_with_the_cascades_code():
    error = _failure(CascadeFailed("judge logprob failed", 503, "judge_unavailable", []))
    assert (error.status, error.code, error.type) == (503, "judge_unavailable", "service_unavailable_error")
    error = _failure(CascadeFailed("no worker", 502, "stage_failed", []))
    assert (error.status, error.code) == (502, "stage_failed")
