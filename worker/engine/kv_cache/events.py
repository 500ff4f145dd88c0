"""KV-cache events: what the engine's prefix cache gained or lost, in engine block hashes.

``medium`` says which tier: ``gpu`` (the device block pool) or ``cpu`` (the host tier below it,
worker/engine/kv_cache/host_pool.py), as vLLM's, llm-d's and Dynamo's events say it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

MEDIUM_GPU = "gpu"
MEDIUM_CPU = "cpu"


@dataclass(slots=True)
class BlockStored:
    """These blocks' KV is now written and reusable (emitted after the step that computed it).

    ``lora_name``: the LoRA adapter that computed them (vLLM's field; None: the base model).
    """

    block_hashes: list[int] = field(default_factory=list)
    lora_name: str | None = None
    medium: str = MEDIUM_GPU


@dataclass(slots=True)
class BlockRemoved:
    """These blocks were evicted; their hashes name nothing in this engine any more."""

    block_hashes: list[int] = field(default_factory=list)
    medium: str = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: nothing is cached."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
