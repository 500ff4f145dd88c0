"""HostBlockPool: the CPU tier below the GPU BlockPool, keyed by the same block hashes.

Each of ``num_blocks`` host slots holds one block's KV (the model runner owns the host tensors
and indexes them by slot). An entry goes through::

    reserve(hash) ──► pending ──commit──► stored (loadable, LRU) ──evict──► gone
                         └────discard────► gone  (the copy out failed: never loadable)

Only *stored* entries are found by :meth:`lookup_run`, so a copy that failed, or has not run
yet, is never loaded. Entries are kept in LRU order (a lookup or a re-store makes them most
recently used); a new reservation evicts the least recently used unpinned stored entry. Pending
entries and entries a load is reading from are *pinned*: never evicted, so no store can overwrite
a slot while it is being read or written.

Stored and evicted entries are recorded as ``BlockStored`` / ``BlockRemoved`` events with
``medium="cpu"``. Nothing here allocates tensors or does I/O.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Sequence

from worker.engine.kv_cache.events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent


class HostBlock:
    """One host slot's entry: the block hash it holds, pins, and whether its KV is written."""

    __slots__ = ("block_hash", "slot", "pins", "stored", "lora_name")

    def __init__(self, block_hash: int, slot: int, lora_name: str | None) -> None:
        self.block_hash = block_hash
        self.slot = slot
        self.pins = 0
        self.stored = False
        self.lora_name = lora_name

    def __repr__(self) -> str:
        return f"HostBlock(slot={self.slot}, hash={self.block_hash}, pins={self.pins}, stored={self.stored})"


class HostBlockPool:
    """``num_blocks`` host slots, LRU over block hashes, with pins and two-phase stores."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the CPU KV tier needs at least one block")
        self.num_blocks = num_blocks
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # pop() hands out slot 0 first
        self._entries: OrderedDict[int, HostBlock] = OrderedDict()  # LRU first
        self._events: list[KVCacheEvent] = []
        # Where events go: this pool's own list, or (``sink`` set) the GPU pool's, so that one
        # stream keeps the two tiers' events in the order they happened.
        self.sink: Callable[[KVCacheEvent], None] | None = None
        self.num_evicted = 0
        self.num_stored = 0  # entries whose KV is written (loadable)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: int) -> HostBlock | None:
        """The entry for ``block_hash`` (pending or stored), without touching its LRU place."""
        return self._entries.get(block_hash)

    def lookup_run(self, block_hashes: Sequence[int]) -> list[HostBlock]:
        """The stored entries of the longest leading run of ``block_hashes`` (no LRU change)."""
        run: list[HostBlock] = []
        for h in block_hashes:
            entry = self._entries.get(h)
            if entry is None or not entry.stored:
                break
            run.append(entry)
        return run

    def touch(self, block_hash: int) -> None:
        """Make ``block_hash`` most recently used (if present)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)

    def reserve(self, block_hash: int, lora_name: str | None = None) -> HostBlock | None:
        """A pinned, pending entry for ``block_hash`` in a free or evicted slot.

        None when the hash is already here (it is touched instead) or every slot is pinned.
        """
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return None
        if not self._free_slots and not self._evict_one():
            return None
        entry = HostBlock(block_hash, self._free_slots.pop(), lora_name)
        entry.pins = 1
        self._entries[block_hash] = entry
        return entry

    def _evict_one(self) -> bool:
        for h, entry in self._entries.items():
            if entry.pins == 0:
                del self._entries[h]
                self._free_slots.append(entry.slot)
                self.num_evicted += 1
                self.num_stored -= 1  # pinned entries (pending ones too) are never evicted
                self._emit(BlockRemoved([h], medium=MEDIUM_CPU))
                return True
        return False

    def commit(self, entries: Iterable[HostBlock]) -> None:
        """The copies into these reserved entries succeeded: they become loadable and unpinned."""
        by_adapter: dict[str | None, list[int]] = {}
        for entry in entries:
            if self._entries.get(entry.block_hash) is not entry:
                continue  # cleared meanwhile
            entry.stored = True
            entry.pins -= 1
            self.num_stored += 1
            by_adapter.setdefault(entry.lora_name, []).append(entry.block_hash)
        for lora_name, hashes in by_adapter.items():
            self._emit(BlockStored(hashes, lora_name, medium=MEDIUM_CPU))

    def discard(self, entries: Iterable[HostBlock]) -> None:
        """The copies into these reserved entries failed: forget them (their slots are free)."""
        for entry in entries:
            if self._entries.get(entry.block_hash) is entry and not entry.stored:
                del self._entries[entry.block_hash]
                self._free_slots.append(entry.slot)

    def pin(self, entries: Iterable[HostBlock]) -> None:
        """Protect stored entries from eviction while a load reads them (and make them MRU)."""
        for entry in entries:
            entry.pins += 1
            self._entries.move_to_end(entry.block_hash)

    def unpin(self, entries: Iterable[HostBlock]) -> None:
        """Release :meth:`pin`."""
        for entry in entries:
            if entry.pins <= 0:
                raise RuntimeError(f"{entry} unpinned more often than pinned")
            entry.pins -= 1

    def clear(self) -> bool:
        """Forget every entry (nothing may be pinned); True if done. Emits nothing: the caller
        announces the reset (the GPU pool's ``AllBlocksCleared`` covers both tiers)."""
        if any(e.pins for e in self._entries.values()):
            return False
        self._entries.clear()
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        self.num_stored = 0
        return True

    def _emit(self, event: KVCacheEvent) -> None:
        if self.sink is not None:
            self.sink(event)
        else:
            self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def slot_hashes(self) -> list[int]:
        """Hashes from least to most recently used (tests and debugging)."""
        return list(self._entries)
