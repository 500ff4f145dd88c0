"""EngineStats (the engine's load and counters), LoRAStats (its adapters), SpeedMeter (measured speed)."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable

from protocol import ATTENTION_KNEE_TOKENS  # the unit of the measured prefill speed

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.kv_cache.kv_tier import KVTierStats
    from worker.engine.lora.adapter import LoRAAdapter


def prefill_work(chunks: Iterable[tuple[int, int]], knee: float = ATTENTION_KNEE_TOKENS) -> float:
    """Linear-equivalent tokens of prefill chunks ``(new, computed)``: ``sum n * (1 + (c + n/2) / knee)``.

    The router predicts a prefill of ``n`` new tokens over ``c`` cached ones as ``n * (1 + (c +
    n/2) / knee) / rate``; measuring ``rate`` as this work per second (rather than plain tokens per
    second) makes it independent of the context lengths a worker happened to serve, so identical
    GPUs report the same speed.
    """
    total = 0.0
    for n, c in chunks:
        total += n * (1.0 + (c + 0.5 * n) / knee)
    return total


@dataclass(slots=True)
class LoRACounters:
    """Cumulative per-adapter counters (the worker's ``/metrics`` exposes them by adapter name)."""

    requests: int = 0
    disk_loads: int = 0  # read from disk into host memory
    slot_loads: int = 0  # copied from host memory into a GPU slot
    cpu_evictions: int = 0  # host copy dropped (LRU)
    slot_evictions: int = 0  # GPU slot given to another adapter
    slot_wait_s: float = 0.0  # seconds requests spent waiting for a GPU slot


@dataclass(slots=True)
class LoRAStats:
    """Where an engine's adapters are and who waits for them, right now.

    ``adapters``: every adapter served, name -> the first 16 hex digits of its content digest
    (a reloaded name gets a new one). ``gpu``: in a GPU slot; ``cpu``: in host memory but not in
    a slot (the rest are on disk only). ``running`` / ``waiting``: requests per adapter, as
    vLLM's ``running_lora_adapters`` / ``waiting_lora_adapters``. ``disk_load_s`` /
    ``slot_load_s``: measured seconds of one disk -> host read and one host -> slot copy (EMA,
    0 until measured).
    """

    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    adapters: dict[str, str] = field(default_factory=dict)
    gpu: list[str] = field(default_factory=list)
    cpu: list[str] = field(default_factory=list)
    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    counters: dict[str, LoRACounters] = field(default_factory=dict)
    disk_load_s: float = 0.0
    slot_load_s: float = 0.0

    @classmethod
    def of(cls, config: "EngineConfig", adapters: list["LoRAAdapter"], gpu: list[str], cpu: list[str],
           running: Iterable[str | None], waiting: Iterable[str | None], disk_load_s: float,
           slot_load_s: float) -> "LoRAStats":
        """A snapshot (counters copied: the engine keeps counting)."""
        assert config.max_cpu_loras is not None
        return cls(max_loras=config.max_loras, max_cpu_loras=config.max_cpu_loras,
                   max_lora_rank=config.max_lora_rank,
                   adapters={a.name: a.short_digest for a in adapters}, gpu=sorted(gpu), cpu=sorted(cpu),
                   running=dict(sorted(Counter(n for n in running if n).items())),
                   waiting=dict(sorted(Counter(n for n in waiting if n).items())),
                   counters={a.name: replace(a.counters) for a in adapters},
                   disk_load_s=disk_load_s, slot_load_s=slot_load_s)

    def load_report_fields(self) -> dict[str, Any]:
        """The LoRA fields of ``protocol.LoadReport``."""
        return {"max_loras": self.max_loras, "lora_adapters": dict(self.adapters),
                "lora_gpu": list(self.gpu), "lora_cpu": list(self.cpu),
                "lora_running": dict(self.running), "lora_waiting": dict(self.waiting),
                "lora_disk_load_s": self.disk_load_s, "lora_slot_load_s": self.slot_load_s}


@dataclass(slots=True)
class EngineStats:
    """A snapshot of load, capacity, measured speed and cumulative counters.

    Blocks: ``free_blocks`` hold nothing, ``cached_blocks`` hold reusable KV but no live
    request references them (both are allocatable; cached ones are evicted LRU first-to-last),
    ``used_blocks`` are referenced by live requests; the three add up to ``total_blocks``.
    ``kv_usage`` = used / total. ``queued_prefill_tokens`` are uncomputed prompt (or recompute)
    tokens of waiting and partially prefilled requests; ``running_tokens`` the context tokens of
    running requests. ``prefill_tokens_per_s`` (linear-equivalent tokens per second, see
    :func:`prefill_work`) and ``decode_step_s`` are EMAs over recent steps (the configured
    defaults until measured; ``speed_measured`` says which). ``lora`` is None without LoRA.
    ``prefill_tokens_computed``: prompt (and recompute) tokens the model computed;
    ``kv_tier``: the CPU KV tier's state and counters (None without a tier).
    """

    running: int
    waiting: int
    queued_prefill_tokens: int
    running_tokens: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    total_blocks: int
    kv_usage: float
    block_size: int
    capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefill_tokens_per_s: float
    decode_step_s: float
    speed_measured: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished: int
    num_steps: int
    lora: LoRAStats | None = None
    prefill_tokens_computed: int = 0
    kv_tier: "KVTierStats | None" = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_report_fields(self) -> dict[str, Any]:
        """The fields of ``protocol.LoadReport`` this snapshot fills (all but id/status/ts)."""
        return {
            "running": self.running, "waiting": self.waiting,
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "running_tokens": self.running_tokens, "kv_usage": self.kv_usage,
            "free_blocks": self.free_blocks, "total_blocks": self.total_blocks,
            "cached_blocks": self.cached_blocks, "block_size": self.block_size,
            "capacity_tokens": self.capacity_tokens, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_step_s": self.decode_step_s,
            **(self.lora.load_report_fields() if self.lora is not None else {}),
            **({"kv_tier_load_tokens_per_s": self.kv_tier.load_tokens_per_s} if self.kv_tier is not None else {}),
        }


class SpeedMeter:
    """Exponential moving averages of prefill throughput and decode step time.

    A pure-decode step updates ``decode_step_s``. A step with at least ``min_prefill_tokens``
    prefill tokens updates ``prefill_tokens_per_s`` with ``work / (duration - decode share)``.
    The decode share of a step that also decoded is what the router's load model charges for
    it: ``decode_step_s * prefill_tokens / step_tokens`` (a full step's budget of prefill pays
    one decode step; never more than half the step). With ``step_tokens`` 0 every mixed step is
    charged a whole decode step -- too much for a short prefill riding along a decode batch,
    whose step costs hardly more than the decode alone. ``work`` is the step's linear-equivalent prefill tokens
    (:func:`prefill_work`, the unit the router predicts in; plain tokens if the caller does not
    say). Small prefill chunks are skipped: a step's fixed costs (reading the weights, launch
    overhead) would make them look slow, and a worker serving short cache-hit suffixes would
    report a speed its long prefills never see.

    Once measured, a sample more than ``max_jump`` times off the current estimate is clipped to
    that factor before averaging. A stall (the process stopped, swapped or paused mid-step)
    makes one step look hundreds of times slower; unclipped, it would make the worker look so
    slow that a router never sends it the work that would correct the estimate. A real change
    of speed still comes through, over a few steps.
    """

    def __init__(self, prefill_tokens_per_s: float, decode_step_s: float, alpha: float = 0.2,
                 min_prefill_tokens: int = 32, max_jump: float = 10.0, step_tokens: int = 0) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.step_tokens = step_tokens
        self.decode_step_s = decode_step_s
        self.alpha = alpha
        self.min_prefill_tokens = min_prefill_tokens
        self.max_jump = max_jump
        self.prefill_measured = False
        self.decode_measured = False

    def observe(self, duration_s: float, prefill_tokens: int, decode_seqs: int,
                prefill_work: float | None = None) -> None:
        """Fold one step's duration into the averages (``prefill_work`` defaults to the tokens)."""
        if duration_s <= 0:
            return
        if prefill_tokens == 0 and decode_seqs > 0:
            self.decode_step_s = self._ema(self.decode_step_s, duration_s, self.decode_measured)
            self.decode_measured = True
        elif prefill_tokens >= self.min_prefill_tokens:
            share = self.decode_step_s
            if self.step_tokens > 0:
                share *= min(1.0, prefill_tokens / self.step_tokens)
            decode_share = min(share, duration_s / 2) if decode_seqs else 0.0
            work = prefill_tokens if prefill_work is None else prefill_work
            rate = work / (duration_s - decode_share)
            self.prefill_tokens_per_s = self._ema(self.prefill_tokens_per_s, rate, self.prefill_measured)
            self.prefill_measured = True

    def _ema(self, old: float, new: float, measured: bool) -> float:
        if not measured:
            return new
        new = min(max(new, old / self.max_jump), old * self.max_jump)
        return (1 - self.alpha) * old + self.alpha * new


def engine_speed_meter(prefill_tokens_per_s: float, decode_step_s: float, max_num_batched_tokens: int,
                       alpha: float = 0.2) -> SpeedMeter:
    """The :class:`SpeedMeter` an engine with this step budget uses (the simulators too).

    It measures prefill on steps of at least 1/32 of the budget (>= 32 tokens): below that a
    step's time is mostly its fixed costs (an H100 reads Llama-3-8B's weights in ~6 ms, the
    time of ~250 prefill tokens); and charges mixed steps their budget's share of a decode step.
    """
    return SpeedMeter(prefill_tokens_per_s, decode_step_s, alpha,
                      min_prefill_tokens=max(32, max_num_batched_tokens // 32), step_tokens=max_num_batched_tokens)
