"""The Llama architecture over a paged KV cache: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Tokens of all scheduled sequences are flattened into one ``[num_tokens, hidden]`` batch for
every linear layer; only attention looks at sequence boundaries, through the attention
backend of :mod:`kernels.backend` and the :class:`AttentionContext`.

Projections are fused (``qkv_proj`` = q|k|v rows, ``gate_up_proj`` = gate|up rows): one matmul
instead of three or two, which matters on CPU at small batches. The loader maps Hugging Face's
separate tensors into these, and the saver splits them back.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.config import ModelConfig
from worker.engine.model.attention_context import AttentionContext

if TYPE_CHECKING:
    from worker.engine.lora.weights import LoRAContext

# The projections a LoRA adapter may target (Hugging Face / PEFT names) -> the fused projection
# that computes them here and which of its slices (the loader maps checkpoints the same way).
LORA_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def lora_target_offsets(config: ModelConfig) -> dict[str, int]:
    """First output column of each target's slice in its fused projection's output."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"q_proj": 0, "k_proj": q, "v_proj": q + kv, "o_proj": 0,
            "gate_proj": 0, "up_proj": config.intermediate_size, "down_proj": 0}


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as Hugging Face's Llama does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of RoPE, with Llama 3's frequency scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed fp32 cos/sin table indexed by position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[T, 1, D]`` of positions ``[T]`` (looked up once per forward pass)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, D]`` rotated by its tokens' ``cos``/``sin`` (computed in fp32)."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(dtype)


class LlamaAttention(nn.Module):
    """GQA self-attention that writes its new K/V into the paged cache, then attends over it."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext,
                lora: "LoRAContext | None" = None) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(self.layer_idx, "qkv_proj", x, qkv)
        # q and k are adjacent columns of the fused projection: rotate them as one tensor of
        # num_heads + num_kv_heads heads (one set of RoPE ops per layer instead of two).
        qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(n, -1, self.head_dim), *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        backend = ctx.backend
        backend.write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)  # type: ignore[attr-defined]
        d = ctx.num_decode_tokens
        parts = []
        if d:
            parts.append(backend.decode(  # type: ignore[attr-defined]
                q[:d], k_cache, v_cache, ctx.decode_block_tables, ctx.decode_context_lens, self.scale,
                max_context_len=ctx.decode_max_context_len))
        if d < n:
            parts.append(backend.extend(  # type: ignore[attr-defined]
                q[d:], k_cache, v_cache, ctx.extend_block_tables, ctx.extend_query_start_loc,
                ctx.extend_context_lens, self.scale, max_query_len=ctx.extend_max_query_len))
        out = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)).reshape(n, self.q_size)
        y = self.o_proj(out)
        if lora is not None:
            lora.apply(self.layer_idx, "o_proj", out, y)
        return y


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: "LoRAContext | None" = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(self.layer_idx, "gate_up_proj", x, gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        h = F.silu(gate) * up
        y = self.down_proj(h)
        if lora is not None:
            lora.apply(self.layer_idx, "down_proj", h, y)
        return y


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext,
                lora: "LoRAContext | None" = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, ctx, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole model: ``forward`` gives hidden states, ``compute_logits`` the chosen rows' logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.rotary_emb = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], ctx: AttentionContext,
                lora: "LoRAContext | None" = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` (before the final norm) of the flattened batch.

        With ``lora``, every projection an adapter of the step targets adds each token's own
        adapter delta after the shared base matmul (worker/engine/lora/weights.py).
        """
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary_emb(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, rope, kv_cache, ctx, lora)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[rows, vocab]`` of the given hidden rows (final norm applied here)."""
        return self.lm_head(self.model.norm(hidden)).float()
