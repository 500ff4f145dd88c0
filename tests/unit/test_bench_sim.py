"""The fleet simulator: exact step times, the engine's cache rules, closed-form decode runs, the
router's own balancer, determinism, and the ``prefixlb sim`` / ``sweep`` commands."""
from __future__ import annotations

import json

import pytest

from bench.sim.fleet import FleetConfig, simulate
from bench.sim.router import SimRouterConfig
from bench.sim.worker import SimRequest, SimWorker
from bench.stats import summarize
from bench.workloads import load_workload
from prefixlb.commands import sim as sim_cmd
from prefixlb.commands import sweep as sweep_cmd
from worker.simulator.latency import LatencyModel, StepShape
from worker.simulator.profiles import get_gpu, get_model

MOONCAKE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"


def _latency() -> LatencyModel:
    return LatencyModel(get_gpu("H100-80G"), get_model("llama-3-8b"))


def _run_alone(worker: SimWorker, req: SimRequest, t0: float = 0.0) -> None:
    t = worker.add(req, t0)
    while t is not None:
        t = worker.on_event(t)


def test_a_decode_run_takes_exactly_the_sum_of_its_steps_in_both_roofline_regimes():
    lm = _latency()
    w = SimWorker("w", lm, num_blocks=100, unit=512)
    for batch, ctx in ((1, 1000), (200, 3000), (256, 200)):
        c0 = w._c_tok * batch + w._c_ctx * batch * ctx
        m0 = w._m_base + w._m_ctx * batch * ctx
        k = 300
        stepped = 0.0
        for i in range(k):
            shape = StepShape()
            for _ in range(batch):
                shape.add_decode(ctx + i)
            stepped += lm.step_time(shape)
        assert w._run_time(c0, w._c_ctx * batch, m0, w._m_ctx * batch, k) == pytest.approx(stepped, rel=1e-9)


def test_a_lone_request_prefills_in_budget_sized_chunks_then_decodes_step_by_step():
    lm = _latency()
    w = SimWorker("w", lm, num_blocks=200, unit=512, max_num_batched_tokens=8192)
    req = SimRequest(0, 0.0, block_hashes=[], num_prompt=20000, max_tokens=4)
    _run_alone(w, req)
    chunks = [(8192, 0, False), (8192, 8192, False), (3616, 16384, True)]
    ttft = 0.0
    for n, done, samples in chunks:
        shape = StepShape()
        shape.add_prefill(n, done, samples)
        ttft += lm.step_time(shape)
    decode = sum(lm.decode_step_time(1, 20000 + i) for i in range(1, 4))
    assert req.cached_tokens == 0
    assert req.first_token_at == pytest.approx(ttft, rel=1e-12)
    assert req.finished_at == pytest.approx(ttft + decode, rel=1e-12)


def test_a_repeated_prompt_reuses_all_full_blocks_but_the_one_holding_its_last_token():
    lm = _latency()
    w = SimWorker("w", lm, num_blocks=200, unit=512)
    hashes = list(range(1, 5))  # 4 full 512-token blocks
    first = SimRequest(0, 0.0, hashes, num_prompt=2048, max_tokens=2)
    _run_alone(w, first)
    again = SimRequest(1, 10.0, hashes, num_prompt=2048, max_tokens=2)
    _run_alone(w, again, 10.0)
    # 2048 tokens: the last token sits in block 3, so blocks 0..2 are reused.
    assert first.cached_tokens == 0 and again.cached_tokens == 1536
    assert again.first_token_at - 10.0 == pytest.approx(lm.prefill_time(512, 1536), rel=1e-12)
    w.pool.check_invariants()
    assert w.pool.get_num_free_blocks() == 200  # every block back in the free queue


def test_the_least_recently_used_prefix_is_evicted_first_tail_block_first():
    # 6 blocks; each 1100-token request holds 2 hashed blocks and 1 partial one. When c needs
    # 3 blocks, the free queue holds: two plain partial blocks, then b's tail block, then b's
    # head block, then a's (used most recently). c takes the two plain ones and b's tail.
    lm = _latency()
    w = SimWorker("w", lm, num_blocks=6, unit=512)
    a, b, c = [10, 11], [20, 21], [30, 31]
    for i, hashes in enumerate((a, b, a, c)):  # a is used again after b, so b is older
        _run_alone(w, SimRequest(i, float(i), hashes, num_prompt=1100, max_tokens=1), float(i))
    hits = {name: w.kv.get_computed_blocks(SimRequest(9, 9.0, h, 1100, 1))[1] for name, h in
            (("a", a), ("b", b), ("c", c))}
    assert hits == {"a": 1024, "b": 512, "c": 1024}


def test_closed_form_decode_runs_give_the_same_results_as_stepping_one_step_at_a_time():
    workload = load_workload(f"mooncake:{MOONCAKE}", num_requests=400)
    runs = []
    for decode_runs in (True, False):
        cfg = FleetConfig(workers=2, kv_blocks=9000, decode_runs=decode_runs, speedup=0.5,
                          router=SimRouterConfig(policy="cache_aware"))
        runs.append(simulate(workload, cfg))
    fast, slow = (r.records for r in runs)
    assert runs[0].meta["preemptions"] == runs[1].meta["preemptions"] > 0  # the pool is tight
    assert [(r.worker_id, r.cached_tokens, r.error) for r in fast] == \
           [(r.worker_id, r.cached_tokens, r.error) for r in slow]
    for f, s in zip(fast, slow):
        if f.ok:
            assert f.ttft_ms == pytest.approx(s.ttft_ms, rel=1e-9)
            assert f.e2e_ms == pytest.approx(s.e2e_ms, rel=1e-9)


