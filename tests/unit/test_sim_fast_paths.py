"""The fleet simulator's fast paths give the reference's results: the aggregate worker exactly (same
floats, same KV events, same routing) on small cases built to exercise preemption, chunked
prefill, prefix hits and closed-form decode runs; a decode run's speed update equals observing
its steps one by one (up to float rounding); the lazy block pool and the memoised unit hashes
equal the engine's pool and the workloads' hashes."""
from __future__ import annotations

import random

import pytest

from bench.sim.aggregate import AggregateWorker, make_worker
from bench.sim.decode_run import decode_run_cut, decode_run_time, decode_steps_done_by, observe_decode_run
from bench.sim.lazy_pool import LazyBlockPool
from bench.sim.prompt_hashes import UnitHasher
from bench.sim.fleet import FleetConfig, simulate
from bench.sim.router import SimRouter, SimRouterConfig
from bench.sim.worker import SimRequest, SimWorker
from bench.workloads import load_workload, unit_hashes
from worker.engine.kv_cache import BlockPool
from worker.simulator.latency import LatencyModel
from worker.simulator.profiles import get_gpu, get_model
from worker.engine.stats import SpeedMeter, engine_speed_meter

MOONCAKE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"


def _latency() -> LatencyModel:
    return LatencyModel(get_gpu("H100-80G"), get_model("llama-3-8b"))


def _comparable(result) -> tuple:
    meta = dict(result.meta, fleet=dict(result.meta["fleet"]))
    meta.pop("wall_s")
    meta["fleet"].pop("aggregate")
    return result.records, meta


@pytest.mark.parametrize("workload, fleet", [
    # A pool too small for the trace's working set: preemptions of decoding requests.
    (f"mooncake:{MOONCAKE}", dict(workers=2, kv_blocks=9000, speedup=0.5)),
    (f"mooncake:{MOONCAKE}", dict(workers=2, kv_blocks=9000, speedup=0.5, decode_runs=False)),
    # Growing histories in 64-token blocks: decodes cross block boundaries, sessions, preemptions.
    ("multi-turn", dict(workers=4, unit=64, kv_blocks=3000, speedup=4.0)),
    # Small budget and batch: chunked prefills behind decodes, the router's in-flight limit.
    ("system-prompt", dict(workers=2, unit=64, kv_blocks=700, max_num_seqs=64, max_num_batched_tokens=1024,
                           speedup=5.0)),
])
def test_the_aggregate_worker_gives_exactly_the_reference_workers_results(workload, fleet):
    wl = load_workload(workload, seed=2, num_requests=400)
    reference = simulate(wl, FleetConfig(aggregate=False, **fleet))
    aggregate = simulate(wl, FleetConfig(aggregate=True, **fleet))
    assert _comparable(aggregate) == _comparable(reference)
    if workload.startswith("mooncake"):
        assert reference.meta["preemptions"] > 0  # the case is tight enough to matter


def _replay(worker: SimWorker, arrivals: list[tuple[float, int, list[int], int, int]]) -> list[tuple]:
    """Drive one worker through ``arrivals``; everything it exposes, after every call."""
    log: list[tuple] = []
    nxt: float | None = None
    pending = list(arrivals)
    while pending or nxt is not None:
        if nxt is not None and (not pending or nxt <= pending[0][0]):
            now = nxt
            nxt = worker.on_event(now)
            log.append((now, nxt, [r.index for r in worker.take_finished()],
                        [r.index for r in worker.take_first_tokens()], worker.take_kv_events()))
        else:
            t, i, hashes, prompt, max_tokens = pending.pop(0)
            started = worker.add(SimRequest(i, t, hashes, prompt, max_tokens), t)
            nxt = started if started is not None else nxt
        log.append((len(worker.running), len(worker.waiting), worker.running_tokens,
                    worker.queued_prefill_tokens, worker.pool.get_num_free_blocks(), worker.num_preemptions,
                    worker.speed.prefill_tokens_per_s, worker.speed.decode_step_s))
    return log


