"""KVCacheManager: the prefix cache on top of the BlockPool, per request.

A request's prompt is cut into full blocks of ``block_size`` tokens; each gets a chained hash
(:mod:`worker.engine.kv_cache.hashing`). On admission the longest run of leading blocks whose hashes
are cached is reused, but never the block holding the last token: at least one token is always
recomputed so that a full hit still produces logits. Blocks are registered as cached only after
the step that wrote their KV (:meth:`cache_computed_blocks`).
"""
from __future__ import annotations

from worker.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from worker.engine.kv_cache.hashing import hash_block_tokens
from worker.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Allocates a request's blocks, finds its cached prefix, registers and frees its blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def _ensure_hashes(self, seq: Sequence, num_blocks: int) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.namespace)
            hashes.append(parent)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """The cached leading blocks of ``seq`` and how many tokens they hold.

        Looks at every full block except one holding the last token (that one is recomputed).
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._ensure_hashes(seq, max_blocks)
        hits: list[KVCacheBlock] = []
        lookup = self.block_pool.cached_block_hash_to_block
        for h in seq.block_hashes[:max_blocks]:
            block = lookup.get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``; False (and no change) if full.

        ``new_computed_blocks`` are cache hits (from :meth:`get_computed_blocks`) that a newly
        admitted request takes a reference on.
        """
        computed = new_computed_blocks or []
        num_tokens = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        needed = cdiv(num_tokens, self.block_size) - len(seq.blocks) - len(computed)
        # Hits sitting unreferenced in the free queue stop being allocatable once touched.
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if max(needed, 0) + evictable_hits > self.block_pool.get_num_free_blocks():
            return False
        if computed:
            self.block_pool.touch(computed)
            seq.blocks.extend(computed)
            seq.num_registered_blocks = len(seq.blocks)
        if needed > 0:
            seq.blocks.extend(self.block_pool.get_new_blocks(needed))
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of ``seq`` whose KV is written (after a step)."""
        if not self.enable_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.blocks))
        if num_full <= seq.num_registered_blocks:
            return
        self._ensure_hashes(seq, num_full)
        start = seq.num_registered_blocks
        self.block_pool.cache_blocks(seq.blocks[start:num_full], seq.block_hashes[start:num_full],
                                     seq.lora_name)
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``; its tail blocks become the first evicted."""
        self.block_pool.free_blocks(reversed(seq.blocks))
        seq.blocks = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (only when no request holds blocks)."""
        return self.block_pool.reset_prefix_cache()
