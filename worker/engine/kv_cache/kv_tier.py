"""KVTier: what goes down to the CPU tier, what comes back up, and the transfer-vs-recompute call.

The tier sits below the GPU :class:`~worker.engine.kv_cache.BlockPool` and speaks its block
hashes (namespace, LoRA adapter and cache salt included, so nothing is shared across them).

**Store policies** (when a GPU block's KV is copied to a host slot):

- ``write_back`` (default): when the GPU pool evicts a cached block to reuse it;
- ``write_through``: as soon as a block is registered in the GPU prefix cache;
- ``selective``: like ``write_back``, but only blocks reused at least ``min_hits`` times.

**Loads.** After the GPU hit, the longest contiguous run of stored CPU blocks is loaded back
when the transfer is cheaper than recomputing those tokens::

    transfer_s  = blocks * block_bytes / load_bytes_per_s          (measured host -> device)
    recompute_s = prefill_work(tokens, context=gpu_hit) / prefill_tokens_per_s   (engine's speed)

and recomputed otherwise. ``load_bytes_per_s`` starts at the configured value and becomes the
EMA of the copies the runner timed; the prefill speed is the engine's own
:class:`~worker.engine.stats.SpeedMeter` (the same unit the router predicts in).

**Copies** are queued here while the scheduler plans a step and handed to the runner with that
step (:meth:`take_copies`): stores run first (an evicted GPU block is about to be overwritten by
this very step), then loads, then the model. :meth:`finish_copies` commits the stores that
succeeded, discards the ones that failed (never loadable) and unpins the loads' sources.

No tensors, no I/O: the runner moves the bytes.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from worker.engine.kv_cache.block_pool import KVCacheBlock
from worker.engine.kv_cache.events import KVCacheEvent
from worker.engine.kv_cache.host_pool import HostBlock, HostBlockPool
from worker.engine.stats import SpeedMeter, prefill_work

STORE_POLICIES = ("write_back", "write_through", "selective")
DEFAULT_STORE_POLICY = "write_back"
DEFAULT_MIN_HITS = 2
# Until measured: PCIe 4.0 x16's effective host -> device rate on CUDA; a memcpy on a CPU.
DEFAULT_CUDA_LOAD_BYTES_PER_S = 25e9
DEFAULT_CPU_LOAD_BYTES_PER_S = 10e9


@dataclass(slots=True)
class TierCounters:
    """Cumulative counters of the tier (in tokens where a request sees them)."""

    loaded_tokens: int = 0  # prompt tokens loaded from the tier instead of recomputed
    recomputed_tokens: int = 0  # tokens the tier held but the decision recomputed
    loaded_blocks: int = 0
    stored_blocks: int = 0
    failed_stores: int = 0  # copies out that failed (their entries were discarded)
    skipped_stores: int = 0  # no slot free of pins
    bytes_loaded: int = 0
    bytes_stored: int = 0


@dataclass(slots=True)
class KVTierStats:
    """A snapshot of the tier: capacity, use, measured bandwidth, counters."""

    policy: str
    total_blocks: int
    block_size: int
    stored_blocks: int
    block_bytes: int
    load_bytes_per_s: float
    load_measured: bool
    counters: TierCounters = field(default_factory=TierCounters)

    @property
    def usage(self) -> float:
        return self.stored_blocks / self.total_blocks

    @property
    def load_tokens_per_s(self) -> float:
        """Tokens of KV loaded per second at the current bandwidth (what the router credits a
        ``cpu`` hit with); 0 when the block size is unknown."""
        if self.block_bytes <= 0 or self.block_size <= 0:
            return 0.0
        return min(self.load_bytes_per_s * self.block_size / self.block_bytes, 1e10)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class TierCopies:
    """One step's copies: ``stores`` (gpu block id -> host slot), then ``loads`` (host slot -> gpu block id)."""

    stores: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


