"""GPU and model profiles for the simulated worker: the constants the latency model runs on.

GPU peak numbers are NVIDIA's datasheet values for the SXM parts, dense bf16 (no 2:4
sparsity); ``hbm_bytes`` is the total memory the driver reports (``nvidia-smi``), which is
a little below the marketing size. Model shapes are the ones in each model's Hugging Face
``config.json``. Sources and derivations are listed in docs/simulator.md ("The latency model").
"""
from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024
# The simulated worker's batch limits: a GPU's serving batch (the CPU engine's are EngineConfig's).
SIM_MAX_NUM_SEQS = 256
SIM_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class GPUProfile:
    """One accelerator: peak dense bf16 compute, HBM bandwidth and size, default efficiencies.

    ``compute_efficiency`` is the fraction of peak FLOP/s a prefill reaches (model FLOPs
    utilisation); ``bandwidth_efficiency`` the fraction of peak bandwidth a decode step reaches.
    ``host_to_device_bandwidth`` is an effective host -> GPU copy rate (what a LoRA adapter's
    move from host memory into a GPU slot runs at): about 80% of the PCIe link's peak.
    """

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: int
    host_to_device_bandwidth: float  # bytes/s, effective
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.75


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One model's shape: what sets its FLOPs per token, its weight bytes and its KV bytes."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_params: float
    intermediate_size: int
    bytes_per_param: int = 2  # bf16 weights
    kv_bytes_per_elem: int = 2  # bf16 KV cache
    max_model_len: int = 131072

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights (one copy, before tensor parallelism)."""
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers: ``2 · layers · kv_heads · head_dim · bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem

    def lora_params(self, rank: int, target_modules: tuple[str, ...] | list[str]) -> int:
        """Parameters (A and B, all layers) of a rank-``rank`` LoRA adapter on ``target_modules``."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        in_out = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
                  "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
        return self.num_layers * rank * sum(in_out[m] for m in target_modules)

    @property
    def matmul_params(self) -> float:
        """Weights multiplied per token: all but the input embedding (a lookup, not a matmul)."""
        return self.num_params - self.vocab_size * self.hidden_size


GPUS: dict[str, GPUProfile] = {
    # A100 SXM4 80GB datasheet: 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e; nvidia-smi 81920 MiB;
    # PCIe Gen4 x16 (32 GB/s per direction): 25 GB/s effective.
    "A100-80G": GPUProfile("A100-80G", 312e12, 2.039e12, 81920 * MIB, 25e9),
    # H100 SXM5 80GB datasheet: 989 TFLOP/s bf16 dense (1,979 with sparsity), 3.35 TB/s HBM3;
    # nvidia-smi 81559 MiB; PCIe Gen5 x16 (64 GB/s per direction): 50 GB/s effective.
    "H100-80G": GPUProfile("H100-80G", 989e12, 3.35e12, 81559 * MIB, 50e9),
    # H200 SXM 141GB: same compute as H100, 4.8 TB/s HBM3e; nvidia-smi 143771 MiB; PCIe Gen5.
    "H200": GPUProfile("H200", 989e12, 4.8e12, 143771 * MIB, 50e9),
}

MODELS: dict[str, ModelProfile] = {
    # meta-llama/Llama-3.1-8B config.json (Llama 3 shapes, 128K context).
    "llama-3-8b": ModelProfile("llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32,
                               num_kv_heads=8, head_dim=128, vocab_size=128256, num_params=8.03e9,
                               intermediate_size=14336),
    # meta-llama/Llama-3.1-70B config.json.
    "llama-3-70b": ModelProfile("llama-3-70b", num_layers=80, hidden_size=8192, num_heads=64,
                                num_kv_heads=8, head_dim=128, vocab_size=128256, num_params=70.6e9,
                                intermediate_size=28672),
}


class ProfileError(ValueError):
    """An unknown profile name, or a model that does not fit on the chosen GPUs."""


def get_gpu(name: str) -> GPUProfile:
    """The GPU profile called ``name`` (case-insensitive)."""
    for key, gpu in GPUS.items():
        if key.lower() == name.lower():
            return gpu
    raise ProfileError(f"unknown GPU profile {name!r}; known: {', '.join(GPUS)}")


def get_model(name: str) -> ModelProfile:
    """The model profile called ``name`` (case-insensitive)."""
    for key, model in MODELS.items():
        if key.lower() == name.lower():
            return model
    raise ProfileError(f"unknown model profile {name!r}; known: {', '.join(MODELS)}")
