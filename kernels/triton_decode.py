"""Triton paged decode attention: split-KV ("flash-decoding") with grouped-query heads.

Same contract as `kernels.attention_ref.paged_decode_attention`, plus tuning knobs and `out=`.

Grid of the main kernel: `(num_seqs, num_kv_heads, num_splits)`. One program owns one KV head
of one sequence and one *partition* of its context (`partition_size` tokens):

    context:  |---- split 0 ----|---- split 1 ----|-- split 2 --|
    program (s, h, j) streams K/V of split j once, for all `group = num_heads // num_kv_heads`
    query heads that read KV head h (the group is the M dimension of the dot products), and
    writes its partial output (already normalised) and its log-sum-exp.

A second small kernel merges the partials of each (sequence, query head) with log-sum-exp
weights. With one split the first kernel writes the final output and the merge is skipped.

Softmax runs in base 2 (`exp2`, with `scale * log2(e)` folded into the scores), online over
tiles of `block_n` tokens; the running maximum starts at -inf, and since each tile the loop visits
holds at least one valid token, no NaN arises. A sequence with context length 0 gets zeros.

Two things decide the speed on a GPU (bench/kernels_sweep.py on an H200, docs/benchmarks.md):
- Waves. A tiling fits `programs_per_sm` programs per SM at once (registers, shared memory),
  and programs of one launch have the same length, so they run in waves; a grid a little larger
  than one wave pays for a second. Batch 64 x 4K is 512 programs: in one wave of 660 (tiles of
  32, 5 per SM) it reads K/V at 89% of HBM peak; in two waves of 396 (tiles of 64, 3 per SM)
  at 72%. `partition_for_waves` picks the split count by this model.
- Buffering. The block ids of the *next* tile are loaded one iteration ahead, so a tile's K/V
  addresses do not depend on a load in the same iteration; only then does Triton's pipeliner give
  K/V `num_stages - 1` shared-memory buffers (next tile in flight while this one is computed);
  with the ids loaded in the same iteration it kept one buffer. Then fewer programs per SM
  (2.5) keep HBM busy, so small batches need fewer splits.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
# A partition shorter than this is too little work to be worth a program and a share of the merge.
MIN_PARTITION = 128
# The merge kernel holds all partials of one head at once.
MAX_SPLITS = 64


@dataclass(frozen=True, slots=True)
class DecodeTiling:
    """Launch shape of the split kernel: tokens per tile, warps, pipeline stages; how many of its
    programs one SM holds at once (registers and shared memory) and how many per SM already keep
    HBM busy (below that, a program's own latency bounds it). Both measured on an H200."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    saturating_per_sm: float


# Chosen by bench/kernels_sweep.py on an H200 (docs/benchmarks.md, "Attention kernels"): tiles
# of 32 tokens double-buffered (37 KB of shared memory, 91 registers) fit 5 programs per SM
# (the split variant 6), and 2.5 per SM (330 programs) already reach full bandwidth.
CUDA_TILING = DecodeTiling(block_n=32, num_warps=4, num_stages=3, programs_per_sm=5, saturating_per_sm=2.5)
# The interpreter's cost grows with the number of loop iterations: large tiles, one split.
CPU_TILING = DecodeTiling(block_n=64, num_warps=4, num_stages=1, programs_per_sm=1, saturating_per_sm=1.0)
# Cost model of `partition_for_waves`, in tiles: a program's fixed cost (loading q, the first
# tile's latency, the epilogue) and the merge kernel's.
PROGRAM_OVERHEAD_TILES = 2
MERGE_OVERHEAD_TILES = 2


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, partials_ptr,
    scale_log2,
    stride_q_seq, stride_q_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt_seq, stride_o_seq, stride_o_head,
    num_splits, partition_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
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
    heads = kv_head * GROUP + g
    row_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt_seq
    k_head = k_cache_ptr + kv_head * stride_kc_head + d[None, :]
    v_head = v_cache_ptr + kv_head * stride_vc_head + d[None, :]
    n = tl.arange(0, BLOCK_N)
    blocks = tl.load(table + (start + n) // PAGE_SIZE, mask=start + n < end, other=0)
    for tile in range(start, end, BLOCK_N):
        tokens = tile + n
        token_ok = tokens < end
        # int64: block id * block stride overflows int32 once the pool passes 2^31 elements.
        row = blocks.to(tl.int64)
        # The next tile's block ids, one iteration ahead (see the module docstring).
        ahead = tokens + BLOCK_N
        blocks = tl.load(table + ahead // PAGE_SIZE, mask=ahead < end, other=0)
        offsets = tokens % PAGE_SIZE
        kv_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_head + row[:, None] * stride_kc_block + offsets[:, None] * stride_kc_off,
            mask=kv_mask, other=0.0,
        )
        v = tl.load(
            v_head + row[:, None] * stride_vc_block + offsets[:, None] * stride_vc_off,
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
            out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=store_mask,
        )
    else:
        # Partials: `[num_seqs, num_heads, num_splits, HEAD_DIM]` outputs, then as many LSEs.
        num_heads = tl.num_programs(1) * GROUP
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(partials_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=store_mask)
        lse = tl.where(has_tokens, m + tl.log2(tl.where(has_tokens, l, 1.0)), float("-inf"))
        lse_ptr = partials_ptr + tl.num_programs(0).to(tl.int64) * num_heads * num_splits * HEAD_DIM
        tl.store(lse_ptr + part, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    out_ptr, partials_ptr,
    stride_o_seq, stride_o_head,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    split_ok = s < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + s
    lse_ptr = partials_ptr + tl.num_programs(0).to(tl.int64) * tl.num_programs(1) * num_splits * HEAD_DIM
    lse = tl.load(lse_ptr + part, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    # All splits empty (context length 0): weights 0, output 0, and no -inf - -inf.
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    parts = tl.load(
        partials_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=split_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0,
    )
    total = tl.sum(weights, axis=0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + d,
        out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM,
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
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context (see attention_ref).

    `max_context_len` (optional) saves a device-to-host read of `context_lens.max()`. The rest
    are for tests and tuning (bench/kernels_sweep.py); unset, they come from `CUDA_TILING` /
    `CPU_TILING` and the wave count (`_choose_partition`):
    `partition_size` (a multiple of 16) fixes the split-KV partition length (`block_n` is then
    reduced to a divisor of it); `block_n` (a power of two >= 16) the tokens per tile; `num_warps`,
    `num_stages` Triton's launch options; `out` a preallocated output like `q`.
    The last dimension of q, the caches and the block tables must be contiguous.
    """
    num_seqs, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError(
            "paged_decode_attention needs unit stride in the last dimension of q, the caches and block_tables"
        )
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    tiling = CUDA_TILING if q.is_cuda else CPU_TILING
    block_n = block_n or tiling.block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if partition_size is None:
        partition_size = _choose_partition(max_context_len, num_seqs * num_kv_heads, block_n, q.device)
    elif partition_size <= 0 or partition_size % 16:
        raise ValueError(f"partition_size must be a positive multiple of 16, got {partition_size}")
    else:
        block_n = math.gcd(block_n, partition_size)
    num_splits = max(1, triton.cdiv(max_context_len, partition_size))
    direct = num_splits == 1
    partials = out if direct else torch.empty(
        num_seqs * num_heads * num_splits * (head_dim + 1), dtype=torch.float32, device=q.device
    )
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partials,
        scale * LOG2_E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_splits, partition_size,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DIRECT_OUTPUT=direct, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps or tiling.num_warps, num_stages=num_stages or tiling.num_stages,
    )
    if not direct:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, partials, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out


def _choose_partition(max_context_len: int, programs_per_split: int, block_n: int, device: torch.device) -> int:
    """The partition length (a multiple of `block_n`) for the longest context.

    On CPU (the interpreter) one split is fastest, so the whole context is one partition. On a
    GPU, see `partition_for_waves`."""
    tiles = max(1, triton.cdiv(max_context_len, block_n))
    if device.type != "cuda":
        return tiles * block_n
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _multiprocessors(index)
    per_split = partition_for_waves(
        tiles, programs_per_split, sms * CUDA_TILING.programs_per_sm, sms * CUDA_TILING.saturating_per_sm,
        max(1, MIN_PARTITION // block_n),
    )
    return per_split * block_n


@functools.lru_cache(maxsize=4096)
def partition_for_waves(
    tiles: int, programs_per_split: int, slots: int, saturating: float, min_tiles: int = 1
) -> int:
    """Tiles per partition that minimise the modelled device time of the launch.

    `tiles`: the longest context in tiles; `programs_per_split`: sequences x KV heads; `slots`:
    programs the GPU runs at once; `saturating`: programs that already keep HBM busy. Programs
    of one launch have the same length, so they run in waves of `slots`; a wave of n programs
    takes one program's time if n <= `saturating` (latency-bound), else n / `saturating` times
    that (bandwidth-bound). So a grid a little larger than one wave pays for a second one, and
    a grid of fewer than `saturating` programs leaves bandwidth unused.
    """
    best_cost, best = math.inf, tiles
    for splits in range(1, min(MAX_SPLITS, max(1, tiles // min_tiles)) + 1):
        per_split = triton.cdiv(tiles, splits)
        used = triton.cdiv(tiles, per_split)
        full, rest = divmod(programs_per_split * used, slots)
        waves = full * max(1.0, slots / saturating) + (max(1.0, rest / saturating) if rest else 0.0)
        cost = waves * (per_split + PROGRAM_OVERHEAD_TILES) + (MERGE_OVERHEAD_TILES if used > 1 else 0)
        if cost < best_cost:
            best_cost, best = cost, per_split
    return best


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs get exact fp32 products (not TF32): the fp32 path is the accuracy reference.
    fp16 / bf16 inputs keep Triton's default (their products are exact in the fp32 accumulator)."""
    return "ieee" if dtype == torch.float32 else None
