"""BlockPool: the fixed set of KV blocks, their ref counts, the LRU free queue, the hash map.

Every block is in exactly one of three states::

    in use   ref_cnt > 0                     not in the free queue
    cached   ref_cnt == 0, block_hash set    in the free queue, findable by hash
    free     ref_cnt == 0, no block_hash     in the free queue

The free queue is ordered by eviction priority; new blocks are taken from its head::

    head -> [free ... free][cached (least recently used) ... cached (most recently used)] <- tail

Freed blocks without a hash go to the head (they hold nothing worth keeping); freed cached
blocks go to the tail, so the least recently used cached block is evicted first. A cache hit
on a block in the queue removes it from the middle in O(1) (doubly linked list).

The pool never allocates tensors: block ids index the KV tensors the model runner owns.
"""
from __future__ import annotations

from typing import Callable, Iterable

from worker.engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class KVCacheBlock:
    """One KV block: its id, ref count, hash (when cached), and free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) pop at the head, push at either end, remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels keep every link operation branch-free.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (the next to be reused)."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (reused first)."""
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Ids from head to tail (for tests and debugging)."""
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    """Hands out KV blocks, keeps the prefix cache's hash -> block map, records KV events.

    Events (:class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared`) accumulate
    until :meth:`take_events`.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        self.num_cached_free_blocks = 0  # cached blocks with ref_cnt == 0
        self._events: list[KVCacheEvent] = []
        # Called with each cached block about to be evicted, while its KV is still intact (the
        # CPU tier copies it out: worker/engine/kv_cache/kv_tier.py).
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    # ---- queries -------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus cached-unreferenced (evictable)."""
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The block holding the prefix named ``block_hash``, if cached."""
        return self.cached_block_hash_to_block.get(block_hash)

    def usage(self) -> float:
        """Fraction of blocks referenced by live requests."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    # ---- allocation ----------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting cached ones (ref 1)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks; {self.get_num_free_blocks()} free")
        out = []
        evicted: list[int] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                if self.on_evict is not None:
                    self.on_evict(block)
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._events.append(BlockRemoved(evicted))
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks (removing unreferenced ones from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in eviction order (first = evicted first).

        Blocks reaching ref 0 with a hash go to the tail (cached, LRU); without one, to the head.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than referenced")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)
                    self.num_cached_free_blocks += 1

    # ---- prefix cache --------------------------------------------------------------------
    def cache_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[int],
                     lora_name: str | None = None) -> None:
        """Register in-use ``blocks`` (KV written) under ``block_hashes`` and emit BlockStored
        (naming the LoRA adapter that computed them, if any).

        A hash that already names another block leaves this block unregistered: two requests
        computed the same prefix concurrently, and one copy is enough.
        """
        if not self.enable_caching:
            return
        stored: list[int] = []
        for block, h in zip(blocks, block_hashes):
            if block.block_hash is not None:
                continue
            if h in self.cached_block_hash_to_block:
                continue
            block.block_hash = h
            self.cached_block_hash_to_block[h] = block
            stored.append(h)
        if stored:
            self._events.append(BlockStored(stored, lora_name))

    def _uncache(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_cached_free_blocks -= 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no block is in use. True if done."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cached_free_blocks = 0
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self._events.append(AllBlocksCleared())
        return True

    def record_event(self, event: KVCacheEvent) -> None:
        """Append another tier's event to this pool's stream (in order with its own)."""
        self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Raise AssertionError if the three block states do not add up (tests call this)."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        free = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is None)
        assert in_use + cached + free == self.num_blocks
        assert cached == self.num_cached_free_blocks, (cached, self.num_cached_free_blocks)
        assert free + cached == self.free_block_queue.num_free_blocks
        assert len(self.free_block_queue.block_ids()) == free + cached
        assert all(self.cached_block_hash_to_block[b.block_hash] is b
                   for b in self.blocks if b.block_hash is not None)
