"""A simulated replica's LoRA adapters: GPU slots over host memory over disk, in virtual time.

The engine's rules (``worker/engine/lora/slots.py``, ``registry.py``, the scheduler's slot
admission in ``worker/engine/scheduler.py``; docs/lora.md) restated on adapter names:

- ``max_loras`` GPU slots; a running request pins its adapter's slot; an adapter that needs a slot
  takes a free one, else the least recently used unpinned one (a *slot load*: a host -> GPU copy
  that the runner does before the step that admits it, so its seconds are added to that step);
- a waiting request whose adapter has no slot and finds none unpinned is *blocked*; requests
  behind it that need no new slot are still admitted; each distinct blocked adapter reserves one
  pinned slot (the one with the fewest running requests, then the least recently used), which
  admits nothing new until it drains and the blocked adapter takes it;
- ``max_cpu_loras`` adapters in host memory, LRU over those with no request in the replica; a
  request whose adapter is only on disk is read into host memory *before it is queued* (the
  worker's ``prefetch``, in a thread): the fleet delays its arrival at the replica by the read
  (:meth:`SimLoRA.prefetch`), and a second request for an adapter being read waits for the same read.

Every adapter has the same size (``params``: the workload's rank and targets on the model's
shapes), so a load costs the latency model's ``lora_slot_load_time`` / ``lora_disk_load_time``.
"""
from __future__ import annotations

from collections import OrderedDict


class SimLoRA:
    """Adapter tiers of one simulated replica (see the module docstring). No clock of its own."""

    def __init__(self, max_loras: int, max_cpu_loras: int, slot_load_s: float, disk_load_s: float) -> None:
        if max_loras < 1 or max_cpu_loras < max_loras:
            raise ValueError("need max_loras >= 1 and max_cpu_loras >= max_loras")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.slot_load_s = slot_load_s
        self.disk_load_s = disk_load_s
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter -> pins, least recently used first
        self.host: OrderedDict[str, float] = OrderedDict()  # adapter -> time its read completes, LRU first
        self.in_replica: dict[str, int] = {}  # requests queued or running, by adapter (keep host weights)
        self.draining: dict[str, None] = {}  # pinned adapters whose slot is reserved for a blocked one
        self.slot_loads = 0  # host -> GPU copies
        self.disk_loads = 0  # disk -> host reads
        self.pending_load_s = 0.0  # slot copies for the next step

    # -- the host tier -----------------------------------------------------------------------
    def prefetch(self, adapter: str, now: float) -> float:
        """A request for ``adapter`` arrives at ``now``: seconds until its weights are in host memory."""
        ready = self.host.get(adapter)
        self.in_replica[adapter] = self.in_replica.get(adapter, 0) + 1
        if ready is not None:
            self.host.move_to_end(adapter)
            return max(0.0, ready - now)
        self.disk_loads += 1
        self.host[adapter] = now + self.disk_load_s
        self._evict_host()
        return self.disk_load_s

    def _evict_host(self) -> None:
        # Beyond the bound, the least recently used adapters with no request here drop their weights.
        excess = len(self.host) - self.max_cpu_loras
        if excess <= 0:
            return
        for name in [n for n in self.host if not self.in_replica.get(n) and n not in self.slots][:excess]:
            del self.host[name]

    def left(self, adapter: str) -> None:
        """A request for ``adapter`` finished (or failed): it no longer holds the weights in host memory."""
        n = self.in_replica.get(adapter, 0) - 1
        if n > 0:
            self.in_replica[adapter] = n
        else:
            self.in_replica.pop(adapter, None)
            self._evict_host()

    # -- GPU slots ---------------------------------------------------------------------------
    def begin_admission(self) -> None:
        """Before a step's admission: reservations whose adapter lost its slot have served."""
        for name in [n for n in self.draining if n not in self.slots]:
            del self.draining[name]

    def available(self, adapter: str, blocked: list[str]) -> bool:
        """Whether a request for ``adapter`` may be admitted now; else it is noted as blocked."""
        if adapter in self.slots:
            if adapter not in self.draining:
                return True
            return False  # its slot drains for a blocked adapter: joining would keep it pinned
        if len(self.slots) < self.max_loras or any(p == 0 for p in self.slots.values()):
            return True
        if adapter not in blocked:
            blocked.append(adapter)
            if len(self.draining) < len(blocked):
                self._reserve()
        return False

    def _reserve(self) -> None:
        candidates = [(pins, i, n) for i, (n, pins) in enumerate(self.slots.items())
                      if pins > 0 and n not in self.draining]
        if candidates:
            self.draining[min(candidates)[2]] = None  # fewest pins, then least recently used

    def end_admission(self, saw_whole_queue: bool, blocked: list[str]) -> None:
        """After a step's admission: reservations beyond the blocked adapters are released."""
        if saw_whole_queue and len(self.draining) > len(blocked):
            for name in list(self.draining)[len(blocked):]:
                del self.draining[name]

    def pin(self, adapter: str) -> None:
        """A request for ``adapter`` is admitted (callers checked :meth:`available`)."""
        pins = self.slots.get(adapter)
        if pins is None:
            if len(self.slots) >= self.max_loras:
                victim = next(n for n, p in self.slots.items() if p == 0)
                del self.slots[victim]
            pins = 0
            self.slot_loads += 1
            self.pending_load_s += self.slot_load_s
        self.slots[adapter] = pins + 1
        self.slots.move_to_end(adapter)

    def unpin(self, adapter: str) -> None:
        """A running request for ``adapter`` finished or was preempted."""
        self.slots[adapter] -= 1

    def take_load_s(self) -> float:
        """Seconds of slot copies the next step starts with."""
        s, self.pending_load_s = self.pending_load_s, 0.0
        return s

    # -- the report --------------------------------------------------------------------------
    def gpu(self) -> list[str]:
        """Adapters in a slot."""
        return list(self.slots)

    def cpu(self) -> list[str]:
        """Adapters in host memory but not in a slot (their read done or under way)."""
        return [n for n in self.host if n not in self.slots]

    def busy(self) -> int:
        """Distinct adapters pinned by running requests."""
        return sum(1 for p in self.slots.values() if p > 0)
