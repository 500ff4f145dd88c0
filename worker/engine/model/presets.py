"""Models the project builds itself from a fixed seed: ``tiny`` (tests) and ``small`` (benchmarks).

Both use the byte-level vocabulary (256 bytes + BOS + EOS). Weights are drawn so that the
model is *decisive*: projections ~ N(0, 1/fan_in) keep activations at unit scale through the
layers, and the output head is scaled so logits spread with a standard deviation of about 4.
A random model with default (std 0.02) initialisation has nearly flat logits, so fp32 rounding
differences would flip greedy choices often; with this spread, top-2 gaps below 1e-3 are rare
(the parity test counts them).
"""
from __future__ import annotations

import math

import torch

from worker.engine.config import ModelConfig
from worker.engine.errors import ModelLoadError
from worker.engine.model.llama import LlamaForCausalLM
from worker.engine.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE

LOGIT_STD = 4.0


def _byte_config(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=BYTE_VOCAB_SIZE, bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, **kw)


PRESETS: dict[str, ModelConfig] = {
    # ~3.0M parameters: 4 layers, hidden 256, 8 query heads over 2 KV heads (GQA 4:1).
    "tiny": _byte_config(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=4096),
    # ~51M parameters: big enough that prefill compute dominates Python overhead on CPU.
    "small": _byte_config(hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                          num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                          max_position_embeddings=8192),
}

PRESET_SEEDS = {"tiny": 1234, "small": 4321}


def preset_config(name: str) -> ModelConfig:
    """A fresh copy of a preset's ModelConfig."""
    if name not in PRESETS:
        raise ModelLoadError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    p = PRESETS[name]
    return ModelConfig(**{f: getattr(p, f) for f in p.__slots__})  # type: ignore[attr-defined]


@torch.no_grad()
def build_preset(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 seed: int | None = None) -> LlamaForCausalLM:
    """The preset ``name`` with its deterministic weights (same seed -> bit-identical weights);
    ``seed`` draws another model of the same shape (default: the preset's own seed)."""
    config = preset_config(name)
    gen = torch.Generator().manual_seed(PRESET_SEEDS[name] if seed is None else seed)
    model = LlamaForCausalLM(config)
    for pname, param in model.named_parameters():
        if pname.endswith("norm.weight") or "layernorm" in pname:
            param.fill_(1.0)
        elif pname == "model.embed_tokens.weight":
            param.copy_(torch.randn(param.shape, generator=gen))
        elif pname == "lm_head.weight":
            param.copy_(torch.randn(param.shape, generator=gen) * (LOGIT_STD / math.sqrt(param.shape[1])))
        elif pname.endswith("bias"):
            param.zero_()
        else:
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1]))
    return model.to(device=device, dtype=dtype).eval()
