"""The latency model of the simulated worker: how long one engine step takes on a GPU profile.

A step is a roofline: it takes the longer of its compute time and its memory time, plus a
fixed per-step overhead (scheduling, kernel launches)::

    flops = 2 · P_mm · T  +  2 · V · H · S  +  4 · L · d_attn · A
    bytes = W  +  kv_bytes_per_token · K
    step  = overhead + max(flops / (tp · peak_flops · eff_c),  bytes / (tp · bandwidth · eff_b))

with, summed over the sequences of the step,

- ``T``  tokens pushed through the layers: every new prefill token plus one per decoding sequence;
- ``S``  rows that produce logits (a prefill that completes its prompt, every decode);
- ``A``  attention (query, key) pairs: a prefill chunk of ``n`` new tokens after ``c`` cached or
  already computed ones contributes ``n·c + n(n+1)/2`` (causal), a decode with context ``ctx``
  (its new token included) contributes ``ctx``;
- ``K``  KV tokens read or written: ``c + n`` for a prefill chunk, ``ctx`` for a decode;
- ``P_mm`` the matmul parameters (all but the input embedding), ``V·H`` the LM head,
  ``L`` layers, ``d_attn = heads · head_dim``, ``W`` the weight bytes; ``4`` = 2 FLOPs per
  multiply-add for ``QKᵀ`` and again for ``PV``.

So a lone prefill is compute-bound and grows linearly in new tokens plus an attention term in
new × (cached + new); a decode step is bandwidth-bound (weights + the batch's KV bytes) until the
batch is large enough for compute to dominate; a mixed step pays the maximum of the two, never
their sum (both run in the same kernels). Tensor parallelism divides compute, weights and KV
evenly over ``tp`` GPUs (communication is not modelled: optimistic for TP > 1).

KV capacity per GPU = HBM · memory_utilization − weights / tp − activation reserve, divided by
the KV bytes of one token per GPU.

LoRA adapters (never merged: the base matmuls run once for the batch) add, per step,
``2 · Σ tokens · P_lora`` FLOPs (each token through its own adapter's A then B: a multiply-add
per adapter parameter) and the bytes of every *distinct* adapter in the step (BGMV/SGMV read
each adapter's A and B once) to the same roofline, so a few rank-16 adapters cost little and 32
distinct ones at batch 32 cost their weights' bandwidth. ``P_lora = layers · r · Σ (in + out)``
over the targeted projections. Loading an adapter costs ``bytes / host_to_device_bandwidth``
from host memory into a GPU slot (between steps) and ``disk_latency_s + bytes /
disk_bandwidth`` from disk into host memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from worker.simulator.profiles import GPUProfile, ModelProfile, ProfileError

GIB = 1024**3
TP_DEGREES = (1, 2, 4, 8)


@dataclass(slots=True)
class StepShape:
    """The work of one engine step, as the sums the latency model needs (see module docstring)."""

    tokens: int = 0
    sampled: int = 0
    attention_pairs: int = 0
    kv_tokens: int = 0
    num_seqs: int = 0
    lora_token_params: float = 0.0  # Σ over sequences with an adapter: tokens · adapter params
    lora_weight_bytes: float = 0.0  # bytes of the distinct adapters the step reads

    def add_prefill(self, new_tokens: int, computed_tokens: int, samples: bool) -> None:
        """A prefill chunk of ``new_tokens`` after ``computed_tokens`` (cached or earlier chunks)."""
        n, c = new_tokens, computed_tokens
        self.tokens += n
        self.sampled += int(samples)
        self.attention_pairs += n * c + n * (n + 1) // 2
        self.kv_tokens += c + n
        self.num_seqs += 1

    def add_decode(self, context_tokens: int) -> None:
        """One decoding sequence whose context (its new token included) is ``context_tokens``."""
        self.tokens += 1
        self.sampled += 1
        self.attention_pairs += context_tokens
        self.kv_tokens += context_tokens
        self.num_seqs += 1

    def add_lora(self, tokens: int, adapter_params: float) -> None:
        """``tokens`` of one sequence also go through its adapter of ``adapter_params`` parameters."""
        self.lora_token_params += tokens * adapter_params

    def add_lora_weights(self, num_bytes: float) -> None:
        """One distinct adapter of the step: its weights are read once."""
        self.lora_weight_bytes += num_bytes


@dataclass(slots=True)
class LatencyModel:
    """Step durations and KV capacity of one model on ``tp`` GPUs of one profile.

    ``tp=None`` picks the smallest degree in 1, 2, 4, 8 that leaves at least
    ``min_kv_fraction`` of each GPU's memory for KV cache. Efficiencies default to the GPU's.
    """

    gpu: GPUProfile
    model: ModelProfile
    tp: int | None = None
    memory_utilization: float = 0.9
    activation_reserve_bytes: float = 1 * GIB
    step_overhead_s: float = 0.001
    compute_efficiency: float | None = None
    bandwidth_efficiency: float | None = None
    min_kv_fraction: float = 0.1
    disk_bandwidth: float = 2e9  # bytes/s of reading an adapter's safetensors (NVMe, parsed)
    disk_latency_s: float = 0.005  # opening and parsing the files
    _flops_per_s: float = field(init=False, default=0.0)
    _bytes_per_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.tp is None:
            self.tp = next((t for t in TP_DEGREES if self._fits(t)), 0)
            if not self.tp:
                raise ProfileError(f"{self.model.name} does not fit on 8 x {self.gpu.name}")
        elif self.tp < 1 or not self._fits(self.tp):
            raise ProfileError(f"{self.model.name} does not fit on {self.tp} x {self.gpu.name} "
                               f"with {self.min_kv_fraction:.0%} of memory left for KV cache")
        ce = self.compute_efficiency if self.compute_efficiency is not None else self.gpu.compute_efficiency
        be = self.bandwidth_efficiency if self.bandwidth_efficiency is not None else self.gpu.bandwidth_efficiency
        self._flops_per_s = self.tp * self.gpu.peak_flops * ce
        self._bytes_per_s = self.tp * self.gpu.hbm_bandwidth * be

    @property
    def flops_per_s(self) -> float:
        """Effective compute of the replica: ``tp · peak · compute efficiency``."""
        return self._flops_per_s

    @property
    def bytes_per_s(self) -> float:
        """Effective HBM bandwidth of the replica: ``tp · bandwidth · bandwidth efficiency``."""
        return self._bytes_per_s

    def _kv_bytes_free(self, tp: int) -> float:
        """Bytes left for KV cache on each GPU at tensor-parallel degree ``tp``."""
        usable = self.gpu.hbm_bytes * self.memory_utilization
        return usable - self.model.weight_bytes / tp - self.activation_reserve_bytes

    def _fits(self, tp: int) -> bool:
        return self._kv_bytes_free(tp) >= self.min_kv_fraction * self.gpu.hbm_bytes

    # ------------------------------------------------------------------ capacity

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the replica (all its ``tp`` GPUs) holds."""
        per_gpu_token = self.model.kv_bytes_per_token / self.tp
        return int(self._kv_bytes_free(self.tp) // per_gpu_token)

    def kv_capacity_blocks(self, block_size: int) -> int:
        """Full KV blocks of ``block_size`` tokens the replica holds."""
        return self.kv_capacity_tokens() // block_size

    # ------------------------------------------------------------------ time

    def flops(self, shape: StepShape) -> float:
        """Floating-point operations of one step (all GPUs together)."""
        m = self.model
        return (2.0 * m.matmul_params * shape.tokens
                + 2.0 * m.vocab_size * m.hidden_size * shape.sampled
                + 4.0 * m.num_layers * m.num_heads * m.head_dim * shape.attention_pairs
                + 2.0 * shape.lora_token_params)

    def bytes_moved(self, shape: StepShape) -> float:
        """HBM bytes of one step: the weights once, plus the KV of every token it reads or writes,
        plus each distinct LoRA adapter's weights once."""
        return (self.model.weight_bytes + self.model.kv_bytes_per_token * shape.kv_tokens
                + shape.lora_weight_bytes)

    def step_time(self, shape: StepShape) -> float:
        """Seconds one step takes; an empty step takes nothing."""
        if shape.num_seqs == 0:
            return 0.0
        compute = self.flops(shape) / self._flops_per_s
        memory = self.bytes_moved(shape) / self._bytes_per_s
        return self.step_overhead_s + max(compute, memory)

    def lora_bytes(self, adapter_params: float) -> float:
        """Bytes of an adapter of ``adapter_params`` parameters in the model's weight dtype."""
        return adapter_params * self.model.bytes_per_param

    def lora_slot_load_time(self, adapter_params: float) -> float:
        """Seconds to copy an adapter from host memory into a GPU slot (all ``tp`` GPUs at once)."""
        return self.lora_bytes(adapter_params) / self.tp / self.gpu.host_to_device_bandwidth

    def lora_disk_load_time(self, adapter_params: float) -> float:
        """Seconds to read an adapter from disk into host memory."""
        return self.disk_latency_s + self.lora_bytes(adapter_params) / self.disk_bandwidth

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` in one step, alone."""
        shape = StepShape()
        shape.add_prefill(new_tokens, cached_tokens, samples=True)
        return self.step_time(shape)

    def decode_step_time(self, batch_size: int, context_tokens_per_seq: int) -> float:
        """Seconds of one decode step for ``batch_size`` sequences of equal context."""
        shape = StepShape()
        for _ in range(batch_size):
            shape.add_decode(context_tokens_per_seq)
        return self.step_time(shape)

    def nominal_speed(self) -> tuple[float, float]:
        """(prefill tokens/s of a cold 2,048-token prompt, decode step s at batch 1, 1,024 context).

        The speed a worker reports before it has measured its own steps.
        """
        return 2048 / self.prefill_time(2048), self.decode_step_time(1, 1024)
