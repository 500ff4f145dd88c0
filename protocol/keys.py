"""Redis key names, all in one place, all under one configurable prefix.

Every key is bounded: registry and load entries expire unless refreshed by a heartbeat, the
event stream is trimmed to a maximum length, snapshots expire. Redis must not grow without limit.

=================================  ======  ===============================================
key                                type    content
=================================  ======  ===============================================
``{p}workers``                     zset    worker_id -> last heartbeat (unix s); pruned
``{p}worker:{id}``                 string  WorkerInfo JSON, EX heartbeat TTL
``{p}load:{id}``                   string  LoadReport JSON, EX heartbeat TTL
``{p}kv_events``                   stream  KVEvent entries (field ``e``: JSON), MAXLEN ~N
``{p}index_snapshot``              string  PrefixIndex snapshot (with the stream id it covers)
``{p}config``                      hash    runtime router settings shared by routers
``{p}drains``                      hash    worker URL -> admin drain time (unix s); EX 7 days
=================================  ======  ===============================================
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "prefixlb:"


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key names under ``prefix``."""

    prefix: str = DEFAULT_PREFIX

    @property
    def workers(self) -> str:
        """Sorted set of worker ids scored by their last heartbeat."""
        return f"{self.prefix}workers"

    def worker(self, worker_id: str) -> str:
        """One worker's registry entry."""
        return f"{self.prefix}worker:{worker_id}"

    def load(self, worker_id: str) -> str:
        """One worker's latest load report."""
        return f"{self.prefix}load:{worker_id}"

    @property
    def kv_events(self) -> str:
        """The KV-event stream."""
        return f"{self.prefix}kv_events"

    @property
    def index_snapshot(self) -> str:
        """The latest prefix-index snapshot."""
        return f"{self.prefix}index_snapshot"

    @property
    def config(self) -> str:
        """Runtime router settings shared by all routers."""
        return f"{self.prefix}config"

    @property
    def drains(self) -> str:
        """Workers drained through any router's admin API (by URL), so every router drains them."""
        return f"{self.prefix}drains"
