"""The fleet simulator: a workload through the router's policy onto simulated replicas, in virtual time.

One event loop, no HTTP, no sleeping: arrivals come from the workload (``arrival_s / speedup``),
each worker's next event is the end of its step (or of a run of decode steps) in a heap, and
heartbeat load reports go to the router every ``report_interval_s``. A request for a LoRA adapter
that its replica must first read from disk reaches that replica's queue after the read
(:mod:`bench.sim.lora`). Results are the same
:class:`~bench.records.RequestRecord` lines the HTTP load generator writes, so the same summary,
report and ``bench compare`` apply.
"""
from __future__ import annotations

import gc
import heapq
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from worker.engine.kv_cache.kv_tier import KVTier
from worker.simulator.latency import LatencyModel
from worker.simulator.profiles import SIM_MAX_NUM_BATCHED_TOKENS, SIM_MAX_NUM_SEQS, get_gpu, get_model
from worker.simulator.runner import nominal_speed

from protocol import LoadReport

from bench.records import RequestRecord
from bench.sim import simloop
from bench.sim.aggregate import make_worker
from bench.sim.lora import SimLoRA
from bench.sim.prompt_hashes import UnitHasher
from bench.sim.router import NoCapacity, SimRouter, SimRouterConfig
from bench.sim.worker import SimRequest, SimWorker
from bench.workloads import Workload


@dataclass(slots=True)
class FleetConfig:
    """The simulated fleet: how many replicas of which GPU/model, their KV pool and batching."""

    workers: int = 8
    gpu: str = "H100-80G"
    model: str = "llama-3-8b"
    tp: int | None = None
    kv_blocks: int | None = None  # per worker, in engine blocks of ``block_size`` tokens
    block_size: int = 16
    unit: int = 512  # the simulator's block, in tokens (a multiple of block_size)
    max_num_seqs: int = SIM_MAX_NUM_SEQS
    max_num_batched_tokens: int = SIM_MAX_NUM_BATCHED_TOKENS
    bos_tokens: int = 1  # the byte tokenizer's BOS: prompt_tokens = characters + 1
    speedup: float = 1.0
    upper_bound: bool = False  # one worker with the whole fleet's capacity and compute
    decode_runs: bool = True  # sum runs of decode-only steps in closed form (False: step by step)
    aggregate: bool = True  # decode state as aggregates (bench.sim.aggregate; False: the reference worker)
    max_model_len: int | None = None  # default: the model profile's context length
    cpu_kv_ratio: float = 0.0  # each worker's CPU KV tier, in multiples of its GPU KV (0: none)
    cpu_kv_policy: str = "write_back"
    # LoRA adapters, for workloads whose requests name one (else unused): the engine's flags
    max_loras: int = 8
    max_cpu_loras: int | None = None  # default: 4 x max_loras, as the worker's
    lora_rank: int = 16  # every adapter: this rank on all seven projections
    router: SimRouterConfig = field(default_factory=SimRouterConfig)


@dataclass(slots=True)
class SimResult:
    """Per-request records plus what the run was and how the fleet was used."""

    records: list[RequestRecord]
    meta: dict


def build_latency(cfg: FleetConfig) -> LatencyModel:
    """The latency model of one replica (of the merged replica for the upper bound)."""
    gpu, model = get_gpu(cfg.gpu), get_model(cfg.model)
    if cfg.upper_bound:
        base = LatencyModel(gpu, model, tp=cfg.tp)
        return LatencyModel(gpu, model, tp=base.tp * cfg.workers)
    return LatencyModel(gpu, model, tp=cfg.tp)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_workers(cfg: FleetConfig, latency: LatencyModel, adapters: bool = False) -> list[SimWorker]:
    """The replicas (one merged replica for the upper bound), with LoRA slots if ``adapters``."""
    if cfg.unit % cfg.block_size:
        raise ValueError("unit must be a multiple of block_size")
    per_worker_tokens = (cfg.kv_blocks * cfg.block_size if cfg.kv_blocks is not None
                         else LatencyModel(latency.gpu, latency.model, tp=cfg.tp).kv_capacity_tokens())
    n = 1 if cfg.upper_bound else cfg.workers
    scale = cfg.workers if cfg.upper_bound else 1
    num_blocks = per_worker_tokens * scale // cfg.unit
    params = float(latency.model.lora_params(cfg.lora_rank, LORA_TARGETS)) if adapters else 0.0

    def lora() -> SimLoRA | None:
        if not adapters:
            return None
        return SimLoRA(cfg.max_loras * scale, (cfg.max_cpu_loras or 4 * cfg.max_loras) * scale,
                       latency.lora_slot_load_time(params), latency.lora_disk_load_time(params))

    return [make_worker(f"sim-{i}", latency, num_blocks, cfg.unit,
                        cfg.max_num_seqs * scale, cfg.max_num_batched_tokens * scale,
                        decode_runs=cfg.decode_runs, aggregate=cfg.aggregate,
                        tier=build_tier(cfg, latency, num_blocks), lora=lora(), lora_params=params)
            for i in range(n)]


