"""LoRASlots: which adapter each GPU slot holds, which slots running requests pin, LRU among the rest.

Slots ``1 .. max_loras`` hold one adapter version each; slot 0 is "no adapter" (all zeros in the
runner's stacks) and is never assigned. A slot is *pinned* while a running request uses its
adapter: a pinned slot is never given to another adapter, so no step ever computes more than
``max_loras`` distinct adapters. An unpinned slot keeps its adapter (a later request for it needs
no load) until another adapter needs a slot: free slots go first, then the least recently used
unpinned one.

Assignments are recorded as *loads* that the scheduler hands to the runner with the next batch:
the runner copies the adapter's weights into the slot before that step computes anything, so
loading happens between steps. Pure bookkeeping; no tensors.
"""
from __future__ import annotations

from worker.engine.lora.adapter import LoRAAdapter


class LoRASlots:
    """The GPU slot table of one engine (see the module docstring)."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_loras = max_loras
        self.adapters: list[LoRAAdapter | None] = [None] * (max_loras + 1)  # index = slot; [0] unused
        self.pins = [0] * (max_loras + 1)
        self._last_used = [0] * (max_loras + 1)
        self._tick = 0
        self._by_id: dict[int, int] = {}  # lora_int_id -> slot
        self._loads: list[tuple[int, LoRAAdapter]] = []

    def slot_of(self, adapter: LoRAAdapter) -> int:
        """The slot holding ``adapter`` (this version), 0 if none."""
        return self._by_id.get(adapter.lora_int_id, 0)

    def is_pinned(self, adapter: LoRAAdapter) -> bool:
        """Whether running requests hold ``adapter``'s slot."""
        slot = self.slot_of(adapter)
        return slot > 0 and self.pins[slot] > 0

    def can_pin(self, adapter: LoRAAdapter) -> bool:
        """Whether :meth:`pin` would succeed now (it has a slot, or one is free or unpinned)."""
        return self.slot_of(adapter) > 0 or any(self.pins[s] == 0 for s in range(1, self.max_loras + 1))

    def pin(self, adapter: LoRAAdapter) -> int:
        """Pin ``adapter``'s slot for one running request, assigning a slot first if it has none
        (recording a load, and evicting the LRU unpinned adapter if no slot is free). Returns the
        slot; raises RuntimeError if every slot is pinned (callers check :meth:`can_pin`)."""
        slot = self.slot_of(adapter)
        if slot == 0:
            slot = self._victim()
            old = self.adapters[slot]
            if old is not None:
                del self._by_id[old.lora_int_id]
                old.counters.slot_evictions += 1
            self.adapters[slot] = adapter
            self._by_id[adapter.lora_int_id] = slot
            self._loads = [(s, a) for s, a in self._loads if s != slot]
            self._loads.append((slot, adapter))
            adapter.counters.slot_loads += 1
        self.pins[slot] += 1
        self._tick += 1
        self._last_used[slot] = self._tick
        return slot

    def unpin(self, adapter: LoRAAdapter) -> None:
        """Release one running request's pin on ``adapter``'s slot."""
        slot = self.slot_of(adapter)
        if slot == 0 or self.pins[slot] == 0:
            raise RuntimeError(f"adapter {adapter.name!r} is not pinned")
        self.pins[slot] -= 1

    def take_loads(self) -> list[tuple[int, LoRAAdapter]]:
        """Slot assignments since the last call, ``(slot, adapter)``, for the runner to apply."""
        loads, self._loads = self._loads, []
        return loads

    def pinned_slots(self) -> list[int]:
        """Slots running requests hold."""
        return [s for s in range(1, self.max_loras + 1) if self.pins[s] > 0]

    def least_recently_used(self, slots: list[int]) -> int:
        """The slot of ``slots`` used longest ago."""
        return min(slots, key=lambda s: self._last_used[s])

    def _victim(self) -> int:
        free = [s for s in range(1, self.max_loras + 1) if self.adapters[s] is None]
        if free:
            return free[0]
        idle = [s for s in range(1, self.max_loras + 1) if self.pins[s] == 0]
        if not idle:
            raise RuntimeError("every LoRA slot is pinned")
        return self.least_recently_used(idle)
