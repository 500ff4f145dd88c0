"""The one place that chooses how attention over the paged KV cache, and LoRA deltas, are computed.

`get_attention_backend("auto"|"triton"|"torch", device)` (and `get_lora_backend`, same names and
rules, for the multi-LoRA BGMV/SGMV ops of `kernels/lora_ref.py` / `kernels/triton_lora.py`):
- `torch`: the references in `kernels/attention_ref.py` (any device; the CPU engine's path);
- `triton`: the kernels in `kernels/triton_*.py`. On a CPU device they run under Triton's
  interpreter, which must be switched on (`TRITON_INTERPRET=1`) before the kernels are defined:
  this module sets it when the kernels have not been imported yet, and refuses clearly when they
  were already compiled for a GPU;
- `auto`: `triton` on CUDA, `torch` elsewhere.

Importing this module never imports triton: a CPU worker on the torch backend does not pay for
it, and the interpreter switch can still be set first.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import attention_ref, lora_ref

BACKEND_NAMES = ("auto", "triton", "torch")
_TRITON_MODULES = ("kernels.triton_kv_write", "kernels.triton_decode", "kernels.triton_extend",
                   "kernels.triton_lora")


class AttentionBackendError(ValueError):
    """The requested attention backend does not exist or cannot run on the requested device."""


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """Three attention ops with the signatures of docs/kernels.md ("The three ops").

    `write_kv(k, v, k_cache, v_cache, slot_mapping)`,
    `decode(q, k_cache, v_cache, block_tables, context_lens, scale)`,
    `extend(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)`.
    """

    name: str
    write_kv: Callable[..., None]
    decode: Callable[..., torch.Tensor]
    extend: Callable[..., torch.Tensor]


TORCH_BACKEND = AttentionBackend(
    name="torch",
    write_kv=attention_ref.write_kv,
    decode=attention_ref.paged_decode_attention,
    extend=attention_ref.prefix_extend_attention,
)


@dataclass(frozen=True, slots=True)
class LoRABackend:
    """The two multi-LoRA ops (`kernels/lora_ref.py` documents the contract).

    `bgmv(y, x, a, b, slot_ids)`: per-row slots (decode);
    `sgmv(y, x, a, b, seg_starts, seg_lens, seg_slots, max_seg_len)`: segments (prefill).
    `segments_for_decode`: feed decode rows grouped by slot to `sgmv` too (the torch reference
    computes a segment as one matmul pair; a GPU kernel is better at one row per slot with BGMV).
    """

    name: str
    bgmv: Callable[..., None]
    sgmv: Callable[..., None]
    segments_for_decode: bool = False


TORCH_LORA_BACKEND = LoRABackend(name="torch", bgmv=lora_ref.bgmv, sgmv=lora_ref.sgmv, segments_for_decode=True)


def _resolve(name: str, device: torch.device) -> str:
    if name not in BACKEND_NAMES:
        raise AttentionBackendError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend `name` resolves to on `device`; raises `AttentionBackendError` if unusable."""
    device = torch.device(device)
    if _resolve(name, device) == "torch":
        return TORCH_BACKEND
    return _triton_backend(device)


def get_lora_backend(name: str, device: torch.device | str) -> LoRABackend:
    """The multi-LoRA ops `name` resolves to on `device` (same rules as the attention backend)."""
    device = torch.device(device)
    if _resolve(name, device) == "torch":
        return TORCH_LORA_BACKEND
    _check_triton_device(device)
    from kernels import triton_lora  # see the module docstring

    return LoRABackend(name="triton", bgmv=triton_lora.bgmv, sgmv=triton_lora.sgmv)


def _check_triton_device(device: torch.device) -> None:
    if device.type not in ("cuda", "cpu"):
        raise AttentionBackendError(f"the triton backend runs on cuda or cpu, not {device.type}")
    if device.type == "cpu":
        _require_interpreter()


def _triton_backend(device: torch.device) -> AttentionBackend:
    _check_triton_device(device)
    # Imported here, not at the top: see the module docstring.
    from kernels import triton_decode, triton_extend, triton_kv_write

    return AttentionBackend(
        name="triton",
        write_kv=triton_kv_write.write_kv,
        decode=triton_decode.paged_decode_attention,
        extend=triton_extend.prefix_extend_attention,
    )


def _require_interpreter() -> None:
    """Switch Triton's CPU interpreter on, or refuse if the kernels were built without it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if any(module in sys.modules for module in _TRITON_MODULES):
        raise AttentionBackendError(
            "the triton backend on cpu needs TRITON_INTERPRET=1 before the kernels are imported; "
            "they were already imported without it (set it in the environment at start-up)"
        )
    os.environ["TRITON_INTERPRET"] = "1"
