"""EngineConfig (how one replica runs) and ModelConfig (the Llama-family architecture).

The engine works without a model when it is given a runner (the simulated worker): then
``model`` is ``None``, ``num_kv_blocks`` must be given, and ``max_model_len`` defaults to the
KV pool's capacity.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from worker.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(slots=True)
class EngineConfig:
    """Settings of one engine. Defaults run the ``tiny`` preset on CPU.

    ``num_kv_blocks`` wins over ``kv_memory_bytes``; with neither, the pool takes what
    ``gpu_memory_utilization`` of a CUDA device leaves after the weights, or on a CPU 512 MiB
    capped at ``DEFAULT_KV_BLOCKS`` (worker/engine/kv_sizing.py). ``tokenizer`` is a directory
    with ``tokenizer.json`` (default: the checkpoint's), ``chat_template`` a Jinja file that
    replaces the checkpoint's template. ``dtype`` is that of the
    weights and the KV cache: ``"auto"`` is the checkpoint's ``torch_dtype``, float32 on a CPU.
    ``default_prefill_tokens_per_s`` / ``default_decode_step_s`` are reported until the engine
    has measured its own speed. With ``enable_lora`` the engine serves LoRA adapters
    (docs/lora.md): ``max_loras`` GPU slots (distinct adapters in one step), ``max_cpu_loras``
    adapters kept in host memory (default 4 x ``max_loras``), ranks up to ``max_lora_rank``.

    CPU KV tier (docs/kv-tier.md): ``cpu_kv_blocks`` host blocks (wins over
    ``cpu_kv_memory_bytes``; neither: no tier), stored by ``cpu_kv_store_policy``
    (``write_back``, ``write_through``, ``selective`` with ``cpu_kv_min_hits``);
    ``cpu_kv_load_bytes_per_s`` is the host -> device bandwidth assumed until measured (None: 25
    GB/s on CUDA, 10 GB/s on CPU).
    """

    model: str | None = "tiny"
    tokenizer: str | None = None
    chat_template: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_bytes: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    device: str = "cpu"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    num_threads: int | None = None
    seed: int = 0
    default_prefill_tokens_per_s: float = 2000.0
    default_decode_step_s: float = 0.05
    speed_ema_alpha: float = 0.2
    enable_lora: bool = False
    max_loras: int = 4
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    cpu_kv_blocks: int | None = None
    cpu_kv_memory_bytes: int | None = None
    cpu_kv_store_policy: str = "write_back"
    cpu_kv_min_hits: int = 2
    cpu_kv_load_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError("attention_backend must be auto, triton or torch")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError("dtype must be auto, float32, float16 or bfloat16")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 4 * self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        if self.cpu_kv_blocks is not None and self.cpu_kv_blocks < 0:
            raise ValueError("cpu_kv_blocks must be >= 0")
        if self.cpu_kv_memory_bytes is not None and self.cpu_kv_memory_bytes < 0:
            raise ValueError("cpu_kv_memory_bytes must be >= 0")
        if self.cpu_kv_store_policy not in ("write_back", "write_through", "selective"):
            raise ValueError("cpu_kv_store_policy must be write_back, write_through or selective")
        if self.cpu_kv_min_hits < 1:
            raise ValueError("cpu_kv_min_hits must be >= 1")
        if self.cpu_kv_load_bytes_per_s is not None and not self.cpu_kv_load_bytes_per_s > 0:
            raise ValueError("cpu_kv_load_bytes_per_s must be positive")

    def num_cpu_kv_blocks(self, block_bytes: int) -> int:
        """Host blocks of the CPU KV tier for blocks of ``block_bytes`` (0: no tier)."""
        if self.cpu_kv_blocks is not None:
            return self.cpu_kv_blocks
        if self.cpu_kv_memory_bytes is not None and block_bytes > 0:
            return self.cpu_kv_memory_bytes // block_bytes
        return 0


DEFAULT_KV_BLOCKS = 4096


@dataclass(slots=True)
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

    Field names follow Hugging Face's ``config.json``; Qwen2 sets ``attention_bias`` (q/k/v
    bias, no o bias), Mistral may set ``sliding_window`` (the engine then caps its context at
    the window so that full attention stays exact).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architecture: str = "LlamaForCausalLM"
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the model serves exactly."""
        if self.sliding_window:
            return min(self.max_position_embeddings, int(self.sliding_window))
        return self.max_position_embeddings

    @property
    def eos_token_ids(self) -> list[int]:
        """All end-of-sequence ids (HF allows a list)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, list):
            return [int(t) for t in self.eos_token_id]
        return [int(self.eos_token_id)]

    @property
    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        per_layer = attn + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + l * per_layer + h

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` of Llama, Qwen2 or Mistral."""
        archs = data.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
        rope_scaling = data.get("rope_scaling")
        rope_theta = data.get("rope_theta")
        params = data.get("rope_parameters")  # transformers >= 5 nests rope settings here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
                "default", "llama3", None):
            raise ModelLoadError(f"unsupported rope_scaling {rope_scaling!r}")
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        sliding = data.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not data.get("use_sliding_window", False):
            sliding = None
        try:
            return cls(
                vocab_size=int(data["vocab_size"]),
                hidden_size=int(data["hidden_size"]),
                intermediate_size=int(data["intermediate_size"]),
                num_hidden_layers=int(data["num_hidden_layers"]),
                num_attention_heads=int(data["num_attention_heads"]),
                num_key_value_heads=int(data.get("num_key_value_heads") or data["num_attention_heads"]),
                head_dim=data.get("head_dim"),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                attention_bias=arch == "Qwen2ForCausalLM" or bool(data.get("attention_bias", False)),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=data.get("bos_token_id"),
                eos_token_id=data.get("eos_token_id"),
                architecture=arch,
                torch_dtype=str(data.get("torch_dtype") or data.get("dtype") or "float32"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks {exc.args[0]!r}") from exc

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` that transformers loads as ``self.architecture``."""
        model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                      "MistralForCausalLM": "mistral"}[self.architecture]
        d = asdict(self)
        d.pop("extra")
        d.pop("architecture")
        d["architectures"] = [self.architecture]
        d["model_type"] = model_type
        d["hidden_act"] = "silu"
        d["mlp_bias"] = False
        if self.architecture == "Qwen2ForCausalLM":
            d.pop("attention_bias")
        return d
