"""The fleet simulator's replica schedules exactly what the engine schedules.

The engine's real :class:`~worker.engine.scheduler.Scheduler` (inside an ``LLMEngine`` with the
simulated runner, so no model runs) and ``bench.sim``'s reference :class:`SimWorker` get the same
small deterministic workload: prompts sharing system prompts, arriving while earlier ones run,
in a pool and a token budget small enough to chunk prefills and preempt. Both must produce the
same steps (which requests, how many new tokens each, prefill or decode: the engine calls a
preempted request's recompute a decode once it is down to its last token), the same step
durations, the same cached tokens per request, the same preemptions and the same KV events.

Two differences are by design (``bench/sim/worker.py``'s docstring), so the workload is chosen
to make the comparison exact rather than approximate:

- the simulator's block is ``unit`` tokens: the engine runs with ``block_size = unit`` (16), and
  the simulated requests carry the engine's own block hashes of the same token ids;
- the simulator never hashes generated tokens, the engine registers every full block it wrote:
  every request has ``prompt_len % 16 + max_tokens - 1 < 16``, so its computed tokens never fill
  a block past its prompt's full ones and the engine registers no generated block either.

With a CPU KV tier on both sides (the engine's :class:`KVTier` in each), the same holds: the
same loads, the same write-back stores (as ``cpu`` KV events), the same copy time in each step.

Decode runs (closed-form runs of decode steps) are off: the comparison is step by step. The
fast :class:`AggregateWorker` (which keeps decoding requests as aggregates, so its steps list
only the other chunks) is held to everything but the per-request step lists.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from bench.sim.aggregate import AggregateWorker
from bench.sim.worker import SimRequest, SimWorker, is_decode
from worker.engine.config import EngineConfig
from worker.engine.kv_cache import BlockRemoved, BlockStored, hash_request_blocks
from worker.engine.kv_cache.kv_tier import KVTier
from worker.engine.llm_engine import LLMEngine
from worker.engine.runner import RunnerOutput, ScheduledBatch
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus
from worker.simulator.latency import LatencyModel
from worker.simulator.profiles import get_gpu, get_model
from worker.simulator.runner import SimulatedRunner, VirtualClock

UNIT = 16
NUM_BLOCKS = 10
MAX_NUM_SEQS = 6
MAX_NUM_BATCHED_TOKENS = 48
TIER_BLOCKS = 24
BLOCK_BYTES = 2 * 1024 * 1024  # Llama-3-8B's KV of 16 tokens


@dataclass(frozen=True)
class Arrival:
    """A request that arrives while step ``step`` runs (the first one: on an idle replica)."""

    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int


def _workload(seed: int, num_requests: int = 30) -> list[Arrival]:
    rng = random.Random(seed)
    systems = [[rng.randrange(256) for _ in range(UNIT * k)] for k in (2, 3, 4)]  # shared whole blocks
    out = []
    for i in range(num_requests):
        prompt = list(rng.choice(systems)) + [rng.randrange(256) for _ in range(rng.randint(0, 40))]
        tail = len(prompt) % UNIT
        max_tokens = rng.randint(1, UNIT - tail)  # tail + max_tokens - 1 < UNIT: no generated block fills
        out.append(Arrival(step=0 if i == 0 else (i - 1) // 2, request_id=f"r{i}", prompt=prompt,
                           max_tokens=max_tokens))
    return out


def _latency() -> LatencyModel:
    return LatencyModel(get_gpu("H100-80G"), get_model("llama-3-8b"))


class _RecordingRunner(SimulatedRunner):
    """The simulated runner, keeping each step's shape and modelled duration."""

    def __init__(self, latency: LatencyModel) -> None:
        super().__init__(latency, clock=VirtualClock(sleep=lambda s: None))
        self.steps_seen: list[list[tuple[str, int, bool]]] = []
        self.split: list[tuple[int, int]] = []  # (prefill tokens, decoding sequences): the speed meter's view
        self.durations: list[float] = []

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self.steps_seen.append([(s.request_id, s.num_scheduled_tokens, s.is_prefill) for s in batch.seqs])
        self.split.append((batch.num_prefill_tokens, batch.num_decode_seqs))
        before = self.clock.modelled_s
        out = super().execute(batch)
        self.durations.append(self.clock.modelled_s - before)
        return out


