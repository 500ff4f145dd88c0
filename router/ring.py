"""WorkerRing: consistent hashing of prefixes and sessions onto workers (uhashring).

Two routers that know the same workers build the same ring (same worker ids, same virtual
nodes, same hash), so they place a new prefix or session on the same worker without talking.
Keys are the router's 64-bit chain or session hashes; they are already uniform, so they are
used as ring positions directly, and virtual-node points are hashed with xxh3 (uhashring's
default md5 would dominate the decision time).

Removing a worker moves only its keys (to their next workers on the ring); adding one takes
only its share.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import xxhash
from uhashring import HashRing

DEFAULT_VNODES = 160


def _ring_hash(key: object) -> int:
    if isinstance(key, int):
        return key & 0xFFFFFFFFFFFFFFFF
    return xxhash.xxh3_64_intdigest(str(key).encode("utf-8", "surrogatepass"))


class WorkerRing:
    """The consistent-hash ring over routable worker ids."""

    def __init__(self, worker_ids: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        self.vnodes = vnodes
        self._ring = HashRing(nodes=[], hash_fn=_ring_hash, vnodes=vnodes)
        self._members: set[str] = set()
        for worker_id in worker_ids:
            self.add(worker_id)

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
            self._ring.add_node(worker_id, {"vnodes": self.vnodes})
            self._members.add(worker_id)

    def remove(self, worker_id: str) -> None:
        """Take ``worker_id`` off the ring (no-op if absent)."""
        if worker_id in self._members:
            self._ring.remove_node(worker_id)
            self._members.discard(worker_id)

    def owner(self, key: int) -> str | None:
        """The worker that owns ``key`` (None on an empty ring)."""
        if not self._members:
            return None
        return self._ring.get_node(key)

    def successors(self, key: int, count: int) -> list[str]:
        """The first ``count`` distinct workers clockwise from ``key`` (the owner first)."""
        if not self._members or count <= 0:
            return []
        return [node["nodename"] for node in self._ring.range(key, size=min(count, len(self._members)))]

    def walk(self, key: int) -> Iterator[str]:
        """Every worker once, in ring order from ``key``'s owner (lazy)."""
        if not self._members:
            return iter(())
        return (node["nodename"] for node in self._ring.range(key))

    def first_under_bound(self, key: int, over_bound: Callable[[str], bool]) -> tuple[str | None, int]:
        """Bounded-load lookup: the first worker from ``key``'s owner not ``over_bound``.

        Returns ``(worker_id, hops)``, ``hops`` = how many workers over the bound were walked
        past (0 = the owner itself); ``(None, n)`` when every worker is over the bound.
        """
        hops = 0
        for worker_id in self.walk(key):
            if not over_bound(worker_id):
                return worker_id, hops
            hops += 1
        return None, hops
