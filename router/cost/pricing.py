"""The price of one response's usage, its no-cache counterfactual, and the break-even arithmetic.

Hosted model, per response (``p`` = input price per token, ``w`` the TTL's write multiplier,
``r`` the read multiplier)::

    input   = (prompt − cached − written)·p  +  cached·r·p  +  written·w·p
    output  = completion · output price
    no-cache counterfactual = prompt·p + output

Self-hosted model: a cached prefix is not free to hold but costs nothing per request; what it
saves is the prefill, ``prefill_seconds(prompt, 0) − prefill_seconds(prompt − cached, cached)``
(the router's prefill model) at the replica's price per second. Cache writes cost nothing
extra (the KV is written by the prefill anyway).

Break-even (the source texts' walkthrough): a prefix of ``P`` tokens written once and read
``k`` times costs ``P·(w + r·k)`` with the cache and ``P·(1 + k)`` without, so caching pays
when ``k > (w − 1) / (1 − r)``: more than 0.2777… reads for the 5-minute TTL (1.25x, 0.1x),
more than 1.111… for the 1-hour TTL (2x, 0.1x).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.cost.price_book import HostedPrice, ModelPrice, SelfHostedPrice
from router.routing.policy import prefill_seconds

MTOK = 1_000_000


@dataclass(frozen=True, slots=True)
class Usage:
    """One response's token counts. ``cache_write_tokens`` are prompt tokens written to a
    hosted API's cache with ``cache_ttl`` (OpenAI-compatible workers do not report writes:
    see :func:`assume_full_prompt_writes`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    cache_ttl: str = "5m"

    def __post_init__(self) -> None:
        prompt, completion, cached, written = (self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                                               self.cache_write_tokens)
        # one test for the usual case (plain ints, none negative): one usage a request is built
        if not (type(prompt) is int and type(completion) is int and type(cached) is int and type(written) is int
                and prompt >= 0 and completion >= 0 and cached >= 0 and written >= 0):
            for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "cache_write_tokens"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.cached_tokens + self.cache_write_tokens > self.prompt_tokens:
            raise ValueError(f"cached ({self.cached_tokens}) + written ({self.cache_write_tokens}) tokens "
                             f"exceed the prompt ({self.prompt_tokens})")


@dataclass(frozen=True, slots=True)
class PricedUsage:
    """One response in USD: the parts of the actual cost and the no-cache counterfactual."""

    input_usd: float
    cache_read_usd: float
    cache_write_usd: float
    output_usd: float
    no_cache_usd: float

    @property
    def total_usd(self) -> float:
        """What the response cost."""
        return self.input_usd + self.cache_read_usd + self.cache_write_usd + self.output_usd

    @property
    def saved_usd(self) -> float:
        """What caching saved on it (negative when a write premium was not earned back)."""
        return self.no_cache_usd - self.total_usd


