"""Scheduler: continuous batching under a token budget, chunked prefill, preemption.

Each step gets ``max_num_batched_tokens`` tokens of budget:

1. Running sequences first, in admission order: a decoding sequence takes 1 token, a
   partially prefilled one takes its next chunk. When the pool cannot hold a sequence's new
   tokens, the most recently admitted running sequence is preempted by recompute: its blocks
   are freed, ``num_computed_tokens`` drops to 0, and it goes back to the *front* of the
   waiting queue so it keeps its place (its prefix is often still cached, so the recompute
   is usually cheap).
2. Then waiting sequences in arrival order (strict FCFS: if the head does not fit, nobody
   behind it jumps ahead), while budget, ``max_num_seqs`` and blocks allow. A newly admitted
   sequence reuses its cached prefix and prefills the rest, in chunks if the budget is short.

With a CPU KV tier, an admitted request's GPU hit is followed by the longest run of its blocks
stored in the tier, loaded with the step when the tier says the transfer beats recomputing them
(worker/engine/kv_cache/kv_tier.py); the tier's copies ride on the step's batch.

Prefill chunks and decode tokens share one step ("mixed batches"). The scheduler owns token
bookkeeping only; the engine applies sampled tokens and finishing rules.

With LoRA, every running request pins its adapter's GPU slot (worker/engine/lora/slots.py), so a
step never holds more than ``max_loras`` distinct adapters. A waiting request whose adapter has
no slot and finds none free is *blocked*; requests behind it that need no new slot (the base
model, adapters already in a slot) are still admitted, but each distinct blocked adapter
*reserves* one pinned slot -- the one with the fewest running requests -- that admits nothing
new until it drains and the blocked adapter takes it. So a waiting adapter is never starved by a
stream of requests for the adapters in the slots, and a slot is loaded only between steps.
"""
from __future__ import annotations

import time
from collections import deque

from worker.engine.config import EngineConfig
from worker.engine.kv_cache.kv_cache_manager import KVCacheManager
from worker.engine.kv_cache.kv_tier import KVTier
from worker.engine.lora.adapter import LoRAAdapter
from worker.engine.lora.slots import LoRASlots
from worker.engine.runner import ScheduledBatch, ScheduledSequence
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.stats import SpeedMeter


