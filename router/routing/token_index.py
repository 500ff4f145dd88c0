"""Which token blocks each vLLM backend holds, kept from its KV events. No I/O.

For every backend the index keeps vLLM's own block chain, keyed the way the engine's prefix
cache is: a block is named by *(its parent block's engine hash, its extra key, its tokens)* and
maps to the engine hash vLLM gave it. Looking a prompt up walks the chain block by block from
the root — exactly vLLM's prefix-cache lookup — so the index never needs vLLM's hash function,
its hash seed (``PYTHONHASHSEED``) or its algorithm (``--prefix-caching-hash-algo``)::

    root (parent None)          child                      grandchild
    (None, salt?, t[0:B]) -> h1  (h1, None, t[B:2B]) -> h2  (h2, None, t[2B:3B]) -> h3

Copies are counted per hash and medium: vLLM can hold two physical blocks with one hash (two
requests that computed the same block before either was cached), stores each with its own
``BlockStored`` and removes each with its own ``BlockRemoved``; a hash is gone when its last copy
is. (A request sent with ``kv_cache_report_mode: "full"`` re-reports reused blocks as stored
without a new copy; such re-reports would keep a hash alive after its removal, so a fleet that
uses that mode must rely on ``cached_tokens`` feedback to correct the index.)

**Lost events never leave phantom hits.** Each batch carries the publisher's sequence number.
A gap (a batch missed), or a publisher that started again at 0 (a restarted engine), drops every
entry of that backend: entries kept across a gap could name blocks whose removal was missed. The
backend's :class:`SyncState` says what the remaining entries are worth:

- ``SYNCHRONISED``: every event since the engine's cache was last empty was seen (the stream
  began at seq 0, or an ``AllBlocksCleared`` came, or :meth:`TokenBlockIndex.resynchronise`
  replayed the whole history), so the index is exact;
- ``UNSYNCHRONISED``: the stream was joined late or had a gap; what the index holds is still
  there (a lower bound), but the engine may hold more: route on ``cached_tokens`` feedback.
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from router.routing.vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

DEFAULT_MEDIA = ("GPU",)  # vLLM's CPU build reports medium "GPU" too (its device cache)

_BlockKey = tuple[int | None, Any, tuple[int, ...]]


class SyncState(enum.Enum):
    """How far a backend's entries can be trusted (see the module docstring)."""

    UNKNOWN = "unknown"  # no batch seen yet
    SYNCHRONISED = "synchronised"
    UNSYNCHRONISED = "unsynchronised"


