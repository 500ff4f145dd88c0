"""Sequence: one request's state inside the engine (tokens, progress, blocks, timings)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.engine.kv_cache.hashing import hash_block_tokens
from worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.engine.kv_cache.block_pool import KVCacheBlock
    from worker.engine.lora.adapter import LoRAAdapter


class SequenceStatus(enum.Enum):
    """Where a request is: queued, scheduled, or done (and why)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass(eq=False, slots=True)
class Sequence:
    """A request's tokens and progress.

    ``num_computed_tokens`` counts tokens whose KV is written (cache hits included); after a
    preemption it drops to 0 and the prompt plus the tokens generated so far are recomputed.
    ``num_cached_tokens`` is the prefix-cache hit of the request's first scheduling (what
    ``usage.prompt_tokens_details.cached_tokens`` reports). ``lora`` is the adapter the request
    runs with (None: the base model); ``namespace`` then already includes its identity.
    ``slot_wait_since`` is when the scheduler first found no GPU slot for that adapter.
    ``num_loaded_tokens`` is the part of ``num_cached_tokens`` loaded from the CPU KV tier (the
    rest was a GPU hit).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    namespace: int = 0
    lora: "LoRAAdapter | None" = None
    max_total_tokens: int = 1 << 62
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_loaded_tokens: int = 0
    blocks: list["KVCacheBlock"] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    slot_wait_since: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to prefill (or 1 for a decode step)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def lora_name(self) -> str | None:
        """The adapter's name, None for the base model."""
        return self.lora.name if self.lora is not None else None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def hash_blocks(self, block_size: int, num_blocks: int) -> None:
        """Extend ``block_hashes`` to the first ``num_blocks`` blocks (full ones) of ``token_ids``.

        Hashed on demand, by the KV-cache manager, only as far as a lookup or a registration needs.
        """
        hashes = self.block_hashes
        parent = hashes[-1] if hashes else None
        tokens = self.token_ids
        for i in range(len(hashes), num_blocks):
            parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size], self.namespace)
            hashes.append(parent)