def test_the_simulation_is_deterministic_and_every_request_is_accounted_for():
    workload = load_workload("multi-turn", seed=5, num_requests=600)
    cfg = FleetConfig(workers=4, unit=64, kv_blocks=3000, speedup=4.0)
    a, b = simulate(workload, cfg), simulate(workload, cfg)
    assert a.records == b.records
    assert len(a.records) == 600 and all(r.ok for r in a.records)
    assert all(r.ttft_ms > 0 and r.e2e_ms >= r.ttft_ms for r in a.records)


def test_cache_aware_routing_keeps_far_more_hits_than_round_robin_on_shared_system_prompts():
    workload = load_workload("system-prompt", seed=1, num_requests=1500, options=["tenants=16", "rate=40"])
    hit = {}
    for policy in ("round_robin", "cache_aware"):
        cfg = FleetConfig(workers=8, unit=64, kv_blocks=1200, router=SimRouterConfig(policy=policy))
        result = simulate(workload, cfg)
        hit[policy] = summarize(result.records)["hit_rate"]
        assert result.meta["reasons"].get(policy if policy == "round_robin" else "prefix", 0) > 0
    assert hit["cache_aware"] > hit["round_robin"] + 0.2


def test_the_router_sees_reports_at_its_poll_and_kv_events_and_first_bytes_after_their_delays():
    workload = load_workload("conversation", seed=0, num_requests=300)
    base = FleetConfig(workers=4, unit=512, kv_blocks=28531)
    lag = FleetConfig(workers=4, unit=512, kv_blocks=28531,
                      router=SimRouterConfig(report_interval_s=2.0, report_poll_s=4.0, kv_event_delay_s=0.5,
                                             hop_s=0.01))
    a, b = simulate(workload, base), simulate(workload, lag)
    assert simulate(workload, lag).records == b.records  # still deterministic
    assert a.records != b.records
    # The client pays two hops on every request: no TTFT below 20 ms with hops of 10 ms.
    assert min(r.ttft_ms for r in b.records) >= 20.0 > min(r.ttft_ms for r in a.records)
    assert all(r.ok for r in b.records)
    # Each delay on its own changes what the router decides (KV events matter once blocks are
    # evicted: a small pool; the optimistic inserts at dispatch stand in for late "stored" ones).
    def records(**delays):
        return simulate(workload, FleetConfig(workers=4, unit=512, kv_blocks=8000,
                                              router=SimRouterConfig(report_interval_s=2.0, **delays))).records
    plain = records()
    assert records(report_poll_s=4.0) != plain
    assert records(kv_event_delay_s=5.0) != plain


def test_with_no_delays_the_lag_model_changes_nothing():
    workload = load_workload("multi-turn", seed=5, num_requests=300)
    plain = FleetConfig(workers=4, unit=64, kv_blocks=3000, speedup=4.0)
    zero = FleetConfig(workers=4, unit=64, kv_blocks=3000, speedup=4.0,
                       router=SimRouterConfig(report_poll_s=0.0, kv_event_delay_s=0.0, hop_s=0.0))
    assert simulate(workload, plain).records == simulate(workload, zero).records


def test_the_upper_bound_is_one_worker_with_the_whole_fleets_capacity():
    workload = load_workload("doc-qa", seed=0, num_requests=200)
    result = simulate(workload, FleetConfig(workers=4, unit=64, kv_blocks=5000, upper_bound=True))
    assert list(result.meta["utilisation"]) == ["sim-0"]
    assert result.meta["kv_blocks_per_worker"] == 20000
    assert result.meta["tp"] == 4


def test_a_request_larger_than_the_kv_pool_is_an_error_not_a_hang():
    workload = load_workload("doc-qa", seed=0, num_requests=5, options=["document_tokens=9000"])
    result = simulate(workload, FleetConfig(workers=2, unit=64, kv_blocks=300))
    assert [r.error for r in result.records] == ["prompt and max_tokens do not fit the worker's KV cache"] * 5


def test_sim_and_sweep_commands_write_their_results(tmp_path, capsys):
    out = tmp_path / "run"
    rc = sim_cmd.main(["--workload", "system-prompt", "--num-requests", "200", "--workers", "4",
                       "--kv-blocks", "2000", "--out", str(out), "--label", "ca"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 200 and summary["errors"] == 0
    assert len(summary["per_worker"]) == 4
    rc = sweep_cmd.main(["--workload", "system-prompt", "--num-requests", "150", "--workers", "2",
                         "--affinities", "0,1", "--out", str(tmp_path / "sweep")])
    assert rc == 0
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [r["affinity"] for r in rows] == [0.0, 1.0]
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0
    assert sim_cmd.main(["--workload", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown workload" in capsys.readouterr().err