def build_tier(cfg: FleetConfig, latency: LatencyModel, gpu_blocks: int) -> KVTier | None:
    """One worker's CPU KV tier (``cpu_kv_ratio`` x its GPU blocks), or None.

    A block is ``unit`` tokens of one GPU's KV shard (tensor parallelism splits the KV heads, and
    each GPU loads its shard over its own PCIe link): its bytes over the profile's host -> device
    bandwidth are its transfer time.
    """
    blocks = int(cfg.cpu_kv_ratio * gpu_blocks)
    if blocks < 1:
        return None
    block_bytes = latency.model.kv_bytes_per_token * cfg.unit // latency.tp
    return KVTier(blocks, cfg.unit, block_bytes, policy=cfg.cpu_kv_policy,
                  load_bytes_per_s=latency.gpu.host_to_device_bandwidth)


PROGRESS_EVERY = 1024  # requests between two calls of simulate's ``progress``


def simulate(workload: Workload, cfg: FleetConfig, progress: Callable[[int], None] | None = None) -> SimResult:
    """Run ``workload`` through the fleet; deterministic for a given workload and config.

    ``progress(n)`` is called with the number of requests newly routed, every
    :data:`PROGRESS_EVERY` requests and at the end (a progress bar's ``update``)."""
    # A run allocates millions of long-lived objects and frees almost no reference cycles: the
    # cyclic collector's passes over them cost ~15% of a run and find nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _simulate(workload, cfg, progress)
    finally:
        if collecting:
            gc.enable()


def simulate_with_bar(workload: Workload, cfg: FleetConfig, show: bool = True) -> SimResult:
    """:func:`simulate` with a progress bar of the requests routed on stderr (none unless ``show``)."""
    from tqdm import tqdm

    with tqdm(total=len(workload), disable=not show, unit="req", desc="simulated") as bar:
        return simulate(workload, cfg, progress=bar.update)


