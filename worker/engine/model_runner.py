"""TorchModelRunner: runs a ScheduledBatch through the Llama model and samples.

It owns the KV tensors (per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``) and
lays each step out as one flat batch of tokens, decoding sequences first::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 p1 p1 ...]     positions, slot_mapping likewise
              decodes     extends (prefill chunks, recomputes)

so the paged-decode kernel takes the first rows and prefix-extend the rest. With LoRA, the
same rows carry their adapter's slot: BGMV over the decode rows, SGMV over each prefill chunk
(worker/engine/lora/weights.py); the slot loads a batch asks for are copied in first.

With a CPU KV tier it also owns the host copy of the KV (the same layout with
``num_cpu_kv_blocks`` blocks, pinned on CUDA) and runs a step's tier copies before its model:
stores (device -> host) first, then loads (host -> device). On CUDA they run on a copy stream of
their own and the step waits for them; they are timed, which is how the tier measures its bandwidth.
"""
from __future__ import annotations

import gc
import logging
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

log = logging.getLogger(__name__)


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
        self.kv_block_bytes = kv_block_bytes(mc, self.block_size, torch.tensor([], dtype=self.dtype).element_size())
        self.num_cpu_kv_blocks = engine_config.num_cpu_kv_blocks(self.kv_block_bytes)
        pin = self.device.type == "cuda"
        host_shape = (self.num_cpu_kv_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.cpu_kv_caches = [(torch.empty(host_shape, dtype=self.dtype, pin_memory=pin),
                               torch.empty(host_shape, dtype=self.dtype, pin_memory=pin))
                              for _ in range(mc.num_hidden_layers)] if self.num_cpu_kv_blocks else []
        self._copy_stream = torch.cuda.Stream(self.device) if pin and self.num_cpu_kv_blocks else None
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

    def _copy_kv(self, batch: ScheduledBatch) -> tuple[bool, float, float]:
        """Run the batch's tier copies: (stores succeeded, seconds of the loads, seconds of all)."""
        start = time.perf_counter()
        stores_ok = True
        if batch.kv_stores:
            try:
                self._store_blocks(batch.kv_stores)
            except (RuntimeError, OSError) as exc:  # a failed copy out only costs the tier those blocks
                log.warning("event=kv_store_failed blocks=%d error=%r", len(batch.kv_stores), exc)
                stores_ok = False
        loads_start = time.perf_counter()
        if batch.kv_loads:
            self._load_blocks(batch.kv_loads)
        end = time.perf_counter()
        return stores_ok, end - loads_start if batch.kv_loads else 0.0, end - start

    def _store_blocks(self, stores: list[tuple[int, int]]) -> None:
        """Copy device blocks into host slots (``(gpu_block_id, host_slot)`` pairs)."""
        ids = torch.tensor([g for g, _ in stores], dtype=torch.long, device=self.device)
        slots = torch.tensor([h for _, h in stores], dtype=torch.long)
        stream = self._copy_stream
        if stream is None:
            for (gk, gv), (hk, hv) in zip(self.kv_caches, self.cpu_kv_caches):
                hk.index_copy_(0, slots, gk.index_select(0, ids))
                hv.index_copy_(0, slots, gv.index_select(0, ids))
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the KV is written
        with torch.cuda.stream(stream):
            staged = [(gk.index_select(0, ids).to("cpu", non_blocking=True),
                       gv.index_select(0, ids).to("cpu", non_blocking=True)) for gk, gv in self.kv_caches]
        stream.synchronize()  # the staged copies are on the host before they are scattered
        for (sk, sv), (hk, hv) in zip(staged, self.cpu_kv_caches):
            hk.index_copy_(0, slots, sk)
            hv.index_copy_(0, slots, sv)

    def _load_blocks(self, loads: list[tuple[int, int]]) -> None:
        """Copy host slots into device blocks (``(host_slot, gpu_block_id)`` pairs)."""
        slots = torch.tensor([h for h, _ in loads], dtype=torch.long)
        ids = torch.tensor([g for _, g in loads], dtype=torch.long, device=self.device)
        stream = self._copy_stream
        if stream is None:
            for (gk, gv), (hk, hv) in zip(self.kv_caches, self.cpu_kv_caches):
                gk.index_copy_(0, ids, hk.index_select(0, slots))
                gv.index_copy_(0, ids, hv.index_select(0, slots))
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the stores read these blocks first
        with torch.cuda.stream(stream):
            for (gk, gv), (hk, hv) in zip(self.kv_caches, self.cpu_kv_caches):
                gk.index_copy_(0, ids, hk.index_select(0, slots).pin_memory().to(self.device, non_blocking=True))
                gv.index_copy_(0, ids, hv.index_select(0, slots).pin_memory().to(self.device, non_blocking=True))
        stream.synchronize()  # timed: the tier's bandwidth is measured on this
        torch.cuda.current_stream(self.device).wait_stream(stream)

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
        stores_ok, kv_load_s, kv_copy_s = (self._copy_kv(batch) if batch.kv_stores or batch.kv_loads
                                           else (True, 0.0, 0.0))
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
        out = RunnerOutput(lora_load_s=lora_load_s, kv_stores_ok=stores_ok, kv_load_s=kv_load_s,
                           kv_copy_s=kv_copy_s)
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
