"""LoRARegistry: the adapters an engine serves, by name, and the host-memory tier below the GPU slots.

Three tiers, fastest first::

    GPU slots     --max-loras      the scheduler's LoRASlots (worker/engine/lora/slots.py)
    host memory   --max-cpu-loras  here: adapters whose weights are read, LRU
    disk          everything registered: re-read (and re-checked) when needed again

Host memory holds at most ``max_cpu_loras`` adapters' weights; the least recently used one with
no request in the engine loses its weights first. An adapter with requests in the engine
(``refcount > 0``) keeps them (the scheduler may put it into a slot at any step), so the bound is
exceeded only while more adapters than that have requests in flight.

Thread-safe: the server adds, removes and prefetches adapters from its own threads while the
engine thread acquires and releases them for requests. Disk reads happen outside the lock.
A removed or replaced version lives on until its last request finishes (its requests finish
with the weights they started with); new requests only ever see the current version.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

from worker.engine.errors import (LoRAAdapterConflictError, LoRAAdapterNotFoundError, LoRAError,
                                  LoRAUnavailableError)
from worker.engine.lora.adapter import LoRAAdapter, LoRACounters

# Reads the adapter at ``path`` as ``name``: a validated LoRAAdapter with ``weights`` set
# (an empty dict where no tensors are needed: the simulated worker).
AdapterReader = Callable[[str, str], LoRAAdapter]


class LoRARegistry:
    """Named adapters and their host residency (see the module docstring)."""

    def __init__(self, max_cpu_loras: int, reader: AdapterReader, reserved_names: Iterable[str] = (),
                 ema_alpha: float = 0.3) -> None:
        if max_cpu_loras < 1:
            raise ValueError("max_cpu_loras must be >= 1")
        self.max_cpu_loras = max_cpu_loras
        self.reader = reader
        self.reserved_names = frozenset(reserved_names)
        self.ema_alpha = ema_alpha
        self.disk_load_s = 0.0  # EMA of one disk -> host read (0 until measured)
        self._lock = threading.Lock()
        self._current: dict[str, LoRAAdapter] = {}
        self._resident: dict[int, LoRAAdapter] = {}  # lora_int_id -> version with weights
        self._counters: dict[str, LoRACounters] = {}
        self._next_id = 0
        self._tick = 0

    # ---- names ------------------------------------------------------------------------------
    def add(self, name: str, path: str, replace: bool = False) -> LoRAAdapter:
        """Read, validate and register the adapter at ``path`` as ``name``; it is host-resident.

        Raises :class:`LoRAAdapterConflictError` if ``name`` is a base model's or is already
        loaded and ``replace`` is false; the reader's errors (not found, invalid) pass through.
        With ``replace`` the previous version keeps serving the requests that already use it.
        """
        self._check_name(name, replace)
        adapter = self._read(name, path)
        with self._lock:
            self._check_name(name, replace)
            self._next_id += 1
            adapter.lora_int_id = self._next_id
            adapter.counters = self._counters.setdefault(name, LoRACounters())
            adapter.counters.disk_loads += 1
            previous = self._current.get(name)
            if previous is not None:
                self._retire(previous)
            self._current[name] = adapter
            self._touch(adapter)
            self._resident[adapter.lora_int_id] = adapter
            self._trim()
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        """Unregister ``name`` (new requests get 404); its running requests finish normally."""
        with self._lock:
            adapter = self._current.pop(name, None)
            if adapter is None:
                raise LoRAAdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
            self._retire(adapter)
            self._counters.pop(name, None)
        return adapter

    def get(self, name: str) -> LoRAAdapter:
        """The current version of ``name``; :class:`LoRAAdapterNotFoundError` if none."""
        adapter = self._current.get(name)
        if adapter is None:
            raise LoRAAdapterNotFoundError(f"The lora adapter '{name}' is not loaded on this worker.")
        return adapter

    def adapters(self) -> list[LoRAAdapter]:
        """Current versions, by name."""
        with self._lock:
            return [self._current[n] for n in sorted(self._current)]

    def __contains__(self, name: object) -> bool:
        return name in self._current

    def __len__(self) -> int:
        return len(self._current)

    # ---- residency --------------------------------------------------------------------------
    def acquire(self, adapter: LoRAAdapter) -> None:
        """Take a reference for one request and make its weights host-resident (reading them
        from disk if they were dropped). Raises :class:`LoRAUnavailableError` if they cannot be
        read back as registered, :class:`LoRAAdapterNotFoundError` if the version was removed."""
        with self._lock:
            if adapter.removed and adapter.weights is None:
                raise LoRAAdapterNotFoundError(f"The lora adapter '{adapter.name}' was unloaded.")
            adapter.refcount += 1
            adapter.counters.requests += 1
        try:
            self._ensure_resident(adapter)
        except BaseException:
            self.release(adapter)
            raise

    def release(self, adapter: LoRAAdapter) -> None:
        """Drop one request's reference; a removed version loses its weights with the last."""
        with self._lock:
            adapter.refcount -= 1
            if adapter.refcount <= 0:
                adapter.refcount = 0
                if adapter.removed:
                    self._drop(adapter)
                else:
                    self._trim()

    def prefetch(self, adapter: LoRAAdapter) -> None:
        """Make ``adapter`` host-resident now (off the engine thread, before its request is
        queued), so the engine does not read the disk between steps."""
        self._ensure_resident(adapter)

    def is_resident(self, adapter: LoRAAdapter) -> bool:
        """Whether the weights are in host memory."""
        return adapter.weights is not None

    def resident(self) -> list[LoRAAdapter]:
        """Current versions whose weights are in host memory, by name."""
        with self._lock:
            return sorted((a for a in self._resident.values() if not a.removed), key=lambda a: a.name)

    # ---- internals --------------------------------------------------------------------------
    def _check_name(self, name: str, replace: bool) -> None:
        if name in self.reserved_names:
            raise LoRAAdapterConflictError(f"The lora adapter '{name}' conflicts with a served base model.")
        if not replace and name in self._current:
            raise LoRAAdapterConflictError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True.")

    def _read(self, name: str, path: str) -> LoRAAdapter:
        start = time.perf_counter()
        adapter = self.reader(name, path)
        elapsed = time.perf_counter() - start
        self.disk_load_s = elapsed if self.disk_load_s == 0 else (
            (1 - self.ema_alpha) * self.disk_load_s + self.ema_alpha * elapsed)
        return adapter

    def _ensure_resident(self, adapter: LoRAAdapter) -> None:
        with self._lock:
            if adapter.weights is not None:
                self._touch(adapter)
                return
        try:
            fresh = self._read(adapter.name, adapter.path)
        except LoRAError as exc:
            raise LoRAUnavailableError(f"LoRA adapter '{adapter.name}' could not be read back from "
                                       f"{adapter.path}: {exc}; load it again") from exc
        if fresh.digest != adapter.digest:
            raise LoRAUnavailableError(f"LoRA adapter '{adapter.name}' changed on disk since it was loaded "
                                       f"from {adapter.path}; load it again (load_inplace) to serve the new "
                                       "weights")
        with self._lock:
            if adapter.weights is None:
                adapter.weights = fresh.weights
                adapter.counters.disk_loads += 1
            self._touch(adapter)
            self._resident[adapter.lora_int_id] = adapter
            self._trim()

    def _touch(self, adapter: LoRAAdapter) -> None:
        self._tick += 1
        adapter.last_used = self._tick

    def _retire(self, adapter: LoRAAdapter) -> None:
        adapter.removed = True
        if adapter.refcount == 0:
            self._drop(adapter)

    def _drop(self, adapter: LoRAAdapter) -> None:
        adapter.weights = None
        self._resident.pop(adapter.lora_int_id, None)

    def _trim(self) -> None:
        while len(self._resident) > self.max_cpu_loras:
            idle = [a for a in self._resident.values() if a.refcount == 0]
            if not idle:
                return
            victim = min(idle, key=lambda a: a.last_used)
            self._drop(victim)
            victim.counters.cpu_evictions += 1
