"""Sizing the KV pool: vLLM's GPU-memory rule as a pure function, the CPU default, the dtype choice.

The CUDA path of the model runner measures free memory before and after loading the weights and
hands the numbers to :func:`kv_blocks_for_gpu`; these tests give it the numbers of an 80 GiB
GPU serving Llama-3-8B so the rule is checked without a GPU.
"""
from __future__ import annotations

import pytest
import torch

from worker.engine.config import DEFAULT_KV_BLOCKS, ModelConfig
from worker.engine.errors import ModelLoadError
from worker.engine.kv_sizing import (GIB, activation_bytes, kv_block_bytes, kv_blocks_for_cpu, kv_blocks_for_gpu,
                                     kv_blocks_for_memory)
from worker.engine.model.loader import resolve_dtype

LLAMA_3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         torch_dtype="bfloat16")


def test_a_llama_3_8b_kv_entry_is_128_kib_per_token_in_bfloat16_and_twice_that_in_float32():
    assert kv_block_bytes(LLAMA_3_8B, 1, 2) == 128 * 1024  # docs/operations.md "Sizing"
    assert kv_block_bytes(LLAMA_3_8B, 16, 4) == 2 * 16 * 128 * 1024


def test_the_kv_pool_gets_the_budget_left_after_weights_and_activations():
    block = kv_block_bytes(LLAMA_3_8B, 16, 2)  # 2 MiB
    total = 80 * GIB
    weights = 15 * GIB  # what loading took: free before - free after
    reserve = 1 * GIB
    blocks = kv_blocks_for_gpu(total, free_before_load=79 * GIB, free_after_load=64 * GIB, utilization=0.9,
                               block_bytes=block, reserved_activation_bytes=reserve)
    assert blocks == (int(total * 0.9) - weights - reserve) // block == 28672  # 56 GiB of 2 MiB blocks


def test_another_process_on_the_gpu_does_not_shrink_the_budget_if_it_leaves_enough_free():
    block = kv_block_bytes(LLAMA_3_8B, 16, 2)
    alone = kv_blocks_for_gpu(80 * GIB, 79 * GIB, 64 * GIB, 0.5, block, GIB)
    shared = kv_blocks_for_gpu(80 * GIB, 41 * GIB, 26 * GIB, 0.5, block, GIB)  # 38 GiB held by someone else
    assert alone == shared == (40 * GIB - 16 * GIB) // block


def test_a_gpu_with_less_free_memory_than_the_budget_is_refused_with_the_numbers():
    with pytest.raises(ModelLoadError, match=r"30.00 GiB free of 80.00 GiB.*--gpu-memory-utilization 0.9.*72.00 GiB"):
        kv_blocks_for_gpu(80 * GIB, 30 * GIB, 15 * GIB, 0.9, 2 * 1024 * 1024, GIB)


def test_weights_that_leave_no_room_for_one_block_are_refused():
    with pytest.raises(ModelLoadError, match="no room for the KV cache"):
        kv_blocks_for_gpu(16 * GIB, 16 * GIB, 1 * GIB, 0.9, 2 * 1024 * 1024, GIB)


def test_the_activation_reserve_grows_with_the_step_budget_and_covers_the_samplers_logits():
    small = activation_bytes(LLAMA_3_8B, 512, 1, 2)
    big = activation_bytes(LLAMA_3_8B, 2048, 32, 2)
    assert small < big
    assert big >= 32 * 128256 * 4 * 3
    assert 0.3 * GIB < big < 1 * GIB  # of the order vLLM's profiling finds for an 8B model


def test_a_cpu_replica_gets_512_mib_of_kv_at_most_4096_blocks():
    assert kv_blocks_for_cpu(256 * 1024) == 2048
    assert kv_blocks_for_cpu(1024) == DEFAULT_KV_BLOCKS
    assert kv_blocks_for_memory(16 * 1024 * 1024, 1024 * 1024) == 16
    with pytest.raises(ModelLoadError, match="too small for one block"):
        kv_blocks_for_memory(1000, 1024)


@pytest.mark.parametrize("requested, checkpoint, device, expected", [
    ("auto", "bfloat16", "cuda", torch.bfloat16),
    ("auto", "float16", "cuda:1", torch.float16),
    ("auto", "float32", "cuda", torch.float32),
    ("auto", "bfloat16", "cpu", torch.float32),
    ("float16", "bfloat16", "cuda", torch.float16),
    ("bfloat16", "float32", "cpu", torch.bfloat16),
])
def test_dtype_auto_is_the_checkpoints_on_an_accelerator_and_float32_on_a_cpu(requested, checkpoint, device,
                                                                               expected):
    assert resolve_dtype(requested, checkpoint, device) is expected


def test_a_checkpoint_dtype_the_engine_cannot_run_asks_for_an_explicit_dtype():
    with pytest.raises(ModelLoadError, match="choose one with --dtype"):
        resolve_dtype("auto", "float8_e4m3fn", "cuda")


def test_the_lora_slot_reserve_is_what_the_slots_allocate():
    from worker.engine.kv_sizing import lora_slot_bytes
    from worker.engine.lora.weights import LoRASlotWeights
    from worker.engine.model.presets import preset_config

    config = preset_config("tiny")
    slots = LoRASlotWeights(config, max_loras=3, max_rank=8, dtype=torch.bfloat16, device="cpu")
    assert lora_slot_bytes(config, 3, 8, 2) == slots.num_bytes > 0
