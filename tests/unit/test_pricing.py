"""The price of a response and the break-even arithmetic, against the source texts' walkthrough."""
from __future__ import annotations

import math

import pytest

from router.cost.price_book import HostedPrice, SelfHostedPrice
from router.cost.pricing import (Usage, assume_full_prompt_writes, break_even_reads, min_paying_reads,
                                 prefix_reuse_cost, price_usage, usage_from_openai)

# 1 USD per token: the walkthrough's "token-price units" read directly as dollars.
UNIT = HostedPrice(input_per_mtok=1e6, output_per_mtok=4e6, cache_read_multiplier=0.1,
                   cache_write_5m_multiplier=1.25, cache_write_1h_multiplier=2.0)


@pytest.mark.parametrize("usage, input_usd, read_usd, write_usd, output_usd, no_cache_usd", [
    # The walkthrough's request 1 (cold): writes the 10,000-token prefix, pays the question.
    (Usage(10_200, 0, 0, 10_000, "5m"), 200, 0, 12_500, 0, 10_200),
    # Requests 2..100 (warm): read the prefix at 0.1x.
    (Usage(10_200, 0, 10_000, 0), 200, 1_000, 0, 0, 10_200),
    # The 1-hour TTL writes at 2x.
    (Usage(10_200, 0, 0, 10_000, "1h"), 200, 0, 20_000, 0, 10_200),
    # Output is priced the same with or without the cache.
    (Usage(1_000, 50, 512, 0), 488, 51.2, 0, 200, 1_200),
    # Nothing cached, nothing written: the actual cost is the counterfactual.
    (Usage(300, 7, 0, 0), 300, 0, 0, 28, 328),
])
def test_a_hosted_response_is_priced_part_by_part(usage, input_usd, read_usd, write_usd, output_usd, no_cache_usd):
    priced = price_usage(usage, UNIT)
    assert priced.input_usd == pytest.approx(input_usd)
    assert priced.cache_read_usd == pytest.approx(read_usd)
    assert priced.cache_write_usd == pytest.approx(write_usd)
    assert priced.output_usd == pytest.approx(output_usd)
    assert priced.no_cache_usd == pytest.approx(no_cache_usd)
    assert priced.total_usd == pytest.approx(input_usd + read_usd + write_usd + output_usd)
    assert priced.saved_usd == pytest.approx(no_cache_usd - priced.total_usd)


def test_the_walkthrough_saves_87_percent_over_100_requests():
    # P = 10,000, Q = 200, N = 100, all within the TTL (section 5.6.8).
    without, with_cache = prefix_reuse_cost(10_000, 200, 100, 1.25, 0.1)
    assert (without, with_cache) == (pytest.approx(1_020_000), pytest.approx(131_500))
    assert 1 - with_cache / without == pytest.approx(0.871, abs=5e-4)
    # The same number, request by request, through the response pricer.
    priced = [price_usage(Usage(10_200, 0, 0, 10_000), UNIT)] + \
        [price_usage(Usage(10_200, 0, 10_000, 0), UNIT) for _ in range(99)]
    assert sum(p.total_usd for p in priced) == pytest.approx(131_500)
    assert sum(p.no_cache_usd for p in priced) == pytest.approx(1_020_000)


@pytest.mark.parametrize("write, read, threshold, min_reads, uses_the_texts_give", [
    (1.25, 0.1, 0.25 / 0.9, 1, 1.28),   # 5-minute TTL: 1.25 + 0.1r < 1 + r  <=>  r > 0.2777...
    (2.0, 0.1, 1.0 / 0.9, 2, None),     # 1-hour TTL with the 0.1x read of the hosted APIs
    (2.0, 0.2, 1.25, 2, 2.25),          # the texts' 1-hour arithmetic (2 + 0.2(N-1) < N): N > 2.25
    (1.0, 0.5, 0.0, 1, None),           # no write premium: the first read pays
    (0.0, 0.0, -1.0, 0, None),          # a free write pays even unread
])
def test_break_even_read_counts(write, read, threshold, min_reads, uses_the_texts_give):
    assert break_even_reads(write, read) == pytest.approx(threshold)
    assert min_paying_reads(write, read) == min_reads
    if uses_the_texts_give is not None:  # the texts count uses N = reads + 1
        assert 1 + break_even_reads(write, read) == pytest.approx(uses_the_texts_give, abs=0.005)