def _count(value: Any) -> int:
    """A token count as reported: a non-negative int (not a bool), else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def usage_from_openai(usage: Mapping[str, Any] | None) -> Usage:
    """A :class:`Usage` from an OpenAI ``usage`` object (``prompt_tokens_details.cached_tokens``).

    Anthropic-style ``cache_creation_input_tokens`` / ``cache_read_input_tokens`` are read too
    when present (there ``input_tokens`` excludes both). Missing or malformed counts are 0.
    """
    return Usage(*openai_counts(usage))


def openai_counts(usage: Mapping[str, Any] | None) -> tuple[int, int, int, int]:
    """:func:`usage_from_openai`'s counts, ``(prompt, completion, cached, written)``, without
    building the :class:`Usage` (they are always a valid one: cached and written tokens within
    the prompt)."""
    if type(usage) is not dict and not isinstance(usage, Mapping):  # (a dict: no ABC check)
        return 0, 0, 0, 0
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if type(details) is dict or isinstance(details, Mapping) else 0
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        read, written = _count(usage.get("cache_read_input_tokens")), _count(usage.get("cache_creation_input_tokens"))
        prompt = _count(usage.get("input_tokens")) + read + written
        return prompt, _count(usage.get("output_tokens")), read, written
    prompt = _count(usage.get("prompt_tokens"))
    return prompt, _count(usage.get("completion_tokens")), min(cached, prompt), 0


def assume_full_prompt_writes(usage: Usage, price: HostedPrice, ttl: str = "5m") -> Usage:
    """``usage`` with every uncached prompt token written to the cache (a breakpoint at the
    prompt's end, or automatic caching), unless the prompt is below the model's minimum.

    What a hosted API would bill for traffic whose writes nobody reported: an upper bound of
    the write premium (a breakpoint placed at the end of the shared prefix writes less).
    """
    if usage.prompt_tokens < price.min_cacheable_tokens:
        return Usage(usage.prompt_tokens, usage.completion_tokens, 0, 0, ttl)
    return Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                 usage.prompt_tokens - usage.cached_tokens, ttl)


def price_hosted(usage: Usage, price: HostedPrice) -> PricedUsage:
    """The bill of ``usage`` on a hosted model (module docstring)."""
    per_token = price.input_per_mtok / MTOK
    plain = usage.prompt_tokens - usage.cached_tokens - usage.cache_write_tokens
    output = usage.completion_tokens * price.output_per_mtok / MTOK
    return PricedUsage(
        input_usd=plain * per_token,
        cache_read_usd=usage.cached_tokens * per_token * price.cache_read_multiplier,
        cache_write_usd=usage.cache_write_tokens * per_token * price.write_multiplier(usage.cache_ttl),
        output_usd=output,
        no_cache_usd=usage.prompt_tokens * per_token + output)


def prefill_gpu_seconds(price: SelfHostedPrice, prompt_tokens: int, cached_tokens: int) -> float:
    """Seconds of one replica the prefill of ``prompt_tokens`` takes with ``cached_tokens`` cached."""
    return prefill_seconds(prompt_tokens - cached_tokens, cached_tokens, price.prefill_tokens_per_s,
                           price.attention_knee_tokens)


def price_self_hosted(usage: Usage, price: SelfHostedPrice) -> PricedUsage:
    """The GPU time of ``usage`` on a self-hosted model, in USD (module docstring).

    Output is priced at the replica's batched decode throughput when the book gives one,
    else at 0 (what caching changes is the prefill; decode is the same either way).
    """
    rate = price.usd_per_second
    actual = prefill_gpu_seconds(price, usage.prompt_tokens, usage.cached_tokens)
    cold = prefill_gpu_seconds(price, usage.prompt_tokens, 0)
    output = (usage.completion_tokens / price.output_tokens_per_s * rate
              if price.output_tokens_per_s else 0.0)
    return PricedUsage(input_usd=actual * rate, cache_read_usd=0.0, cache_write_usd=0.0,
                       output_usd=output, no_cache_usd=cold * rate + output)


def price_usage(usage: Usage, price: ModelPrice) -> PricedUsage:
    """The price of ``usage`` on a hosted or self-hosted model."""
    if isinstance(price, SelfHostedPrice):
        return price_self_hosted(usage, price)
    return price_hosted(usage, price)


def break_even_reads(write_multiplier: float, read_multiplier: float) -> float:
    """The read count above which a written prefix pays: ``(w − 1) / (1 − r)``.

    ``inf`` when reads cost as much as plain input (``r >= 1``) and writes cost anything
    extra: caching never pays then. A value <= 0 means any use pays (no write premium).
    """
    premium = write_multiplier - 1.0
    discount = 1.0 - read_multiplier
    if discount <= 0.0:
        return math.inf if premium >= 0.0 else -math.inf
    return premium / discount


def min_paying_reads(write_multiplier: float, read_multiplier: float) -> int | None:
    """The fewest reads (an integer) at which writing a prefix costs strictly less than not
    caching it: the smallest ``k`` with ``w + r·k < 1 + k``. None when no count pays."""
    threshold = break_even_reads(write_multiplier, read_multiplier)
    if threshold == math.inf:
        return None
    if threshold < 0.0:
        return 0
    return math.floor(threshold) + 1


def prefix_reuse_cost(prefix_tokens: int, question_tokens: int, requests: int,
                      write_multiplier: float, read_multiplier: float) -> tuple[float, float]:
    """The walkthrough of the source texts, in units of the input price per token.

    ``requests`` requests share a ``prefix_tokens`` prefix (all within its TTL) and add
    ``question_tokens`` each: (cost without caching, cost with the first request writing the
    prefix and the rest reading it).
    """
    if requests <= 0:
        return 0.0, 0.0
    without = requests * (prefix_tokens + question_tokens)
    with_cache = (prefix_tokens * write_multiplier + question_tokens
                  + (requests - 1) * (prefix_tokens * read_multiplier + question_tokens))
    return float(without), with_cache
