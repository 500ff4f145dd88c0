"""Torch reference attention over the paged KV cache: the CPU path of the engine and the ground
truth the Triton kernels are tested against.

Layout (docs/architecture.md, "KV cache layout"): per layer `k_cache`, `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`; token `t` of a sequence lives in physical block
`block_table[t // block_size]` at offset `t % block_size`.

    block_table = [7, 2, 9]          block_size = 4, context_len = 10
    tokens 0-3 -> block 7, tokens 4-7 -> block 2, tokens 8-9 -> block 9 (offsets 0-1)

Every op here gathers the blocks a sequence uses, keeps grouped-query attention as a
`[kv_head, group]` split of the query heads (no copy of K/V per query head), and computes
attention densely in fp32, casting the result back to the query's dtype. A sequence whose
context length is 0 (a padding row) yields zeros.
"""
from __future__ import annotations

import torch


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter `k`, `v` (`[num_tokens, num_kv_heads, head_dim]`) into the caches at their slots.

    `slot_mapping[i] = block_id * block_size + offset` (int64) is where token `i` goes; a negative
    slot marks a padding token and is skipped. The caches are written in place.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The first `num_tokens` tokens named by `block_table` (`[..., max_blocks]`), contiguous.

    Returns `[..., num_tokens, num_kv_heads, head_dim]`. Entries of the block table past the
    blocks `num_tokens` needs are never read, so they may hold any padding value.
    """
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    # Padding entries inside the used range (a shorter sequence in a batch) are clamped to a
    # valid id; the tokens they produce are masked out by the callers.
    table = block_table[..., :num_blocks].long().clamp(min=0)
    gathered = cache[table]  # [..., num_blocks, block_size, kv_heads, head_dim]
    gathered = gathered.flatten(-4, -3)
    return gathered[..., :num_tokens, :, :]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole paged context.

    `q`: `[num_seqs, num_heads, head_dim]`; `block_tables`: `[num_seqs, max_blocks]` int32;
    `context_lens`: `[num_seqs]` int32, tokens including the current one (already written).
    Query head `h` reads KV head `h // (num_heads // num_kv_heads)`. Returns
    `[num_seqs, num_heads, head_dim]` in `q.dtype`. All sequences are computed in one batched
    op, padded to the longest context (`max_context_len` if given, else `context_lens.max()`).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = max_context_len
    if max_len is None:
        max_len = int(context_lens.max()) if num_seqs else 0
    if max_len == 0:
        return torch.zeros_like(q)
    keys = gather_kv(k_cache, block_tables, max_len).float()  # [S, T, Hkv, D]
    values = gather_kv(v_cache, block_tables, max_len).float()
    queries = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", queries, keys) * scale
    positions = torch.arange(max_len, device=q.device)
    valid = positions[None, :] < context_lens.to(q.device).long()[:, None]  # [S, T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = _softmax_or_zero(scores)
    out = torch.einsum("skgt,stkd->skgd", probs, values)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


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
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached prefix and, causally, themselves.

    `q`: `[total_new_tokens, num_heads, head_dim]`, sequences concatenated; sequence `s` owns
    rows `query_start_loc[s]:query_start_loc[s + 1]` (`q_len` rows). Its new token `i` sits at
    position `context_lens[s] - q_len + i` and attends to every position up to its own; the new
    tokens' KV is already in the cache. Returns `[total_new_tokens, num_heads, head_dim]` in
    `q.dtype`. Sequences are computed one at a time (their query lengths differ widely, so
    padding them into one batch would waste memory); within a sequence everything is batched.
    `max_query_len` is accepted for parity with the Triton kernel's signature (where it saves a
    device-to-host read); the per-sequence loop here does not need it.
    """
    del max_query_len
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s, context_len in enumerate(lens):
        begin, end = starts[s], starts[s + 1]
        q_len = end - begin
        if q_len == 0 or context_len == 0:
            continue
        keys = gather_kv(k_cache, block_tables[s], context_len).float()  # [T, Hkv, D]
        values = gather_kv(v_cache, block_tables[s], context_len).float()
        queries = q[begin:end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("ikgd,tkd->kgit", queries, keys) * scale
        query_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        causal = key_pos[None, :] <= query_pos[:, None]  # [q_len, T]
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = _softmax_or_zero(scores)
        seq_out = torch.einsum("kgit,tkd->ikgd", probs, values)
        out[begin:end] = seq_out.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out


def _softmax_or_zero(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; a row with no valid key gives zeros instead of NaN."""
    probs = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)