@pytest.mark.parametrize("write, read", [(1.25, 0.1), (2.0, 0.1), (2.0, 0.2), (1.0, 0.5)])
def test_the_minimum_paying_read_count_is_where_caching_starts_to_win(write, read):
    k = min_paying_reads(write, read)
    without, with_cache = prefix_reuse_cost(1_000, 0, k + 1, write, read)
    assert with_cache < without
    if k > 0:
        without, with_cache = prefix_reuse_cost(1_000, 0, k, write, read)
        assert with_cache >= without


def test_reads_as_dear_as_input_never_pay_for_a_write_premium():
    assert break_even_reads(1.25, 1.0) == math.inf
    assert min_paying_reads(1.25, 1.0) is None


def test_a_self_hosted_response_saves_the_prefill_of_its_cached_prefix():
    price = SelfHostedPrice(usd_per_gpu_hour=3.6, prefill_tokens_per_s=1_000, gpus=2,
                            output_tokens_per_s=500, attention_knee_tokens=32_768)
    priced = price_usage(Usage(10_200, 100, 10_000, 0), price)
    per_s = 3.6 * 2 / 3600  # 0.002 USD per replica-second
    actual_s = 200 / 1_000 * (1 + (10_000 + 100) / 32_768)   # 200 new tokens over 10,000 cached
    cold_s = 10_200 / 1_000 * (1 + 5_100 / 32_768)            # the whole prompt, cold
    assert priced.input_usd == pytest.approx(actual_s * per_s)
    assert priced.output_usd == pytest.approx(100 / 500 * per_s)
    assert priced.no_cache_usd == pytest.approx(cold_s * per_s + 100 / 500 * per_s)
    assert (priced.cache_read_usd, priced.cache_write_usd) == (0.0, 0.0)
    assert priced.saved_usd == pytest.approx((cold_s - actual_s) * per_s)


def test_self_hosted_output_is_free_without_a_decode_throughput():
    price = SelfHostedPrice(usd_per_gpu_hour=1.0, prefill_tokens_per_s=1_000)
    assert price_usage(Usage(10, 1_000, 0), price).output_usd == 0.0


@pytest.mark.parametrize("body, expected", [
    ({"prompt_tokens": 120, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 64}},
     Usage(120, 9, 64)),
    ({"prompt_tokens": 12, "completion_tokens": 3}, Usage(12, 3, 0)),
    # A worker claiming more cached tokens than the prompt has is clamped.
    ({"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 99}}, Usage(12, 3, 12)),
    # Anthropic's shape: input_tokens excludes the cache reads and writes.
    ({"input_tokens": 50, "output_tokens": 7, "cache_read_input_tokens": 1_000, "cache_creation_input_tokens": 200},
     Usage(1_250, 7, 1_000, 200)),
    ({"prompt_tokens": -5, "completion_tokens": "x", "prompt_tokens_details": None}, Usage(0, 0, 0)),
    (None, Usage()),
])
def test_usage_is_read_from_openai_and_anthropic_shapes(body, expected):
    assert usage_from_openai(body) == expected


def test_unreported_writes_are_assumed_for_the_whole_uncached_prompt_above_the_minimum():
    price = HostedPrice(1.0, 1.0, min_cacheable_tokens=1_024)
    assert assume_full_prompt_writes(Usage(5_000, 10, 3_000), price, "1h") == Usage(5_000, 10, 3_000, 2_000, "1h")
    # Below the minimum nothing is cached: no write, and no read either.
    assert assume_full_prompt_writes(Usage(1_000, 10, 512), price) == Usage(1_000, 10, 0, 0)


@pytest.mark.parametrize("kwargs", [
    {"prompt_tokens": -1}, {"completion_tokens": 1.5}, {"cached_tokens": True},
    {"prompt_tokens": 10, "cached_tokens": 8, "cache_write_tokens": 3},
])
def test_impossible_usage_is_refused(kwargs):
    with pytest.raises(ValueError):
        Usage(**kwargs)
