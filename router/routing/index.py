"""PrefixIndex: which workers hold which prefixes, named by the router's chain hashes.

One chain hash names a whole prompt prefix (see ``protocol/hashing.py``), so the index is a flat
map ``hash -> {worker: expiry}``. A worker's match for a prompt is the number of leading chain
hashes it holds: the walk stops at the first hash the worker lacks, exactly as the worker's own
prefix cache stops at the first missing block.

Three sources write it (design.md section 3):

* ``insert(..., confirmed=False)`` -- optimistic inserts from the router's own decisions; they
  live ``optimistic_ttl_s`` unless a KV event confirms them;
* ``insert(..., confirmed=True)`` / ``remove`` / ``clear_worker`` -- the workers' KV events
  (``stored`` / ``removed`` / ``cleared``); confirmed entries live ``confirmed_ttl_s`` (a safety
  bound for lost ``removed`` events) and are refreshed whenever they are used or re-stored;
* ``demote`` -- feedback: a worker that reported fewer cached tokens than predicted.

Bounded: at most ``max_entries`` hashes in LRU order (a lookup that matches a hash makes it most
recently used), and expired entries are dropped lazily and by :meth:`sweep`.

Clearing a worker is O(1): every worker is represented by a ``_Holder`` object; clearing (or
removing) the worker replaces its holder, so all entries of the old holder become invisible at
once and are dropped lazily as they are met.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import partial
from itertools import islice, repeat, takewhile
from operator import lt
from typing import Iterable, Iterator, Sequence

from router.routing import hotloop


class _Holder:
    """One incarnation of a worker in the index (replaced when the worker is cleared)."""

    __slots__ = ("worker_id",)

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


@dataclass(slots=True)
class IndexStats:
    """Counters the metrics endpoint exposes."""

    entries: int = 0
    evicted_lru: int = 0
    expired: int = 0
    inserted: int = 0
    removed: int = 0


DEFAULT_MAX_ENTRIES = 200_000
DEFAULT_OPTIMISTIC_TTL_S = 30.0
DEFAULT_CONFIRMED_TTL_S = 3600.0
_NO_ENTRY: dict = {}  # what a lookup of an unknown hash reads as (never written)
_SHORT_WALK = 200  # chains up to this long are matched by a plain loop (the iterators cost more to set up)


class PrefixIndex:
    """Chain hash -> workers holding that prefix, with LRU + TTL bounds. No I/O, no clock.

    Every method that depends on time takes ``now`` (seconds, any monotonic-enough clock the
    caller uses consistently), so the fleet simulator can drive it in virtual time.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, optimistic_ttl_s: float = DEFAULT_OPTIMISTIC_TTL_S,
                 confirmed_ttl_s: float = DEFAULT_CONFIRMED_TTL_S) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self.optimistic_ttl_s = optimistic_ttl_s
        self.confirmed_ttl_s = confirmed_ttl_s
        self._map: OrderedDict[int, dict[_Holder, float]] = OrderedDict()
        self._live: dict[str, _Holder] = {}
        self.stats = IndexStats()

    def __len__(self) -> int:
        return len(self._map)

    def _holder(self, worker_id: str) -> _Holder:
        holder = self._live.get(worker_id)
        if holder is None:
            holder = self._live[worker_id] = _Holder(worker_id)
        return holder

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Per worker, how many leading hashes of ``hashes`` it holds (workers with 0 omitted).

        Matched hashes become most recently used: a prefix in use is the one most worth keeping.
        """
        return self.match_top(hashes, now, None)[0]

    def match_top(self, hashes: Sequence[int], now: float, limit: int | None) -> tuple[dict[str, int], bool]:
        """Like :meth:`match`, but at most ``limit`` workers: those with the longest matches.

        Returns ``(matches, complete)``; ``complete`` is False when more workers than ``limit``
        hold the first chunk and only the ``limit`` longest were kept (then use
        :meth:`depth_of` for any other worker). That case -- a system prompt every worker
        holds -- must not cost O(workers): it binary-searches the deepest chunk anyone holds
        and walks back from there, which assumes each worker's holdings are prefix-closed
        (true of a prefix cache: it evicts a chain from its tail, and a ``removed`` event for a
        middle chunk is only honoured exactly on the walk below).
        """
        if not hashes:
            return {}, True
        get = self._map.get
        entry = get(hashes[0])
        if not entry:
            return {}, True
        if limit is not None and len(entry) > limit:
            return self._match_many(hashes, now, limit)
        live = self._live
        holders = [h for h, exp in entry.items() if exp > now and live.get(h.worker_id) is h]
        if not holders:
            return {}, True
        touch = self._map.move_to_end
        touch(hashes[0])
        result: dict[str, int] = {}
        n = len(hashes)
        i = 1
        if len(holders) == 1:
            # The common case (one home per prefix) without per-step list building.
            only = holders[0]
            if n <= _SHORT_WALK:
                while i < n:
                    entry = get(hashes[i])
                    if entry is None or entry.get(only, 0.0) <= now:
                        break
                    touch(hashes[i])
                    i += 1
                return {only.worker_id: i}, True
            # The same walk by C iterators (a 100K-token prompt has thousands of chunks): the
            # holder's expiry for each next hash (0.0 where it has none), taken while it is
            # live, then those hashes made most recently used, in order.
            expiries = map(dict.get, map(get, islice(hashes, 1, None), repeat(_NO_ENTRY)), repeat(only), repeat(0.0))
            i += len(list(takewhile(partial(lt, now), expiries)))
            deque(map(touch, islice(hashes, 1, i)), maxlen=0)  # consumed for its effect
            return {only.worker_id: i}, True
        while i < n:
            entry = get(hashes[i])
            if entry is None:
                break
            still = [h for h in holders if entry.get(h, 0.0) > now]
            if len(still) != len(holders):
                for h in holders:
                    if h not in still:
                        result[h.worker_id] = i
                if not still:
                    holders = still
                    break
                holders = still
            touch(hashes[i])
            i += 1
        for h in holders:
            result[h.worker_id] = i
        return result, True

    def _live_in(self, entry: dict[_Holder, float], now: float) -> bool:
        live = self._live
        for holder, exp in entry.items():
            if exp > now and live.get(holder.worker_id) is holder:
                return True
        return False

    def _match_many(self, hashes: Sequence[int], now: float, limit: int) -> tuple[dict[str, int], bool]:
        # Compiled where built (router/routing/_hotloop.c): the same steps, in the same order.
        # Every decision of a fleet whose holders share a system prompt comes here.
        hot = hotloop.hot
        if hot is not None:
            found = hot.match_many(self._map, self._live, hashes, now, limit, _Holder)
            if found is not NotImplemented:
                return found
        return self._match_many_python(hashes, now, limit)

    def _match_many_python(self, hashes: Sequence[int], now: float, limit: int) -> tuple[dict[str, int], bool]:
        get = self._map.get
        lo, hi = 0, len(hashes)  # hashes[:lo] have a live holder; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            entry = get(hashes[mid - 1])
            if entry and self._live_in(entry, now):
                lo = mid
            else:
                hi = mid - 1
        # The search above assumes holdings are prefix-closed; a hash no live worker holds in the
        # middle (evicted, removed, expired) breaks that, and no cache serves past it: the
        # verifying walk (which also marks the prefix most recently used) ends the match there.
        touch = self._map.move_to_end
        for i in range(lo):
            entry = get(hashes[i])
            if not entry or not self._live_in(entry, now):
                lo = i
                break
            touch(hashes[i])
        if lo == 0:
            return {}, True
        live = self._live
        result: dict[str, int] = {}
        level = lo
        while level > 0 and len(result) < limit:
            entry = get(hashes[level - 1])
            if entry:
                for holder, exp in entry.items():
                    worker_id = holder.worker_id
                    if worker_id not in result and exp > now and live.get(worker_id) is holder:
                        result[worker_id] = level  # first seen walking back: its deepest chunk
                        if len(result) >= limit:
                            break
            level -= 1
        return result, False

    def depth_of(self, hashes: Sequence[int], worker_id: str, now: float, start: int = 0) -> int:
        """How many hashes of ``hashes``, from ``start`` on, ``worker_id`` holds in a row (no LRU
        side effect). ``start`` > 0 asks for the run that follows a prefix held elsewhere (a CPU
        tier's run after the worker's GPU hit)."""
        holder = self._live.get(worker_id)
        if holder is None:
            return 0
        get = self._map.get
        i = 0
        for h in hashes[start:] if start else hashes:
            entry = get(h)
            if entry is None or entry.get(holder, 0.0) <= now:
                break
            i += 1
        return i

    def insert(self, hashes: Iterable[int], worker_id: str, now: float, confirmed: bool) -> None:
        """Record that ``worker_id`` holds each prefix in ``hashes``.

        Optimistic entries never shorten a longer (confirmed) life; confirmed ones always get
        the full confirmed TTL.
        """
        holder = self._holder(worker_id)
        expiry = now + (self.confirmed_ttl_s if confirmed else self.optimistic_ttl_s)
        m = self._map
        count = 0
        for h in hashes:
            entry = m.get(h)
            if entry is None:
                m[h] = {holder: expiry}
            else:
                if confirmed or entry.get(holder, 0.0) < expiry:
                    entry[holder] = expiry
                m.move_to_end(h)
            count += 1
        self.stats.inserted += count
        excess = len(m) - self.max_entries
        if excess > 0:
            for _ in range(excess):
                m.popitem(last=False)
            self.stats.evicted_lru += excess

    def remove(self, hashes: Iterable[int], worker_id: str) -> None:
        """``worker_id`` no longer holds these prefixes (a ``removed`` KV event)."""
        holder = self._live.get(worker_id)
        if holder is None:
            return
        m = self._map
        for h in hashes:
            entry = m.get(h)
            if entry is not None and entry.pop(holder, None) is not None:
                self.stats.removed += 1
                if not entry:
                    del m[h]

    def demote(self, hashes: Iterable[int], worker_id: str, now: float) -> None:
        """Feedback: these entries proved stale; keep them only as short-lived optimistic ones.

        The request that revealed the misprediction has just stored the prefix on that worker
        again, so dropping the entries outright would be wrong too; a KV event re-confirms them.
        """
        holder = self._live.get(worker_id)
        if holder is None:
            return
        expiry = now + self.optimistic_ttl_s
        m = self._map
        for h in hashes:
            entry = m.get(h)
            if entry is not None and holder in entry:
                entry[holder] = min(entry[holder], expiry)

    def clear_worker(self, worker_id: str) -> None:
        """Forget everything about ``worker_id`` (a ``cleared`` event, or the worker left)."""
        if worker_id in self._live:
            self._live[worker_id] = _Holder(worker_id)

    def forget_worker(self, worker_id: str) -> None:
        """Like :meth:`clear_worker`, and stop tracking the worker at all."""
        self._live.pop(worker_id, None)

    def holds(self, h: int, worker_id: str, now: float) -> bool:
        """True when ``worker_id`` holds the prefix named by ``h``."""
        holder = self._live.get(worker_id)
        entry = self._map.get(h)
        return holder is not None and entry is not None and entry.get(holder, 0.0) > now

    def sweep(self, now: float, budget: int = 10_000) -> int:
        """Drop expired and orphaned entries, oldest first, looking at most ``budget`` hashes.

        Returns how many hashes were deleted. Meant to run periodically, off the request path.
        """
        live = self._live
        m = self._map
        deleted = 0
        keys = list(islice(m.keys(), budget))
        for h in keys:
            entry = m[h]
            stale = [holder for holder, exp in entry.items()
                     if exp <= now or live.get(holder.worker_id) is not holder]
            for holder in stale:
                del entry[holder]
            if not entry:
                del m[h]
                deleted += 1
        self.stats.expired += deleted
        return deleted

    def entries(self, now: float) -> Iterator[tuple[int, str, float]]:
        """Every live ``(hash, worker_id, seconds_left)``, oldest first (for snapshots)."""
        live = self._live
        for h, entry in self._map.items():
            for holder, exp in entry.items():
                if exp > now and live.get(holder.worker_id) is holder:
                    yield h, holder.worker_id, exp - now

    def hash_list(self) -> list[int]:
        """Every chain hash, oldest first (a copy: safe to walk while the index changes)."""
        return list(self._map)

    def entries_for(self, hashes: Iterable[int], now: float) -> list[tuple[int, str, float]]:
        """Live ``(hash, worker_id, seconds_left)`` for ``hashes`` (those still present)."""
        live = self._live
        get = self._map.get
        out = []
        for h in hashes:
            entry = get(h)
            if entry is None:
                continue
            for holder, exp in entry.items():
                if exp > now and live.get(holder.worker_id) is holder:
                    out.append((h, holder.worker_id, exp - now))
        return out

    def load_entries(self, items: Iterable[tuple[int, str, float]], now: float) -> int:
        """Add ``(hash, worker_id, seconds_left)`` entries (from a snapshot); returns the count."""
        m = self._map
        count = 0
        for h, worker_id, ttl in items:
            if ttl <= 0:
                continue
            holder = self._holder(worker_id)
            expiry = now + ttl
            entry = m.get(h)
            if entry is None:
                m[h] = {holder: expiry}
            elif entry.get(holder, 0.0) < expiry:
                entry[holder] = expiry
            count += 1
        excess = len(m) - self.max_entries
        for _ in range(max(0, excess)):
            m.popitem(last=False)
        return count

    def workers(self) -> list[str]:
        """Ids of the workers the index currently tracks."""
        return list(self._live)