def _simulate(workload: Workload, cfg: FleetConfig, progress: Callable[[int], None] | None) -> SimResult:
    started = time.perf_counter()
    latency = build_latency(cfg)
    adapters = cfg.max_loras > 0 and any(spec.adapter for spec in workload.requests)
    workers = build_workers(cfg, latency, adapters)
    prefill_rate, decode_step = nominal_speed(latency)
    max_len = cfg.max_model_len or latency.model.max_model_len
    router = SimRouter(workers, cfg.router, cfg.unit, cfg.block_size, prefill_rate, decode_step)
    by_id = {w.worker_id: i for i, w in enumerate(workers)}
    heap: list[tuple[float, int, int, int]] = []  # (time, seq, worker index, worker version)
    seq = 0
    requests: list[SimRequest] = []
    records: list[RequestRecord] = []
    interval = cfg.router.report_interval_s
    measured = cfg.router.speed_report == "measured"
    next_report = 0.0
    reporting = interval > 0
    # What reaches the router late (bench/sim/router.py, SimRouterConfig): reports wait for the
    # router's next poll, KV events and first bytes / finishes for their delivery delay.
    poll = cfg.router.report_poll_s
    polling = reporting and poll > 0
    next_poll = 0.0
    latest: dict[int, LoadReport] = {}
    kv_delay, hop = cfg.router.kv_event_delay_s, cfg.router.hop_s
    # Host work before the engine sees a request: the client pays it in full (the engine starts
    # that much earlier here than over HTTP, a small error at the loads the model is used at).
    ingest = cfg.router.ingest_s_per_token
    delayed: list[tuple[float, int, Callable, tuple]] = []  # (delivery time, seq, handler, args)
    inf = math.inf

    heappop, heappush = heapq.heappop, heapq.heappush
    on_first_token, on_kv, on_finish = router.on_first_token, router.on_kv, router.on_finish
    drain = simloop.drain_events  # the loop's body below, compiled; None: Python's

    def heartbeat(at: float) -> None:
        nonlocal next_poll
        for wi, w in enumerate(workers):
            speed = w.speed
            rate = speed.prefill_tokens_per_s if measured else prefill_rate
            if polling:
                latest[wi] = router.refilled_report(w, at, rate, speed.decode_step_s)  # read, then dropped
            else:
                router.report(w, at, rate, speed.decode_step_s)
        if polling:
            next_poll = max(next_poll, math.ceil(at / poll) * poll)

    def read_reports(at: float) -> None:
        for report in latest.values():
            router.apply_report(report, at)
        latest.clear()

    def arrive(wi: int, req: SimRequest, when: float) -> None:
        nonlocal seq
        w = workers[wi]
        nxt = w.add(req, when)
        if nxt is not None:
            seq += 1
            heappush(heap, (nxt, seq, wi, w.version))

    # The event loop: millions of iterations, so its names are locals and its calls few.
    def run_until(t: float) -> None:
        nonlocal seq, next_report, next_poll
        while heap or delayed:
            head = heap[0][0] if heap else inf
            if delayed and delayed[0][0] < head:
                head = delayed[0][0]
            if reporting and next_report <= (head if head < t else t):
                heartbeat(next_report)
                next_report += interval
                continue
            if latest and next_poll <= (head if head < t else t):
                read_reports(next_poll)
                next_poll += poll
                continue
            if head > t:
                break
            if drain is not None:
                # The events up to the next heartbeat, report read or ``t``, all but an adapter's
                # arrival (it takes sequence numbers: handled below), as the body below does.
                stop = next_report if reporting else inf
                if latest and next_poll < stop:
                    stop = next_poll
                last_seq = drain(heap, delayed, workers, t, stop, seq, hop, kv_delay, on_first_token, on_kv,
                                 on_finish)
                if last_seq is not None:
                    seq = last_seq
                    continue
            if delayed and delayed[0][0] == head:
                _, _, handler, args = heappop(delayed)
                handler(*args)
                continue
            when, _, wi, version = heappop(heap)
            w = workers[wi]
            if version != w.version:
                continue
            nxt = w.on_event(when)
            first = w.first_tokens  # (w.take_first_tokens(), without the call on every event)
            if first:
                w.first_tokens = []
                for req in first:
                    if hop:
                        seq += 1
                        heappush(delayed, (when + hop, seq, on_first_token, (req, when + hop)))
                    else:
                        on_first_token(req, when)
            # Most steps emit no KV event: the pool's pending list read, not taken, until one does.
            if w.pool._events:
                for kind, hashes, medium in w.take_kv_events():
                    if kv_delay:
                        seq += 1
                        heappush(delayed, (when + kv_delay, seq, on_kv,
                                           (w.worker_id, kind, hashes, when + kv_delay, medium)))
                    else:
                        on_kv(w.worker_id, kind, hashes, when, medium)
            finished = w.finished  # (w.take_finished())
            if finished:
                w.finished = []
                for req in finished:
                    if hop:
                        seq += 1
                        heappush(delayed, (when + hop, seq, on_finish, (req, when + hop)))
                    else:
                        on_finish(req, when)
            if nxt is not None:
                seq += 1
                heappush(heap, (nxt, seq, wi, w.version))
        if latest and next_poll <= t:  # reports sent before the fleet went idle
            read_reports(next_poll)
            next_poll += poll
        # An idle fleet sends nothing new; resume the heartbeat grid at ``t``.
        if reporting and t != inf:
            next_report = max(next_report, math.ceil(t / interval) * interval)

    hasher = UnitHasher(cfg.unit)  # = bench.workloads.unit_hashes, memoised
    speedup, bos, fits, route = cfg.speedup, cfg.bos_tokens, workers[0].fits, router.route
    reported = 0
    for i, spec in enumerate(workload.requests):
        if progress is not None and i - reported >= PROGRESS_EVERY:
            progress(i - reported)
            reported = i
        now = spec.arrival_s / speedup
        run_until(now)
        req = SimRequest(spec.index, now, hasher(spec.segments), spec.prompt_tokens + bos, spec.max_tokens,
                         spec.session, spec.adapter if adapters else None)
        requests.append(req)
        if req.num_prompt + 1 > max_len:  # the worker answers 400, as vLLM does
            req.error = f"prompt of {req.num_prompt} tokens exceeds the context length {max_len}"
            continue
        if not fits(req):
            req.error = "prompt and max_tokens do not fit the worker's KV cache"
            continue
        try:
            decision = route(req, now)
        except NoCapacity as exc:
            req.error = f"no capacity: {exc}"
            continue
        wi = by_id[decision.worker_id]
        w = workers[wi]
        if req.lora_name is not None and w.lora is not None:
            delay = w.lora.prefetch(req.lora_name, now)
            if delay > 0.0:  # its adapter is read from disk first: it reaches the engine after
                seq += 1
                heappush(delayed, (now + delay, seq, arrive, (wi, req, now + delay)))
                continue
        nxt = w.add(req, now)
        if nxt is not None:
            seq += 1
            heappush(heap, (nxt, seq, wi, w.version))
    run_until(float("inf"))
    if progress is not None:
        progress(len(requests) - reported)

    end = max((r.finished_at or r.arrival for r in requests), default=0.0)
    for r in requests:
        if r.error is None and r.finished_at is None:
            r.error = "did not finish"
        ok = r.error is None
        # positional (index, sent_s, worker_id, ttft_ms, e2e_ms, prompt_tokens, cached_tokens,
        # completion_tokens, error, session): keywords to a class make CPython 3.11 pack a dict
        records.append(RequestRecord(
            r.index, r.arrival, r.worker_id,
            (r.first_token_at - r.arrival + 2 * hop + ingest * r.num_prompt) * 1000.0 if ok else None,
            (r.finished_at - r.arrival + 2 * hop + ingest * r.num_prompt) * 1000.0 if ok else None,
            r.num_prompt if ok else 0, max(0, r.cached_tokens) if ok else 0,
            r.max_tokens if ok else 0, r.error, r.session))
    span = max(1e-9, end - (requests[0].arrival if requests else 0.0))
    meta = {
        "kind": "sim",
        "workload": workload.name,
        "workload_params": workload.params,
        "fleet": {k: v for k, v in asdict(cfg).items() if k != "router"},
        "router": asdict(cfg.router),
        "tp": latency.tp,
        "kv_blocks_per_worker": workers[0].pool.num_blocks * cfg.unit // cfg.block_size,
        "kv_tokens_per_worker": workers[0].pool.num_blocks * cfg.unit,
        "utilisation": {w.worker_id: round(w.busy_s / span, 4) for w in workers},
        "mean_utilisation": round(sum(w.busy_s for w in workers) / span / len(workers), 4),
        "preemptions": sum(w.num_preemptions for w in workers),
        "prefill_tokens_computed": sum(w.prefill_tokens_computed for w in workers),
        "kv_tier": _tier_totals(workers, latency.tp),
        "reasons": dict(sorted(router.reasons.items())),
        "lora": _lora_meta(workers, len(requests)) if adapters else None,
        "nominal_prefill_tokens_per_s": round(prefill_rate, 1),
        "wall_s": round(time.perf_counter() - started, 3),
    }
    return SimResult(records, meta)


