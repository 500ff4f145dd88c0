"""Engine test support: a runner whose "KV cache" is token ids, so wrong blocks show up as wrong tokens.

:class:`SlotMemoryRunner` writes every computed token into its slot (``block_id * block_size +
offset``) and, when a sequence samples, reads the whole context back *through the block table*
and returns ``next_token(context)``. A scheduler or prefix-cache bug that reuses the wrong block,
overwrites a block another request still reads, or loses tokens across a preemption changes the
context read back and therefore the output, which tests compare against
:func:`reference_continuation` (computed with no cache at all).
"""
from __future__ import annotations

import xxhash
from array import array

from worker.engine.runner import RunnerOutput, ScheduledBatch


def next_token(context: list[int]) -> int:
    """A deterministic 'model': a byte (0-255) that depends on every token of the context."""
    return xxhash.xxh64_intdigest(array("q", context).tobytes()) % 256


def reference_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    """What any correct engine must generate for ``prompt`` with :class:`SlotMemoryRunner`."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class SlotMemoryRunner:
    """A ModelRunner computing :func:`next_token` over the context it reads from its slots."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.batches: list[ScheduledBatch] = []

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self.batches.append(batch)
        for s in batch.seqs:
            for i, tok in enumerate(s.new_token_ids):
                self.slots[self._slot(s.block_ids, s.num_computed_tokens + i)] = tok
        out = RunnerOutput()
        for s in batch.seqs:
            if s.samples:
                context = [self.slots[self._slot(s.block_ids, p)] for p in range(s.context_len)]
                assert None not in context, f"{s.request_id} read an unwritten slot"
                out.sampled_token_ids[s.request_id] = next_token(context)  # type: ignore[arg-type]
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
