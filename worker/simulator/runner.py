"""SimulatedRunner: the engine's ModelRunner with a latency model in place of a model.

The engine keeps everything real — scheduler, continuous batching, BlockPool, prefix cache,
preemption — and only ``execute`` is simulated: it sums the step's work into a
:class:`~worker.simulator.latency.StepShape`, sleeps the modelled duration divided by the time
scale, and returns deterministic tokens (a fixed text, then EOS after ``output_len`` tokens unless the request
ignores EOS; ``max_tokens`` applies as usual), or, in the recorded-answer mode
(:class:`RecordedAnswerRunner`), each prompt's recorded answer.

Sleeps are scheduled on a virtual clock: each step ends ``duration / time_scale`` after the
previous step's end, not after "now", so per-step Python overhead and sleep overshoot do not
accumulate while the engine is busy. After an idle gap the clock restarts from now.

LoRA adapters are real PEFT directories read for their rank and targets only (no tensors); their
cost comes from the latency model on the simulated model's shapes: the delta of every token with
an adapter and each distinct adapter's weights in the step's roofline, a slot load (host -> GPU)
added to the step that needs it, and a disk read slept (scaled) by whoever reads the adapter.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.lora.adapter import LoRAAdapter, read_peft_adapter
from worker.engine.runner import RunnerOutput, ScheduledBatch, ScheduledSequence, TokenLogprob
from worker.simulator.latency import LatencyModel, StepShape
from worker.simulator.profiles import SIM_MAX_NUM_BATCHED_TOKENS, SIM_MAX_NUM_SEQS, get_gpu, get_model
from worker.simulator.recorded import RecordedAnswers
from worker.engine.stats import prefill_work
from worker.engine.tokenizer import BYTE_EOS_ID, ByteTokenizer

SIM_TEXT = (b"The quick brown fox jumps over the lazy dog while the simulated model keeps "
            b"answering in the same calm and deterministic voice. ")
IMPOSSIBLE_LOGPROB = -9999.0  # OpenAI's value for tokens the distribution never picks


@dataclass(slots=True)
class VirtualClock:
    """Sleeps so that consecutive steps end exactly ``duration / time_scale`` apart."""

    time_scale: float = 1.0
    idle_gap_s: float = 0.05
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    modelled_s: float = 0.0  # total modelled (unscaled) time of all steps
    # How far the host made the simulated GPU fall behind the model, in modelled seconds: the
    # lateness of a step that follows another without an idle gap (its wall start is past the
    # previous step's scheduled end). Above a few percent of a TTFT, a replay is not faithful.
    behind_s: float = 0.0
    behind_max_s: float = 0.0
    _next: float = field(default=0.0)

    def advance(self, modelled_s: float, continuing: bool = False) -> float:
        """Account one step of ``modelled_s`` seconds; sleep until it ends; return the wall sleep.

        ``continuing``: the step goes on with work of the previous one (no idle gap between
        them), so it starts where the previous one was scheduled to end even when the host is
        late -- the clock catches up instead of losing the modelled time.
        """
        self.modelled_s += modelled_s
        now = self.now()
        if continuing:
            start = self._next
            late = (now - start) * self.time_scale
            self.behind_s = late if late > 0.0 else 0.0
            if self.behind_s > self.behind_max_s:
                self.behind_max_s = self.behind_s
        else:
            start = self._next if now - self._next < self.idle_gap_s else now
            self.behind_s = 0.0
        self._next = start + modelled_s / self.time_scale
        wait = self._next - now
        if wait > 0:
            self.sleep(wait)
        return max(0.0, wait)


class SimulatedRunner:
    """A :class:`~worker.engine.runner.ModelRunner` whose steps take the latency model's time."""

    def __init__(self, latency: LatencyModel, time_scale: float = 1.0, output_len: int = 256,
                 eos_token_id: int = BYTE_EOS_ID, clock: VirtualClock | None = None) -> None:
        self.latency = latency
        self.output_len = output_len
        self.eos_token_id = eos_token_id
        self.clock = clock or VirtualClock(time_scale)
        self.steps = 0
        self.lora_slots: dict[int, LoRAAdapter] = {}  # what the engine loaded into each slot
        self._previous: set[str] = set()  # the request ids of the last step
        self.kv_block_bytes = 0  # one KV block on one GPU (set by build_simulated_engine): tier copies

    def lora_params(self, adapter: LoRAAdapter) -> int:
        """The adapter's parameters on the simulated model (its rank and targets, the profile's shapes)."""
        return self.latency.model.lora_params(adapter.rank, adapter.target_modules)

    def shape(self, batch: ScheduledBatch) -> StepShape:
        """The latency model's view of a batch (after its LoRA slot loads)."""
        shape = StepShape()
        active: set[int] = set()
        for s in batch.seqs:
            if s.is_prefill:
                shape.add_prefill(s.num_scheduled_tokens, s.num_computed_tokens, s.samples)
            else:
                shape.add_decode(s.context_len)
            if s.lora_slot:
                shape.add_lora(s.num_scheduled_tokens, self.lora_params(self.lora_slots[s.lora_slot]))
                active.add(s.lora_slot)
        for slot in active:
            shape.add_lora_weights(self.latency.lora_bytes(self.lora_params(self.lora_slots[slot])))
        return shape

    def read_lora(self, name: str, path: str, max_rank: int) -> LoRAAdapter:
        """Read a PEFT adapter's metadata and sleep its modelled disk read (scaled)."""
        adapter = read_peft_adapter(name, path, max_rank=max_rank)
        self.clock.sleep(self.latency.lora_disk_load_time(self.lora_params(adapter)) / self.clock.time_scale)
        adapter.weights = {}  # resident: the simulator needs no tensors
        return adapter

    def token_for(self, output_index: int, ignore_eos: bool = False) -> int:
        """The deterministic token at output position ``output_index``.

        EOS at ``output_len - 1`` unless the request ignores EOS (then the text goes on, as a
        model asked to ignore EOS would be made to).
        """
        if output_index >= self.output_len - 1 and not ignore_eos:
            return self.eos_token_id
        return SIM_TEXT[output_index % len(SIM_TEXT)]

    def next_token(self, seq: ScheduledSequence) -> int:
        """The token ``seq`` samples this step (the fixed text; the recorded-answer mode overrides)."""
        return self.token_for(seq.num_output_tokens, seq.sampling_params.ignore_eos)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Sleep the step's modelled time, then sample one token per sampling sequence.

        The output's ``step_s`` is the modelled time over the time scale: what the engine
        measures its speed with. Its own wall-clock timing would be wrong both ways -- a step
        whose sleep was skipped to catch up the virtual clock looks instantaneous (absurd
        speeds), one delayed by CPU contention looks slow.
        """
        loads = 0.0
        for slot, adapter in batch.lora_loads:
            self.lora_slots[slot] = adapter
            loads += self.latency.lora_slot_load_time(self.lora_params(adapter))
        # The CPU KV tier's copies (stores, then loads) at the profile's host <-> device rate.
        rate = self.latency.gpu.host_to_device_bandwidth
        kv_load = len(batch.kv_loads) * self.kv_block_bytes / rate
        kv_copy = kv_load + len(batch.kv_stores) * self.kv_block_bytes / rate
        modelled = self.latency.step_time(self.shape(batch)) + loads + kv_copy
        ids = {s.request_id for s in batch.seqs}
        self.clock.advance(modelled, continuing=not ids.isdisjoint(self._previous))
        self._previous = ids
        self.steps += 1
        scale = self.clock.time_scale
        out = RunnerOutput(step_s=modelled / scale, lora_load_s=loads / scale, kv_load_s=kv_load / scale,
                           kv_copy_s=kv_copy / scale)
        for s in batch.seqs:
            if not s.samples:
                continue
            token = self.next_token(s)
            out.sampled_token_ids[s.request_id] = token
            k = s.sampling_params.logprobs
            if k is not None:
                # The simulated distribution puts all mass on its token.
                top = [(token, 0.0)] + [((token + i) % 256, IMPOSSIBLE_LOGPROB) for i in range(1, k)]
                out.logprobs[s.request_id] = TokenLogprob(token, 0.0, top[:k])
        return out


class RecordedAnswerRunner(SimulatedRunner):
    """The latency model's timing, and each prompt's recorded answer as the output tokens.

    At a request's first sampling step its prompt is decoded and looked up in ``answers``;
    the answer's tokens follow one per decode step, then EOS (past the answer, a request that
    ignores EOS gets the fixed text). Logprobs stay the point mass of :class:`SimulatedRunner`:
    this replay *is* deterministic, and nothing else would be honest — the recorded models'
    own logprobs were not recorded (docs: "Cost accounting and judges").
    """

    def __init__(self, answers: RecordedAnswers, latency: LatencyModel, tokenizer: ByteTokenizer,
                 time_scale: float = 1.0, output_len: int = 256, clock: VirtualClock | None = None) -> None:
        super().__init__(latency, time_scale, output_len, tokenizer.eos_token_id or BYTE_EOS_ID, clock)
        self.answers = answers
        self.tokenizer = tokenizer
        self._tokens: dict[str, list[int]] = {}

    def answer_tokens(self, prompt_token_ids: list[int]) -> list[int] | None:
        """The recorded answer's tokens for a prompt, or None when it was not recorded."""
        text = self.answers.find(self.tokenizer.decode(prompt_token_ids))
        return None if text is None else self.tokenizer.encode(text, add_bos=False)

    def next_token(self, seq: ScheduledSequence) -> int:
        tokens = self._tokens.get(seq.request_id)
        if tokens is None:
            tokens = self._tokens[seq.request_id] = self.answer_tokens(seq.prompt_token_ids) or []
        k = seq.num_output_tokens
        if k < len(tokens):
            return tokens[k]
        if seq.sampling_params.ignore_eos:
            return SIM_TEXT[(k - len(tokens)) % len(SIM_TEXT)]
        return self.eos_token_id

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        for rid in batch.finished_request_ids:
            self._tokens.pop(rid, None)
        return super().execute(batch)


