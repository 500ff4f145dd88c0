"""KVCacheManager: the prefix cache on top of the BlockPool, per request.

A request's prompt is cut into full blocks of ``block_size`` tokens; each gets a chained hash
(:mod:`worker.engine.kv_cache.hashing`). On admission the longest run of leading blocks whose hashes
are cached is reused, but never the block holding the last token: at least one token is always
recomputed so that a full hit still produces logits. Blocks are registered as cached only after
the step that wrote their KV (:meth:`cache_computed_blocks`); a freed request's blocks go back
tail first, so its last blocks are evicted first.

These rules exist only here. They read and write a request through :class:`KVCacheRequest`,
which both the engine's :class:`~worker.engine.sequence.Sequence` and the fleet simulator's
lightweight ``bench.sim.worker.SimRequest`` (hashes precomputed, no token ids) satisfy; the
simulator runs them on its own lazily built pool (``pool_class``).

With a CPU tier (:class:`~worker.engine.kv_cache.kv_tier.KVTier`, ``tier=``) the lookup goes on
past the GPU hit: :meth:`get_tier_run` finds the longest run of stored CPU blocks right after it,
and :meth:`plan_tier_load` copies that run into the request's freshly allocated blocks with the
next step, after which the blocks count as computed and are registered like any other.
"""
from __future__ import annotations

from typing import Protocol

from worker.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from worker.engine.kv_cache.host_pool import HostBlock
from worker.engine.kv_cache.kv_tier import KVTier


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheRequest(Protocol):
    """The request state the KV-cache rules read and write.

    ``blocks`` are the request's KV blocks in token order, the first ``num_registered_blocks``
    of them registered in the prefix cache (or taken from it); ``block_hashes`` the chained
    hashes of its leading full blocks, as many as are known so far.
    """

    num_computed_tokens: int
    blocks: list[KVCacheBlock]
    block_hashes: list[int]
    num_registered_blocks: int

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        ...

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter that computes the request's KV (named in ``BlockStored``); None: the base model."""
        ...

    def hash_blocks(self, block_size: int, num_blocks: int) -> None:
        """Extend ``block_hashes`` towards ``num_blocks`` hashes (full blocks only).

        A request may stop short: the simulator's requests carry the hashes of their prompt and
        never hash generated tokens.
        """
        ...


class KVCacheManager:
    """Allocates a request's blocks, finds its cached prefix, registers and frees its blocks.

    ``pool_class`` builds the pool (``pool_class(num_blocks, enable_caching)``): the engine's
    :class:`BlockPool`, or a subclass with the same behaviour (the simulator's lazy pool).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, *,
                 pool_class: type[BlockPool] = BlockPool, tier: KVTier | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = pool_class(num_blocks, enable_caching)
        self.tier = tier if enable_caching else None
        if self.tier is not None:
            self.block_pool.on_evict = self.tier.on_gpu_evict
            self.tier.host.sink = self.block_pool.record_event

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_computed_blocks(self, req: KVCacheRequest) -> tuple[list[KVCacheBlock], int]:
        """The cached leading blocks of ``req`` and how many tokens they hold.

        Looks at every full block except one holding the last token (that one is recomputed).
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        if len(req.block_hashes) < max_blocks:
            req.hash_blocks(self.block_size, max_blocks)
        hits: list[KVCacheBlock] = []
        lookup = self.block_pool.cached_block_hash_to_block
        for h in req.block_hashes[:max_blocks]:
            block = lookup.get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_tier_run(self, req: KVCacheRequest, num_gpu_hits: int) -> list[HostBlock]:
        """The CPU tier's stored run of ``req``'s blocks right after its ``num_gpu_hits`` GPU
        hits (never the block holding the last token); empty without a tier.

        Call after :meth:`get_computed_blocks` (which hashed the blocks looked at).
        """
        if self.tier is None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.tier.find(req.block_hashes[num_gpu_hits:max_blocks])

    def plan_tier_load(self, req: KVCacheRequest, run: list[HostBlock], num_gpu_hits: int) -> None:
        """Load ``run`` (pinned) into the blocks of ``req`` after its GPU hits, with the next step.

        Call after :meth:`allocate_slots` made room for the run's tokens and the rest.
        """
        assert self.tier is not None
        self.tier.plan_load(run, req.blocks[num_gpu_hits:num_gpu_hits + len(run)])

    def _num_new_blocks(self, req: KVCacheRequest, num_new_tokens: int,
                        computed: list[KVCacheBlock]) -> int | None:
        """Blocks to take from the free queue for ``num_new_tokens`` more tokens after the hits
        ``computed``; None when the pool cannot spare them."""
        bs = self.block_size
        num_tokens = req.num_computed_tokens + len(computed) * bs + num_new_tokens
        needed = cdiv(num_tokens, bs) - len(req.blocks) - len(computed)
        # Hits sitting unreferenced in the free queue stop being allocatable once touched. (A
        # loop, not sum() over a generator: this runs for every admission check of the simulator.)
        evictable_hits = 0
        for b in computed:
            if b.ref_cnt == 0:
                evictable_hits += 1
        if max(needed, 0) + evictable_hits > self.block_pool.get_num_free_blocks():
            return None
        return needed

    def can_allocate(self, req: KVCacheRequest, num_new_tokens: int,
                     new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Whether :meth:`allocate_slots` with the same arguments would succeed (changes nothing)."""
        return self._num_new_blocks(req, num_new_tokens, new_computed_blocks or []) is not None

    def allocate_slots(self, req: KVCacheRequest, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req``; False (and no change) if full.

        ``new_computed_blocks`` are cache hits (from :meth:`get_computed_blocks`) that a newly
        admitted request takes a reference on.
        """
        computed = new_computed_blocks or []
        needed = self._num_new_blocks(req, num_new_tokens, computed)
        if needed is None:
            return False
        if computed:
            self.block_pool.touch(computed)
            req.blocks.extend(computed)
            req.num_registered_blocks = len(req.blocks)
        if needed > 0:
            req.blocks.extend(self.block_pool.get_new_blocks(needed))
        return True

    def cache_computed_blocks(self, req: KVCacheRequest) -> None:
        """Register the full blocks of ``req`` whose KV is written (after a step)."""
        if not self.enable_caching:
            return
        start = req.num_registered_blocks
        num_full = min(req.num_computed_tokens // self.block_size, len(req.blocks))
        if num_full <= start:
            return
        if len(req.block_hashes) < num_full:
            req.hash_blocks(self.block_size, num_full)
            num_full = min(num_full, len(req.block_hashes))
            if num_full <= start:
                return
        blocks = req.blocks[start:num_full]
        self.block_pool.cache_blocks(blocks, req.block_hashes[start:num_full], req.lora_name)
        req.num_registered_blocks = num_full
        if self.tier is not None:
            self.tier.on_gpu_cached(blocks, req.lora_name)

    def free(self, req: KVCacheRequest) -> None:
        """Release the blocks of ``req``; its tail blocks become the first evicted."""
        self.block_pool.free_blocks(reversed(req.blocks))
        req.blocks = []
        req.num_registered_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, on the GPU and in the CPU tier (only when no request holds
        blocks and no copy is queued)."""
        pool = self.block_pool
        if pool.get_num_free_blocks() != pool.num_blocks:
            return False
        if self.tier is not None and not self.tier.clear():
            return False
        return pool.reset_prefix_cache()  # its AllBlocksCleared covers the tier too
