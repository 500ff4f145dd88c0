"""TorchModelRunner: runs a ScheduledBatch through the Llama model and samples.

It owns the KV tensors (per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``) and
lays each step out as one flat batch of tokens, decoding sequences first::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 p1 p1 ...]     positions, slot_mapping likewise
              decodes     extends (prefill chunks, recomputes)

so the paged-decode kernel takes the first rows and prefix-extend the rest. With LoRA, the
same rows carry their adapter's slot: BGMV over the decode rows, SGMV over each prefill chunk
(worker/engine/lora/weights.py); the slot loads a batch asks for are copied in first.
"""
from __future__ import annotations

import gc
import time

import torch

from kernels.backend import get_attention_backend, get_lora_backend
from worker.engine.config import EngineConfig
from worker.engine.errors import ModelLoadError
from worker.engine.kv_sizing import (activation_bytes, kv_block_bytes, kv_blocks_for_cpu, kv_blocks_for_gpu,
                                     kv_blocks_for_memory, lora_slot_bytes)
from worker.engine.lora.weights import LoRASlotWeights, build_lora_context
from worker.engine.model.attention_context import AttentionContext
from worker.engine.model.llama import LlamaForCausalLM
from worker.engine.model.loader import load_model, load_model_config, resolve_dtype
from worker.engine.model.presets import PRESETS
from worker.engine.runner import RunnerOutput, ScheduledBatch, ScheduledSequence
from worker.engine.sampler import sample
from worker.engine.tokenizer import Tokenizer, load_tokenizer, read_chat_template_file

