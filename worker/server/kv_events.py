"""Translate the engine's KV events (token-block hashes) into the router's chunk hashes. Pure.

The router names prefixes by chained hashes of fixed-size chunks of the *rendered request
bytes*; the engine caches *token blocks*. For every request the worker computes the router's
chain ``h_1..h_n`` (protocol.render_request + protocol.chunk_hashes) and attaches each chunk
to the prompt block whose caching completes it::

    rendered bytes  |---- C ----|---- C ----|---- C ----|--|        L bytes, n = L // C chunks
    prompt tokens   |B|..........................................|  N tokens
    chunk i ends at byte i·C  ->  token p_i = ceil(i·C·N / L)  ->  block k_i = ceil(p_i / bs) - 1

(exact for the byte-level tokenizer on text completions, where N = L + 1 with the BOS token;
proportional otherwise). A chunk whose block is not a *full* prompt block is not attached: the
engine never caches partial blocks, so the router must not be told that prefix is held.

When the engine reports a block stored, its chunks are announced ``stored`` (naming the LoRA
adapter whose KV it is); when evicted, ``removed`` -- but only the chunks no other stored block
still completes: one chunk hash can complete in a different block of each request (the block
that ends a shared system prompt also starts each request's own text), and one request's
eviction must not tell the router the shared prefix is gone (the entry stays, so a later
recompute is announced again); on a cache reset, ``cleared``. Each ``stored`` / ``removed`` keeps the
engine event's ``medium`` (``gpu``, or ``cpu`` for the host KV tier): a block can be held in
both tiers at once, and each tier's state of it is tracked apart. The router's chunk chain and the engine's block
chain may have different seeds: a LoRA request's blocks are also keyed by the adapter's content
digest (worker/engine/kv_cache/hashing.py ``adapter_namespace``), its chunks by the names the
router sees. The table from block hash to chunk hashes is
bounded (least recently registered entries go first): a forgotten entry only means its later
eviction goes unannounced, which the router's TTL and cached-token feedback correct.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from protocol.hashing import chunk_hashes
from protocol.messages import KV_CLEARED, KV_REMOVED, KV_STORED, MEDIUM_GPU
from worker.engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from worker.engine.kv_cache.hashing import hash_request_blocks


def chunk_blocks(num_chunks: int, chunk_size: int, rendered_len: int, num_prompt_tokens: int,
                 block_size: int) -> list[int]:
    """Block index completing each chunk ``1..num_chunks``, or -1 when that is not a full block."""
    if rendered_len <= 0 or num_prompt_tokens <= 0:
        return [-1] * num_chunks
    full_blocks = num_prompt_tokens // block_size
    out = []
    for i in range(1, num_chunks + 1):
        pos = -(-i * chunk_size * num_prompt_tokens // rendered_len)  # ceil without floats
        block = -(-pos // block_size) - 1
        out.append(block if block < full_blocks else -1)
    return out


@dataclass(frozen=True, slots=True)
class RequestChunks:
    """One request's router chunks, the prompt block completing each (-1: none), block hashes,
    and the LoRA adapter it runs with (None: the base model)."""

    chunk_hashes: list[int]
    chunk_block_ids: list[int]
    block_hashes: list[int]
    lora_name: str | None = None


def request_chunks(rendered: bytes, prompt_token_ids: Sequence[int], namespace: int,
                   chunk_size: int, block_size: int, block_namespace: int | None = None,
                   lora_name: str | None = None) -> RequestChunks:
    """Compute a request's router chain and map it onto its prompt blocks.

    ``namespace`` is ``protocol.namespace_seed(model, adapter, cache_salt)``: the seed of the
    router's chunk chain, and of the engine's block chain unless ``block_namespace`` (the
    engine's seed of a LoRA request) is given.
    """
    hashes = chunk_hashes(rendered, chunk_size, namespace)
    blocks = chunk_blocks(len(hashes), chunk_size, len(rendered), len(prompt_token_ids), block_size)
    needed = max(blocks, default=-1) + 1
    seed = namespace if block_namespace is None else block_namespace
    block_hashes = hash_request_blocks(prompt_token_ids, block_size, seed, needed) if needed else []
    return RequestChunks(hashes, blocks, block_hashes, lora_name)


@dataclass(slots=True)
class _Entry:
    chunks: dict[int, None] = field(default_factory=dict)  # an ordered set
    stored: set[str] = field(default_factory=set)  # the mediums holding the block


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """One router-facing change: ``kind`` is stored / removed / cleared, in chunk hashes
    (``lora_name``: the adapter whose KV a ``stored`` is; ``medium``: the tier)."""

    kind: str
    hashes: list[int]
    lora_name: str | None = None
    medium: str = MEDIUM_GPU


class KVEventMapper:
    """Remembers which router chunks each engine block completes, and translates engine events.

    ``max_blocks`` bounds the table; ``max_chunks_per_block`` bounds what one block can collect
    from many differently rendered requests.
    """

    def __init__(self, max_blocks: int = 65536, max_chunks_per_block: int = 64) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self.max_chunks_per_block = max_chunks_per_block
        self._blocks: OrderedDict[int, _Entry] = OrderedDict()
        # How many stored blocks back each (chunk, medium): the same chunk hash can complete in
        # different blocks of different requests (a chunk ending mid-block, a BOS shift: the
        # block holding the end of a shared system prompt also holds the start of each
        # request's own text), so it is removed only when the last of them is evicted.
        self._backing: dict[tuple[int, str], int] = {}
        self.forgotten = 0  # entries dropped by the bound (unannounced evictions possible)

    def __len__(self) -> int:
        return len(self._blocks)

    def chunks_of(self, block_hash: int) -> list[int]:
        """The chunk hashes attached to ``block_hash`` (empty if unknown)."""
        entry = self._blocks.get(block_hash)
        return list(entry.chunks) if entry else []

    def register(self, request: RequestChunks) -> list[ChunkEvent]:
        """Attach a request's chunks to its prompt blocks (see :func:`request_chunks`).

        Returns ``stored`` events for chunks newly attached to blocks already stored (a block
        cached by an earlier request whose rendering attached other chunks).
        """
        late: dict[str, list[int]] = {}
        block_hashes = request.block_hashes
        for h, k in zip(request.chunk_hashes, request.chunk_block_ids):
            if k < 0 or k >= len(block_hashes):
                continue
            block = block_hashes[k]
            entry = self._blocks.get(block)
            if entry is None:
                entry = self._blocks[block] = _Entry()
                self._bound()
            else:
                self._blocks.move_to_end(block)
            if h in entry.chunks or len(entry.chunks) >= self.max_chunks_per_block:
                continue
            entry.chunks[h] = None
            for medium in entry.stored:
                self._back(h, medium, 1)
                late.setdefault(medium, []).append(h)
        return [ChunkEvent(KV_STORED, hashes, request.lora_name, medium) for medium, hashes in sorted(late.items())]

    def _bound(self) -> None:
        while len(self._blocks) > self.max_blocks:
            _, entry = self._blocks.popitem(last=False)
            for medium in entry.stored:
                for h in entry.chunks:
                    self._back(h, medium, -1)
            self.forgotten += 1

    def _back(self, chunk: int, medium: str, delta: int) -> int:
        """Change how many stored blocks back ``chunk`` in ``medium``; returns the new count."""
        key = (chunk, medium)
        count = self._backing.get(key, 0) + delta
        if count > 0:
            self._backing[key] = count
        else:
            self._backing.pop(key, None)
        return count

    def translate(self, events: Iterable[KVCacheEvent]) -> list[ChunkEvent]:
        """Router-facing events for a sequence of engine events, in order; empty ones omitted."""
        out: list[ChunkEvent] = []
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self._blocks.clear()
                self._backing.clear()
                out.append(ChunkEvent(KV_CLEARED, []))
            elif isinstance(event, BlockStored):
                hashes = []
                for block in event.block_hashes:
                    entry = self._blocks.get(block)
                    if entry is not None:
                        if event.medium not in entry.stored:
                            entry.stored.add(event.medium)
                            for h in entry.chunks:
                                self._back(h, event.medium, 1)
                        hashes.extend(entry.chunks)
                if hashes:
                    out.append(ChunkEvent(KV_STORED, hashes, event.lora_name, event.medium))
            elif isinstance(event, BlockRemoved):
                hashes = []
                for block in event.block_hashes:
                    # Kept (not stored): a request registered earlier may compute the block again.
                    entry = self._blocks.get(block)
                    if entry is not None and event.medium in entry.stored:
                        entry.stored.discard(event.medium)
                        # Announced only when no other stored block still completes the chunk.
                        hashes.extend(h for h in entry.chunks if self._back(h, event.medium, -1) == 0)
                if hashes:
                    out.append(ChunkEvent(KV_REMOVED, hashes, medium=event.medium))
        return out
