"""LLMEngine: requests in, RequestOutputs out, one ``step()`` at a time (no HTTP, no threads).

::

    engine = LLMEngine(EngineConfig(model="tiny"))          # torch model runner
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=8), namespace=seed)
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

With ``runner=`` given (the simulated worker) no model and no tensors are created: the engine
uses the byte-level tokenizer (unless one is passed) and ``config.num_kv_blocks`` blocks.
"""
from __future__ import annotations

import time
from typing import Iterable

from worker.engine.config import DEFAULT_KV_BLOCKS, EngineConfig, ModelConfig
from worker.engine.errors import (DuplicateRequestError, EngineStepError, InvalidRequestError,
                           PromptTooLongError)
from worker.engine.kv_cache.events import KVCacheEvent
from worker.engine.output_processor import RequestState, abort_output, process_token
from worker.engine.outputs import RequestOutput
from worker.engine.runner import ModelRunner
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.stats import EngineStats, engine_speed_meter, prefill_work
from worker.engine.tokenizer import ByteTokenizer, Tokenizer


class LLMEngine:
    """A paged-KV, prefix-caching, continuously batching engine driven by :meth:`step`."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
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
        self.scheduler = Scheduler(config, num_blocks)
        self.speed = engine_speed_meter(config.default_prefill_tokens_per_s, config.default_decode_step_s,
                                        config.max_num_batched_tokens, config.speed_ema_alpha)
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
                    namespace: int = 0, arrival_time: float | None = None) -> None:
        """Queue a request. ``namespace`` seeds its block hashes (no sharing across namespaces)."""
        if request_id in self.scheduler.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already running")
        self.validate_request(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, namespace=namespace,
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
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._pending.append(abort_output(seq, self._states.pop(request_id, None)))
        self.requests_finished += 1
        return True

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
            self._pending = outputs
            failed = [s.request_id for s in batch.seqs]
            for rid in failed:
                seq = self.scheduler.requests.get(rid)
                if seq is not None:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                    self._states.pop(rid, None)
                    self.requests_finished += 1
            raise EngineStepError(failed, exc) from exc
        duration = time.perf_counter() - start if result.step_s is None else result.step_s
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
                self.scheduler.finish(seq, seq.status)
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
            requests_finished=self.requests_finished, num_steps=self.num_steps)