def _tier_totals(workers: list[SimWorker], tp: int) -> dict | None:
    """The fleet's CPU KV tier counters summed over workers (None without tiers); bytes over all
    ``tp`` GPUs of a worker (each moves its shard)."""
    tiers = [w.tier for w in workers if w.tier is not None]
    if not tiers:
        return None
    out = {"blocks_per_worker": tiers[0].host.num_blocks, "policy": tiers[0].policy}
    for name in ("loaded_tokens", "recomputed_tokens", "loaded_blocks", "stored_blocks", "bytes_loaded",
                 "bytes_stored", "skipped_stores"):
        out[name] = sum(getattr(t.counters, name) for t in tiers) * (tp if name.startswith("bytes") else 1)
    out["bytes_moved"] = out["bytes_loaded"] + out["bytes_stored"]
    return out


def _lora_meta(workers: list[SimWorker], num_requests: int) -> dict:
    """Adapter loads of a run: slot loads (host -> GPU) and disk reads, in all and per 1,000 requests."""
    slot = sum(w.lora.slot_loads for w in workers if w.lora is not None)
    disk = sum(w.lora.disk_loads for w in workers if w.lora is not None)
    per = 1000.0 / max(1, num_requests)
    return {"slot_loads": slot, "disk_loads": disk, "slot_loads_per_1000": round(slot * per, 2),
            "disk_loads_per_1000": round(disk * per, 2)}