def nominal_speed(latency: LatencyModel) -> tuple[float, float]:
    """The profile's speed in the units the engine measures: (prefill work/s, decode step s).

    The latency model's cold 2,048-token prefill expressed as linear-equivalent tokens per
    second (:func:`worker.engine.stats.prefill_work`), and its decode step at batch 1, 1,024 context.
    """
    tokens = 2048
    return prefill_work([(tokens, 0)]) / latency.prefill_time(tokens), latency.decode_step_time(1, 1024)


def build_simulated_engine(gpu: str, model: str, *, tp: int | None = None, time_scale: float = 1.0,
                           block_size: int = 16, num_kv_blocks: int | None = None,
                           kv_memory_bytes: int | None = None,
                           max_num_seqs: int = SIM_MAX_NUM_SEQS,
                           max_num_batched_tokens: int = SIM_MAX_NUM_BATCHED_TOKENS,
                           max_model_len: int | None = None, output_len: int = 256,
                           seed: int = 0, answers: RecordedAnswers | None = None,
                           enable_lora: bool = False, max_loras: int = 4, max_cpu_loras: int | None = None,
                           max_lora_rank: int = 16, served_model_names: Iterable[str] = (),
                           cpu_kv_blocks: int | None = None, cpu_kv_memory_bytes: int | None = None,
                           cpu_kv_store_policy: str = "write_back", cpu_kv_min_hits: int = 2,
                           cpu_kv_load_bytes_per_s: float | None = None,
                           ) -> tuple[LLMEngine, SimulatedRunner]:
    """An LLMEngine on a simulated ``model`` over ``tp`` x ``gpu`` (profile names).

    KV capacity is the latency model's unless ``num_kv_blocks`` (or ``kv_memory_bytes`` of KV
    cache per GPU) overrides it. The engine reports
    the profile's nominal speed (scaled by ``time_scale``) until it has measured its own steps.
    With ``answers`` the outputs are those recorded answers (:class:`RecordedAnswerRunner`).
    With ``enable_lora`` it serves adapters as the real engine does (slots, host tier), costed by
    the latency model. With ``cpu_kv_blocks`` (or ``cpu_kv_memory_bytes`` of host memory per
    GPU) it has a CPU KV tier whose copies cost the GPU profile's host <-> device bandwidth.
    """
    latency = LatencyModel(get_gpu(gpu), get_model(model), tp=tp)
    blocks = num_kv_blocks or latency.kv_capacity_blocks(block_size)
    if kv_memory_bytes and not num_kv_blocks:
        per_gpu_token = latency.model.kv_bytes_per_token / latency.tp
        blocks = int(kv_memory_bytes // per_gpu_token) // block_size
    prefill_tps, decode_s = nominal_speed(latency)
    config = EngineConfig(
        model=None, block_size=block_size, num_kv_blocks=blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len or latency.model.max_model_len, seed=seed,
        default_prefill_tokens_per_s=prefill_tps * time_scale,
        default_decode_step_s=decode_s / time_scale, enable_lora=enable_lora, max_loras=max_loras,
        max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank,
        cpu_kv_blocks=cpu_kv_blocks, cpu_kv_memory_bytes=cpu_kv_memory_bytes,
        cpu_kv_store_policy=cpu_kv_store_policy, cpu_kv_min_hits=cpu_kv_min_hits,
        cpu_kv_load_bytes_per_s=(cpu_kv_load_bytes_per_s or latency.gpu.host_to_device_bandwidth) * time_scale)
    tokenizer = ByteTokenizer()
    runner = (SimulatedRunner(latency, time_scale=time_scale, output_len=output_len) if answers is None else
              RecordedAnswerRunner(answers, latency, tokenizer, time_scale=time_scale, output_len=output_len))
    runner.kv_block_bytes = latency.model.kv_bytes_per_token * block_size // latency.tp  # one GPU's shard
    reader = functools.partial(runner.read_lora, max_rank=max_lora_rank)
    engine = LLMEngine(config, runner=runner, tokenizer=tokenizer, lora_reader=reader,
                       served_model_names=served_model_names)
    return engine, runner
