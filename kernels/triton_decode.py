"""Triton paged decode attention: split-KV ("flash-decoding") with grouped-query heads.

Same contract as `kernels.attention_ref.paged_decode_attention`.

Grid of the main kernel: `(num_seqs, num_kv_heads, num_splits)`. One program owns one KV head
of one sequence and one *partition* of its context (`partition_size` tokens):

    context:  |---- split 0 ----|---- split 1 ----|-- split 2 --|
    program (s, h, j) streams K/V of split j once, for all `group = num_heads // num_kv_heads`
    query heads that read KV head h (the group is the M dimension of the dot products), and
    writes its partial output (already normalised) and its log-sum-exp.

A second small kernel merges the partials of each (sequence, query head) with log-sum-exp
weights. With one split the first kernel writes the final output and the merge is skipped.
Long contexts with few sequences get several splits, so the GPU has enough programs.

Softmax runs in base 2 (`exp2`, with `scale * log2(e)` folded into the scores), online over
tiles of `BLOCK_N` tokens; the running maximum starts at -inf, and since each tile the loop visits
holds at least one valid token, no NaN arises. A sequence with context length 0 gets zeros.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
# Small enough for the GPU to keep K and V tiles of head_dim 128 in shared memory with two stages.
BLOCK_N = 64
# Below this, a partition is too little work to be worth a program and a merge.
MIN_PARTITION = 256


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_kc_block, stride_kc_off, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_off, stride_vc_head, stride_vc_dim,
    stride_bt_seq, stride_bt_blk,
    stride_o_seq, stride_o_head, stride_o_dim,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    group, head_dim, block_size, partition_size,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DIRECT_OUTPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    row_ok = g < group
    dim_ok = d < head_dim
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :] * stride_q_dim,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt_seq
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        tokens = tile + n
        token_ok = tokens < end
        blocks = tl.load(table + (tokens // block_size) * stride_bt_blk, mask=token_ok, other=0)
        # int64: block id * block stride overflows int32 once the pool passes 2^31 elements.
        row = blocks.to(tl.int64)
        offsets = tokens % block_size
        kv_mask = token_ok[:, None] & dim_ok[None, :]
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
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    has_tokens = l > 0.0
    out = acc / tl.where(has_tokens, l, 1.0)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if DIRECT_OUTPUT:
        tl.store(
            out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :] * stride_o_dim,
            out.to(out_ptr.dtype.element_ty), mask=store_mask,
        )
    else:
        tl.store(
            part_out_ptr + seq * stride_po_seq + heads[:, None] * stride_po_head
            + split * stride_po_split + d[None, :],
            out, mask=store_mask,
        )
        lse = tl.where(has_tokens, m + tl.log2(tl.where(has_tokens, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split, lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_o_seq, stride_o_head, stride_o_dim,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    num_splits, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    split_ok = s < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + s, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    # All splits empty (context length 0): weights 0, output 0, and no -inf - -inf.
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    parts = tl.load(
        part_out_ptr + seq * stride_po_seq + head * stride_po_head + s[:, None] * stride_po_split + d[None, :],
        mask=split_ok[:, None] & (d[None, :] < head_dim), other=0.0,
    )
    total = tl.sum(weights, axis=0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + d * stride_o_dim,
        out.to(out_ptr.dtype.element_ty), mask=d < head_dim,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context (see attention_ref).

    `max_context_len` (optional) saves a device-to-host read of `context_lens.max()`;
    `partition_size` (optional, a multiple of 64) forces the split-KV partition length, which
    otherwise is chosen so that the grid fills the device.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if partition_size is None:
        partition_size = _choose_partition(max_context_len, num_seqs * num_kv_heads, q.device)
    if partition_size % BLOCK_N:
        raise ValueError(f"partition_size must be a multiple of {BLOCK_N}, got {partition_size}")
    num_splits = max(1, triton.cdiv(max_context_len, partition_size))
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused by the kernel in this mode
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        po_strides, pl_strides = part_out.stride()[:3], part_lse.stride()[:2]
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_out, part_lse,
        scale * LOG2_E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *out.stride(), *po_strides, *pl_strides,
        group, head_dim, k_cache.shape[1], partition_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        DIRECT_OUTPUT=direct, DOT_PRECISION=_dot_precision(q.dtype),
    )
    if not direct:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse,
            *out.stride(), *po_strides, *pl_strides,
            num_splits, head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out


def _choose_partition(max_context_len: int, programs_per_split: int, device: torch.device) -> int:
    """A partition length (multiple of BLOCK_N) giving about two programs per GPU core.

    On CPU (the interpreter) a single split is fastest, so the whole context is one partition.
    """
    padded_len = max(BLOCK_N, triton.cdiv(max_context_len, BLOCK_N) * BLOCK_N)
    if device.type != "cuda":
        return padded_len
    cores = torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, math.ceil(2 * cores / programs_per_split))
    partition = triton.cdiv(triton.cdiv(max_context_len, splits), BLOCK_N) * BLOCK_N
    return min(padded_len, max(MIN_PARTITION, partition))


def _dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs get exact fp32 products (not TF32): the fp32 path is the accuracy reference.
    fp16 / bf16 inputs keep Triton's default (their products are exact in the fp32 accumulator)."""
    return "ieee" if dtype == torch.float32 else None
