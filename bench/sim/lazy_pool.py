"""The engine's BlockPool with its never-used blocks made on first use (1,000 replicas start in ~0 s).

``worker.engine.kv_cache.BlockPool`` builds every block object and links it into the free queue up
front: at 1,000 simulated replicas of ~1,000 blocks each that is a million objects and over a
second before the first request, most of which no request of a run ever touches. Here the
pool's rules are unchanged (its hot methods are the engine's with the queue's steps written in);
only its free queue keeps the blocks no one has used yet as a counted run instead of a million
nodes. That run is all there is to it because of how the
queue moves: blocks leave at the head (or from the middle, only cached ones, which have been
used), freed blocks enter at the head (plain) or the tail (cached). So the never-used blocks
always form one contiguous stretch, in id order, and are handed out from its front exactly when
the eager queue would hand them out::

    head -> [freed plain ...] [never used: ids next..n-1, counted] [cached LRU ...] <- tail

:class:`LazyBlockPool` therefore hands out the same block ids, in the same order, with the same
events as the eager pool (a test drives both with random operations).
"""
from __future__ import annotations

from typing import Iterable

from worker.engine.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from worker.engine.kv_cache.events import BlockRemoved


class _LazyFreeQueue(FreeKVCacheBlockQueue):
    """A free queue whose never-used blocks are one marker node standing for ids ``len(made)..n-1``."""

    def __init__(self, made: list[KVCacheBlock], num_blocks: int) -> None:
        super().__init__(())
        self._made = made  # the pool's ``blocks``: block i at index i, grown on demand
        self._num_blocks = num_blocks
        self._marker = KVCacheBlock(-2)
        super().append(self._marker)
        self.num_free_blocks = num_blocks  # the marker counts for every block it stands for

    def _fresh(self) -> int:
        return self._num_blocks - len(self._made)

    def popleft(self) -> KVCacheBlock:
        marker = self._marker
        if self._head.next_free is not marker:
            return super().popleft()
        block = KVCacheBlock(len(self._made))
        self._made.append(block)
        if not self._fresh():
            self._unlink_marker()
        self.num_free_blocks -= 1
        return block

    def _unlink_marker(self) -> None:
        marker = self._marker
        prev, nxt = marker.prev_free, marker.next_free
        if prev is None or nxt is None:
            return
        prev.next_free, nxt.prev_free = nxt, prev
        marker.prev_free = marker.next_free = None

    def materialize(self) -> None:
        """Make every never-used block now, in place of the marker (for whole-pool walks)."""
        marker = self._marker
        if marker.prev_free is None:
            return
        made, before = self._made, marker.prev_free
        for block_id in range(len(made), self._num_blocks):
            block = KVCacheBlock(block_id)
            made.append(block)
            block.prev_free, before.next_free = before, block
            before = block
        before.next_free, marker.next_free.prev_free = marker.next_free, before
        marker.prev_free = marker.next_free = None

    def block_ids(self) -> list[int]:
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            if node is self._marker:
                out.extend(range(len(self._made), self._num_blocks))
            else:
                out.append(node.block_id)
            node = node.next_free
        return out


class LazyBlockPool(BlockPool):
    """:class:`~worker.engine.kv_cache.BlockPool` whose blocks are created when first handed out."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        super().__init__(1, enable_caching)  # every attribute the pool has, for one block ...
        self.num_blocks = num_blocks  # ... then its blocks replaced by the lazy run
        self.blocks = []
        self.free_block_queue = _LazyFreeQueue(self.blocks, num_blocks)

    # get_new_blocks, touch and free_blocks: the engine pool's, with the free queue's operations
    # written in (the same links, counts, events and evictions, in the same order; an error where
    # the engine's raises): the simulator's KV bookkeeping calls them for every request, and the
    # layers of method calls (pool, lazy queue, queue) cost more than the link updates.

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks; {queue.num_free_blocks} free")
        head = queue._head
        marker = getattr(queue, "_marker", None)  # None once reset_prefix_cache made the queue eager
        made = self.blocks
        out = []
        evicted: list[int] = []
        for _ in range(num_blocks):
            block = head.next_free
            if block is marker:  # a never-used block, made now (_LazyFreeQueue.popleft)
                block = KVCacheBlock(len(made))
                made.append(block)
                if len(made) == self.num_blocks:
                    queue._unlink_marker()
                queue.num_free_blocks -= 1
            else:
                nxt = block.next_free
                if block is queue._tail or nxt is None:
                    raise ValueError("no free blocks")
                head.next_free = nxt
                nxt.prev_free = head
                block.prev_free = block.next_free = None
                queue.num_free_blocks -= 1
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
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                prev, nxt = block.prev_free, block.next_free
                if prev is None or nxt is None:
                    raise RuntimeError(f"{block} is not in the free queue")
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                queue.num_free_blocks -= 1
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        queue = self.free_block_queue
        head, tail = queue._head, queue._tail
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than referenced")
            if block.ref_cnt == 0:
                if block.block_hash is None:  # to the head: reused first
                    first = head.next_free
                    head.next_free = block
                    block.prev_free = head
                    block.next_free = first
                    first.prev_free = block
                else:  # to the tail: evicted last
                    last = tail.prev_free
                    last.next_free = block
                    block.prev_free = last
                    block.next_free = tail
                    tail.prev_free = block
                    self.num_cached_free_blocks += 1
                queue.num_free_blocks += 1

    def materialize(self) -> None:
        """Create every block now (whole-pool operations walk ``blocks``)."""
        queue = self.free_block_queue
        if isinstance(queue, _LazyFreeQueue):
            queue.materialize()

    def reset_prefix_cache(self) -> bool:
        self.materialize()
        return super().reset_prefix_cache()

    def check_invariants(self) -> None:
        self.materialize()
        super().check_invariants()
