"""AdapterBoard: which LoRA adapters each worker holds, what a cold one costs, where an adapter may run.

A worker serving many adapters keeps a few in GPU slots (``max_loras``), more in host memory,
the rest on disk (docs/lora.md, "Three tiers"). A request for an adapter that is not in a slot
waits for it to be loaded -- a disk read if it is not in host memory, then a host -> GPU copy --
and, when every slot is pinned by running requests of other adapters, for a slot to drain. This
module keeps, per worker, what its load reports say (``LoadReport.max_loras``, ``lora_adapters``,
``lora_gpu``, ``lora_cpu``, ``lora_running``, ``lora_waiting``, ``lora_disk_load_s``,
``lora_slot_load_s``; a vLLM backend's ``vllm:lora_requests_info`` turned into the same fields)
plus what this router sent since, and answers two questions for the policy, with no I/O:

**How long before the adapter is usable there** (:meth:`AdapterBoard.ready_s`), added to the
candidate's predicted time to first token (``Candidate.adapter_s``)::

    ready_s(w, a) = 0                                   a in a slot of w (reported, or sent there since)
                  = slot_load_s + [a not in host] * disk_load_s + slot_wait_s(w)   otherwise
    slot_wait_s(w) = max(0, busy + blocked + 1 - max_loras) * service_s / max_loras

with ``busy`` the distinct adapters with requests running on w (pinning their slots), and
``blocked`` the distinct other adapters already waiting there for a slot: each drain of a slot
takes about one request's service time, and ``max_loras`` slots drain in parallel.

**Where it may run** (:meth:`AdapterBoard.candidate_ids`): *bounded replication*. An adapter has
a consistent-hash home, the first worker on its own ring (its name hashed), so a cold adapter,
or one no worker holds, goes to the same worker from every router, and that worker loads it.
The request may go to the first ``K`` workers on the adapter's ring that serve it and are under
their hard limit::

    K(a) = min(workers serving a, ceil((demand(a) + 1) / share) + spare)

``demand(a)`` is the adapter's requests in flight (this router's, or the workers' reports if
they count more), ``share`` the fleet's fair share of requests per worker (bounded-load
consistent hashing's ``ceil(1.25 x mean)``) and ``spare`` (``PolicyConfig.adapter_spare``, 1)
one worker beyond the need, so that a busy home can spill. A hot adapter spreads to as many
workers as its traffic fills; a cold one stays with its home, whose slot it keeps warm. Workers
that have the adapter in a slot now are candidates too (they serve it without a load). The cost
model then chooses among them, with ``ready_s`` in the cost; prefix locality stays per adapter,
since the index is keyed by the namespace, which carries the adapter.

Reports are untrusted: names are bounded strings, lists bounded in length, a worker cannot
claim more adapters in slots than its ``max_loras``, times are clamped, and one worker's report
changes only that worker's entry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet

import xxhash

from protocol import LoadReport
from router.routing.policy import PolicyConfig, hash_load_bound

if TYPE_CHECKING:
    from router.routing.balancer import Balancer
    from router.routing.load import LoadBoard

MAX_ADAPTER_NAME = 256
MAX_ADAPTERS_PER_WORKER = 4096  # names taken from one report at most
MAX_KNOWN_ADAPTERS = 100_000  # adapter names this router keeps statistics for
MAX_LOAD_S = 600.0  # a disk read or slot copy claimed longer than this is not believed
MAX_REQUESTS = 1 << 24
# Until a worker has measured: an 84 MB adapter (Llama-3-8B, rank 16, seven projections) read at
# ~2 GB/s after a 5 ms seek, and copied to the GPU at ~25 GB/s (the simulated worker's assumptions).
DEFAULT_DISK_LOAD_S = 0.047
DEFAULT_SLOT_LOAD_S = 0.0034
TIER_GPU, TIER_CPU, TIER_DISK = "gpu", "cpu", "disk"


def adapter_ring_key(adapter: str) -> int:
    """The position of ``adapter`` on the worker ring: its home is the key's owner."""
    return xxhash.xxh3_64_intdigest(adapter.encode("utf-8", "surrogatepass"))