def _run_engine(arrivals: list[Arrival], tier_blocks: int = 0) -> dict:
    runner = _RecordingRunner(_latency())
    runner.kv_block_bytes = BLOCK_BYTES
    config = EngineConfig(model=None, block_size=UNIT, num_kv_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS,
                          max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, cpu_kv_blocks=tier_blocks,
                          cpu_kv_load_bytes_per_s=_latency().gpu.host_to_device_bandwidth)
    engine = LLMEngine(config, runner=runner)
    pending = list(arrivals)
    cached: dict[str, int] = {}

    def arrive(step: int) -> None:
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.request_id, a.prompt, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True))

    first = pending.pop(0)
    engine.add_request(first.request_id, first.prompt,
                       SamplingParams(max_tokens=first.max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length" and len(out.token_ids) == _max_tokens(arrivals, out.request_id)
                cached[out.request_id] = out.num_cached_tokens
        assert pending == [] or engine.has_unfinished_requests(), "the workload must keep the replica busy"
        arrive(len(runner.steps_seen) - 1)
    return {"steps": runner.steps_seen, "split": runner.split, "durations": runner.durations, "cached_tokens": cached,
            "preemptions": engine.scheduler.num_preemptions, "kv_events": _engine_events(engine),
            "tier": engine.kv_tier.stats().counters if engine.kv_tier is not None else None}


def _max_tokens(arrivals: list[Arrival], request_id: str) -> int:
    return next(a.max_tokens for a in arrivals if a.request_id == request_id)


def _engine_events(engine: LLMEngine) -> list[tuple[str, list[int], str]]:
    kinds = {BlockStored: "stored", BlockRemoved: "removed"}
    return [(kinds[type(e)], e.block_hashes, e.medium) for e in engine.take_kv_events()]


def _run_sim(arrivals: list[Arrival], cls: type[SimWorker] = SimWorker, tier_blocks: int = 0) -> dict:
    tier = (KVTier(tier_blocks, UNIT, BLOCK_BYTES, load_bytes_per_s=_latency().gpu.host_to_device_bandwidth)
            if tier_blocks else None)
    worker = cls("w", _latency(), num_blocks=NUM_BLOCKS, unit=UNIT, max_num_seqs=MAX_NUM_SEQS,
                 max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, decode_runs=False, tier=tier)
    requests = [SimRequest(i, 0.0, hash_request_blocks(a.prompt, UNIT, 0), len(a.prompt), a.max_tokens)
                for i, a in enumerate(arrivals)]
    steps: list[list[tuple[str, int, bool]]] = []
    split: list[tuple[int, int]] = []
    durations: list[float] = []
    tail_decodes = 0  # recomputes down to their last token (decodes, as the engine labels them)
    pending = list(zip(arrivals, requests))
    now = 0.0
    end = worker.add(pending.pop(0)[1], now)
    while end is not None:
        # The step just started: what it computes, read before it is applied.
        steps.append([(f"r{req.index}", n, not is_decode(req, n)) for req, n in worker._batch])
        split.append(worker._step_work[:2])
        tail_decodes += sum(1 for req, n in worker._batch if req.prefill_left == 1 and is_decode(req, n))
        durations.append(end - now)
        while pending and pending[0][0].step <= len(steps) - 1:
            worker.add(pending.pop(0)[1], now)  # arrives while the step runs
        now = end
        end = worker.on_event(now)
    assert pending == [], "the workload must keep the replica busy"
    assert all(r.num_output == r.max_tokens and r.finished_at is not None for r in requests)
    return {"steps": steps, "split": split, "durations": durations,
            "cached_tokens": {f"r{r.index}": r.cached_tokens for r in requests},
            "preemptions": worker.num_preemptions, "kv_events": worker.take_kv_events(),
            "tail_decodes": tail_decodes, "tier": tier.stats().counters if tier is not None else None}


SEEDS = range(4)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_simulated_replica_schedules_exactly_the_steps_the_engines_scheduler_does(seed):
    arrivals = _workload(seed)
    engine, sim = _run_engine(arrivals), _run_sim(arrivals)
    assert sim["steps"] == engine["steps"]
    assert sim["split"] == engine["split"]
    assert sim["durations"] == engine["durations"]  # same shapes, so the same latency-model floats
    assert sim["cached_tokens"] == engine["cached_tokens"]
    assert sim["preemptions"] == engine["preemptions"]
    assert sim["kv_events"] == engine["kv_events"]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_aggregate_replica_matches_the_engines_scheduler_too(seed):
    arrivals = _workload(seed)
    engine, sim = _run_engine(arrivals), _run_sim(arrivals, AggregateWorker)
    for key in ("split", "durations", "cached_tokens", "preemptions", "kv_events"):
        assert sim[key] == engine[key], key


def _prefilling(step: list[tuple[str, int, bool]]) -> set[str]:
    return {rid for rid, _, prefill in step if prefill}


def test_the_parity_workload_shares_prefixes_chunks_prefills_and_preempts():
    # What makes the comparison above worth something: in every seed's run, cache hits, prompts
    # prefilled over consecutive steps (chunks) and preemptions; in some, a recompute that ends
    # as a decode.
    tail_decodes = 0
    for seed in SEEDS:
        engine, sim = _run_engine(_workload(seed)), _run_sim(_workload(seed))
        steps = engine["steps"]
        assert sum(engine["cached_tokens"].values()) > 0
        assert any(_prefilling(a) & _prefilling(b) for a, b in zip(steps, steps[1:]))
        assert engine["preemptions"] > 0
        tail_decodes += sim["tail_decodes"]
    assert tail_decodes > 0


@pytest.mark.parametrize("cls", [SimWorker, AggregateWorker])
def test_a_running_recompute_down_to_its_last_token_is_a_decode_in_both(cls):
    # The workloads above reach this label only through admission (cache hits leave one token);
    # a recompute chunked down to its last token is rarer, so its state is built directly: 20
    # prompt tokens, 3 generated, all but the last of the 23 computed again, running alone.
    config = EngineConfig(model=None, block_size=UNIT, num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = Scheduler(config, num_blocks=8)
    seq = Sequence("r0", list(range(20)), SamplingParams(max_tokens=8))
    seq.token_ids += [7, 8, 9]
    assert scheduler.kv_cache_manager.allocate_slots(seq, 22)
    seq.num_computed_tokens, seq.status = 22, SequenceStatus.RUNNING
    scheduler.requests["r0"] = seq
    scheduler.running.append(seq)
    batch = scheduler.schedule()

    worker = cls("w", _latency(), num_blocks=8, unit=UNIT, max_num_seqs=4, max_num_batched_tokens=64,
                 decode_runs=False)
    req = SimRequest(0, 0.0, [], num_prompt=20, max_tokens=8)
    req.num_output = 3
    assert worker.kv.allocate_slots(req, 22)
    req.num_computed_tokens, req.prefill_left = 22, 1
    worker.running.append(req)
    worker.running_tokens = req.num_tokens
    worker._start_step(0.0)

    assert [(s.num_scheduled_tokens, s.is_prefill) for s in batch.seqs] == [(1, False)]
    assert worker._step_work[:2] == (batch.num_prefill_tokens, batch.num_decode_seqs) == (0, 1)


@pytest.mark.parametrize("cls", [SimWorker, AggregateWorker])
@pytest.mark.parametrize("seed", SEEDS)
def test_with_a_cpu_tier_the_replica_loads_and_stores_what_the_engine_does(seed, cls):
    arrivals = _workload(seed)
    engine = _run_engine(arrivals, tier_blocks=TIER_BLOCKS)
    sim = _run_sim(arrivals, cls, tier_blocks=TIER_BLOCKS)
    for key in ("split", "durations", "cached_tokens", "preemptions", "kv_events", "tier"):
        assert sim[key] == engine[key], key
    if cls is SimWorker:
        assert sim["steps"] == engine["steps"]
    # worth comparing: the tier was used, and it changed what was computed
    assert engine["tier"].loaded_tokens > 0 and engine["tier"].stored_blocks > 0
    assert sum(engine["cached_tokens"].values()) > sum(_run_engine(arrivals)["cached_tokens"].values())
