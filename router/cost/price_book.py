"""The price book: what one token costs on each model, hosted or self-hosted (YAML).

A hosted model is priced per token, with the prompt-caching multipliers of the hosted APIs
(cache writes cost more than plain input, reads much less)::

    models:
      example-hosted:
        input_per_mtok: 3.00              # USD per million prompt tokens
        output_per_mtok: 15.00            # USD per million completion tokens
        cache_read_multiplier: 0.1        # a cached-prefix read costs 0.1 x the input price
        cache_write_5m_multiplier: 1.25   # writing a prefix with the 5-minute TTL: 1.25 x
        cache_write_1h_multiplier: 2.0    # ... with the 1-hour TTL: 2 x
        min_cacheable_tokens: 1024        # shorter prompts are silently not cached

A self-hosted model costs GPU time; a cached prefix saves its prefill, which the router's own
prefill model turns into seconds (``n·(1 + (c + n/2)/knee) / tokens_per_s`` for ``n`` new
tokens after ``c`` cached ones) and the GPU price into money::

      llama-3-8b:
        self_hosted:
          usd_per_gpu_hour: 2.50
          gpus: 1                         # GPUs per replica (tensor parallelism)
          prefill_tokens_per_s: 11000     # linear-equivalent prefill speed of one replica
          output_tokens_per_s: 2500       # optional: the replica's batched decode throughput
          attention_knee_tokens: 32768    # optional, the router's default

``prefill_tokens_per_s`` may instead come from the simulated worker's latency model
(``gpu: H100-80G`` and ``sim_model: llama-3-8b``): the router cannot import the worker, so
:func:`load_price_book` takes a ``prefill_speed(gpu, sim_model)`` callable, which ``prefixlb
cost`` supplies. The representative multipliers (1.25x, 2x, 0.1x) are those of the source
texts; real prices change by vendor and date, so the book is yours to keep current.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from protocol.messages import ATTENTION_KNEE_TOKENS
from router.yaml_file import read_yaml

TTLS = ("5m", "1h")
_HOSTED_KEYS = {"input_per_mtok", "output_per_mtok", "cache_read_multiplier", "cache_write_5m_multiplier",
                "cache_write_1h_multiplier", "min_cacheable_tokens"}
_SELF_HOSTED_KEYS = {"usd_per_gpu_hour", "gpus", "prefill_tokens_per_s", "output_tokens_per_s",
                     "attention_knee_tokens", "gpu", "sim_model"}

PrefillSpeed = Callable[[str, str], float]


class PriceBookError(ValueError):
    """The price book is malformed; the message names the offending key."""


@dataclass(frozen=True, slots=True)
class HostedPrice:
    """Per-token prices of a hosted API model (USD per million tokens, multipliers of input)."""

    input_per_mtok: float
    output_per_mtok: float
    cache_read_multiplier: float = 0.1
    cache_write_5m_multiplier: float = 1.25
    cache_write_1h_multiplier: float = 2.0
    min_cacheable_tokens: int = 0

    def write_multiplier(self, ttl: str) -> float:
        """The cache-write multiplier of ``ttl`` (``5m`` or ``1h``)."""
        if ttl == "5m":
            return self.cache_write_5m_multiplier
        if ttl == "1h":
            return self.cache_write_1h_multiplier
        raise PriceBookError(f"unknown cache TTL {ttl!r} (known: {', '.join(TTLS)})")


@dataclass(frozen=True, slots=True)
class SelfHostedPrice:
    """GPU-time prices of a model this fleet serves itself."""

    usd_per_gpu_hour: float
    prefill_tokens_per_s: float
    gpus: int = 1
    output_tokens_per_s: float | None = None
    attention_knee_tokens: float = ATTENTION_KNEE_TOKENS

    @property
    def usd_per_second(self) -> float:
        """What one second of one replica costs."""
        return self.usd_per_gpu_hour * self.gpus / 3600.0


ModelPrice = HostedPrice | SelfHostedPrice


@dataclass(frozen=True, slots=True)
class PriceBook:
    """Prices by model name. ``name`` labels the book in reports."""

    models: Mapping[str, ModelPrice] = field(default_factory=dict)
    name: str = "price book"

    def get(self, model: str) -> ModelPrice | None:
        """The price of ``model``, or None when the book does not list it."""
        return self.models.get(model)

    def __contains__(self, model: object) -> bool:
        return model in self.models


def _number(where: str, value: Any, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PriceBookError(f"{where}: expected a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise PriceBookError(f"{where}: must be {bound}, got {value!r}")
    return float(value)


def _unknown(where: str, entry: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(entry) - allowed)
    if extra:
        raise PriceBookError(f"{where}: unknown key(s) {', '.join(map(repr, extra))} "
                             f"(allowed: {', '.join(sorted(allowed))})")


def _hosted(where: str, entry: Mapping[str, Any]) -> HostedPrice:
    _unknown(where, entry, _HOSTED_KEYS)
    for key in ("input_per_mtok", "output_per_mtok"):
        if key not in entry:
            raise PriceBookError(f"{where}: missing {key!r}")
    defaults = HostedPrice(0.0, 0.0)
    read = _number(f"{where}.cache_read_multiplier", entry.get("cache_read_multiplier",
                                                                 defaults.cache_read_multiplier))
    write_5m = _number(f"{where}.cache_write_5m_multiplier",
                       entry.get("cache_write_5m_multiplier", defaults.cache_write_5m_multiplier))
    write_1h = _number(f"{where}.cache_write_1h_multiplier",
                       entry.get("cache_write_1h_multiplier", defaults.cache_write_1h_multiplier))
    min_tokens = entry.get("min_cacheable_tokens", 0)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise PriceBookError(f"{where}.min_cacheable_tokens: expected an integer >= 0, got {min_tokens!r}")
    return HostedPrice(_number(f"{where}.input_per_mtok", entry["input_per_mtok"]),
                       _number(f"{where}.output_per_mtok", entry["output_per_mtok"]),
                       read, write_5m, write_1h, min_tokens)


def _self_hosted(where: str, entry: Any, prefill_speed: PrefillSpeed | None) -> SelfHostedPrice:
    if not isinstance(entry, Mapping):
        raise PriceBookError(f"{where}: expected a mapping, got {type(entry).__name__}")
    _unknown(where, entry, _SELF_HOSTED_KEYS)
    if "usd_per_gpu_hour" not in entry:
        raise PriceBookError(f"{where}: missing 'usd_per_gpu_hour'")
    if "prefill_tokens_per_s" in entry:
        speed = _number(f"{where}.prefill_tokens_per_s", entry["prefill_tokens_per_s"], strict=True)
    elif "gpu" in entry and "sim_model" in entry:
        if prefill_speed is None:
            raise PriceBookError(f"{where}: 'gpu' + 'sim_model' need the latency model, which only "
                                 "`prefixlb cost` reads; give 'prefill_tokens_per_s' instead")
        try:
            speed = float(prefill_speed(str(entry["gpu"]), str(entry["sim_model"])))
        except (KeyError, ValueError) as exc:
            raise PriceBookError(f"{where}: {exc}") from None
    else:
        raise PriceBookError(f"{where}: give 'prefill_tokens_per_s' (or 'gpu' and 'sim_model')")
    gpus = entry.get("gpus", 1)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PriceBookError(f"{where}.gpus: expected an integer >= 1, got {gpus!r}")
    out = entry.get("output_tokens_per_s")
    return SelfHostedPrice(
        _number(f"{where}.usd_per_gpu_hour", entry["usd_per_gpu_hour"]), speed, gpus,
        None if out is None else _number(f"{where}.output_tokens_per_s", out, strict=True),
        _number(f"{where}.attention_knee_tokens", entry.get("attention_knee_tokens", ATTENTION_KNEE_TOKENS),
                strict=True))


def parse_price_book(data: Any, name: str = "price book",
                     prefill_speed: PrefillSpeed | None = None) -> PriceBook:
    """Validate a decoded price book (``{"models": {name: entry}}``); raise PriceBookError."""
    if not isinstance(data, Mapping) or set(data) - {"models", "name"}:
        raise PriceBookError(f"{name}: expected a mapping with 'models' (and optionally 'name')")
    models = data.get("models")
    if not isinstance(models, Mapping) or not models:
        raise PriceBookError(f"{name}: 'models' must be a non-empty mapping of model name to prices")
    out: dict[str, ModelPrice] = {}
    for model, entry in models.items():
        where = f"models.{model}"
        if not isinstance(model, str) or not model:
            raise PriceBookError(f"{name}: model names must be non-empty strings, got {model!r}")
        if not isinstance(entry, Mapping):
            raise PriceBookError(f"{where}: expected a mapping, got {type(entry).__name__}")
        if "self_hosted" in entry:
            if len(entry) != 1:
                raise PriceBookError(f"{where}: 'self_hosted' excludes per-token prices")
            out[model] = _self_hosted(f"{where}.self_hosted", entry["self_hosted"], prefill_speed)
        else:
            out[model] = _hosted(where, entry)
    label = data.get("name", name)
    return PriceBook(out, str(label))


def load_price_book(path: str | Path, prefill_speed: PrefillSpeed | None = None) -> PriceBook:
    """Read and validate the YAML price book at ``path`` (named after the file unless it says)."""
    return parse_price_book(read_yaml(path, PriceBookError, "price book"), Path(path).stem, prefill_speed)


# The source texts' representative multipliers, input side only, in units of the input price
# (1 USD per million tokens): the book `prefixlb cost` uses when none is given.
REFERENCE_BOOK = PriceBook({"reference": HostedPrice(1.0, 0.0, 0.1, 1.25, 2.0, 0)}, "reference")
