"""LoRA test support: PEFT-format adapter directories, written directly or by peft itself.

:func:`write_adapter` writes ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's
exact layout with random (never zero) A and B, for tests that need files but no model math.
:func:`make_peft_adapter` has peft build one on a saved checkpoint with ``init_lora_weights=False``
(PEFT's default B = 0 would make every adapter a no-op and every parity test vacuous).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterable

import torch

from bench.lora import ALL_TARGETS, peft_key, random_adapter_tensors, save_peft_adapter
from worker.engine.model.presets import preset_config

__all__ = ["ALL_TARGETS", "make_peft_adapter", "peft_key", "write_adapter"]


def write_adapter(path: Path, *, rank: int = 4, alpha: float = 8.0, targets: Iterable[str] = ("q_proj", "v_proj"),
                  layers: Iterable[int] | None = None, seed: int = 0, preset: str = "tiny",
                  config: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A PEFT adapter for ``preset``'s shapes at ``path``; ``config`` entries override the
    config's, ``tensors`` replace or add tensors (to build broken adapters)."""
    targets = tuple(targets)
    out = random_adapter_tensors(preset_config(preset), rank, targets, seed, layers)
    out.update(tensors or {})
    return save_peft_adapter(path, out, rank, alpha, targets, preset, config)


def make_peft_adapter(checkpoint: Path, path: Path, *, rank: int, alpha: float, targets: Iterable[str],
                      seed: int, use_rslora: bool = False) -> Path:
    """peft's own adapter on the transformers model at ``checkpoint``, non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora)
    with warnings.catch_warnings():  # peft calls a transformers API deprecated for v6
        warnings.simplefilter("ignore", FutureWarning)
        get_peft_model(base, config).save_pretrained(str(path))
    return path
