"""The fleet simulator with CPU KV tiers: ``FleetConfig.cpu_kv_ratio`` gives each simulated worker
the engine's tier (``bench/sim/fleet.py``).

(That a simulated replica with a tier schedules, loads and stores exactly what the engine does is
``tests/unit/test_sim_engine_parity.py``'s.)"""
from __future__ import annotations

from bench.routing_report import ReportPlan, _fleet
from bench.sim.fleet import FleetConfig, simulate
from bench.stats import summarize
from bench.workloads import load_workload

def test_a_cpu_tier_keeps_the_prefixes_hbm_evicts_and_cuts_the_prefill_work():
    # 20 documents x 10 questions on 4 workers whose HBM holds 24K tokens each: documents are
    # evicted between their questions; a tier of 4x the HBM keeps them.
    workload = load_workload("doc-qa", seed=0, num_requests=400)
    runs = {}
    for ratio in (0.0, 4.0):
        result = simulate(workload, FleetConfig(workers=4, unit=64, kv_blocks=1500, cpu_kv_ratio=ratio))
        runs[ratio] = (summarize(result.records), result.meta)
    (plain, plain_meta), (tiered, meta) = runs[0.0], runs[4.0]
    assert plain_meta["kv_tier"] is None
    tier = meta["kv_tier"]
    assert tier["blocks_per_worker"] == 4 * 1500 * 16 // 64
    assert tier["loaded_tokens"] > 0 and tier["stored_blocks"] > 0
    assert tier["bytes_moved"] == (tier["loaded_blocks"] + tier["stored_blocks"]) * 64 * 128 * 1024
    assert tiered["hit_rate"] > plain["hit_rate"] + 0.5
    assert meta["prefill_tokens_computed"] < plain_meta["prefill_tokens_computed"] / 2
    assert tiered["errors"] == plain["errors"] == 0
    assert tiered["ttft_ms"]["p50"] < plain["ttft_ms"]["p50"]


def test_the_routing_report_gives_every_simulated_fleet_the_tier_it_is_asked_for():
    plan = ReportPlan(cpu_kv_ratio=4.0)
    assert _fleet(plan, 8, 512, 1.0).cpu_kv_ratio == 4.0
    assert _fleet(plan, 8, 512, 1.0, upper_bound=True).cpu_kv_ratio == 4.0
    assert _fleet(ReportPlan(), 8, 512, 1.0).cpu_kv_ratio == 0.0