def replicas(demand: int, share: int, spare: int, serving: int) -> int:
    """``K``: on how many workers an adapter with ``demand`` requests in flight may run (>= 1).

    ``ceil((demand + 1) / share)`` workers carry the adapter's traffic at the fleet's fair share
    per worker, plus ``spare``; never more than the ``serving`` workers, never fewer than one.
    """
    need = -(-(max(0, demand) + 1) // max(1, share))
    return max(1, min(serving, need + max(0, spare)))


def slot_wait_s(max_loras: int, busy: int, blocked: int, service_s: float) -> float:
    """Predicted wait for a free GPU slot (see the module docstring); 0 when one is free or unknown."""
    if max_loras <= 0:
        return 0.0
    ahead = busy + blocked + 1 - max_loras
    return ahead * service_s / max_loras if ahead > 0 else 0.0


def _names(value: object, limit: int = MAX_ADAPTERS_PER_WORKER) -> list[str]:
    """Valid adapter names from an untrusted collection (bounded, deduplicated, in order)."""
    out: dict[str, None] = {}
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        for name in value:
            if isinstance(name, str) and 0 < len(name) <= MAX_ADAPTER_NAME:
                out[name] = None
                if len(out) >= limit:
                    break
    return list(out)


def _counts(value: object) -> dict[str, int]:
    """Valid ``name -> requests`` pairs from an untrusted mapping (bounded, clamped)."""
    out: dict[str, int] = {}
    if isinstance(value, dict):
        for name, n in value.items():
            if (isinstance(name, str) and 0 < len(name) <= MAX_ADAPTER_NAME and isinstance(n, int)
                    and not isinstance(n, bool) and n > 0):
                out[name] = min(n, MAX_REQUESTS)
                if len(out) >= MAX_ADAPTERS_PER_WORKER:
                    break
    return out


def _seconds(value: object, default: float) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return min(float(value), MAX_LOAD_S)
    return default


@dataclass(slots=True)
class WorkerAdapters:
    """One worker's adapters: its last report, and this router's requests there since."""

    max_loras: int = 0
    served: frozenset[str] | None = None  # None: not listed (a vLLM backend loads on request)
    gpu: frozenset[str] = frozenset()
    cpu: frozenset[str] = frozenset()
    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    disk_load_s: float = DEFAULT_DISK_LOAD_S
    slot_load_s: float = DEFAULT_SLOT_LOAD_S
    sent: dict[str, int] = field(default_factory=dict)  # this router's requests in flight, by adapter
    recent: dict[str, float] = field(default_factory=dict)  # adapter -> last dispatch here after its report

    def serves(self, adapter: str) -> bool:
        """Whether a request for ``adapter`` may go here (unknown lists: yes)."""
        return self.served is None or adapter in self.served

    def in_slot(self, adapter: str) -> bool:
        """In a GPU slot by its report, or put there by a request of ours since (running or done)."""
        return adapter in self.gpu or adapter in self.sent or adapter in self.running or adapter in self.recent

    def tier(self, adapter: str) -> str:
        """Where ``adapter`` is here: ``gpu``, ``cpu`` (host memory) or ``disk``."""
        if self.in_slot(adapter):
            return TIER_GPU
        return TIER_CPU if adapter in self.cpu else TIER_DISK

    def ready_s(self, adapter: str, service_s: float) -> tuple[float, float]:
        """(load seconds, slot-wait seconds) before a new request for ``adapter`` can run here."""
        if self.in_slot(adapter):
            return 0.0, 0.0
        load = self.slot_load_s + (0.0 if adapter in self.cpu else self.disk_load_s)
        busy = len(self.running.keys() | self.sent.keys())
        blocked = sum(1 for a in self.waiting if a != adapter and a not in self.gpu and a not in self.running)
        return load, slot_wait_s(self.max_loras, busy, blocked, service_s)


@dataclass(slots=True)
class AdapterStats:
    """What this router did for one adapter (its metrics)."""

    requests: int = 0
    loads: dict[str, int] = field(default_factory=lambda: {TIER_CPU: 0, TIER_DISK: 0})
    predicted_slot_wait_s: float = 0.0
    evictions: int = 0  # left a worker's slots between two of its reports


class AdapterBoard:
    """Per-worker adapter residency, adapter demand, and the adapter-aware candidate set. No I/O."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerAdapters] = {}
        self._known: dict[str, int] = {}  # adapter -> workers that report it (any tier)
        self._inflight: dict[str, int] = {}  # adapter -> this router's requests in flight
        self._reported: dict[str, int] = {}  # adapter -> running + waiting, summed over the reports
        self.stats: dict[str, AdapterStats] = {}

    # -- reports -----------------------------------------------------------------------------
    def apply_report(self, report: LoadReport, at: float) -> None:
        """Take a worker's adapter picture from its load report, stamped ``at`` (fields validated
        and bounded); what this router sent there after ``at`` stays known as in a slot."""
        old = self._workers.get(report.worker_id)
        if not (report.max_loras or report.lora_adapters or report.lora_gpu or report.lora_cpu
                or report.lora_running or report.lora_waiting):
            # A worker without adapters (every report of a fleet without LoRA): nothing to parse.
            if old is not None:
                self._forget(report.worker_id)
            return
        max_loras = report.max_loras if isinstance(report.max_loras, int) and report.max_loras > 0 else 0
        served = _names(report.lora_adapters)
        running, waiting = _counts(report.lora_running), _counts(report.lora_waiting)
        # No worker has more adapters in slots than it has slots.
        gpu = _names(report.lora_gpu, max_loras if max_loras else MAX_ADAPTERS_PER_WORKER)
        cpu = _names(report.lora_cpu)
        if not (max_loras or served or gpu or cpu or running or waiting):
            if old is not None:
                self._forget(report.worker_id)
            return
        w = WorkerAdapters(
            max_loras=max_loras, served=frozenset(served) if served else None, gpu=frozenset(gpu),
            cpu=frozenset(cpu), running=running, waiting=waiting,
            disk_load_s=_seconds(report.lora_disk_load_s, old.disk_load_s if old else DEFAULT_DISK_LOAD_S),
            slot_load_s=_seconds(report.lora_slot_load_s, old.slot_load_s if old else DEFAULT_SLOT_LOAD_S),
            sent=old.sent if old is not None else {},
            recent={a: t for a, t in old.recent.items() if t > at} if old is not None else {})
        self._set_known(report.worker_id, old, w)
        self._workers[report.worker_id] = w
        if old is not None:
            for name in old.gpu - w.gpu:
                stats = self._stats(name)
                if stats is not None:
                    stats.evictions += 1

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker's adapters (it left the fleet)."""
        self._forget(worker_id)

    def _forget(self, worker_id: str) -> None:
        old = self._workers.pop(worker_id, None)
        if old is not None:
            self._set_known(worker_id, old, None)

    def _set_known(self, worker_id: str, old: WorkerAdapters | None, new: WorkerAdapters | None) -> None:
        for w, sign in ((old, -1), (new, 1)):
            if w is not None:
                for counts in (w.running, w.waiting):
                    for name, n in counts.items():
                        total = self._reported.get(name, 0) + sign * n
                        if total > 0:
                            self._reported[name] = total
                        else:
                            self._reported.pop(name, None)
        before = _held(old)
        after = _held(new)
        for name in before - after:
            n = self._known.get(name, 0) - 1
            if n > 0:
                self._known[name] = n
            else:
                self._known.pop(name, None)
        for name in after - before:
            if name in self._known or len(self._known) < MAX_KNOWN_ADAPTERS:
                self._known[name] = self._known.get(name, 0) + 1

    # -- reads -------------------------------------------------------------------------------
    def knows(self, name: str) -> bool:
        """True when some worker reports serving or holding an adapter called ``name``."""
        return name in self._known

    def get(self, worker_id: str) -> WorkerAdapters | None:
        """A worker's adapter picture (None: it reported none)."""
        return self._workers.get(worker_id)

    def residency(self) -> dict[str, tuple[int, int]]:
        """Per known adapter: (workers with it in a slot, workers with it in host memory only)."""
        out: dict[str, list[int]] = {}
        for w in self._workers.values():
            for name in w.gpu | w.sent.keys() | w.running.keys() | w.recent.keys():
                if name in self._known:
                    out.setdefault(name, [0, 0])[0] += 1
            for name in w.cpu:
                if name in self._known and not w.in_slot(name):
                    out.setdefault(name, [0, 0])[1] += 1
        return {name: (gpu, cpu) for name, (gpu, cpu) in out.items()}

    def demand(self, adapter: str) -> int:
        """Requests for ``adapter`` in flight: this router's, or the workers' reports if more."""
        return max(self._inflight.get(adapter, 0), self._reported.get(adapter, 0))

    def ready_s(self, worker_id: str, adapter: str, service_s: float) -> float:
        """Seconds before ``adapter`` can run on ``worker_id``: load plus slot wait (0 if unknown)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0.0
        load, wait = w.ready_s(adapter, service_s)
        return load + wait

    def candidate_ids(self, view: Balancer, adapter: str, exclude: AbstractSet[str],
                      cfg: PolicyConfig) -> tuple[list[str], list[str]]:
        """(candidate worker ids, the adapter's ring successors): bounded replication, see above.

        Never a worker in ``exclude``, nor one that lists its adapters without ``adapter`` (unless
        none serves it: then its home, whose answer says so).
        """
        ring = view.ring
        board = view.board
        workers = self._workers
        key = adapter_ring_key(adapter)
        n = len(ring)
        share = hash_load_bound(max(board.total_in_system, n - 1), n, cfg.hash_load_factor)
        k = replicas(self.demand(adapter), share, cfg.adapter_spare, n)
        successors: list[str] = []
        served = False
        for worker_id in ring.walk(key):  # lazily: a decision looks at about k workers
            if worker_id in exclude:
                continue
            w = workers.get(worker_id)
            if w is not None and not w.serves(adapter):
                continue
            served = True
            load = board.get(worker_id)
            if load is not None and load.over_limit():
                continue  # at its hard limit: the next worker on the ring takes its place
            successors.append(worker_id)
            if len(successors) == k:
                break
        if not served:
            # No worker serves it: its home answers (a 4xx naming the adapters it has), not a 503.
            successors = [w for w in ring.successors(key, 1 + len(exclude)) if w not in exclude][:1]
        ids = dict.fromkeys(successors)
        # Workers with the adapter in a slot now (placed there while its traffic was higher, or
        # loaded at start) serve it without a load: scored too, never beyond their hard limit.
        for worker_id, w in workers.items():
            if w.in_slot(adapter) and worker_id in ring and worker_id not in exclude and w.serves(adapter):
                load = board.get(worker_id)
                if load is None or not load.over_limit():
                    ids[worker_id] = None
        return list(ids), successors

    # -- bookkeeping -------------------------------------------------------------------------
    def dispatched(self, worker_id: str, adapter: str, board: LoadBoard, now: float) -> str:
        """A request for ``adapter`` went to ``worker_id`` at ``now``; returns the tier it was in there."""
        w = self._workers.get(worker_id)
        tier = w.tier(adapter) if w is not None else TIER_GPU
        predicted_wait_s = 0.0
        if w is not None:
            load = board.get(worker_id)
            if load is not None:
                predicted_wait_s = w.ready_s(adapter, load.service_s)[1]
            w.sent[adapter] = w.sent.get(adapter, 0) + 1
            w.recent[adapter] = now
        self._inflight[adapter] = self._inflight.get(adapter, 0) + 1
        stats = self._stats(adapter)
        if stats is not None:
            stats.requests += 1
            if tier != TIER_GPU:
                stats.loads[tier] += 1
            stats.predicted_slot_wait_s += predicted_wait_s
        return tier

    def finished(self, worker_id: str, adapter: str, now: float) -> None:
        """A request for ``adapter`` on ``worker_id`` ended at ``now`` (once per :meth:`dispatched`).

        The adapter stays known as in a slot there until a report taken after ``now``: one taken
        between the dispatch and the worker seeing the request does not show it yet.
        """
        w = self._workers.get(worker_id)
        if w is not None:
            _decrement(w.sent, adapter)
            w.recent[adapter] = max(now, w.recent.get(adapter, now))
        _decrement(self._inflight, adapter)

    def _stats(self, adapter: str) -> AdapterStats | None:
        stats = self.stats.get(adapter)
        if stats is None and adapter in self._known and len(self.stats) < MAX_KNOWN_ADAPTERS:
            stats = self.stats[adapter] = AdapterStats()
        return stats


def _held(w: WorkerAdapters | None) -> set[str]:
    if w is None:
        return set()
    return set(w.served or ()) | w.gpu | w.cpu | w.running.keys() | w.waiting.keys()


def _decrement(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