class Scheduler:
    """Chooses what each step computes; keeps the waiting and running queues."""

    def __init__(self, config: EngineConfig, num_blocks: int, tier: KVTier | None = None,
                 speed: SpeedMeter | None = None) -> None:
        """``tier``: the CPU KV tier (None: none); ``speed``: the engine's measured speed, which
        the tier's transfer-vs-recompute decision reads."""
        self.config = config
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size,
                                               config.enable_prefix_caching, tier=tier)
        self.tier = self.kv_cache_manager.tier
        self.speed = speed if speed is not None else SpeedMeter(config.default_prefill_tokens_per_s,
                                                                config.default_decode_step_s)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self._finished_ids: list[str] = []
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None
        # Slots reserved for blocked adapters: slot -> the lora_int_id it held when reserved.
        self._draining: dict[int, int] = {}
        # Counters (cumulative).
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting request."""
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark ``seq`` finished, drop it from the queues and free its blocks now."""
        if seq in self.running:
            self.running.remove(seq)
            self._unpin(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        self.kv_cache_manager.free(seq)
        self.requests.pop(seq.request_id, None)
        self._finished_ids.append(seq.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _unpin(self, seq: Sequence) -> None:
        if seq.lora is not None and self.lora_slots is not None:
            self.lora_slots.unpin(seq.lora)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._unpin(seq)
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work and reserve its blocks."""
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not kv.allocate_slots(seq, n):
                victim = self.running[-1]  # never scheduled yet: it sits at or after ``seq``
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # ``seq`` preempted itself: nothing after it is running any more

        # Admitting new work right after preempting would only thrash the pool.
        now = time.monotonic()
        self._forget_taken_reservations()
        blocked: list[LoRAAdapter] = []  # distinct adapters waiting for a slot, in queue order
        tier = self.tier
        i = 0
        while (i < len(self.waiting) and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[i]
            if seq.lora is not None and not self._slot_available(seq, blocked, now):
                i += 1  # it waits for a slot; those behind it may still go
                continue
            hits, num_hit_tokens = kv.get_computed_blocks(seq)
            run = kv.get_tier_run(seq, len(hits)) if tier is not None else []
            num_recomputed = 0
            if run and tier is not None:
                if tier.should_load(len(run), num_hit_tokens, self.speed):
                    tier.pin(run)  # allocating may store (evict) blocks, which must not take these
                else:
                    num_recomputed, run = len(run), []
            num_loaded = len(run) * self.block_size
            n = seq.num_tokens - num_hit_tokens - num_loaded
            if (n > budget and not self.config.enable_chunked_prefill) or not kv.allocate_slots(
                    seq, num_loaded + min(n, budget), hits):
                if run and tier is not None:
                    tier.unpin(run)
                break
            n = min(n, budget)
            if tier is not None:
                if run:
                    kv.plan_tier_load(seq, run, len(hits))
                elif num_recomputed:
                    tier.note_recomputed(num_recomputed)
                tier.note_hits(seq.block_hashes[:len(hits)])
            del self.waiting[i]
            if seq.lora is not None:
                self._pin(seq, now)
            seq.num_computed_tokens = num_hit_tokens + num_loaded
            seq.status = SequenceStatus.RUNNING
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit_tokens + num_loaded
                seq.num_loaded_tokens = num_loaded
                seq.first_scheduled_time = now
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        if i >= len(self.waiting) and len(self._draining) > len(blocked):
            self._release_reservations(len(blocked))  # the whole queue was seen: fewer are needed

        batch = ScheduledBatch(finished_request_ids=self._finished_ids, block_size=self.block_size)
        if scheduled:  # an empty batch never reaches the runner: keep the ids for the next one
            self._finished_ids = []
            if self.lora_slots is not None:
                batch.lora_loads = self.lora_slots.take_loads()
            if self.tier is not None:
                copies = self.tier.take_copies()
                batch.kv_stores, batch.kv_loads = copies.stores, copies.loads
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            is_decode = n == 1 and end == seq.num_tokens and seq.num_output_tokens > 0
            batch.seqs.append(ScheduledSequence(
                request_id=seq.request_id,
                new_token_ids=seq.token_ids[start:end],
                num_computed_tokens=start,
                num_scheduled_tokens=n,
                block_ids=[b.block_id for b in seq.blocks],
                is_prefill=not is_decode,
                samples=end == seq.num_tokens,
                sampling_params=seq.sampling_params,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
                prompt_token_ids=seq.prompt_token_ids,
                lora_slot=self.lora_slots.slot_of(seq.lora) if seq.lora is not None and self.lora_slots else 0,
            ))
        return batch

    # ---- LoRA slots --------------------------------------------------------------------------
    def _slot_available(self, seq: Sequence, blocked: list[LoRAAdapter], now: float) -> bool:
        """Whether ``seq``'s adapter may take (or share) a slot now; else note that it waits."""
        slots = self.lora_slots
        lora = seq.lora
        assert slots is not None and lora is not None
        slot = slots.slot_of(lora)
        if slot and slot in self._draining:
            ok = False  # its slot drains for a blocked adapter: joining would keep it pinned
        elif slots.can_pin(lora):
            ok = True
        else:
            ok = False
            if all(b is not lora for b in blocked):
                blocked.append(lora)
                if len(self._draining) < len(blocked):
                    self._reserve_slot()
        if not ok and seq.slot_wait_since is None:
            seq.slot_wait_since = now
        return ok

    def _reserve_slot(self) -> None:
        """Stop admitting to one more pinned slot: the one with the fewest running requests."""
        slots = self.lora_slots
        assert slots is not None
        candidates = [s for s in slots.pinned_slots() if s not in self._draining]
        if not candidates:
            return
        fewest = min(slots.pins[s] for s in candidates)
        slot = slots.least_recently_used([s for s in candidates if slots.pins[s] == fewest])
        holder = slots.adapters[slot]
        assert holder is not None
        self._draining[slot] = holder.lora_int_id

    def _forget_taken_reservations(self) -> None:
        slots = self.lora_slots
        if slots is None:
            return
        for slot, lora_id in list(self._draining.items()):
            holder = slots.adapters[slot]
            if holder is None or holder.lora_int_id != lora_id:
                del self._draining[slot]  # another adapter took it: the reservation served

    def _release_reservations(self, keep: int) -> None:
        # Release the most recently reserved first: older reservations have drained longest.
        for slot in list(self._draining)[keep:]:
            del self._draining[slot]

    def _pin(self, seq: Sequence, now: float) -> None:
        assert self.lora_slots is not None and seq.lora is not None
        self.lora_slots.pin(seq.lora)
        if seq.slot_wait_since is not None:
            seq.lora.counters.slot_wait_s += now - seq.slot_wait_since
            seq.slot_wait_since = None

    def on_step_done(self, batch: ScheduledBatch) -> None:
        """Advance computed-token counts and register newly written full blocks as cached."""
        kv = self.kv_cache_manager
        for s in batch.seqs:
            seq = self.requests.get(s.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += s.num_scheduled_tokens
            kv.cache_computed_blocks(seq)

    # ---- load --------------------------------------------------------------------------------
    def queued_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens not yet computed, over waiting and running requests."""
        total = sum(seq.num_tokens - seq.num_computed_tokens for seq in self.waiting)
        total += sum(seq.num_tokens - seq.num_computed_tokens
                     for seq in self.running if seq.num_tokens - seq.num_computed_tokens > 1)
        return total

    def running_tokens(self) -> int:
        """Context tokens of running requests (decode pressure)."""
        return sum(seq.num_tokens for seq in self.running)
