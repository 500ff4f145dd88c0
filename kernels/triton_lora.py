"""Triton multi-LoRA deltas: BGMV (decode) and SGMV (prefill), Punica-style shrink then expand.

Same contracts as `kernels.lora_ref.bgmv` / `sgmv`. Each op is two kernels around a small fp32
buffer of shape `[T, R]`, so every adapter's A and B are read once per tile instead of once per
output column::

    shrink:  buf[t, :]  = A[s_t] @ x[t]          (R values per token)
    expand:  y[t, cols] += B[s_t][cols] @ buf[t]

- BGMV, one program per token (and per tile of R or of output columns): matrix-vector products
  as broadcast multiply + sum in fp32; a token of slot 0 masks every load and store off (no
  memory traffic, `y` untouched).
- SGMV, one program per segment and tile of `BLOCK_M` rows: `tl.dot` tiles (>= 16 on every
  side, so `R` is padded to at least 16 in the tile, with masked loads). fp32 inputs use exact
  fp32 products (`ieee`, not TF32), as the attention kernels do; fp16/bf16 inputs multiply in
  their dtype with fp32 accumulation, and the expand rounds the buffer to the weights' dtype
  first (as vLLM's kernels do): a few ulps of that dtype.

The slot test is broadcast through a vector in the masks because Triton's interpreter rejects a
mask built from a scalar boolean.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_decode import _dot_precision

# BGMV: K chunk of the shrink, output-column tile of the expand. SGMV: rows, K chunk, columns.
# The interpreter's cost is per program, so CPU tiles are large (the tests also run small ones).
CUDA_BGMV = (128, 128)
CPU_BGMV = (256, 256)
CUDA_SGMV = (32, 64, 64)
CPU_SGMV = (64, 128, 128)


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, buf_ptr,
    K, R,
    stride_x_tok, stride_x_k, stride_a_slot, stride_a_r, stride_a_k, stride_buf_tok,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < R) & (r * 0 + slot != 0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < K) & (k * 0 + slot != 0)
        xk = tl.load(x_ptr + tok * stride_x_tok + k * stride_x_k, mask=k_ok, other=0.0).to(tl.float32)
        ak = tl.load(a_ptr + slot * stride_a_slot + r[:, None] * stride_a_r + k[None, :] * stride_a_k,
                     mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(ak * xk[None, :], axis=1)
    tl.store(buf_ptr + tok * stride_buf_tok + r, acc, mask=r < R)


@triton.jit
def _bgmv_expand_kernel(
    buf_ptr, b_ptr, slot_ptr, y_ptr,
    N, R,
    stride_buf_tok, stride_b_slot, stride_b_n, stride_b_r, stride_y_tok, stride_y_n,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    n_block = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < R) & (r * 0 + slot != 0)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (n < N) & (n * 0 + slot != 0)
    v = tl.load(buf_ptr + tok * stride_buf_tok + r, mask=r_ok, other=0.0)
    bt = tl.load(b_ptr + slot * stride_b_slot + n[:, None] * stride_b_n + r[None, :] * stride_b_r,
                 mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(bt * v[None, :], axis=1)
    y_addr = y_ptr + tok * stride_y_tok + n * stride_y_n
    y = tl.load(y_addr, mask=n_ok, other=0.0)
    tl.store(y_addr, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _segment_rows(seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M: tl.constexpr):
    """This program's rows of its segment (grid axes 0 and 1), which are real, and the slot."""
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    return start + i.to(tl.int64), (i < length) & (i * 0 + slot != 0), slot


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, buf_ptr,
    K, R,
    stride_x_tok, stride_x_k, stride_a_slot, stride_a_r, stride_a_k, stride_buf_tok,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    rows, m_ok, slot = _segment_rows(seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_x_tok + k[None, :] * stride_x_k,
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # A^T tile [BLOCK_K, BLOCK_R]: only loaded for a real slot (any row in range).
        at = tl.load(a_ptr + slot * stride_a_slot + k[:, None] * stride_a_k + r[None, :] * stride_a_r,
                     mask=k_ok[:, None] & r_ok[None, :] & (r[None, :] * 0 + slot != 0), other=0.0)
        acc += tl.dot(xt, at.to(xt.dtype), input_precision=DOT_PRECISION)
    tl.store(buf_ptr + rows[:, None] * stride_buf_tok + r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _sgmv_expand_kernel(
    buf_ptr, b_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, y_ptr,
    N, R,
    stride_buf_tok, stride_b_slot, stride_b_n, stride_b_r, stride_y_tok, stride_y_n,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    n_block = tl.program_id(2)
    rows, m_ok, slot = _segment_rows(seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    v = tl.load(buf_ptr + rows[:, None] * stride_buf_tok + r[None, :], mask=m_ok[:, None] & r_ok[None, :],
                other=0.0)
    bt = tl.load(b_ptr + slot * stride_b_slot + r[:, None] * stride_b_r + n[None, :] * stride_b_n,
                 mask=r_ok[:, None] & n_ok[None, :] & (n[None, :] * 0 + slot != 0), other=0.0)
    delta = tl.dot(v.to(bt.dtype), bt, input_precision=DOT_PRECISION)
    mask = m_ok[:, None] & n_ok[None, :]
    y_addr = y_ptr + rows[:, None] * stride_y_tok + n[None, :] * stride_y_n
    y = tl.load(y_addr, mask=mask, other=0.0)
    tl.store(y_addr, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _tiles(x: torch.Tensor, cuda: tuple[int, ...], cpu: tuple[int, ...]) -> tuple[int, ...]:
    return cuda if x.is_cuda else cpu


def bgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_ids: torch.Tensor,
         *, tiles: tuple[int, int] | None = None) -> None:
    """``y[t] += b[s] @ (a[s] @ x[t])`` per row of slot ``s = slot_ids[t] != 0`` (see lora_ref).

    ``tiles`` (optional) overrides ``(BLOCK_K, BLOCK_N)`` (powers of two), for tests and tuning.
    """
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    _, rank, k_dim = a.shape
    n_dim = b.shape[1]
    block_k, block_n = tiles or _tiles(x, CUDA_BGMV, CPU_BGMV)
    block_r = triton.next_power_of_2(rank)
    buf = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    _bgmv_shrink_kernel[(num_tokens,)](
        x, a, slot_ids, buf, k_dim, rank,
        *x.stride(), *a.stride(), buf.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k,
    )
    _bgmv_expand_kernel[(num_tokens, triton.cdiv(n_dim, block_n))](
        buf, b, slot_ids, y, n_dim, rank,
        buf.stride(0), *b.stride(), *y.stride(),
        BLOCK_N=block_n, BLOCK_R=block_r,
    )


def sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor,
         seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int | None = None, *,
         tiles: tuple[int, int, int] | None = None) -> None:
    """Each segment's rows add its slot's delta (see lora_ref.sgmv).

    ``max_seg_len`` (optional) saves a device-to-host read of the longest segment; ``tiles``
    overrides ``(BLOCK_M, BLOCK_K, BLOCK_N)`` (powers of two >= 16).
    """
    num_segs = seg_starts.shape[0]
    if num_segs == 0 or x.shape[0] == 0:
        return
    if max_seg_len is None:
        max_seg_len = int(seg_lens.max())
    if max_seg_len == 0:
        return
    _, rank, k_dim = a.shape
    n_dim = b.shape[1]
    block_m, block_k, block_n = tiles or _tiles(x, CUDA_SGMV, CPU_SGMV)
    block_r = max(16, triton.next_power_of_2(rank))
    precision = _dot_precision(x.dtype)
    buf = torch.empty(x.shape[0], rank, dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(max_seg_len, block_m)
    _sgmv_shrink_kernel[(num_segs, m_blocks)](
        x, a, seg_starts, seg_lens, seg_slots, buf, k_dim, rank,
        *x.stride(), *a.stride(), buf.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, DOT_PRECISION=precision,
    )
    _sgmv_expand_kernel[(num_segs, m_blocks, triton.cdiv(n_dim, block_n))](
        buf, b, seg_starts, seg_lens, seg_slots, y, n_dim, rank,
        buf.stride(0), *b.stride(), *y.stride(),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(b.dtype),
    )
