"""End to end: a short replay through the real router in front of 4 simulated workers.

Real processes over loopback, real Redis (workers publish KV events and load reports), the
bench's own load generator as the client. 24 tenants share 1,024-token system prompts and each
worker's KV pool holds about 7 of them: round-robin makes every worker cycle through all 24
(LRU thrash), cache_aware keeps each tenant on one worker.
"""
from __future__ import annotations

import asyncio

from bench.cluster import cluster
from bench.loadgen import LoadConfig, run_load
from bench.stats import summarize
from bench.workloads import load_workload

TIME_SCALE = 20.0


def _replay(tmp_path, policy: str, redis_url: str, prefix: str) -> dict:
    workload = load_workload("system-prompt", seed=3, num_requests=300, options=[
        "tenants=24", "zipf=0", "rate=10", "system_tokens=1024", "question_tokens=32-64", "output_tokens=4-8"])
    with cluster(tmp_path / policy) as c:
        workers = c.workers(4, TIME_SCALE, kv_blocks=500, redis=redis_url, redis_prefix=prefix)
        router = c.router(workers, policy, redis=redis_url, redis_prefix=prefix)
        records = asyncio.run(run_load(workload, LoadConfig(router.url, time_scale=TIME_SCALE, progress=False)))
    return summarize(records, fleet=[f"sim-{i}" for i in range(4)])


def test_cache_aware_routing_beats_round_robin_on_hit_rate_through_the_real_router(
        tmp_path, redis_server_url, redis_prefix):
    rr = _replay(tmp_path, "round_robin", redis_server_url, redis_prefix + "rr:")
    ca = _replay(tmp_path, "cache_aware", redis_server_url, redis_prefix + "ca:")
    for s in (rr, ca):
        assert s["requests"] == 300 and s["errors"] == 0
        assert s["prompt_tokens"] > 300 * 1024
    # Round-robin spreads requests evenly over the four workers.
    assert sorted(v["requests"] for v in rr["per_worker"].values()) == [75, 75, 75, 75]
    assert ca["hit_rate"] > rr["hit_rate"] + 0.3, (ca["hit_rate"], rr["hit_rate"])