class Applied(enum.Enum):
    """What :meth:`TokenBlockIndex.apply` did with a batch."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq already seen (a replay overlapping the live stream): ignored
    GAP = "gap"  # batches were missed: entries dropped, then this batch applied
    RESTARTED = "restarted"  # the publisher began again at 0: entries dropped, then applied


@dataclass(slots=True)
class _Block:
    key: _BlockKey
    copies: Counter = field(default_factory=Counter)  # medium -> physical copies


@dataclass(slots=True)
class _Backend:
    blocks: dict[_BlockKey, int] = field(default_factory=dict)  # key -> engine hash
    by_hash: dict[int, _Block] = field(default_factory=dict)
    block_size: int | None = None
    last_seq: int | None = None
    state: SyncState = SyncState.UNKNOWN
    gaps: int = 0

    def clear(self) -> None:
        self.blocks.clear()
        self.by_hash.clear()


def block_extra_key(index: int, lora_name: str | None = None, cache_salt: str | None = None) -> tuple | None:
    """The extra key vLLM publishes for text block ``index``: the LoRA name, then (block 0 only)
    the ``cache_salt``; None when there is neither."""
    parts: list[Any] = []
    if lora_name:
        parts.append(lora_name)
    if cache_salt and index == 0:
        parts.append(cache_salt)
    return tuple(parts) or None


class TokenBlockIndex:
    """Per backend: vLLM's block chain from KV events, and how many leading prompt tokens it holds.

    ``max_blocks`` bounds one backend's entries (an engine holds at most its KV pool's blocks);
    a backend beyond it has lost removals, so it is dropped and marked unsynchronised.
    """

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self._backends: dict[str, _Backend] = {}

    # ---- state -------------------------------------------------------------------------------
    def state(self, backend: str) -> SyncState:
        """How far ``backend``'s entries can be trusted."""
        b = self._backends.get(backend)
        return b.state if b is not None else SyncState.UNKNOWN

    def block_size(self, backend: str) -> int | None:
        """The engine's block size, learned from its events (None before the first BlockStored)."""
        b = self._backends.get(backend)
        return b.block_size if b is not None else None

    def num_blocks(self, backend: str) -> int:
        """Distinct blocks ``backend`` holds by the index."""
        b = self._backends.get(backend)
        return len(b.by_hash) if b is not None else 0

    def gaps(self, backend: str) -> int:
        """Sequence gaps seen on ``backend``'s stream (each dropped its entries)."""
        b = self._backends.get(backend)
        return b.gaps if b is not None else 0

    def backends(self) -> list[str]:
        return sorted(self._backends)

    def forget(self, backend: str) -> None:
        """Drop everything about ``backend`` (it left the fleet)."""
        self._backends.pop(backend, None)

    def mark_unsynchronised(self, backend: str) -> None:
        """The subscription was lost (the caller saw the connection drop): drop the entries."""
        b = self._backends.setdefault(backend, _Backend())
        b.clear()
        b.last_seq = None
        b.state = SyncState.UNSYNCHRONISED

    # ---- events ------------------------------------------------------------------------------
    def apply(self, backend: str, batch: KVEventBatch) -> Applied:
        """Apply one batch of ``backend``'s events, checking its sequence number first."""
        b = self._backends.setdefault(backend, _Backend())
        outcome = Applied.APPLIED
        if b.last_seq is None:
            # the first batch since we knew nothing, or since an empty replay: only seq 0 proves
            # that nothing was missed
            b.state = SyncState.SYNCHRONISED if batch.seq == 0 else SyncState.UNSYNCHRONISED
        elif batch.seq <= b.last_seq:
            if batch.seq != 0:
                return Applied.DUPLICATE
            b.clear()  # a new publisher (restarted engine): its cache starts empty
            b.state = SyncState.SYNCHRONISED
            outcome = Applied.RESTARTED
        elif batch.seq != b.last_seq + 1:
            b.clear()
            b.gaps += 1
            b.state = SyncState.UNSYNCHRONISED
            outcome = Applied.GAP
        b.last_seq = batch.seq
        self._apply_events(b, batch.events)
        if len(b.by_hash) > self.max_blocks:
            b.clear()
            b.state = SyncState.UNSYNCHRONISED
        return outcome

    def resynchronise(self, backend: str, history: Sequence[KVEventBatch]) -> bool:
        """Rebuild ``backend`` from a replay of its whole stream (seq 0 on, contiguous).

        Returns False, changing nothing, when ``history`` does not start at 0 or has a hole: the
        replay buffer no longer holds the beginning, and the backend stays unsynchronised. An
        empty history (the engine never published) is a synchronised, empty backend.
        """
        if not history:
            old = self._backends.get(backend)
            self._backends[backend] = _Backend(state=SyncState.SYNCHRONISED, gaps=old.gaps if old else 0)
            return True
        if history[0].seq != 0:
            return False
        if any(later.seq != earlier.seq + 1 for earlier, later in zip(history, history[1:])):
            return False
        fresh = _Backend(state=SyncState.SYNCHRONISED)
        old = self._backends.get(backend)
        fresh.gaps = old.gaps if old is not None else 0
        for batch in history:
            self._apply_events(fresh, batch.events)
            fresh.last_seq = batch.seq
        self._backends[backend] = fresh
        return True

    def _apply_events(self, b: _Backend, events: Iterable[Any]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                if event.group_idx != 0:
                    continue  # only the full-attention group: the one prefix lookups walk
                if b.block_size is None or event.block_size > b.block_size:
                    b.block_size = event.block_size
                medium = event.medium or DEFAULT_MEDIA[0]
                for parent, h, tokens, extra in event.blocks():
                    block = b.by_hash.get(h)
                    if block is None:
                        key = (parent, extra, tokens)
                        block = b.by_hash[h] = _Block(key)
                        b.blocks[key] = h
                    block.copies[medium] += 1
            elif isinstance(event, BlockRemoved):
                if event.group_idx != 0:
                    continue
                medium = event.medium or DEFAULT_MEDIA[0]
                for h in event.block_hashes:
                    block = b.by_hash.get(h)
                    if block is None:
                        continue  # stored before we subscribed (or already dropped)
                    block.copies[medium] -= 1
                    if block.copies[medium] <= 0:
                        del block.copies[medium]
                    if not block.copies:
                        del b.by_hash[h]
                        if b.blocks.get(block.key) == h:
                            del b.blocks[block.key]
            elif isinstance(event, AllBlocksCleared):
                b.clear()
                b.state = SyncState.SYNCHRONISED

    # ---- lookups -----------------------------------------------------------------------------
    def matched_tokens(self, backend: str, token_ids: Sequence[int], lora_name: str | None = None,
                       cache_salt: str | None = None, media: tuple[str, ...] = DEFAULT_MEDIA) -> int:
        """How many leading tokens of ``token_ids`` ``backend`` holds in full blocks on ``media``."""
        b = self._backends.get(backend)
        if b is None or not b.block_size:
            return 0
        size = b.block_size
        parent: int | None = None
        matched = 0
        for i in range(len(token_ids) // size):
            key = (parent, block_extra_key(i, lora_name, cache_salt), tuple(token_ids[i * size:(i + 1) * size]))
            h = b.blocks.get(key)
            if h is None or not any(b.by_hash[h].copies.get(m) for m in media):
                break
            parent = h
            matched += size
        return matched

    def predicted_cached_tokens(self, backend: str, prompt_token_ids: Sequence[int], **kw: Any) -> int:
        """The ``cached_tokens`` vLLM will report for this prompt: matched full blocks, never the
        last prompt token (vLLM always computes it, so a fully cached prompt reports one block less)."""
        return self.matched_tokens(backend, prompt_token_ids[:-1], **kw)
