"""LoRA test support: PEFT-format adapter directories, written directly or by peft itself.

:func:`write_adapter` writes ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's
exact layout with random (never zero) A and B, for tests that need files but no model math.
:func:`make_peft_adapter` has peft build one on a saved checkpoint with ``init_lora_weights=False``
(PEFT's default B = 0 would make every adapter a no-op and every parity test vacuous).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import save_file

from worker.engine.lora.adapter import TARGET_PARENTS, target_features
from worker.engine.model.presets import preset_config

ALL_TARGETS = tuple(TARGET_PARENTS)


def peft_key(layer: int, module: str, ab: str) -> str:
    """PEFT's tensor name of one LoRA matrix."""
    return f"base_model.model.model.layers.{layer}.{TARGET_PARENTS[module]}.{module}.lora_{ab}.weight"


def write_adapter(path: Path, *, rank: int = 4, alpha: float = 8.0, targets: Iterable[str] = ("q_proj", "v_proj"),
                  layers: Iterable[int] | None = None, seed: int = 0, preset: str = "tiny",
                  config: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A PEFT adapter for ``preset``'s shapes at ``path``; ``config`` entries override the
    config's, ``tensors`` replace or add tensors (to build broken adapters)."""
    model = preset_config(preset)
    features = target_features(model)
    gen = torch.Generator().manual_seed(seed)
    targets = tuple(targets)
    out: dict[str, torch.Tensor] = {}
    for layer in (range(model.num_hidden_layers) if layers is None else layers):
        for module in targets:
            in_f, out_f = features[module]
            out[peft_key(layer, module, "A")] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
            out[peft_key(layer, module, "B")] = torch.randn(out_f, rank, generator=gen) / rank**0.5
    out.update(tensors or {})
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
           "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
           "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False, "lora_dropout": 0.0,
           "task_type": "CAUSAL_LM", "base_model_name_or_path": preset, **(config or {})}
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "adapter_model.safetensors"))
    return path


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
