"""Torch reference attention over the paged KV cache: the CPU path of the engine and the ground
truth the Triton kernels are tested against.

Layout (docs/kernels.md, "KV cache layout"): per layer `k_cache`, `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`; token `t` of a sequence lives in physical block
`block_table[t // block_size]` at offset `t % block_size`.

    block_table = [7, 2, 9]          block_size = 4, context_len = 10
    tokens 0-3 -> block 7, tokens 4-7 -> block 2, tokens 8-9 -> block 9 (offsets 0-1)

Every op here gathers the blocks a sequence uses into contiguous K/V (one `index_select`),
then calls `torch.nn.functional.scaled_dot_product_attention` per sequence in fp32 and casts the
result back to the query's dtype. SDPA is exact attention (no approximation; only the summation
order differs from a dense softmax), and on CPU its fused kernel never materialises the
`[heads, q_len, context]` score matrix, which made a cold 2,000-token prefill several times
faster than the dense einsum it replaces. Sequences go one at a time: contexts are ragged, and
padding them into one masked batch was slower than the loop (the padded gather copies more).
Grouped-query attention never copies K/V per query head: a decode folds the group into the
query rows (`[kv_head, group, head_dim]`), an extend passes `enable_gqa=True`. A sequence whose
context length is 0 (a padding row) yields zeros.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter `k`, `v` (`[num_tokens, num_kv_heads, head_dim]`) into the caches at their slots.

    `slot_mapping[i] = block_id * block_size + offset` (int64) is where token `i` goes; a negative
    slot marks a padding token and is skipped. The caches (contiguous, as the engine allocates
    them) are written in place.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # A slot is a row of the cache seen as `[num_blocks * block_size, kv_heads, head_dim]`:
    # `index_copy_` on that view costs ~0.01 ms where advanced-index assignment took 5-8 ms.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


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
    gathered = cache.index_select(0, table.flatten())  # [blocks, block_size, kv_heads, head_dim]
    gathered = gathered.view(*table.shape[:-1], num_blocks * block_size, *cache.shape[2:])
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
    `[num_seqs, num_heads, head_dim]` in `q.dtype`. `max_context_len` is accepted for parity with
    the Triton kernel's signature; the per-sequence loop reads `context_lens` on the host.
    """
    del max_context_len
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # One query position, so a group's query heads are just more rows against one KV head.
    queries = q.float().view(num_seqs, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    tables = block_tables.long()
    outs = []
    for s, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            outs.append(q.new_zeros(1, num_heads, head_dim, dtype=torch.float32))
            continue
        keys = _sequence_kv(k_cache, tables[s], context_len)  # [1, Hkv, T, D]
        values = _sequence_kv(v_cache, tables[s], context_len)
        seq_out = F.scaled_dot_product_attention(queries[s], keys, values, scale=scale)
        outs.append(seq_out.view(1, num_heads, head_dim))
    return torch.cat(outs).to(q.dtype) if outs else torch.zeros_like(q)


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
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    tables = block_tables.long()
    for s, context_len in enumerate(context_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        q_len = end - begin
        if q_len == 0 or context_len == 0:
            continue
        keys = _sequence_kv(k_cache, tables[s], context_len)  # [1, Hkv, T, D]
        values = _sequence_kv(v_cache, tables[s], context_len)
        queries = q[begin:end].float().transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        # SDPA's `is_causal` aligns the diagonal top-left; here the new tokens are the *last*
        # `q_len` positions, so with a cached prefix the mask is explicit (bottom-right).
        mask, is_causal = None, False
        if q_len == context_len:
            is_causal = q_len > 1
        elif q_len > 1:
            query_pos = torch.arange(context_len - q_len, context_len, device=q.device)
            key_pos = torch.arange(context_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, T]
        seq_out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                                 is_causal=is_causal, scale=scale, enable_gqa=True)
        out[begin:end] = seq_out[0].transpose(0, 1).to(q.dtype)
    return out


def _sequence_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One sequence's first `num_tokens` tokens as fp32 `[1, kv_heads, num_tokens, head_dim]`.

    `block_ids`: the sequence's int64 block-table row. The result is a transposed view of one
    contiguous gather: SDPA's fused CPU kernel reads strided K/V, and a 4-D input selects that
    kernel (a 3-D one takes the unfused math path).
    """
    num_blocks = (num_tokens + cache.shape[1] - 1) // cache.shape[1]
    blocks = cache.index_select(0, block_ids[:num_blocks])
    return blocks.flatten(0, 1)[:num_tokens].float().transpose(0, 1).unsqueeze(0)