@pytest.mark.parametrize("seed", range(6))
def test_a_lone_aggregate_worker_matches_the_reference_event_by_event_under_preemption(seed):
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for i in range(80):
        t += rng.expovariate(30.0)
        prompt = rng.randint(40, 420)
        hashes = [rng.randint(1, 4)] + [rng.randint(10, 10**9) for _ in range(5)]  # 4 shared first blocks
        arrivals.append((t, i, hashes[:prompt // 64], prompt, rng.randint(1, 160)))
    lm = _latency()
    shape = dict(num_blocks=24, unit=64, max_num_seqs=12, max_num_batched_tokens=256)
    reference, aggregate = SimWorker("w", lm, **shape), AggregateWorker("w", lm, **shape)
    assert _replay(aggregate, arrivals) == _replay(reference, arrivals)
    assert reference.num_preemptions > 0
    aggregate.pool.check_invariants()


class _CalledLatency(LatencyModel):
    """A LatencyModel whose step_time a worker calls (its written-out form is only for the exact
    type), counting the calls."""
    calls = 0

    def step_time(self, shape):
        type(self).calls += 1
        return super().step_time(shape)


@pytest.mark.parametrize("cls", [SimWorker, AggregateWorker])
@pytest.mark.parametrize("seed", range(3))
def test_a_workers_written_out_step_time_is_the_latency_models_to_the_bit(cls, seed):
    rng = random.Random(100 + seed)
    arrivals, t = [], 0.0
    for i in range(60):
        t += rng.expovariate(40.0)
        prompt = rng.randint(30, 500)
        hashes = [rng.randint(1, 3)] + [rng.randint(10, 10**9) for _ in range(7)]
        arrivals.append((t, i, hashes[:prompt // 64], prompt, rng.randint(1, 120)))
    shape = dict(num_blocks=30, unit=64, max_num_seqs=10, max_num_batched_tokens=320)
    gpu, model = get_gpu("H100-80G"), get_model("llama-3-8b")
    written, called = cls("w", LatencyModel(gpu, model), **shape), cls("w", _CalledLatency(gpu, model), **shape)
    assert written._flops_tok is not None and called._flops_tok is None
    _CalledLatency.calls = 0
    assert _replay(written, arrivals) == _replay(called, arrivals)  # event times compared as floats, exactly
    assert _CalledLatency.calls > 20


def test_make_worker_uses_the_reference_when_decodes_may_not_fit_a_steps_budget():
    lm = _latency()
    assert type(make_worker("a", lm, 10, 64, max_num_seqs=256, max_num_batched_tokens=8192)) is AggregateWorker
    assert type(make_worker("b", lm, 10, 64, max_num_seqs=512, max_num_batched_tokens=256)) is SimWorker
    assert type(make_worker("c", lm, 10, 64, 256, 8192, aggregate=False)) is SimWorker


@pytest.mark.parametrize("cls", [SimWorker, AggregateWorker])
def test_a_request_left_with_one_prompt_token_is_still_prefilling_not_decoding(cls):
    # Step 2 runs a's last decode and 199 of b's 200 prompt tokens (the budget is 200); a then
    # finishes, leaving b alone with 1 prompt token to go: its next step emits its first token.
    lm = _latency()
    w = cls("w", lm, num_blocks=100, unit=64, max_num_seqs=8, max_num_batched_tokens=200)
    a = SimRequest(0, 0.0, [], num_prompt=10, max_tokens=2)
    b = SimRequest(1, 0.0, [], num_prompt=200, max_tokens=10)
    t = w.add(a, 0.0)
    w.add(b, t / 2)
    ends = []
    while t is not None:
        ends.append(t)
        t = w.on_event(t)
    assert a.finished_at == ends[1]
    assert b.first_token_at == ends[2] and b.num_output == 10 and b.prefill_left == 0


def _stepped_meter(est: float, measured: bool, steps: list[float], batch: int) -> SpeedMeter:
    meter = engine_speed_meter(40000.0, est, 8192)
    meter.decode_measured = measured
    for t in steps:
        meter.observe(t, 0, batch)
    return meter


@pytest.mark.parametrize("seed", range(4))
def test_a_decode_runs_speed_update_equals_observing_its_steps_one_by_one(seed):
    rng = random.Random(seed)
    for _ in range(500):
        oh, k, batch = 0.001, rng.randint(1, 300), rng.randint(1, 256)
        c0, m0 = rng.uniform(1e-4, 0.02), rng.uniform(1e-4, 0.02)
        c1, m1 = rng.choice([0.0, rng.uniform(0, 2e-5)]), rng.choice([0.0, rng.uniform(0, 2e-5)])
        est, measured = rng.uniform(0.002, 0.03), rng.random() < 0.8
        stepped = _stepped_meter(est, measured, [oh + max(c0 + c1 * i, m0 + m1 * i) for i in range(k)], batch)
        folded = engine_speed_meter(40000.0, est, 8192)
        folded.decode_measured = measured
        observe_decode_run(folded, oh, c0, c1, m0, m1, k, batch)
        assert folded.decode_measured
        assert folded.decode_step_s == pytest.approx(stepped.decode_step_s, rel=1e-13, abs=0)
        assert folded.prefill_tokens_per_s == stepped.prefill_tokens_per_s


def test_a_decode_run_far_from_the_estimate_is_folded_step_by_step_with_the_meters_clipping():
    # Three 0.5 s steps against an estimate of 10 ms: the first two samples are clipped to 10x
    # the estimate (0.1, then 0.28), the third is not: 0.01 -> 0.028 -> 0.0784 -> 0.16272.
    stepped = _stepped_meter(0.01, True, [0.5, 0.5, 0.5], 4)
    folded = engine_speed_meter(40000.0, 0.01, 8192)
    folded.decode_measured = True
    observe_decode_run(folded, 0.25, 0.25, 0.0, 0.0, 0.0, 3, 4)
    assert folded.decode_step_s == stepped.decode_step_s  # the same calls, bit for bit
    assert folded.decode_step_s == pytest.approx(0.16272, rel=1e-12)


def _drive_pool(pool, ops: list[tuple[float, float, int, int]], resets: bool = False) -> list[tuple]:
    """Random allocate / free / cache / hit operations (and, with ``resets``, prefix-cache resets
    and a freed block freed again); what the pool exposes after each, and every eviction with the
    free count the pool showed then."""
    held: list[list] = []
    log: list[tuple] = []
    pool.on_evict = lambda block: log.append(("evict", block.block_id, block.block_hash, pool.get_num_free_blocks()))
    for op, x, m, key in ops:
        if resets and op > 0.97:
            if op > 0.99 and held:
                blocks = held.pop(int(x * len(held)))
                pool.free_blocks(reversed(blocks))
                for block in [b for b in blocks if b.ref_cnt == 0][:1]:
                    with pytest.raises(RuntimeError) as freed_again:
                        pool.free_blocks([block])
                    log.append(("freed again", str(freed_again.value)))
                    block.ref_cnt = 0  # undone, to go on
            else:
                log.append(("reset", pool.reset_prefix_cache()))
        elif op < 0.4 and m <= pool.get_num_free_blocks():
            blocks = pool.get_new_blocks(m)
            held.append(blocks)
            log.append(("get", [b.block_id for b in blocks]))
        elif op < 0.6 and held:
            pool.free_blocks(reversed(held.pop(int(x * len(held)))))
        elif op < 0.8 and held:
            blocks = held[int(x * len(held))]
            pool.cache_blocks(blocks, [key * 100 + j for j in range(len(blocks))])
        elif (hit := pool.get_cached_block(key * 100)) is not None:
            pool.touch([hit])
            held.append([hit])
            log.append(("hit", hit.block_id))
        log.append((pool.get_num_free_blocks(), pool.free_block_queue.block_ids(),
                    [(type(e).__name__, getattr(e, "block_hashes", None)) for e in pool.take_events()]))
    return log


@pytest.mark.parametrize("seed", range(40))
def test_the_lazy_block_pool_hands_out_the_same_blocks_in_the_same_order_as_the_engines(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    ops = [(rng.random(), rng.random(), rng.randint(1, 5), rng.randint(0, 30)) for _ in range(300)]
    lazy = LazyBlockPool(n)
    assert _drive_pool(lazy, ops) == _drive_pool(BlockPool(n), ops)
    lazy.check_invariants()
    assert [b.block_id for b in lazy.blocks] == list(range(n))


@pytest.mark.parametrize("seed", range(40))
def test_the_lazy_block_pool_evicts_resets_and_fails_as_the_engines_does(seed):
    """The same, with each eviction's callback, resets of the prefix cache (after which the lazy
    pool's queue is the engine's own) and a block freed more often than it was taken."""
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    ops = [(rng.random(), rng.random(), rng.randint(1, 4), rng.randint(0, 8)) for _ in range(400)]
    lazy = LazyBlockPool(n)
    log = _drive_pool(lazy, ops, resets=True)
    assert log == _drive_pool(BlockPool(n), ops, resets=True)
    assert any(entry[0] == "evict" for entry in log)


def test_a_lazy_block_pool_makes_only_the_blocks_it_hands_out():
    pool = LazyBlockPool(1000)
    assert pool.get_num_free_blocks() == 1000 and pool.blocks == []
    first = pool.get_new_blocks(3)
    pool.free_blocks(reversed(first))  # plain blocks go back to the head, tail first
    assert [b.block_id for b in pool.get_new_blocks(4)] == [0, 1, 2, 3]
    assert len(pool.blocks) == 4 and pool.get_num_free_blocks() == 996


@pytest.mark.parametrize("workload, unit", [
    ("system-prompt", 512), ("system-prompt", 64), ("doc-qa", 64), ("multi-turn", 64),
    (f"mooncake:{MOONCAKE}", 512), (f"mooncake:{MOONCAKE}", 384)])
def test_the_memoised_unit_hashes_equal_the_workloads_own(workload, unit):
    hasher = UnitHasher(unit)
    specs = load_workload(workload, seed=3, num_requests=300).requests
    assert [hasher(s.segments) for s in specs] == [unit_hashes(s.segments, unit) for s in specs]
    entries = len(hasher._chains)
    assert [hasher(s.segments) for s in specs] == [unit_hashes(s.segments, unit) for s in specs]
    assert len(hasher._chains) == entries > 0  # the second pass is all lookups


def test_the_memoised_unit_hashes_cover_units_that_straddle_segments():
    hasher = UnitHasher(100, max_entries=3)
    rng = random.Random(7)
    for _ in range(500):
        segments = tuple((rng.randint(1, 6), rng.randint(1, 350)) for _ in range(rng.randint(0, 6)))
        assert hasher(segments) == unit_hashes(segments, 100)
    assert len(hasher._chains) <= 3


def test_steps_done_by_is_the_largest_step_count_whose_run_time_has_elapsed():
    rng = random.Random(11)
    for _ in range(2000):
        oh, k = 0.001, rng.randint(0, 300)
        c0, m0 = rng.uniform(0, 0.02), rng.uniform(0, 0.02)
        c1, m1 = rng.choice([0.0, rng.uniform(0, 1e-4)]), rng.choice([0.0, rng.uniform(0, 1e-4)])
        times = [decode_run_time(oh, c0, c1, m0, m1, m) for m in range(k + 1)]
        for elapsed in (0.0, rng.uniform(0, times[-1] * 1.2), times[rng.randint(0, k)]):
            expected = max(m for m in range(k + 1) if m == 0 or times[m] <= elapsed)
            assert decode_steps_done_by(elapsed, oh, c0, c1, m0, m1, k) == expected


def test_a_run_cut_after_its_step_in_progress_keeps_the_steps_begun_and_their_exact_run_time():
    # (m, the very float decode_run_time gives for m steps), None when the run would end anyway
    # (what SimWorker.add does to a run a new request joins); elapsed times on and around step
    # boundaries, before the run and past its end.
    rng = random.Random(12)
    cuts = 0
    for _ in range(2000):
        oh, k = 0.001, rng.randint(0, 300)
        c0, m0 = rng.uniform(0, 0.02), rng.uniform(0, 0.02)
        c1, m1 = rng.choice([0.0, rng.uniform(0, 1e-4)]), rng.choice([0.0, rng.uniform(0, 1e-4)])
        times = [decode_run_time(oh, c0, c1, m0, m1, m) for m in range(k + 1)]
        at = times[rng.randint(0, k)]
        for elapsed in (-1.0, 0.0, rng.uniform(0, times[-1] * 1.2), at, at * (1 - 1e-12), at * (1 + 1e-12)):
            done = max(m for m in range(k + 1) if m == 0 or times[m] <= elapsed)
            expected = (done + 1, times[done + 1]) if done + 1 < k else None
            assert decode_run_cut(elapsed, oh, c0, c1, m0, m1, k) == expected
            cuts += expected is not None
    assert cuts > 1000


@pytest.mark.parametrize("workload, fleet", [
    ("multi-lora", dict(workers=4, unit=64, cpu_kv_ratio=1.0, kv_blocks=3000, speedup=4.0)),  # adapters, a tier
    ("system-prompt", dict(workers=3, unit=64, router=SimRouterConfig(report_poll_s=0.0))),  # reports read at once
])
def test_a_refilled_load_report_equals_one_made_new(workload, fleet, monkeypatch):
    """The heartbeat writes each worker's report into its last one: every report the router reads
    equals the report made new from the same worker at the same moment, field for field."""
    refilled = SimRouter.refilled_report
    compared: list[str] = []

    def checked(self, worker, now, rate, step):
        report = refilled(self, worker, now, rate, step)
        assert report == SimRouter.make_report(worker, now, rate, step)
        compared.append(worker.worker_id)
        return report
    monkeypatch.setattr(SimRouter, "refilled_report", checked)

    result = simulate(load_workload(workload, seed=3, num_requests=300), FleetConfig(**fleet))

    assert all(r.ok for r in result.records)
    assert len(compared) > 4 * len(set(compared))  # most of them refilled, not first reports
