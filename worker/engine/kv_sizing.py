"""How many KV blocks one replica gets: ``--kv-blocks``, ``--kv-memory``, or what the device leaves.

On CUDA, without an explicit size, the pool is sized the way vLLM sizes it: the process may use
``gpu_memory_utilization`` of the device's *total* memory (a per-process budget: another process
on the same GPU does not shrink it, but it must leave that much free at start). From that budget
come off what loading the weights took (measured: free memory before minus after) and the peak
activations of one engine step (estimated by :func:`activation_bytes`); the rest is KV::

    total x utilization
    ├── weights (+ CUDA context)      free_before_load - free_after_load
    ├── activations of one step       activation_bytes(...)
    ├── LoRA slots (with LoRA)        lora_slot_bytes(...)
    └── KV cache                      the rest, in whole blocks

On a CPU the pool is at most :data:`DEFAULT_CPU_KV_MEMORY_BYTES` and :data:`DEFAULT_KV_BLOCKS`
blocks: host memory is shared with everything else, and a CPU replica is for trials and tests.
These are pure functions of numbers, so the CUDA rule is tested without a GPU.
"""
from __future__ import annotations

from worker.engine.config import DEFAULT_KV_BLOCKS, ModelConfig
from worker.engine.errors import ModelLoadError

DEFAULT_CPU_KV_MEMORY_BYTES = 512 * 1024 * 1024
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
GIB = 1024 ** 3


def kv_block_bytes(config: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one KV block over all layers (K and V): 2 x layers x block x KV heads x head_dim x dtype."""
    assert config.head_dim is not None
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * dtype_bytes


def activation_bytes(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int) -> int:
    """An upper estimate of one engine step's peak activation memory.

    Per scheduled token, the widest moment of a layer holds the residual stream and its norm
    (2 x hidden), the fused gate/up output and its product (3 x intermediate), and the q/k/v
    and attention outputs; doubled for the allocator's fragmentation and temporaries. The
    sampler works on float32 logits of at most ``max_num_seqs`` rows (logits, probabilities and
    a sorted copy for top-p: 3 x vocab x 4 bytes each).
    """
    assert config.head_dim is not None
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = 2 * config.hidden_size + 3 * config.intermediate_size + 2 * q + 2 * kv
    return 2 * max_num_batched_tokens * per_token * dtype_bytes + 3 * max_num_seqs * config.vocab_size * 4


def lora_slot_bytes(config: ModelConfig, max_loras: int, max_rank: int, dtype_bytes: int) -> int:
    """Device memory of the LoRA slots (worker/engine/lora/weights.py): per layer and target
    module, ``max_loras + 1`` stacks of A (rank x in) and B (out x rank)."""
    from worker.engine.lora.adapter import target_features

    per_layer = sum(max_rank * (in_f + out_f) for in_f, out_f in target_features(config).values())
    return config.num_hidden_layers * (max_loras + 1) * per_layer * dtype_bytes


def kv_blocks_for_gpu(total_bytes: int, free_before_load: int, free_after_load: int, utilization: float,
                      block_bytes: int, reserved_activation_bytes: int) -> int:
    """KV blocks that fit ``utilization`` of a device of ``total_bytes`` (vLLM's rule, see above).

    Raises :class:`ModelLoadError` when the device had less free memory at start than the
    budget asks for, or when the budget leaves no room for a single block after the weights.
    """
    if not 0.0 < utilization <= 1.0:
        raise ModelLoadError(f"gpu_memory_utilization must be in (0, 1], not {utilization}")
    budget = int(total_bytes * utilization)
    if free_before_load < budget:
        raise ModelLoadError(
            f"the GPU has {free_before_load / GIB:.2f} GiB free of {total_bytes / GIB:.2f} GiB, less than "
            f"--gpu-memory-utilization {utilization:g} asks for ({budget / GIB:.2f} GiB): lower it, or free "
            "the GPU from other processes")
    weights = max(0, free_before_load - free_after_load)
    kv_bytes = budget - weights - reserved_activation_bytes
    blocks = kv_bytes // block_bytes if kv_bytes > 0 else 0
    if blocks < 1:
        raise ModelLoadError(
            f"no room for the KV cache: {budget / GIB:.2f} GiB budget (--gpu-memory-utilization "
            f"{utilization:g}) - {weights / GIB:.2f} GiB weights - {reserved_activation_bytes / GIB:.2f} GiB "
            f"activations leaves less than one {block_bytes}-byte block; raise --gpu-memory-utilization, "
            "or lower --max-num-batched-tokens")
    return int(blocks)


def kv_blocks_for_cpu(block_bytes: int) -> int:
    """The default pool of a CPU replica: 512 MiB, at most :data:`DEFAULT_KV_BLOCKS` blocks."""
    return min(DEFAULT_KV_BLOCKS, DEFAULT_CPU_KV_MEMORY_BYTES // block_bytes)


def kv_blocks_for_memory(kv_memory_bytes: int, block_bytes: int) -> int:
    """Blocks in ``kv_memory_bytes`` (``--kv-memory``); ModelLoadError if not even one fits."""
    blocks = kv_memory_bytes // block_bytes
    if blocks < 1:
        raise ModelLoadError(f"KV memory too small for one block ({block_bytes} bytes)")
    return blocks
