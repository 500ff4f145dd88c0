"""Loading models: a preset name, or a local Hugging Face checkpoint directory.

A checkpoint directory holds ``config.json`` (LlamaForCausalLM, Qwen2ForCausalLM or
MistralForCausalLM), ``*.safetensors`` and, optionally, ``generation_config.json`` (its
``eos_token_id`` adds end-of-sequence ids). Hugging Face's separate q/k/v and gate/up tensors
are copied into the model's fused ``qkv_proj`` / ``gate_up_proj`` rows; every parameter must
be found exactly once, or loading fails with :class:`ModelLoadError` naming what is missing.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from worker.engine.config import ModelConfig
from worker.engine.errors import ModelLoadError
from worker.engine.model.llama import LORA_TARGETS, LlamaForCausalLM
from worker.engine.model.presets import PRESETS, build_preset, preset_config

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# HF name piece -> (our fused name piece, which slice of the fused rows).
_STACKED = {hf: target for hf, target in LORA_TARGETS.items() if target[0] != hf}


DTYPE_CHOICES = ("auto", *DTYPES)


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` / ``"float16"`` / ``"bfloat16"`` as a torch dtype."""
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_dtype(requested: str, checkpoint_dtype: str, device: str) -> torch.dtype:
    """The dtype weights and KV are kept in: ``requested``, or for ``"auto"`` the checkpoint's
    ``torch_dtype`` on an accelerator and float32 on a CPU (where half precision is slow)."""
    if requested != "auto":
        return torch_dtype(requested)
    if torch.device(device).type == "cpu":
        return torch.float32
    if checkpoint_dtype not in DTYPES:
        raise ModelLoadError(f"the checkpoint's torch_dtype {checkpoint_dtype!r} is not one of "
                             f"{', '.join(DTYPES)}: choose one with --dtype")
    return DTYPES[checkpoint_dtype]


def load_model_config(model: str) -> ModelConfig:
    """The ModelConfig of a preset name or a checkpoint directory (no weights read)."""
    if model in PRESETS:
        return preset_config(model)
    path = Path(model)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory "
                             "with config.json")
    config = ModelConfig.from_hf_dict(_read_json(cfg_path))
    generation = path / "generation_config.json"
    if generation.is_file():
        # Instruct checkpoints end a turn with tokens config.json does not name (Llama 3's
        # <|eot_id|>): generation_config.json's eos_token_id, as vLLM reads it, stops generation too.
        extra = _read_json(generation).get("eos_token_id")
        ids = extra if isinstance(extra, list) else [extra] if extra is not None else []
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ModelLoadError(f"{generation}: eos_token_id must be an integer or a list of integers")
        merged = list(dict.fromkeys([*config.eos_token_ids, *ids]))
        config.eos_token_id = merged if len(merged) != 1 else merged[0]
    return config


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _fused_slices(config: ModelConfig) -> dict[str, list[int]]:
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    i = config.intermediate_size
    return {"qkv_proj": [0, q, q + kv, q + 2 * kv], "gate_up_proj": [0, i, 2 * i]}


@torch.no_grad()
def load_model(model: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LlamaForCausalLM:
    """The model named by a preset or stored in a checkpoint directory, in eval mode."""
    if model in PRESETS:
        return build_preset(model, dtype, device)
    config = load_model_config(model)
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {model}")
    net = LlamaForCausalLM(config)
    params = dict(net.named_parameters())
    slices = _fused_slices(config)
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                tensor = f.get_tensor(name)
                target, part = name, None
                for hf, (fused, idx) in _STACKED.items():
                    if f".{hf}." in name:
                        target, part = name.replace(hf, fused), idx
                        break
                if target not in params:
                    raise ModelLoadError(f"unexpected tensor {name!r} in {file.name}")
                param = params[target]
                if part is None:
                    dest = param
                else:
                    bounds = slices[target.split(".")[-2]]
                    dest = param[bounds[part]:bounds[part + 1]]
                if dest.shape != tensor.shape:
                    raise ModelLoadError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
                dest.copy_(tensor.to(param.dtype))
                loaded.add(name if part is None else f"{target}#{part}")
    if config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = []
    for pname in params:
        fused = pname.split(".")[-2] if "." in pname else ""
        if fused in slices:
            parts = range(len(slices[fused]) - 1)
            missing += [f"{pname}#{p}" for p in parts if f"{pname}#{p}" not in loaded]
        elif pname not in loaded:
            missing.append(pname)
    if missing:
        raise ModelLoadError(f"checkpoint {model} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    return net.to(device=device, dtype=dtype).eval()