class KVTier:
    """The CPU tier's policy and bookkeeping over a :class:`HostBlockPool`."""

    def __init__(self, num_blocks: int, block_size: int, block_bytes: int, *,
                 policy: str = DEFAULT_STORE_POLICY, min_hits: int = DEFAULT_MIN_HITS,
                 load_bytes_per_s: float = DEFAULT_CPU_LOAD_BYTES_PER_S, ema_alpha: float = 0.2) -> None:
        if policy not in STORE_POLICIES:
            raise ValueError(f"store policy must be one of {', '.join(STORE_POLICIES)}")
        if min_hits < 1:
            raise ValueError("min_hits must be >= 1")
        if load_bytes_per_s <= 0 or block_bytes < 0:
            raise ValueError("the tier's bandwidth must be positive and block_bytes >= 0")
        self.host = HostBlockPool(num_blocks)
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.policy = policy
        self.min_hits = min_hits
        self.load_bytes_per_s = float(load_bytes_per_s)
        self.load_measured = False
        self.ema_alpha = ema_alpha
        self.counters = TierCounters()
        self._hits: OrderedDict[int, int] = OrderedDict()  # block hash -> reuses (selective)
        self._max_hit_entries = max(65536, 4 * num_blocks)
        # block hash -> the LoRA adapter that computed it (base-model blocks are not listed), so
        # a write-back store's ``cpu`` event names it as the GPU one did
        self._lora_of: OrderedDict[int, str] = OrderedDict()
        self._stores: list[tuple[int, HostBlock]] = []
        self._loads: list[tuple[HostBlock, int]] = []
        self._in_flight: tuple[list[tuple[int, HostBlock]], list[tuple[HostBlock, int]]] | None = None

    # ---- going down -------------------------------------------------------------------------
    def on_gpu_evict(self, block: KVCacheBlock) -> None:
        """The GPU pool is about to reuse cached ``block``: copy it out if the policy says so."""
        h = block.block_hash
        assert h is not None
        if self.policy == "write_through":
            self.host.touch(h)
            return
        if self.policy == "selective" and self._hits.get(h, 0) < self.min_hits:
            return
        self._reserve(block.block_id, h, self._lora_of.get(h))

    def on_gpu_cached(self, blocks: Sequence[KVCacheBlock], lora_name: str | None) -> None:
        """``blocks`` were just registered in the GPU prefix cache (``write_through`` copies them)."""
        if lora_name is not None:
            lora_of = self._lora_of
            for block in blocks:
                if block.block_hash is not None:
                    lora_of[block.block_hash] = lora_name
                    lora_of.move_to_end(block.block_hash)
            while len(lora_of) > self._max_hit_entries:
                lora_of.popitem(last=False)
        if self.policy != "write_through":
            return
        for block in blocks:
            if block.block_hash is not None:
                self._reserve(block.block_id, block.block_hash, lora_name)

    def _reserve(self, gpu_block_id: int, block_hash: int, lora_name: str | None) -> None:
        if block_hash in self.host:
            self.host.touch(block_hash)
            return
        entry = self.host.reserve(block_hash, lora_name)
        if entry is None:
            self.counters.skipped_stores += 1
            return
        self._stores.append((gpu_block_id, entry))

    def note_hits(self, block_hashes: Sequence[int]) -> None:
        """Count a reuse of each block (``selective`` stores only blocks reused ``min_hits`` times)."""
        if self.policy != "selective":
            return
        hits = self._hits
        for h in block_hashes:
            hits[h] = hits.get(h, 0) + 1
            hits.move_to_end(h)
        while len(hits) > self._max_hit_entries:
            hits.popitem(last=False)

    # ---- coming up --------------------------------------------------------------------------
    def find(self, block_hashes: Sequence[int]) -> list[HostBlock]:
        """The stored run of leading ``block_hashes`` (those after the GPU hit)."""
        return self.host.lookup_run(block_hashes)

    def transfer_seconds(self, num_blocks: int) -> float:
        """Predicted host -> device time of ``num_blocks`` blocks at the measured bandwidth."""
        return num_blocks * self.block_bytes / self.load_bytes_per_s

    @staticmethod
    def recompute_seconds(num_tokens: int, context_tokens: int, speed: SpeedMeter) -> float:
        """Predicted prefill time of ``num_tokens`` after ``context_tokens`` at the engine's speed."""
        return prefill_work([(num_tokens, context_tokens)]) / speed.prefill_tokens_per_s

    def should_load(self, num_blocks: int, context_tokens: int, speed: SpeedMeter) -> bool:
        """Whether loading ``num_blocks`` blocks after ``context_tokens`` beats recomputing them."""
        if num_blocks <= 0:
            return False
        tokens = num_blocks * self.block_size
        return self.transfer_seconds(num_blocks) < self.recompute_seconds(tokens, context_tokens, speed)

    def pin(self, run: Sequence[HostBlock]) -> None:
        """Hold ``run`` against eviction while the scheduler decides (stores may evict meanwhile)."""
        self.host.pin(run)

    def unpin(self, run: Sequence[HostBlock]) -> None:
        """Release :meth:`pin` (the request was not admitted, or recomputes)."""
        self.host.unpin(run)

    def plan_load(self, run: Sequence[HostBlock], gpu_blocks: Sequence[KVCacheBlock]) -> None:
        """Copy pinned ``run`` into ``gpu_blocks`` with the next step (they stay pinned till then)."""
        assert len(run) == len(gpu_blocks)
        self._loads.extend(zip(run, (b.block_id for b in gpu_blocks)))
        self.counters.loaded_tokens += len(run) * self.block_size
        self.note_hits([e.block_hash for e in run])

    def note_recomputed(self, num_blocks: int) -> None:
        """The decision recomputed ``num_blocks`` blocks the tier holds."""
        self.counters.recomputed_tokens += num_blocks * self.block_size

    # ---- the step ---------------------------------------------------------------------------
    @property
    def has_queued_copies(self) -> bool:
        """Whether copies wait for the next step."""
        return bool(self._stores or self._loads)

    def take_copies(self) -> TierCopies:
        """The copies queued since the last step, for the step about to run."""
        if self._in_flight is not None:
            raise RuntimeError("the previous step's copies are not finished")
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        self._in_flight = (stores, loads)
        return TierCopies([(gpu, e.slot) for gpu, e in stores], [(e.slot, gpu) for e, gpu in loads])

    def finish_copies(self, stores_ok: bool, load_s: float = 0.0) -> None:
        """The step ran its copies: commit (or, ``stores_ok`` False, discard) the stores, unpin
        the loads' sources, and fold the loads' measured time into the bandwidth."""
        if self._in_flight is None:
            return
        stores, loads = self._in_flight
        self._in_flight = None
        entries = [e for _, e in stores]
        if stores_ok:
            self.host.commit(entries)
            self.counters.stored_blocks += len(entries)
            self.counters.bytes_stored += len(entries) * self.block_bytes
        else:
            self.host.discard(entries)
            self.counters.failed_stores += len(entries)
        sources = [e for e, _ in loads]
        self.host.unpin(sources)
        nbytes = len(sources) * self.block_bytes
        self.counters.loaded_blocks += len(sources)
        self.counters.bytes_loaded += nbytes
        if nbytes > 0 and load_s > 0:
            rate = nbytes / load_s
            a = self.ema_alpha
            self.load_bytes_per_s = rate if not self.load_measured else (1 - a) * self.load_bytes_per_s + a * rate
            self.load_measured = True

    # ---- observability ----------------------------------------------------------------------
    def clear(self) -> bool:
        """Forget every host entry, and the stores queued for the next step (False while a step's
        copies are in flight, or a load is queued)."""
        if self._in_flight is not None or self._loads:
            return False
        self.host.discard(e for _, e in self._stores)
        self._stores = []
        return self.host.clear()

    def take_events(self) -> list[KVCacheEvent]:
        """The host pool's ``medium="cpu"`` events since the last call."""
        return self.host.take_events()

    def stats(self) -> KVTierStats:
        """A snapshot (counters copied)."""
        c = self.counters
        return KVTierStats(policy=self.policy, total_blocks=self.host.num_blocks, block_size=self.block_size,
                           stored_blocks=self.host.num_stored, block_bytes=self.block_bytes,
                           load_bytes_per_s=self.load_bytes_per_s, load_measured=self.load_measured,
                           counters=TierCounters(**asdict(c)))
