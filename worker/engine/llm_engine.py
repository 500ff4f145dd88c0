"""LLMEngine: requests in, RequestOutputs out, one ``step()`` at a time (no HTTP, no threads).

::

    engine = LLMEngine(EngineConfig(model="tiny"))          # torch model runner
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=8), namespace=seed)
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

With ``runner=`` given (the simulated worker) no model and no tensors are created: the engine
uses the byte-level tokenizer (unless one is passed) and ``config.num_kv_blocks`` blocks.

LoRA (``config.enable_lora``, docs/lora.md)::

    adapter = engine.add_lora("sql", "/adapters/sql")       # PEFT directory, validated
    engine.add_request("r2", prompt_ids, params, lora=adapter)
"""
from __future__ import annotations

import functools
import time
from typing import Iterable

from worker.engine.config import DEFAULT_KV_BLOCKS, EngineConfig, ModelConfig
from worker.engine.errors import (DuplicateRequestError, EngineStepError, InvalidRequestError,
                           LoRADisabledError, PromptTooLongError)
from worker.engine.kv_cache.events import KVCacheEvent
from worker.engine.kv_cache.hashing import adapter_namespace
from worker.engine.kv_cache.kv_tier import (DEFAULT_CPU_LOAD_BYTES_PER_S, DEFAULT_CUDA_LOAD_BYTES_PER_S,
                                            KVTier)
from worker.engine.lora.adapter import LoRAAdapter, read_peft_adapter
from worker.engine.lora.registry import AdapterReader, LoRARegistry
from worker.engine.output_processor import RequestState, abort_output, process_token
from worker.engine.outputs import RequestOutput
from worker.engine.runner import ModelRunner
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.stats import EngineStats, LoRAStats, engine_speed_meter, prefill_work
from worker.engine.tokenizer import ByteTokenizer, Tokenizer


