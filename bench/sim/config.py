"""Settings of ``prefixlb sim`` and ``prefixlb sweep``: one schema for flags, env and YAML."""
from __future__ import annotations

from dataclasses import dataclass

from protocol.settings import setting
from router.routing.policies import policy_names
from router.routing.policy import DEFAULT_AFFINITY, DEFAULT_POLICY, PolicyConfig
from worker.simulator.profiles import SIM_MAX_NUM_BATCHED_TOKENS, SIM_MAX_NUM_SEQS

from bench.sim.fleet import FleetConfig
from bench.sim.router import HTTP_HOP_S, INGEST_S_PER_TOKEN, KV_EVENT_DELAY_S, SimRouterConfig
from bench.workloads import Workload, load_workload
from bench.workloads.base import retime_poisson

ENV_PREFIX = "PREFIXLB_SIM_"


@dataclass(slots=True)
class SimSettings:
    """A fleet simulation: workload, fleet, router."""

    workload: str = setting("system-prompt", "system-prompt | doc-qa | multi-turn | conversation | multi-lora | "
                            "mooncake:FILE | azure:FILE")
    workload_opt: list[str] = setting(list, "workload option key=value (repeatable)", flag="--workload-opt")
    seed: int = setting(0, "seed: the workload is deterministic given it")
    num_requests: int | None = setting(None, "number of requests (default: the workload's own)", minimum=1)
    rate: float | None = setting(None, "replace arrivals by a Poisson process of this many req/s", minimum=1e-9)
    speedup: float = setting(1.0, "divide the workload's arrival times by this", minimum=1e-9)
    workers: int = setting(8, "simulated replicas", minimum=1)
    gpu: str = setting("H100-80G", "GPU profile (A100-80G, H100-80G, H200)")
    sim_model: str = setting("llama-3-8b", "model profile (llama-3-8b, llama-3-70b)")
    tp: int | None = setting(None, "tensor-parallel degree (default: smallest that fits)", minimum=1)
    kv_blocks: int | None = setting(None, "KV blocks of --block-size tokens per worker (default: HBM - weights)",
                                    minimum=1)
    block_size: int = setting(16, "engine block size in tokens", minimum=1)
    unit: int | None = setting(None, "simulator block in tokens (default: 512 for mooncake, else 64)", minimum=1)
    max_num_seqs: int = setting(SIM_MAX_NUM_SEQS, "most sequences in a batch (the simulated worker's default)",
                                minimum=1)
    max_num_batched_tokens: int = setting(SIM_MAX_NUM_BATCHED_TOKENS, "token budget of a step (the simulated "
                                          "worker's default)", minimum=1)
    policy: str = setting(DEFAULT_POLICY, "routing policy", choices=policy_names)
    affinity: float = setting(DEFAULT_AFFINITY, "cache_aware affinity strength", minimum=0.0, maximum=1.0)
    report_interval: float = setting(0.5, "seconds between workers' load reports (0: none)", minimum=0.0)
    report_poll: float = setting(1.0, "seconds between the router's reads of the latest reports (its "
                                 "--registry-interval over Redis; 0: each report read as it is sent)", minimum=0.0)
    kv_event_delay: float = setting(KV_EVENT_DELAY_S, "seconds a KV event takes to reach the router", minimum=0.0)
    hop: float = setting(HTTP_HOP_S, "seconds of one HTTP hop router <-> worker (a TTFT pays two)", minimum=0.0)
    ingest: float = setting(INGEST_S_PER_TOKEN, "host seconds per prompt token before the engine starts "
                            "(HTTP body, tokenizing, block hashing)", minimum=0.0)
    upper_bound: bool = setting(False, "one worker with the whole fleet's capacity and compute")
    # The CPU KV tier: docs/kv-tier.md
    cpu_kv_ratio: float = setting(0.0, "each worker's CPU KV tier in multiples of its GPU KV (0: no tier)",
                                  minimum=0.0, maximum=1000.0)
    cpu_kv_policy: str = setting("write_back", "when blocks go down to the CPU tier",
                                 choices=("write_back", "write_through", "selective"))
    max_loras: int = setting(8, "LoRA GPU slots per worker (workloads with adapters)", minimum=1)
    max_cpu_loras: int | None = setting(None, "LoRA adapters in host memory per worker (default: 4 x --max-loras)",
                                        minimum=1)
    lora_rank: int = setting(16, "rank of every LoRA adapter (all seven projections)", minimum=1, maximum=1024)
    adapter_routing: bool = setting(True, "route LoRA requests by adapter residency (off: by prefix only)")
    adapter_spare: int = setting(PolicyConfig().adapter_spare, "workers a LoRA adapter may use beyond what its "
                                 "traffic needs", minimum=0, maximum=1024)
    out: str = setting("runs/sim", "output directory")
    label: str | None = setting(None, "name of this run in reports (default: the directory name)")
    progress: bool = setting(True, "show a progress bar (requests simulated) on stderr")


def build_workload(s: SimSettings) -> Workload:
    """The workload of a simulation (arrivals re-timed when ``rate`` is given)."""
    workload = load_workload(s.workload, s.seed, s.num_requests, s.workload_opt)
    if s.rate is not None:
        workload = retime_poisson(workload, s.rate, s.seed)
    return workload


def fleet_config(s: SimSettings, **overrides) -> FleetConfig:
    """The fleet and router configuration of a simulation."""
    unit = s.unit or (512 if s.workload.startswith("mooncake") else 64)
    router = SimRouterConfig(policy=overrides.pop("policy", s.policy),
                             affinity=overrides.pop("affinity", s.affinity),
                             report_interval_s=s.report_interval, report_poll_s=s.report_poll,
                             kv_event_delay_s=s.kv_event_delay, hop_s=s.hop, ingest_s_per_token=s.ingest,
                             adapter_routing=overrides.pop("adapter_routing", s.adapter_routing),
                             adapter_spare=overrides.pop("adapter_spare", s.adapter_spare))
    return FleetConfig(workers=s.workers, gpu=s.gpu, model=s.sim_model, tp=s.tp, kv_blocks=s.kv_blocks,
                       block_size=s.block_size, unit=unit, max_num_seqs=s.max_num_seqs,
                       max_num_batched_tokens=s.max_num_batched_tokens, speedup=s.speedup,
                       upper_bound=s.upper_bound, cpu_kv_ratio=s.cpu_kv_ratio, cpu_kv_policy=s.cpu_kv_policy,
                       max_loras=s.max_loras, max_cpu_loras=s.max_cpu_loras, lora_rank=s.lora_rank,
                       router=router, **overrides)
