"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs of the raw logits."""
from __future__ import annotations

import math

import pytest
import torch

from worker.engine.errors import InvalidRequestError
from worker.engine.sampler import apply_top_k_top_p, sample
from worker.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 4.0]])


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax_of_every_row():
    tokens, logprobs = sample(LOGITS, [SamplingParams(temperature=0)] * 2, [None, None])
    assert tokens == [1, 3]
    assert logprobs == [None, None]


def test_top_k_keeps_exactly_the_k_largest_logits():
    out = apply_top_k_top_p(torch.tensor([1.0, 3.0, 2.0, 0.0]), top_k=2, top_p=1.0)
    assert torch.isinf(out).tolist() == [True, False, False, True]


def test_top_p_keeps_the_smallest_set_reaching_p_and_always_the_top_token():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda p: (~torch.isinf(apply_top_k_top_p(logits, 0, p))).tolist()
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.9) == [True, True, True, False]
    assert kept(0.01) == [True, False, False, False]


def test_top_k_one_makes_sampling_greedy_whatever_the_temperature():
    params = [SamplingParams(temperature=5.0, top_k=1)] * 2
    for seed in range(5):
        assert sample(LOGITS, params, [gen(seed), gen(seed + 1)])[0] == [1, 3]


def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batch():
    p = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(1, 50, generator=gen(0))
    alone = [sample(logits, [p], [g])[0][0] for g in [gen(7)] for _ in range(3)]
    g = gen(7)
    batched = [sample(torch.cat([torch.randn(1, 50), logits]), [SamplingParams(temperature=1.0), p],
                      [gen(i), g])[0][1] for i in range(3)]
    assert batched == alone


def test_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = [0.25, 0.75] at temperature 1
    g = gen(123)
    draws = [sample(logits, [SamplingParams(temperature=1.0)], [g])[0][0] for _ in range(4000)]
    assert abs(sum(draws) / 4000 - 0.75) < 0.03
    cold = [sample(logits, [SamplingParams(temperature=0.25)], [g])[0][0] for _ in range(2000)]
    assert sum(cold) / 2000 > 0.97  # 3**4 : 1 -> p(1) = 81/82


def test_logprobs_are_log_softmax_of_the_raw_logits_with_top_alternatives():
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0, logprobs=0)]
    tokens, logprobs = sample(LOGITS, params, [None, None])
    lp = torch.log_softmax(LOGITS, -1)
    assert logprobs[0].token_id == 1 and logprobs[0].logprob == pytest.approx(float(lp[0, 1]))
    assert [t for t, _ in logprobs[0].top] == [1, 2]
    assert logprobs[0].top[1][1] == pytest.approx(float(lp[0, 2]))
    assert logprobs[1].top == [] and logprobs[1].logprob == pytest.approx(float(lp[1, 3]))


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(logprobs=-2),
                                    dict(stop_token_ids=[-1])])
def test_out_of_range_sampling_params_are_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_a_single_stop_string_becomes_a_list_and_empty_ones_are_dropped():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=["", "y"]).stop == ["y"]
