"""WorkerRing: consistent hashing of prefixes and sessions onto workers (uhashring's continuum).

Two routers that know the same workers build the same ring (same worker ids, same virtual
nodes, same hash), so they place a new prefix or session on the same worker without talking.
Keys are the router's 64-bit chain or session hashes; they are already uniform, so they are
used as ring positions directly, and virtual-node points are hashed with xxh3 (uhashring's
default md5 would dominate the decision time).

uhashring builds the continuum (its points and their owners); lookups walk that continuum with
``bisect`` here, because uhashring's own ``range()`` copies the whole point list on every call
(about 125 µs at 1,000 workers x 160 points) and ``add_node`` re-sorts it once per node. The
continuum is rebuilt lazily, from the sorted member list, on the first lookup after a
membership change -- so the ring only depends on *which* workers are members, never on the
order they joined in.

Removing a worker moves only its keys (to their next workers on the ring); adding one takes
only its share.
"""
from __future__ import annotations

from array import array
from bisect import bisect_right
from typing import Iterable, Iterator

import xxhash
from uhashring import HashRing

from router.routing import hotloop

DEFAULT_VNODES = 160
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _ring_hash(key: object) -> int:
    if isinstance(key, int):
        return key & _MASK64
    return xxhash.xxh3_64_intdigest(str(key).encode("utf-8", "surrogatepass"))


class WorkerRing:
    """The consistent-hash ring over routable worker ids."""

    def __init__(self, worker_ids: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        self.vnodes = vnodes
        self._members: set[str] = set(worker_ids)
        self._points: list[int] = []
        self._points_u64 = b""  # the same positions as native uint64s, for the compiled walk
        self._owners: list[str] = []
        self._dirty = True

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    @property
    def members(self) -> frozenset[str]:
        """The worker ids on the ring."""
        return frozenset(self._members)

    def add(self, worker_id: str) -> None:
        """Put ``worker_id`` on the ring (no-op if present)."""
        if worker_id not in self._members:
            self._members.add(worker_id)
            self._dirty = True

    def remove(self, worker_id: str) -> None:
        """Take ``worker_id`` off the ring (no-op if absent)."""
        if worker_id in self._members:
            self._members.discard(worker_id)
            self._dirty = True

    def _rebuild(self) -> None:
        ring = HashRing(nodes={w: {"vnodes": self.vnodes} for w in sorted(self._members)},
                        hash_fn=_ring_hash)
        points = ring.get_points()  # sorted (position, worker id)
        self._points = [p for p, _ in points]
        self._points_u64 = array("Q", self._points).tobytes()
        self._owners = [w for _, w in points]
        self._dirty = False

    def _start(self, key: int) -> int:
        if self._dirty:
            self._rebuild()
        pos = bisect_right(self._points, _ring_hash(key))
        return 0 if pos == len(self._points) else pos

    def owner(self, key: int) -> str | None:
        """The worker that owns ``key`` (None on an empty ring)."""
        if not self._members:
            return None
        start = self._start(key)  # may rebuild self._owners
        return self._owners[start]

    def compiled_view(self) -> tuple[bytes, list[str]]:
        """(the ring's positions as native uint64s, the worker at each): what the compiled walk reads."""
        if self._dirty:
            self._rebuild()
        return self._points_u64, self._owners

    def successors(self, key: int, count: int) -> list[str]:
        """The first ``count`` distinct workers clockwise from ``key`` (the owner first)."""
        if not self._members or count <= 0:
            return []
        count = min(count, len(self._members))
        if self._dirty:
            self._rebuild()
        hot = hotloop.hot
        if hot is not None:  # the walk below, compiled (router/routing/_hotloop.c)
            found = hot.ring_successors(self._points_u64, self._owners, key, count)
            if found is not NotImplemented:
                return found
        # _start written out (every decision asks this)
        points = self._points
        i = bisect_right(points, key & _MASK64 if isinstance(key, int) else _ring_hash(key))
        if i == len(points):
            i = 0
        owners = self._owners
        n = len(owners)
        out = [owners[i]]
        while len(out) < count:
            i += 1
            if i == n:
                i = 0
            worker_id = owners[i]
            if worker_id not in out:
                out.append(worker_id)
        return out

    def walk(self, key: int) -> Iterator[str]:
        """Every worker once, in ring order from ``key``'s owner (lazy)."""
        if not self._members:
            return iter(())
        start = self._start(key)
        return self._distinct(self._walk_from(start))

    def _walk_from(self, start: int) -> Iterator[str]:
        owners = self._owners
        n = len(owners)
        for i in range(start, start + n):
            yield owners[i % n] if i >= n else owners[i]

    @staticmethod
    def _distinct(it: Iterator[str]) -> Iterator[str]:
        seen: set[str] = set()
        for worker_id in it:
            if worker_id not in seen:
                seen.add(worker_id)
                yield worker_id
