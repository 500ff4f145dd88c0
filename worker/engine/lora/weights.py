"""The GPU slot stacks of the adapters (runner side) and what one forward pass needs to apply them.

For every layer and target module the runner keeps two stacks on the model's device::

    A  [max_loras + 1, max_lora_rank, in_features]      slot 0: zeros ("no adapter")
    B  [max_loras + 1, out_features, max_lora_rank]     scaling folded in, rank zero-padded

Loading an adapter into a slot copies its host tensors into row ``slot`` of every stack (and
zeros the modules it does not target). A forward pass never merges anything into the base
weights: each fused projection (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) runs
once for the whole batch, then :meth:`LoRAContext.apply` adds every token's delta to each slice
of its output (``q``/``k``/``v`` columns of ``qkv``, ``gate``/``up`` of ``gate_up``) through the
LoRA backend: BGMV over the decode rows (one slot per row), SGMV over the prefill segments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.backend import LoRABackend
from worker.engine.config import ModelConfig
from worker.engine.lora.adapter import LoRAAdapter, target_features
from worker.engine.model.llama import LORA_TARGETS, lora_target_offsets


class LoRASlotWeights:
    """The per-slot A/B stacks of every layer and target module (see the module docstring)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        features = target_features(config)
        offsets = lora_target_offsets(config)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(config.num_hidden_layers):
            for module, (in_f, out_f) in features.items():
                self.a[(layer, module)] = torch.zeros(max_loras + 1, max_rank, in_f, dtype=dtype, device=device)
                self.b[(layer, module)] = torch.zeros(max_loras + 1, out_f, max_rank, dtype=dtype, device=device)
        # fused projection -> [(module, first column, columns)] of its output
        self.slices: dict[str, list[tuple[str, int, int]]] = {}
        for module, (fused, _) in LORA_TARGETS.items():
            self.slices.setdefault(fused, []).append((module, offsets[module], features[module][1]))
        self.slot_modules: list[frozenset[str]] = [frozenset()] * (max_loras + 1)

    @property
    def num_bytes(self) -> int:
        """Device memory of all stacks."""
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    @torch.no_grad()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter``'s host weights into ``slot`` (between steps)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"slot {slot} outside 1..{self.max_loras}")
        if adapter.weights is None:
            raise RuntimeError(f"adapter {adapter.name!r} is not resident in host memory")
        for key, a_stack in self.a.items():
            b_stack = self.b[key]
            pair = adapter.weights.get(key)
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            if pair is not None:
                a, b = pair
                a_stack[slot, :a.shape[0]].copy_(a, non_blocking=True)
                b_stack[slot, :, :b.shape[1]].copy_(b, non_blocking=True)
        self.slot_modules[slot] = frozenset(adapter.target_modules)


@dataclass(slots=True)
class LoRAContext:
    """One step's token-to-slot mapping. Rows are laid out decodes first, then prefill segments.

    ``slot_ids`` ``[num_decode_tokens]``: the decode rows' slots (0 = no adapter), for BGMV. The
    segments cover the other rows with an adapter -- prefill rows, and the decode rows too when
    the backend takes them as segments (``num_decode_tokens`` is then 0): ``seg_starts``
    (absolute row), ``seg_lens``, ``seg_slots``. ``modules``: the target modules some adapter of
    this step adapts (others are skipped outright).
    """

    weights: LoRASlotWeights
    backend: LoRABackend
    num_decode_tokens: int
    slot_ids: torch.Tensor
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor
    max_seg_len: int
    modules: frozenset[str]

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add every row's adapter delta to ``y`` = ``projection(x)`` (all its slices), in place."""
        d = self.num_decode_tokens
        for module, start, size in self.weights.slices[projection]:
            if module not in self.modules:
                continue
            a, b = self.weights.a[(layer, module)], self.weights.b[(layer, module)]
            cols = y[:, start:start + size]
            if d:
                self.backend.bgmv(cols[:d], x[:d], a, b, self.slot_ids)
            if self.max_seg_len:
                self.backend.sgmv(cols, x, a, b, self.seg_starts, self.seg_lens, self.seg_slots,
                                  self.max_seg_len)


def build_lora_context(weights: LoRASlotWeights, backend: LoRABackend, row_slots: list[int],
                       num_decode_tokens: int, device: torch.device) -> LoRAContext | None:
    """The context for a step whose rows (decodes first, grouped by slot) use ``row_slots``;
    None if no row has an adapter."""
    if not any(row_slots):
        return None
    if backend.segments_for_decode:
        num_decode_tokens = 0
    decode = row_slots[:num_decode_tokens]
    starts, lens, slots = [], [], []
    row = num_decode_tokens
    while row < len(row_slots):  # runs of one slot
        end = row
        while end < len(row_slots) and row_slots[end] == row_slots[row]:
            end += 1
        if row_slots[row]:
            starts.append(row)
            lens.append(end - row)
            slots.append(row_slots[row])
        row = end
    modules = frozenset().union(*(weights.slot_modules[s] for s in set(row_slots) if s))

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return LoRAContext(weights=weights, backend=backend, num_decode_tokens=len(decode) if any(decode) else 0,
                       slot_ids=ints(decode), seg_starts=ints(starts), seg_lens=ints(lens),
                       seg_slots=ints(slots), max_seg_len=max(lens, default=0), modules=modules)
