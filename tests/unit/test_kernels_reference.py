"""The torch references (kernels/attention_ref.py) against independent dense attention.

The references are the CPU engine's attention and the ground truth of the Triton tests, so they
are checked here against `scaled_dot_product_attention` on KV gathered token by token (a
different path from the references' block gather), plus exact small cases.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import attention_ref

# fp32 references compute in fp32: only summation order differs from SDPA.
FP32_ATOL = 2e-5


def _token_gather(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """KV of tokens 0..length-1 read one slot at a time: `[length, kv_heads, head_dim]`."""
    bs = cache.shape[1]
    return torch.stack([cache[table[t // bs], t % bs] for t in range(length)])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask=None):
    """q `[n, Hq, D]`, k/v `[T, Hkv, D]` -> `[n, Hq, D]` through torch's SDPA with GQA."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


def _cache(num_blocks=12, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen, dtype=dtype), torch.randn(shape, generator=gen, dtype=dtype)


def test_write_kv_puts_each_token_at_block_and_offset_of_its_slot_and_skips_negative_slots():
    k_cache = torch.zeros(4, 2, 1, 1)
    v_cache = torch.zeros(4, 2, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    v = -k
    slots = torch.tensor([7, -1, 2], dtype=torch.int64)  # block 3 offset 1; padding; block 1 offset 0

    attention_ref.write_kv(k, v, k_cache, v_cache, slots)

    assert k_cache.flatten().tolist() == [0, 0, 3, 0, 0, 0, 0, 1]
    assert v_cache.flatten().tolist() == [0, 0, -3, 0, 0, 0, 0, -1]


def test_decode_over_a_single_token_context_returns_that_tokens_value():
    k_cache, v_cache = _cache()
    q = torch.randn(1, 4, 8)
    table = torch.tensor([[5, 0, 0]], dtype=torch.int32)

    out = attention_ref.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([1], dtype=torch.int32), 0.3)

    expected = v_cache[5, 0].repeat_interleave(2, dim=0)  # 4 query heads over 2 kv heads
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0)


def test_decode_matches_sdpa_with_gqa_shared_and_scattered_blocks_and_ragged_lengths():
    k_cache, v_cache = _cache(num_blocks=12, block_size=4, kv_heads=2, head_dim=8)
    # Sequence 0 and 1 share blocks 9 and 3 (a common prefix); -1 pads unused entries.
    tables = [[9, 3, 11, 0], [9, 3, 6, -1], [2, -1, -1, -1]]
    lens = [13, 9, 3]
    q = torch.randn(3, 8, 8)

    out = attention_ref.paged_decode_attention(
        q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), 0.25
    )

    for s in range(3):
        k = _token_gather(k_cache, tables[s], lens[s])
        v = _token_gather(v_cache, tables[s], lens[s])
        expected = _sdpa(q[s : s + 1], k, v, 0.25)
        torch.testing.assert_close(out[s : s + 1], expected, rtol=0, atol=FP32_ATOL)


def test_decode_of_a_zero_length_padding_row_is_zero():
    k_cache, v_cache = _cache()
    q = torch.randn(2, 2, 8)
    out = attention_ref.paged_decode_attention(
        q, k_cache, v_cache, torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32), 1.0
    )
    assert torch.equal(out[1], torch.zeros(2, 8))
    assert torch.isfinite(out).all()


def test_extend_attends_to_cached_prefix_and_causally_to_new_tokens():
    k_cache, v_cache = _cache(num_blocks=12, block_size=4, kv_heads=1, head_dim=8)
    tables = [[4, 8, 1, 0], [10, 2, -1, -1]]
    lens = [14, 5]  # seq 0: 10 cached + 4 new; seq 1: no prefix, 5 new
    starts = [0, 4, 9]
    q = torch.randn(9, 4, 8)

    out = attention_ref.prefix_extend_attention(
        q, k_cache, v_cache,
        torch.tensor(tables, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), 0.5,
    )

    for s in range(2):
        n, length = starts[s + 1] - starts[s], lens[s]
        k = _token_gather(k_cache, tables[s], length)
        v = _token_gather(v_cache, tables[s], length)
        mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        expected = _sdpa(q[starts[s] : starts[s + 1]], k, v, 0.5, mask)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]], expected, rtol=0, atol=FP32_ATOL)


def test_extend_of_one_new_token_equals_decode():
    k_cache, v_cache = _cache()
    tables = torch.tensor([[3, 7, 5], [1, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 6], dtype=torch.int32)
    q = torch.randn(2, 4, 8)

    extend = attention_ref.prefix_extend_attention(
        q, k_cache, v_cache, tables, torch.tensor([0, 1, 2], dtype=torch.int32), lens, 0.4
    )
    decode = attention_ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.4)

    torch.testing.assert_close(extend, decode, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_decode_in_half_precision_returns_the_query_dtype_close_to_fp32(dtype, atol):
    # The reference computes in fp32 and rounds once at the end, so it stays within one
    # rounding step (of values of magnitude ~1) of the fp32 result computed from the same inputs.
    k_cache, v_cache = _cache(dtype=dtype)
    q = torch.randn(2, 4, 8).to(dtype)
    tables = torch.tensor([[3, 7, 5], [1, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 6], dtype=torch.int32)

    out = attention_ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.4)
    full = attention_ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.4)

    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), full, rtol=0, atol=atol)
