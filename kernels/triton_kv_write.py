"""Triton KV write: scatter each new token's K and V into its slot of the paged cache.

Same contract as `kernels.attention_ref.write_kv`. One program per token copies all of the
token's KV heads; a negative slot (padding) writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k_tok, stride_k_head, stride_k_dim,
    stride_v_tok, stride_v_head, stride_v_dim,
    stride_kc_block, stride_kc_off, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_off, stride_vc_head, stride_vc_dim,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # block_id * stride_block overflows int32 on large pools: the slot is int64 from here on.
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # The slot test is broadcast through `heads` because Triton's interpreter rejects a mask
    # built from a scalar boolean (it is the same mask either way).
    mask = (heads < num_kv_heads) & (dims < head_dim) & (heads * 0 + slot >= 0)

    k = tl.load(k_ptr + token * stride_k_tok + heads * stride_k_head + dims * stride_k_dim, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + heads * stride_v_head + dims * stride_v_dim, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_off + heads * stride_kc_head + dims * stride_kc_dim
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_off + heads * stride_vc_head + dims * stride_vc_dim
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter `k`, `v` (`[num_tokens, num_kv_heads, head_dim]`) into the caches at their slots.

    `slot_mapping`: `[num_tokens]` int64, `block_id * block_size + offset`; negative slots are
    skipped. The caches (`[num_blocks, block_size, num_kv_heads, head_dim]`, any strides) are
    written in place.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads, head_dim, k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
