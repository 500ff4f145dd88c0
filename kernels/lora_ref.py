"""Multi-LoRA deltas over a batch, torch references: BGMV and SGMV (Punica's names).

Adapters are never merged into the base weights. The base projection ``y = x W^T`` runs once for
the whole batch; then every token adds the low-rank delta of *its own* adapter::

    y[t] += B[s_t] @ (A[s_t] @ x[t])          s_t = the token's slot, 0 = no adapter

The adapters of a step sit in *slot stacks*: ``a`` ``[num_slots, R, K]`` and ``b`` ``[num_slots,
N, R]``, one adapter per slot, its rank padded with zeros to ``R`` and its scaling folded into
``B``; slot 0 is all zeros and is skipped.

- :func:`bgmv` (batched gather matrix-vector): one slot per row, for decode steps where each
  token is a different sequence and may use a different adapter;
- :func:`sgmv` (segmented gather matrix-matrix): segments of consecutive rows sharing one slot,
  for prefill, where a sequence's new tokens are contiguous and share its adapter.

Both add into ``y`` in place (``y`` may be a column slice of a fused projection's output, e.g. the
``k`` columns of ``qkv``), compute the delta in fp32 and round once into ``y``'s dtype; rows with
slot 0 are left untouched. The Triton kernels (``kernels/triton_lora.py``) have the same
signatures. These references group rows by slot, so a CPU step costs two small matmuls per
adapter in the batch, not per token.
"""
from __future__ import annotations

import torch


def _add_delta(y: torch.Tensor, rows: torch.Tensor | slice, x: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor) -> None:
    """``y[rows] += (x[rows] @ a^T) @ b^T`` in fp32, rounded once into ``y``'s dtype."""
    if y.dtype == torch.float32 and isinstance(rows, slice):
        # In place on the view: two BLAS calls, no temporaries the size of y (the CPU engine's path).
        y[rows].addmm_(x[rows] @ a.t(), b.t())
        return
    xs = x[rows].float()
    delta = (xs @ a.float().t()) @ b.float().t()
    y[rows] = (y[rows].float() + delta).to(y.dtype)


def bgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         slot_ids: torch.Tensor) -> None:
    """``y[t] += b[s] @ (a[s] @ x[t])`` for every row ``t`` with slot ``s = slot_ids[t] != 0``.

    ``y`` ``[T, N]`` (any strides), ``x`` ``[T, K]``, ``a`` ``[S, R, K]``, ``b`` ``[S, N, R]``,
    ``slot_ids`` ``[T]`` integers in ``[0, S)``.
    """
    if y.shape[0] == 0:
        return
    ids = slot_ids.tolist()
    for slot in sorted(set(ids) - {0}):
        rows = [t for t, s in enumerate(ids) if s == slot]
        index: torch.Tensor | slice
        if rows[-1] - rows[0] + 1 == len(rows):
            index = slice(rows[0], rows[-1] + 1)  # contiguous: a view, no gather
        else:
            index = torch.tensor(rows, device=y.device)
        _add_delta(y, index, x, a[slot], b[slot])


def sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor,
         max_seg_len: int | None = None) -> None:
    """For each segment ``g``: rows ``seg_starts[g] .. + seg_lens[g]`` add slot ``seg_slots[g]``'s delta.

    Shapes as in :func:`bgmv`; the segment tensors are ``[G]`` integers, segments do not overlap,
    and a segment of slot 0 (or of length 0) adds nothing. ``max_seg_len`` is unused here (the
    kernel's grid needs it).
    """
    del max_seg_len
    for start, n, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        if slot == 0 or n == 0:
            continue
        _add_delta(y, slice(start, start + n), x, a[slot], b[slot])
