"""EngineStats (the engine's load and counters) and SpeedMeter (measured prefill/decode speed)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class EngineStats:
    """A snapshot of load, capacity, measured speed and cumulative counters.

    Blocks: ``free_blocks`` hold nothing, ``cached_blocks`` hold reusable KV but no live
    request references them (both are allocatable; cached ones are evicted LRU first-to-last),
    ``used_blocks`` are referenced by live requests; the three add up to ``total_blocks``.
    ``kv_usage`` = used / total. ``queued_prefill_tokens`` are uncomputed prompt (or recompute)
    tokens of waiting and partially prefilled requests; ``running_tokens`` the context tokens of
    running requests. ``prefill_tokens_per_s`` and ``decode_step_s`` are EMAs over recent steps
    (the configured defaults until measured; ``speed_measured`` says which).
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
        }


class SpeedMeter:
    """Exponential moving averages of prefill throughput and decode step time.

    A pure-decode step updates ``decode_step_s``. A step with at least ``min_prefill_tokens``
    prefill tokens updates ``prefill_tokens_per_s`` with ``tokens / (duration - decode share)``,
    the decode share being the current decode step estimate when the step also decoded (never
    more than half the step). Small prefill chunks are skipped: fixed per-step overhead would
    make them look slow.

    Once measured, a sample more than ``max_jump`` times off the current estimate is clipped to
    that factor before averaging. A stall (the process stopped, swapped or paused mid-step)
    makes one step look hundreds of times slower; unclipped, it would make the worker look so
    slow that a router never sends it the work that would correct the estimate. A real change
    of speed still comes through, over a few steps.
    """

    def __init__(self, prefill_tokens_per_s: float, decode_step_s: float, alpha: float = 0.2,
                 min_prefill_tokens: int = 32, max_jump: float = 10.0) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_step_s = decode_step_s
        self.alpha = alpha
        self.min_prefill_tokens = min_prefill_tokens
        self.max_jump = max_jump
        self.prefill_measured = False
        self.decode_measured = False

    def observe(self, duration_s: float, prefill_tokens: int, decode_seqs: int) -> None:
        """Fold one step's duration into the averages."""
        if duration_s <= 0:
            return
        if prefill_tokens == 0 and decode_seqs > 0:
            self.decode_step_s = self._ema(self.decode_step_s, duration_s, self.decode_measured)
            self.decode_measured = True
        elif prefill_tokens >= self.min_prefill_tokens:
            decode_share = min(self.decode_step_s, duration_s / 2) if decode_seqs else 0.0
            rate = prefill_tokens / (duration_s - decode_share)
            self.prefill_tokens_per_s = self._ema(self.prefill_tokens_per_s, rate, self.prefill_measured)
            self.prefill_measured = True

    def _ema(self, old: float, new: float, measured: bool) -> float:
        if not measured:
            return new
        new = min(max(new, old / self.max_jump), old * self.max_jump)
        return (1 - self.alpha) * old + self.alpha * new
