"""Engine test support: a runner whose "KV cache" is token ids, so wrong blocks show up as wrong tokens.

:class:`SlotMemoryRunner` writes every computed token into its slot (``block_id * block_size +
offset``) and, when a sequence samples, reads the whole context back *through the block table*
and returns ``next_token(context)``. A scheduler or prefix-cache bug that reuses the wrong block,
overwrites a block another request still reads, or loses tokens across a preemption changes the
context read back and therefore the output, which tests compare against
:func:`reference_continuation` (computed with no cache at all).

With LoRA, the runner keeps its own slot table from each batch's ``lora_loads`` and mixes the
adapter it finds in a sequence's slot into the next token: a request served from the wrong slot,
or from a slot reassigned under it, generates different tokens than its reference.
"""
from __future__ import annotations

import xxhash
from array import array

from worker.engine.runner import RunnerOutput, ScheduledBatch


def next_token(context: list[int], adapter: str | None = None) -> int:
    """A deterministic 'model': a byte (0-255) that depends on every token of the context (and
    on the adapter's identity, if any)."""
    seed = xxhash.xxh64_intdigest(adapter.encode()) if adapter is not None else 0
    return xxhash.xxh64_intdigest(array("q", context).tobytes(), seed=seed) % 256


def reference_continuation(prompt: list[int], num_tokens: int, adapter: str | None = None) -> list[int]:
    """What any correct engine must generate for ``prompt`` with :class:`SlotMemoryRunner`
    (``adapter``: the identity of the LoRA adapter the request runs with)."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens, adapter))
    return tokens[len(prompt):]


def run_all(engine) -> tuple[dict[str, list[int]], dict]:
    """Step ``engine`` until idle: every request's generated tokens, and its final output."""
    tokens: dict[str, list[int]] = {}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    return tokens, finals


def assert_idle_accounting(engine) -> None:
    """An idle engine holds no block, no request, and its pool's three states add up."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    s = engine.stats()
    assert s.free_blocks + s.cached_blocks + s.used_blocks == s.total_blocks
    assert s.used_blocks == 0 and s.running == 0 and s.waiting == 0


class SlotMemoryRunner:
    """A ModelRunner computing :func:`next_token` over the context it reads from its slots."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.batches: list[ScheduledBatch] = []
        self.lora_slots: dict[int, str] = {}  # GPU slot -> identity of the adapter loaded there
        self.step_adapters: list[set[str]] = []  # the adapters each step computed with

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self.batches.append(batch)
        for slot, adapter in batch.lora_loads:
            self.lora_slots[slot] = adapter.identity
        self.step_adapters.append({self.lora_slots[s.lora_slot] for s in batch.seqs if s.lora_slot})
        for s in batch.seqs:
            for i, tok in enumerate(s.new_token_ids):
                self.slots[self._slot(s.block_ids, s.num_computed_tokens + i)] = tok
        out = RunnerOutput()
        for s in batch.seqs:
            if s.samples:
                context = [self.slots[self._slot(s.block_ids, p)] for p in range(s.context_len)]
                assert None not in context, f"{s.request_id} read an unwritten slot"
                adapter = self.lora_slots[s.lora_slot] if s.lora_slot else None
                out.sampled_token_ids[s.request_id] = next_token(context, adapter)  # type: ignore[arg-type]
        return out


class ScriptedRunner:
    """A ModelRunner that 'samples' each request's next token from a script (test-chosen text)."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = scripts

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        out = RunnerOutput()
        for s in batch.seqs:
            if s.samples:
                out.sampled_token_ids[s.request_id] = self.scripts[s.request_id][s.num_output_tokens]
        return out
