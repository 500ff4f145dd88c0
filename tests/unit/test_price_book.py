"""The YAML price book: what it accepts, and the errors that name the bad key."""
from __future__ import annotations

import pytest

from router.cost.price_book import (REFERENCE_BOOK, HostedPrice, PriceBookError, SelfHostedPrice,
                                    load_price_book, parse_price_book)

BOOK = """
name: example
models:
  hosted-a:
    input_per_mtok: 3.0
    output_per_mtok: 15.0
    cache_read_multiplier: 0.1
    cache_write_5m_multiplier: 1.25
    cache_write_1h_multiplier: 2.0
    min_cacheable_tokens: 1024
  hosted-b:
    input_per_mtok: 0.5
    output_per_mtok: 1.5
  llama-3-8b:
    self_hosted:
      usd_per_gpu_hour: 2.5
      gpus: 2
      prefill_tokens_per_s: 11000
      output_tokens_per_s: 2500
"""


def test_a_price_book_reads_hosted_and_self_hosted_models(tmp_path):
    path = tmp_path / "book.yaml"
    path.write_text(BOOK)
    book = load_price_book(path)
    assert book.name == "example"
    assert book.get("hosted-a") == HostedPrice(3.0, 15.0, 0.1, 1.25, 2.0, 1024)
    # Omitted multipliers take the representative values of the source texts.
    assert book.get("hosted-b") == HostedPrice(0.5, 1.5, 0.1, 1.25, 2.0, 0)
    assert book.get("llama-3-8b") == SelfHostedPrice(2.5, 11000.0, 2, 2500.0)
    assert book.get("llama-3-8b").usd_per_second == pytest.approx(2.5 * 2 / 3600)
    assert book.get("unknown") is None and "hosted-a" in book


def test_the_write_multiplier_follows_the_ttl():
    price = HostedPrice(1.0, 1.0)
    assert (price.write_multiplier("5m"), price.write_multiplier("1h")) == (1.25, 2.0)
    with pytest.raises(PriceBookError, match="unknown cache TTL '24h'"):
        price.write_multiplier("24h")


def test_self_hosted_speed_may_come_from_the_latency_model():
    data = {"models": {"m": {"self_hosted": {"usd_per_gpu_hour": 2.0, "gpu": "H100-80G", "sim_model": "llama-3-8b"}}}}
    book = parse_price_book(data, prefill_speed=lambda gpu, model: {("H100-80G", "llama-3-8b"): 12345.0}[(gpu, model)])
    assert book.get("m").prefill_tokens_per_s == 12345.0
    with pytest.raises(PriceBookError, match="only `prefixlb cost` reads"):
        parse_price_book(data)
    with pytest.raises(PriceBookError, match="models.m.self_hosted"):
        parse_price_book({"models": {"m": {"self_hosted": {"usd_per_gpu_hour": 2.0, "gpu": "X", "sim_model": "Y"}}}},
                         prefill_speed=lambda gpu, model: {}[(gpu, model)])


@pytest.mark.parametrize("data, message", [
    ({"models": {"m": {"output_per_mtok": 1.0}}}, "models.m: missing 'input_per_mtok'"),
    ({"models": {"m": {"input_per_mtok": -1.0, "output_per_mtok": 1.0}}}, r"models.m.input_per_mtok: must be >= 0"),
    ({"models": {"m": {"input_per_mtok": "cheap", "output_per_mtok": 1.0}}}, "expected a finite number, got 'cheap'"),
    ({"models": {"m": {"input_per_mtok": 1.0, "output_per_mtok": 1.0, "cache_read": 0.1}}},
     "models.m: unknown key\\(s\\) 'cache_read'"),
    ({"models": {"m": {"input_per_mtok": 1.0, "output_per_mtok": 1.0, "min_cacheable_tokens": 10.5}}},
     "min_cacheable_tokens: expected an integer >= 0"),
    ({"models": {"m": {"self_hosted": {"usd_per_gpu_hour": 1.0}}}}, "give 'prefill_tokens_per_s'"),
    ({"models": {"m": {"self_hosted": {"usd_per_gpu_hour": 1.0, "prefill_tokens_per_s": 0}}}},
     "prefill_tokens_per_s: must be > 0"),
    ({"models": {"m": {"self_hosted": {"usd_per_gpu_hour": 1.0, "prefill_tokens_per_s": 10, "gpus": 0}}}},
     "gpus: expected an integer >= 1"),
    ({"models": {"m": {"self_hosted": {"prefill_tokens_per_s": 10}, "input_per_mtok": 1.0}}},
     "'self_hosted' excludes per-token prices"),
    ({"models": {}}, "'models' must be a non-empty mapping"),
    (["not", "a", "mapping"], "expected a mapping with 'models'"),
    ({"models": {"m": 3}}, "models.m: expected a mapping, got int"),
])
def test_a_bad_price_book_names_the_offending_key(data, message):
    with pytest.raises(PriceBookError, match=message):
        parse_price_book(data)


def test_unreadable_or_invalid_yaml_is_a_price_book_error(tmp_path):
    with pytest.raises(PriceBookError, match="cannot read price book"):
        load_price_book(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed")
    with pytest.raises(PriceBookError, match="not valid YAML"):
        load_price_book(bad)


def test_the_reference_book_prices_input_in_units_of_the_input_price():
    ref = REFERENCE_BOOK.get("reference")
    assert (ref.input_per_mtok, ref.cache_read_multiplier, ref.cache_write_5m_multiplier,
            ref.cache_write_1h_multiplier) == (1.0, 0.1, 1.25, 2.0)