class TorchModelRunner:
    """The real runner: model forward over the paged KV cache, then the sampler."""

    def __init__(self, model: LlamaForCausalLM, engine_config: EngineConfig, num_kv_blocks: int,
                 tokenizer: Tokenizer) -> None:
        self.model = model
        self.model_config = model.config
        self.config = engine_config
        self.num_kv_blocks = num_kv_blocks
        self.tokenizer = tokenizer
        self.device = torch.device(engine_config.device)
        self.dtype = next(model.parameters()).dtype
        self.block_size = engine_config.block_size
        self.backend = get_attention_backend(engine_config.attention_backend, self.device)
        mc = self.model_config
        shape = (num_kv_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(mc.num_hidden_layers)]
        self.lora_weights: LoRASlotWeights | None = None
        if engine_config.enable_lora:
            self.lora_backend = get_lora_backend(engine_config.attention_backend, self.device)
            self.lora_weights = LoRASlotWeights(mc, engine_config.max_loras, engine_config.max_lora_rank,
                                                self.dtype, self.device)
        self._generators: dict[str, torch.Generator] = {}
        self._seed_counter = engine_config.seed

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "TorchModelRunner":
        """Load ``config.model`` (preset or directory) in its dtype and size the KV pool
        (worker/engine/kv_sizing.py)."""
        if config.model is None:
            raise ModelLoadError("EngineConfig.model is None and no runner was given")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_config = load_model_config(config.model)
        dtype = resolve_dtype(config.dtype, model_config.torch_dtype, config.device)
        # The tokenizer first: a checkpoint without one is refused before its weights are read.
        tok_dir = config.tokenizer or (None if config.model in PRESETS else config.model)
        template = read_chat_template_file(config.chat_template) if config.chat_template else None
        tokenizer = load_tokenizer(tok_dir, template)
        if tokenizer.vocab_size > model_config.vocab_size:
            raise ModelLoadError(f"tokenizer vocabulary ({tokenizer.vocab_size}) exceeds the model's "
                                 f"({model_config.vocab_size})")
        device = torch.device(config.device)
        on_cuda = device.type == "cuda" and config.num_kv_blocks is None and config.kv_memory_bytes is None
        if on_cuda:
            # What an earlier engine of this process left in torch's cache is free for this one.
            gc.collect()
            torch.cuda.empty_cache()
            free_before, total = torch.cuda.mem_get_info(device)
        model = load_model(config.model, dtype, config.device)
        elem = torch.tensor([], dtype=dtype).element_size()
        per_block = kv_block_bytes(model.config, config.block_size, elem)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif config.kv_memory_bytes is not None:
            num_blocks = kv_blocks_for_memory(config.kv_memory_bytes, per_block)
        elif on_cuda:
            free_after, _ = torch.cuda.mem_get_info(device)
            reserve = activation_bytes(model.config, config.max_num_batched_tokens, config.max_num_seqs, elem)
            if config.enable_lora:  # the slots are allocated after the KV cache
                reserve += lora_slot_bytes(model.config, config.max_loras, config.max_lora_rank, elem)
            num_blocks = kv_blocks_for_gpu(total, free_before, free_after, config.gpu_memory_utilization,
                                           per_block, reserve)
        else:
            num_blocks = kv_blocks_for_cpu(per_block)
        return cls(model, config, num_blocks, tokenizer)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            if seed is None:
                self._seed_counter += 1
                seed = hash((self._seed_counter, request_id)) & ((1 << 63) - 1)
            gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def _load_loras(self, batch: ScheduledBatch) -> float:
        """Copy the batch's newly assigned adapters into their slots; the seconds it took."""
        if self.lora_weights is None:
            raise RuntimeError("a batch asked for LoRA slot loads but LoRA is not enabled")
        start = time.perf_counter()
        for slot, adapter in batch.lora_loads:
            self.lora_weights.load(slot, adapter)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # to time the copies (the stream orders them anyway)
        return time.perf_counter() - start

    def _block_table(self, seqs: list[ScheduledSequence]) -> torch.Tensor:
        width = max(len(s.block_ids) for s in seqs)
        rows = [s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Compute the batch's tokens and sample for sequences that complete this step."""
        for rid in batch.finished_request_ids:
            self._generators.pop(rid, None)
        lora_load_s = self._load_loras(batch) if batch.lora_loads else 0.0
        # Decodes grouped by adapter slot: each adapter's decode rows are then one contiguous run.
        decodes = sorted((s for s in batch.seqs if not s.is_prefill), key=lambda s: s.lora_slot)
        extends = [s for s in batch.seqs if s.is_prefill]
        ordered = decodes + extends
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[ScheduledSequence] = []
        row_slots: list[int] = []
        for s in ordered:
            start = s.num_computed_tokens
            table = s.block_ids
            input_ids.extend(s.new_token_ids)
            row_slots.extend([s.lora_slot] * s.num_scheduled_tokens)
            positions.extend(range(start, start + s.num_scheduled_tokens))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + s.num_scheduled_tokens))
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(s)
        dev = self.device
        ctx = AttentionContext(
            backend=self.backend,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(decodes))
        if decodes:
            ctx.decode_block_tables = self._block_table(decodes)
            lens = [s.context_len for s in decodes]
            ctx.decode_context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
            ctx.decode_max_context_len = max(lens)
        if extends:
            ctx.extend_block_tables = self._block_table(extends)
            q_lens = [s.num_scheduled_tokens for s in extends]
            starts = [0]
            for n in q_lens:
                starts.append(starts[-1] + n)
            ctx.extend_query_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)
            ctx.extend_context_lens = torch.tensor([s.context_len for s in extends], dtype=torch.int32, device=dev)
            ctx.extend_max_query_len = max(q_lens)
        lora = None
        if self.lora_weights is not None:
            lora = build_lora_context(self.lora_weights, self.lora_backend, row_slots, len(decodes), dev)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), self.kv_caches, ctx, lora)
        out = RunnerOutput(lora_load_s=lora_load_s)
        if not sample_rows:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        params = [s.sampling_params for s in sample_seqs]
        gens = [None if p.greedy else self._generator(s.request_id, p.seed) for s, p in zip(sample_seqs, params)]
        tokens, logprobs = sample(logits, params, gens)
        for s, tok, lp in zip(sample_seqs, tokens, logprobs):
            out.sampled_token_ids[s.request_id] = tok
            if lp is not None:
                out.logprobs[s.request_id] = lp
        return out
