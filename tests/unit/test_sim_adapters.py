"""LoRA adapters in the fleet simulator (bench/sim/lora.py): the engine's slot rules, load costs, the
disk read before queueing, and adapter-aware routing measured on the multi-lora workload."""
from __future__ import annotations

import pytest

from bench.sim.aggregate import AggregateWorker
from bench.sim.fleet import FleetConfig, simulate
from bench.sim.lora import SimLoRA
from bench.sim.router import SimRouterConfig
from bench.sim.worker import SimRequest, SimWorker
from bench.workloads import load_workload
from worker.simulator.latency import LatencyModel, StepShape
from worker.simulator.profiles import get_gpu, get_model


def _latency() -> LatencyModel:
    return LatencyModel(get_gpu("H100-80G"), get_model("llama-3-8b"))


def _drain(w: SimWorker, t: float | None, max_loras: int) -> list[float]:
    """Run ``w`` until idle; returns each step's end, checking the slot bound at every step."""
    ends = []
    while t is not None:
        assert w.lora.busy() <= max_loras
        assert len({r.lora_name for r in w.running if r.lora_name}) <= max_loras
        ends.append(t)
        t = w.on_event(t)
    return ends


def test_a_slot_load_is_recorded_once_and_an_unpinned_slot_keeps_its_adapter_until_another_needs_it():
    lora = SimLoRA(max_loras=2, max_cpu_loras=4, slot_load_s=0.003, disk_load_s=0.05)
    lora.pin("a")
    lora.pin("a")
    assert (lora.slot_loads, lora.take_load_s()) == (1, 0.003)
    lora.pin("b")
    lora.unpin("a")
    lora.unpin("a")
    assert lora.available("c", []) and lora.gpu() == ["a", "b"]
    lora.pin("c")  # evicts a: the least recently used unpinned slot
    assert lora.gpu() == ["b", "c"] and lora.slot_loads == 3


def test_every_request_of_three_adapters_on_two_slots_finishes_and_no_step_runs_more_than_two():
    # The engine's test (tests/unit/test_lora_scheduler.py) on the simulated replica.
    for cls in (SimWorker, AggregateWorker):
        lora = SimLoRA(max_loras=2, max_cpu_loras=8, slot_load_s=0.003, disk_load_s=0.05)
        w = cls("w", _latency(), num_blocks=400, unit=64, max_num_seqs=64, max_num_batched_tokens=8192,
                lora=lora, lora_params=42e6)
        reqs = [SimRequest(i, 0.0, [], 300, 20 + i, lora_name="abc"[i % 3]) for i in range(12)]
        t = None
        for r in reqs:
            t = w.add(r, 0.0) or t
        _drain(w, t, 2)
        assert all(r.finished_at is not None for r in reqs)
        assert lora.slot_loads >= 3


def test_a_blocked_adapter_is_not_starved_by_a_steady_stream_for_the_adapters_in_the_slots():
    lora = SimLoRA(max_loras=2, max_cpu_loras=8, slot_load_s=0.003, disk_load_s=0.05)
    w = SimWorker("w", _latency(), num_blocks=2000, unit=64, max_num_seqs=256, max_num_batched_tokens=8192,
                  lora=lora, lora_params=42e6)
    t = w.add(SimRequest(0, 0.0, [], 200, 50, lora_name="a"), 0.0)
    w.add(SimRequest(1, 0.0, [], 200, 50, lora_name="b"), 0.0)
    blocked = SimRequest(2, 0.0, [], 200, 5, lora_name="c")
    w.add(blocked, 0.0)
    # Requests for a and b keep coming, one every step: without the reservation a and b would
    # stay pinned for ever and c would never get a slot.
    n = 3
    while blocked.first_token_at is None and n < 400:
        w.add(SimRequest(n, t, [], 200, 50, lora_name="ab"[n % 2]), t)
        n += 1
        t = w.on_event(t)
        assert lora.busy() <= 2
    assert blocked.first_token_at is not None


