"""PreciseIndex: exact cached-token predictions for backends whose KV events the router reads.

For a vLLM backend with a KV-event subscription (``router/fleet/kv_subscriber.py``) the router
knows the engine's own block chain (:class:`~router.routing.token_index.TokenBlockIndex`), so
for a request whose token ids it has (the backend's tokenizer and chat template:
``router/routing/chat_tokens.py``) it knows how many tokens that backend will report cached --
not a byte-level estimate. This object answers that, per backend, and only where the answer is
exact: a backend is *precise* while its stream is synchronised (every event since its cache was
empty was seen); otherwise it is left to the byte-level index and ``cached_tokens`` feedback.

**In flight.** A request's blocks reach the index only when the engine has computed them and
published its ``BlockStored``; until then a second request with the same prefix would see no
hit. So a dispatched request's full prompt blocks are kept as *pending* on its backend, from
dispatch until ``grace_s`` after it finished (its events have arrived by then), and a lookup
takes the longer of the indexed and the pending match. A pending match is a prediction, not a
fact: feedback corrects it like any other.

No I/O, no clock: times are passed in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from router.routing.token_index import SyncState, TokenBlockIndex, block_extra_key

DEFAULT_GRACE_S = 2.0
MAX_PENDING_S = 900.0  # a request that never reports its end stops counting after this


@dataclass(slots=True, frozen=True)
class PromptTokens:
    """A request as its backend tokenizes it: the prompt's token ids and what keys its blocks."""

    token_ids: tuple[int, ...]
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass(slots=True, eq=False)
class Pending:
    """One dispatched request's blocks on one backend (see the module docstring)."""

    backend: str
    keys: tuple[int, ...]
    expires: float


@dataclass(slots=True)
class _PendingBlocks:
    counts: dict[int, int] = field(default_factory=dict)


class PreciseIndex:
    """Exact predicted cached tokens for synchronised backends, plus their in-flight blocks."""

    def __init__(self, index: TokenBlockIndex | None = None, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.index = index if index is not None else TokenBlockIndex()
        self.grace_s = grace_s
        self._backends: set[str] = set()  # backends with a subscription
        self._pending: dict[str, _PendingBlocks] = {}
        self._live: list[Pending] = []
        self._next_expiry = math.inf  # the earliest expiry in _live

    # -- membership ----------------------------------------------------------------------------
    def track(self, backend: str) -> None:
        """``backend`` publishes KV events to this router (its subscription is starting)."""
        self._backends.add(backend)

    def untrack(self, backend: str) -> None:
        """``backend`` left: forget its blocks and its pending requests."""
        self._backends.discard(backend)
        self.index.forget(backend)
        self._pending.pop(backend, None)
        self._live = [p for p in self._live if p.backend != backend]

    def reset(self, backend: str) -> None:
        """``backend``'s cache is gone or unknown (it failed, restarted): drop what is known of it
        until its stream is synchronised again."""
        if backend not in self._backends:
            return
        self.index.mark_unsynchronised(backend)
        self._pending.pop(backend, None)
        self._live = [p for p in self._live if p.backend != backend]

    def has_backends(self) -> bool:
        """Whether any backend has a subscription (else requests need no token ids at all)."""
        return bool(self._backends)

    def precise(self, backend: str) -> bool:
        """True while ``backend``'s predictions are exact (its stream is synchronised)."""
        return backend in self._backends and self.index.state(backend) is SyncState.SYNCHRONISED

    # -- lookups -------------------------------------------------------------------------------
    def cached_tokens(self, tokens: PromptTokens, now: float) -> dict[str, int]:
        """Predicted ``cached_tokens`` of every precise backend for this prompt (0 included: a
        precise 0 is a fact that overrides any byte-level estimate)."""
        out: dict[str, int] = {}
        ids = tokens.token_ids
        if not ids:
            return out
        self._expire(now)
        keys_by_size: dict[int, list[int]] = {}  # the prompt's chain keys, once per block size
        for backend in self._backends:
            if self.index.state(backend) is not SyncState.SYNCHRONISED:
                continue
            cached = self.index.predicted_cached_tokens(backend, ids, lora_name=tokens.lora_name,
                                                        cache_salt=tokens.cache_salt)
            pending = self._pending.get(backend)
            size = self.index.block_size(backend)
            if pending is not None and pending.counts and size:
                keys = keys_by_size.get(size)
                if keys is None:
                    keys = keys_by_size[size] = self._chain_keys(tokens, size)
                matched = 0
                for key in keys:
                    if key not in pending.counts:
                        break
                    matched += size
                cached = max(cached, matched)
            out[backend] = cached
        return out

    # -- in flight -----------------------------------------------------------------------------
    def dispatched(self, backend: str, tokens: PromptTokens, now: float) -> Pending | None:
        """A request with ``tokens`` was sent to ``backend``; returns its pending record."""
        if backend not in self._backends:
            return None
        size = self.index.block_size(backend)
        if not size:
            return None
        keys = tuple(self._chain_keys(tokens, size))
        if not keys:
            return None
        record = Pending(backend, keys, now + MAX_PENDING_S)
        counts = self._pending.setdefault(backend, _PendingBlocks()).counts
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        self._live.append(record)
        self._next_expiry = min(self._next_expiry, record.expires)
        return record

    def finished(self, record: Pending, now: float) -> None:
        """The request of ``record`` ended: its blocks stay pending ``grace_s`` longer."""
        record.expires = min(record.expires, now + self.grace_s)
        self._next_expiry = min(self._next_expiry, record.expires)

    def _expire(self, now: float) -> None:
        if self._next_expiry > now:  # nothing due: the lookup path stays O(1) here
            return
        keep = []
        for p in self._live:
            if p.expires > now:
                keep.append(p)
                continue
            pending = self._pending.get(p.backend)
            if pending is None:
                continue
            for key in p.keys:
                left = pending.counts.get(key, 0) - 1
                if left > 0:
                    pending.counts[key] = left
                else:
                    pending.counts.pop(key, None)
        self._live = keep
        self._next_expiry = min((p.expires for p in keep), default=math.inf)

    @staticmethod
    def _chain_keys(tokens: PromptTokens, size: int) -> list[int]:
        """One key per full block of the prompt less its last token (what the engine can serve
        from cache), each naming the whole prefix up to it."""
        ids = tokens.token_ids
        keys, parent = [], 0
        for i in range((len(ids) - 1) // size):
            parent = hash((parent, block_extra_key(i, tokens.lora_name, tokens.cache_salt),
                           ids[i * size:(i + 1) * size]))
            keys.append(parent)
        return keys
