"""The seam between scheduling and compute: what a step asks of a runner, what it returns.

``ModelRunner.execute(batch)`` computes the scheduled tokens of every sequence in ``batch``
and returns one sampled token per sequence whose ``samples`` flag is set. The torch runner
(:mod:`worker.engine.model_runner`) runs the model and the sampler; the simulated worker's runner
only reads the counts and returns deterministic tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.engine.lora.adapter import LoRAAdapter


@dataclass(slots=True)
class TokenLogprob:
    """A sampled token's logprob and the top alternatives ``[(token_id, logprob), ...]``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step.

    The step computes tokens ``num_computed_tokens .. num_computed_tokens +
    num_scheduled_tokens - 1`` (``new_token_ids``); the KV of the first ``num_computed_tokens``
    positions (cache hits included) is already in ``block_ids``. ``samples`` is True when the
    step reaches the sequence's last known token, so a new token is sampled.
    ``prompt_token_ids`` is the request's whole prompt (the engine's list, read-only): a runner
    that answers per prompt (the simulator's recorded-answer mode) reads it. ``lora_slot`` is
    the GPU slot of the sequence's adapter (0: the base model).
    """

    request_id: str
    new_token_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list[int]
    is_prefill: bool
    samples: bool
    sampling_params: SamplingParams
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)
    lora_slot: int = 0

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache after this step."""
        return self.num_computed_tokens + self.num_scheduled_tokens


@dataclass(slots=True)
class ScheduledBatch:
    """Everything one engine step computes, plus requests finished since the previous step.

    ``lora_loads``: ``(slot, adapter)`` assignments the runner applies before computing this
    step (copy the adapter's weights into the slot): adapters load between steps.
    ``kv_stores`` (``(gpu_block_id, host_slot)``) and then ``kv_loads`` (``(host_slot,
    gpu_block_id)``) are the CPU KV tier's copies, run before the model in that order: a stored
    block may be one this step overwrites, a loaded one is read by it.
    """

    seqs: list[ScheduledSequence] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    block_size: int = 16
    lora_loads: list[tuple[int, "LoRAAdapter"]] = field(default_factory=list)
    kv_stores: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs if s.is_prefill)

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for s in self.seqs if not s.is_prefill)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass(slots=True)
class RunnerOutput:
    """Sampled token (and optional logprobs) per request id that sampled this step.

    ``step_s``: the step's duration when the runner knows it better than the engine's wall
    clock (the simulated runner: its modelled time over the time scale); None = measure it.
    ``lora_load_s``: the part of the step spent loading adapters into slots (the engine keeps
    it out of its speed measurements and reports it as the slot load time).
    ``kv_stores_ok``: False when the batch's KV stores failed (none of them may be loaded);
    ``kv_load_s`` / ``kv_copy_s``: the seconds the KV loads / all KV copies took (the engine
    measures the tier's bandwidth with the first and keeps the second out of its speed).
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    step_s: float | None = None
    lora_load_s: float = 0.0
    kv_stores_ok: bool = True
    kv_load_s: float = 0.0
    kv_copy_s: float = 0.0


class ModelRunner(Protocol):
    """Computes a :class:`ScheduledBatch`. Implementations own their KV tensors (if any)."""

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Run one step; return a token for every sequence with ``samples`` set."""
        ...