def test_steps_with_adapters_cost_their_weights_and_tokens_and_the_admitting_step_its_slot_load():
    lm = _latency()
    base = SimWorker("w", lm, num_blocks=400, unit=64)
    lora = SimLoRA(max_loras=2, max_cpu_loras=8, slot_load_s=0.003, disk_load_s=0.05)
    with_lora = SimWorker("w", lm, num_blocks=400, unit=64, lora=lora, lora_params=42e6)
    t0 = base.add(SimRequest(0, 0.0, [], 1000, 2), 0.0)
    t1 = with_lora.add(SimRequest(0, 0.0, [], 1000, 2, lora_name="a"), 0.0)
    # The prefill step: the slot copy first, then 2 x 42e6 FLOPs per token and the adapter's 84 MB once.
    shape = StepShape()
    shape.add_prefill(1000, 0, True)
    assert t0 == lm.step_time(shape)
    shape.add_lora(1000, 42e6)
    shape.add_lora_weights(lm.lora_bytes(42e6))
    assert t1 == pytest.approx(0.003 + lm.step_time(shape), rel=1e-12)
    assert t1 > t0 + 0.003


def test_a_request_whose_adapter_is_on_disk_reaches_the_queue_after_the_read_and_a_second_one_shares_it():
    wl = load_workload("multi-lora", seed=0, num_requests=2, options=["adapters=1", "rate=1000"])
    res = simulate(wl, FleetConfig(workers=1, unit=64))
    disk = _latency().lora_disk_load_time(_latency().model.lora_params(16, (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    first, second = sorted(res.records, key=lambda r: r.index)
    assert first.ttft_ms / 1000 > disk
    assert res.meta["lora"]["disk_loads"] == 1 and res.meta["lora"]["slot_loads"] == 1


def _loads(policy: str, adapter_routing: bool) -> dict:
    # No shared prefix (system prompts shorter than one unit): only the adapter ties a tenant's
    # requests together, so prefix routing scatters them and adapter routing does not.
    wl = load_workload("multi-lora", seed=1, num_requests=1500,
                       options=["adapters=40", "system_tokens=16", "rate=30"])
    res = simulate(wl, FleetConfig(workers=4, unit=64, max_loras=4,
                                   router=SimRouterConfig(policy=policy, adapter_routing=adapter_routing)))
    assert all(r.error is None for r in res.records)
    return res.meta["lora"]


def test_adapter_aware_routing_loads_adapters_far_less_often_than_prefix_routing_or_round_robin():
    aware = _loads("cache_aware", True)
    prefix_only = _loads("cache_aware", False)
    rr = _loads("round_robin", True)
    # (measured: 503 slot loads and 110 disk reads, against 978 / 374 and 983 / 419)
    assert aware["slot_loads"] < 0.6 * min(prefix_only["slot_loads"], rr["slot_loads"])
    assert aware["disk_loads"] < 0.5 * min(prefix_only["disk_loads"], rr["disk_loads"])


def test_the_load_generator_names_a_requests_adapter_as_its_model():
    import asyncio

    from aiohttp import web

    from bench.loadgen import LoadConfig, run_load
    from bench.workloads import RequestSpec, TextSource, Workload
    from tests.support import completions_server

    models: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        models.append((await request.json())["model"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"text":"a"}],"usage":null}\n\ndata: [DONE]\n\n')
        return resp

    async def main() -> None:
        async with completions_server(completions) as url:
            wl = Workload("t", [RequestSpec(0, 0.0, ((1, 2),), 1, adapter="tenant-3"),
                                RequestSpec(1, 0.0, ((2, 2),), 1)])
            await run_load(wl, LoadConfig(target=url, model="base", progress=False), TextSource())

    asyncio.run(main())
    assert sorted(models) == ["base", "tenant-3"]


def test_the_simulators_adapter_flags_reach_the_routers_policy_and_the_replicas():
    from bench.sim.config import SimSettings, fleet_config
    from bench.sim.router import SimRouter

    cfg = fleet_config(SimSettings(workload="multi-lora", adapter_spare=0, adapter_routing=False, max_loras=3,
                                   max_cpu_loras=5, lora_rank=8))
    assert (cfg.max_loras, cfg.max_cpu_loras, cfg.lora_rank) == (3, 5, 8)
    router = SimRouter([SimWorker("w", _latency(), 10, 64)], cfg.router, 64, 16, 1000.0, 0.01)
    assert (router.balancer.config.adapter_spare, router.balancer.config.adapter_routing) == (0, False)
