"""Triton prefix-extend attention: prefill of new tokens on top of a cached, paged prefix.

Same contract as `kernels.attention_ref.prefix_extend_attention`. This is what makes a prefix-cache
hit cheap: only the new tokens are queries; the cached prefix is only read.

Grid: `(num_seqs, num_heads, cdiv(max_query_len, BLOCK_M))`, tiles 64x64 on CUDA, 32x32 on CPU. A program owns `BLOCK_M` new tokens
of one sequence and one query head, and streams that sequence's keys from the cache in tiles of
`BLOCK_N` (flash-attention online softmax, base 2):

    keys:     0 ...................... prefix_len ........ context_len
              |--- cached prefix: no mask ---|--- new tokens: causal mask ---|
    queries:                                 |== BLOCK_M rows ==|

Tiles entirely below the program's first query position need no causal mask; the rest are masked
with `key_pos <= query_pos`. Every valid query row sees key 0 in the first tile, so the running
maximum is finite before any fully masked tile comes and no NaN arises.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_decode import LOG2_E, _dot_precision

# (BLOCK_M, BLOCK_N): larger tiles on a GPU for more reuse per load; small ones on CPU, where the
# interpreter's cost grows with tile area and test shapes are short.
CUDA_TILES = (64, 64)
CPU_TILES = (32, 32)


@triton.jit
def _attend_tile(
    q, m, l, acc, tile, query_pos,
    table, k_cache_ptr, v_cache_ptr, kv_head, d, dim_ok,
    stride_bt_blk, stride_kc_block, stride_kc_off, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_off, stride_vc_head, stride_vc_dim,
    block_size, context_len, scale_log2,
    CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    keys = tile + tl.arange(0, BLOCK_N)
    key_ok = keys < context_len
    blocks = tl.load(table + (keys // block_size) * stride_bt_blk, mask=key_ok, other=0)
    # int64: block id * block stride overflows int32 once the pool passes 2^31 elements.
    row = blocks.to(tl.int64)
    offsets = keys % block_size
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(
        k_cache_ptr + row[:, None] * stride_kc_block + offsets[:, None] * stride_kc_off
        + kv_head * stride_kc_head + d[None, :] * stride_kc_dim,
        mask=kv_mask, other=0.0,
    )
    v = tl.load(
        v_cache_ptr + row[:, None] * stride_vc_block + offsets[:, None] * stride_vc_off
        + kv_head * stride_vc_head + d[None, :] * stride_vc_dim,
        mask=kv_mask, other=0.0,
    )
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if CAUSAL:
        # Keys past the context lie past every valid query position, so this masks them too.
        scores = tl.where(keys[None, :] <= query_pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr, out_ptr,
    scale_log2,
    stride_q_tok, stride_q_head, stride_q_dim,
    stride_kc_block, stride_kc_off, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_off, stride_vc_head, stride_vc_dim,
    stride_bt_seq, stride_bt_blk,
    stride_o_tok, stride_o_head, stride_o_dim,
    group, head_dim, block_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // group
    q_begin = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_ptr + seq + 1) - q_begin).to(tl.int32)
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len

    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = i < q_len
    query_pos = prefix_len + i
    d = tl.arange(0, BLOCK_D)
    dim_ok = d < head_dim
    tokens = q_begin + i.to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_q_tok + head * stride_q_head + d[None, :] * stride_q_dim,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )

    # Keys up to the last query of this program; none at all if the program has no rows.
    first_pos = prefix_len + m_block * BLOCK_M
    kv_end = tl.minimum(context_len, first_pos + BLOCK_M)
    kv_end = tl.where(m_block * BLOCK_M < q_len, kv_end, 0)
    unmasked_end = tl.minimum((first_pos // BLOCK_N) * BLOCK_N, kv_end)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt_seq
    for tile in range(0, unmasked_end, BLOCK_N):
        m, l, acc = _attend_tile(
            q, m, l, acc, tile, query_pos, table, k_cache_ptr, v_cache_ptr, kv_head, d, dim_ok,
            stride_bt_blk, stride_kc_block, stride_kc_off, stride_kc_head, stride_kc_dim,
            stride_vc_block, stride_vc_off, stride_vc_head, stride_vc_dim,
            block_size, context_len, scale_log2,
            CAUSAL=False, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )
    for tile in range(unmasked_end, kv_end, BLOCK_N):
        m, l, acc = _attend_tile(
            q, m, l, acc, tile, query_pos, table, k_cache_ptr, v_cache_ptr, kv_head, d, dim_ok,
            stride_bt_blk, stride_kc_block, stride_kc_off, stride_kc_head, stride_kc_dim,
            stride_vc_block, stride_vc_off, stride_vc_head, stride_vc_dim,
            block_size, context_len, scale_log2,
            CAUSAL=True, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )

    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_o_tok + head * stride_o_head + d[None, :] * stride_o_dim,
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )


def prefix_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    tiles: tuple[int, int] | None = None,
) -> torch.Tensor:
    """New tokens attend to their cached prefix and causally to themselves (see attention_ref).

    `max_query_len` (optional) saves a device-to-host read of the longest query length.
    `tiles` (optional) overrides `(BLOCK_M, BLOCK_N)` (powers of two >= 16), for tests and tuning.
    """
    total_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q)
    if total_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_heads // k_cache.shape[2]
    block_m, block_n = tiles or (CUDA_TILES if q.is_cuda else CPU_TILES)
    grid = (num_seqs, num_heads, max(1, triton.cdiv(max_query_len, block_m)))
    _extend_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        scale * LOG2_E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        group, head_dim, k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    return out
