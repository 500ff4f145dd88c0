"""Saving a model as a Hugging Face checkpoint that transformers, vLLM and SGLang load unchanged.

A model on the byte-level vocabulary (the presets) also gets its tokenizer files
(:mod:`worker.engine.model.byte_tokenizer_files`), so every engine serving the directory turns
text into the same token ids.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker.engine.model.byte_tokenizer_files import save_byte_tokenizer
from worker.engine.model.llama import LlamaForCausalLM
from worker.engine.model.loader import _fused_slices
from worker.engine.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE

_UNSTACK = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names (fused projections split back)."""
    config = model.config
    slices = _fused_slices(config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("rotary_emb"):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        parts = name.split(".")
        fused = parts[-2]
        if fused in _UNSTACK:
            bounds = slices[fused]
            for i, hf in enumerate(_UNSTACK[fused]):
                out[".".join(parts[:-2] + [hf, parts[-1]])] = tensor[bounds[i]:bounds[i + 1]].contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


def save_pretrained(model: LlamaForCausalLM, directory: str | Path) -> Path:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` into ``directory``.

    A byte-vocabulary model also gets ``tokenizer.json`` and ``tokenizer_config.json``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    tensors = {k: v.detach().cpu() for k, v in hf_state_dict(model).items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if (config.vocab_size, config.bos_token_id, config.eos_token_id) == (BYTE_VOCAB_SIZE, BYTE_BOS_ID,
                                                                        BYTE_EOS_ID):
        save_byte_tokenizer(directory)
    return directory