class LLMEngine:
    """A paged-KV, prefix-caching, continuously batching engine driven by :meth:`step`."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 tokenizer: Tokenizer | None = None, lora_reader: AdapterReader | None = None,
                 served_model_names: Iterable[str] = ()) -> None:
        """``lora_reader`` reads an adapter directory (default: PEFT, validated against the
        model, weights in its dtype; without a model, metadata only). ``served_model_names``
        are names an adapter may not take (the base model's)."""
        self.config = config
        self.model_config: ModelConfig | None = None
        if runner is None:
            from worker.engine.model_runner import TorchModelRunner  # torch only when a model runs

            runner = TorchModelRunner.from_engine_config(config)
            self.model_config = runner.model_config
            num_blocks = runner.num_kv_blocks
            self.tokenizer: Tokenizer = tokenizer or runner.tokenizer
        else:
            num_blocks = config.num_kv_blocks or DEFAULT_KV_BLOCKS
            self.tokenizer = tokenizer or ByteTokenizer()
        self.runner = runner
        self.num_kv_blocks = num_blocks
        self.capacity_tokens = num_blocks * config.block_size
        if config.max_model_len is not None:
            self.max_model_len = config.max_model_len
        elif self.model_config is not None:
            self.max_model_len = self.model_config.max_model_len
        else:
            self.max_model_len = self.capacity_tokens
        if not config.enable_chunked_prefill:
            # A prompt (or a preempted request's recompute) must fit one step's token budget.
            self.max_model_len = min(self.max_model_len, config.max_num_batched_tokens)
        if self.model_config is not None and self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError("max_model_len exceeds the model's max_position_embeddings")
        eos = self.model_config.eos_token_ids if self.model_config else []
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = sorted(set(eos) | ({tok_eos} if tok_eos is not None else set()))
        self.speed = engine_speed_meter(config.default_prefill_tokens_per_s, config.default_decode_step_s,
                                        config.max_num_batched_tokens, config.speed_ema_alpha)
        self.kv_tier = _build_tier(config, runner)
        self.scheduler = Scheduler(config, num_blocks, self.kv_tier, self.speed)
        self.prefill_tokens_computed = 0
        self.lora: LoRARegistry | None = None
        self.lora_slot_load_s = 0.0  # EMA of one host -> slot copy (0 until measured)
        if config.enable_lora:
            if lora_reader is None:
                dtype = getattr(runner, "dtype", None)
                lora_reader = functools.partial(_read_adapter, max_rank=config.max_lora_rank,
                                                model_config=self.model_config, dtype=dtype)
            assert config.max_cpu_loras is not None
            self.lora = LoRARegistry(config.max_cpu_loras, lora_reader, served_model_names)
        self._states: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished = 0
        self.num_steps = 0

    @property
    def vocab_size(self) -> int:
        if self.model_config is not None:
            return self.model_config.vocab_size
        return int(getattr(self.tokenizer, "vocab_size", 1 << 31))

    # ---- requests ----------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`InvalidRequestError` if the request cannot be served (state-free)."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        params.validate()
        limit = min(self.max_model_len, self.capacity_tokens)
        if len(prompt_token_ids) >= limit:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{limit} tokens including at least one generated token")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    namespace: int = 0, arrival_time: float | None = None,
                    lora: LoRAAdapter | None = None) -> None:
        """Queue a request. ``namespace`` seeds its block hashes (no sharing across namespaces);
        with ``lora`` (from :meth:`add_lora` / :meth:`get_lora`) the request runs with that
        adapter and its blocks are keyed by the adapter's identity too."""
        if request_id in self.scheduler.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already running")
        self.validate_request(prompt_token_ids, params)
        if lora is not None:
            if self.lora is None:
                raise LoRADisabledError("LoRA adapters are not enabled on this engine (enable_lora)")
            self.lora.acquire(lora)  # host-resident from here until the request finishes
        seq = Sequence(request_id, list(prompt_token_ids), params,
                       namespace=self.block_namespace(namespace, lora), lora=lora,
                       max_total_tokens=min(self.max_model_len, self.capacity_tokens),
                       arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self._states[request_id] = RequestState(seq, self.tokenizer, self.eos_token_ids)
        self.prompt_tokens_total += len(prompt_token_ids)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks now; its final output (``abort``) comes with the
        next :meth:`step`. False if the request is unknown or already finished."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._pending.append(abort_output(seq, self._states.pop(request_id, None)))
        self.requests_finished += 1
        return True

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        if seq.lora is not None and self.lora is not None:
            self.lora.release(seq.lora)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs, or has an undelivered final output."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, compute and sample one step; return the outputs it produced."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        start = time.perf_counter()
        try:
            result = self.runner.execute(batch)
        except Exception as exc:
            # Only this batch's requests fail; everything else keeps its place.
            if self.kv_tier is not None:
                self.kv_tier.finish_copies(stores_ok=False)  # nothing of this step is loadable
            self._pending = outputs
            failed = [s.request_id for s in batch.seqs]
            for rid in failed:
                seq = self.scheduler.requests.get(rid)
                if seq is not None:
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                    self._states.pop(rid, None)
                    self.requests_finished += 1
            raise EngineStepError(failed, exc) from exc
        duration = time.perf_counter() - start if result.step_s is None else result.step_s
        if batch.lora_loads and result.lora_load_s > 0:
            per_load = result.lora_load_s / len(batch.lora_loads)
            self.lora_slot_load_s = per_load if self.lora_slot_load_s == 0 else (
                0.7 * self.lora_slot_load_s + 0.3 * per_load)
            duration = max(duration - result.lora_load_s, 1e-9)  # not the model's speed
        if self.kv_tier is not None:
            self.kv_tier.finish_copies(result.kv_stores_ok, result.kv_load_s)
            if result.kv_copy_s > 0:
                duration = max(duration - result.kv_copy_s, 1e-9)  # copies are not prefill speed
        self.prefill_tokens_computed += batch.num_prefill_tokens
        self.scheduler.on_step_done(batch)
        self.num_steps += 1
        now = time.monotonic()
        requests = self.scheduler.requests
        for s in batch.seqs:
            if not s.samples:
                continue
            seq = requests.get(s.request_id)
            if seq is None:
                continue
            token_id = result.sampled_token_ids[s.request_id]
            out = process_token(seq, self._states[s.request_id], token_id,
                                result.logprobs.get(s.request_id), now)
            self.generation_tokens_total += 1
            if out.finished:
                self._finish(seq, seq.status)
                self._states.pop(s.request_id, None)
                self.requests_finished += 1
            outputs.append(out)
        work = prefill_work((s.num_scheduled_tokens, s.num_computed_tokens) for s in batch.seqs if s.is_prefill)
        self.speed.observe(duration, batch.num_prefill_tokens, batch.num_decode_seqs, work)
        return outputs

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams],
                 namespace: int = 0) -> list[RequestOutput]:
        """Run prompts to completion; one merged final RequestOutput per prompt, in order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{self.num_steps}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p, namespace=namespace)
        merged: dict[str, RequestOutput] = {}
        while any(rid not in merged or not merged[rid].finished for rid in ids):
            for out in self.step():
                if out.request_id not in ids:
                    continue
                prev = merged.get(out.request_id)
                if prev is not None:
                    out.new_text = prev.new_text + out.new_text
                    out.new_token_ids = prev.new_token_ids + out.new_token_ids
                    if prev.logprobs is not None:
                        out.logprobs = prev.logprobs + (out.logprobs or [])
                    out.itl_s = prev.itl_s + out.itl_s
                    out.ttft_s = prev.ttft_s if prev.ttft_s is not None else out.ttft_s
                merged[out.request_id] = out
        return [merged[rid] for rid in ids]

    # ---- LoRA adapters ------------------------------------------------------------------------
    def _registry(self) -> LoRARegistry:
        if self.lora is None:
            raise LoRADisabledError("LoRA adapters are not enabled on this engine (enable_lora)")
        return self.lora

    def add_lora(self, name: str, path: str, replace: bool = False) -> LoRAAdapter:
        """Read, validate and register the PEFT adapter at ``path`` as ``name`` (any thread).

        Raises the LoRA errors of :mod:`worker.engine.errors` (not found, invalid, conflict,
        disabled). With ``replace``, requests already running keep the previous weights.
        """
        return self._registry().add(name, path, replace)

    def remove_lora(self, name: str) -> LoRAAdapter:
        """Unregister ``name``; its requests in flight finish with it (any thread)."""
        return self._registry().remove(name)

    def get_lora(self, name: str) -> LoRAAdapter:
        """The current version of adapter ``name`` (LoRAAdapterNotFoundError if none)."""
        return self._registry().get(name)

    def list_loras(self) -> list[LoRAAdapter]:
        """Every adapter served, by name (empty without LoRA)."""
        return self.lora.adapters() if self.lora is not None else []

    def block_namespace(self, namespace: int, lora: LoRAAdapter | None) -> int:
        """The seed of the block hashes of a request in ``namespace`` run with ``lora``."""
        return adapter_namespace(namespace, lora.identity if lora is not None else None)

    # ---- observability ----------------------------------------------------------------------
    def take_kv_events(self) -> list[KVCacheEvent]:
        """BlockStored / BlockRemoved / AllBlocksCleared since the previous call, oldest first."""
        return self.scheduler.kv_cache_manager.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks (emits AllBlocksCleared); False while requests hold blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """Load, capacity, measured speed and counters right now."""
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        total = pool.num_blocks
        allocatable = pool.get_num_free_blocks()
        cached = pool.num_cached_free_blocks
        used = total - allocatable
        return EngineStats(
            running=len(sched.running), waiting=len(sched.waiting),
            queued_prefill_tokens=sched.queued_prefill_tokens(),
            running_tokens=sched.running_tokens(),
            free_blocks=allocatable - cached, cached_blocks=cached, used_blocks=used,
            total_blocks=total, kv_usage=used / total, block_size=self.config.block_size,
            capacity_tokens=self.capacity_tokens, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            prefill_tokens_per_s=self.speed.prefill_tokens_per_s,
            decode_step_s=self.speed.decode_step_s,
            speed_measured=self.speed.prefill_measured and self.speed.decode_measured,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits, num_preemptions=sched.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            requests_finished=self.requests_finished, num_steps=self.num_steps,
            lora=self._lora_stats(), prefill_tokens_computed=self.prefill_tokens_computed,
            kv_tier=self.kv_tier.stats() if self.kv_tier is not None else None)

    def _lora_stats(self) -> LoRAStats | None:
        registry, slots = self.lora, self.scheduler.lora_slots
        if registry is None or slots is None:
            return None
        sched = self.scheduler
        in_slots = {a.lora_int_id for a in slots.adapters[1:] if a is not None and not a.removed}
        current = registry.adapters()
        return LoRAStats.of(
            config=self.config, adapters=current,
            gpu=[a.name for a in current if a.lora_int_id in in_slots],
            cpu=[a.name for a in registry.resident() if a.lora_int_id not in in_slots],
            running=[s.lora_name for s in sched.running if s.lora is not None],
            waiting=[s.lora_name for s in sched.waiting if s.lora is not None],
            disk_load_s=registry.disk_load_s, slot_load_s=self.lora_slot_load_s)


def _build_tier(config: EngineConfig, runner: ModelRunner) -> KVTier | None:
    """The CPU KV tier the config asks for (None: none). The torch runner sized it and allocated
    its host tensors (``num_cpu_kv_blocks``); another runner gets ``config``'s blocks."""
    block_bytes = int(getattr(runner, "kv_block_bytes", 0))
    num = getattr(runner, "num_cpu_kv_blocks", None)
    if num is None:
        num = config.num_cpu_kv_blocks(block_bytes)
    if num <= 0 or not config.enable_prefix_caching:
        return None
    bandwidth = config.cpu_kv_load_bytes_per_s or (
        DEFAULT_CUDA_LOAD_BYTES_PER_S if config.device.startswith("cuda") else DEFAULT_CPU_LOAD_BYTES_PER_S)
    return KVTier(num, config.block_size, block_bytes, policy=config.cpu_kv_store_policy,
                  min_hits=config.cpu_kv_min_hits, load_bytes_per_s=bandwidth)


def _read_adapter(name: str, path: str, *, max_rank: int, model_config: ModelConfig | None,
                  dtype) -> LoRAAdapter:
    """The default adapter reader: PEFT, checked against the model; without one, metadata only
    (``weights`` empty: nothing to compute with, but resident)."""
    adapter = read_peft_adapter(name, path, max_rank=max_rank, model_config=model_config, dtype=dtype)
    if model_config is None:
        adapter.weights = {}
    return adapter
