"""The router as the fleet simulator drives it: the router's own :class:`~router.routing.balancer.Balancer`.

Nothing of the routing decision is re-implemented here. The balancer (prefix index, ring, load
board, candidate set, policy, optimistic inserts, feedback) is the object the HTTP router
drives; this module feeds it the same calls in virtual time:

- ``decide`` + ``dispatch`` when a request arrives;
- ``apply_kv_event`` for every ``stored`` / ``removed`` batch of a worker's BlockPool;
- ``first_byte`` at the first token, ``finish`` with ``(prompt_tokens, cached_tokens)`` at the end;
- ``apply_report`` with each worker's heartbeat :class:`~protocol.LoadReport`.

The chain hashes are the workload's unit hashes (one per ``unit`` tokens): the balancer runs
with ``chunk_size = unit`` and learns ~1 token per byte, as with the byte-level tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass

from protocol import DEFAULT_CHUNK_SIZE, KVEvent, LoadReport
from router.routing.balancer import Balancer, Booking
from router.routing.index import DEFAULT_OPTIMISTIC_TTL_S, PrefixIndex
from router.routing.load import LoadBoard, SpeedProfile
from router.routing.policy import DEFAULT_AFFINITY, DEFAULT_POLICY, Decision, NoCapacity, PolicyConfig
from router.routing.prompt import DEFAULT_RING_KEY_CHUNKS, PromptKey, ring_key_of

from bench.sim.worker import SimRequest, SimWorker

SIM_MODEL = "sim"


@dataclass(slots=True)
class SimRouterConfig:
    """How the simulated router is set up (the router's own knobs, and the heartbeat)."""

    policy: str = DEFAULT_POLICY
    affinity: float = DEFAULT_AFFINITY
    ring_key_bytes: int = DEFAULT_RING_KEY_CHUNKS * DEFAULT_CHUNK_SIZE  # the router's default
    report_interval_s: float = 0.5  # the worker's --heartbeat-interval default
    optimistic_ttl_s: float = DEFAULT_OPTIMISTIC_TTL_S
    index_entries: int = 2_000_000
    # "measured": each replica reports its own SpeedMeter EMA, as the worker does; "nominal": all
    # report the profile's nominal prefill speed (what a context-normalised measurement would give
    # identical GPUs; the report's "control" rows).
    speed_report: str = "measured"
    adapter_routing: bool = True  # LoRA requests: the router's adapter-aware placement (router/routing/adapters.py)
    adapter_spare: int = PolicyConfig().adapter_spare  # workers an adapter may use beyond its traffic's need


class SimRouter:
    """One router in front of the simulated fleet."""

    def __init__(self, workers: list[SimWorker], cfg: SimRouterConfig, unit: int, block_size: int,
                 prefill_tokens_per_s: float, decode_step_s: float) -> None:
        self.cfg = cfg
        self.unit = unit
        w0 = workers[0]
        board = LoadBoard(SpeedProfile(prefill_tokens_per_s=prefill_tokens_per_s, decode_step_s=decode_step_s,
                                       max_num_batched_tokens=w0.max_num_batched_tokens,
                                       max_num_seqs=w0.max_num_seqs, block_size=block_size))
        self.balancer = Balancer(PolicyConfig(policy=cfg.policy, affinity=cfg.affinity,
                                                      adapter_routing=cfg.adapter_routing,
                                                      adapter_spare=cfg.adapter_spare), chunk_size=unit,
                                 index=PrefixIndex(max_entries=cfg.index_entries,
                                                   optimistic_ttl_s=cfg.optimistic_ttl_s),
                                 board=board, tokens_per_byte=1.0)
        for w in workers:
            self.balancer.add_worker(w.worker_id, block_size=block_size, max_num_seqs=w.max_num_seqs)
        self.bookings: dict[int, Booking] = {}
        self.reasons: dict[str, int] = {}
        self._event_seq: dict[str, int] = {}

    def prompt_key(self, req: SimRequest) -> PromptKey:
        """The routing view of a simulated request (its text is never built)."""
        num_bytes = req.num_prompt - 1 if req.num_prompt > 1 else req.num_prompt
        data = req.index.to_bytes(8, "little")  # stands in for a prompt shorter than one unit
        key = ring_key_of(data, req.block_hashes, 0, max(1, -(-self.cfg.ring_key_bytes // self.unit)), req.session)
        return PromptKey(SIM_MODEL, num_bytes, req.block_hashes, key, req.session, adapter=req.lora_name)

    def route(self, req: SimRequest, now: float) -> Decision:
        """Choose a worker for ``req`` and book it (raises ``NoCapacity`` like the router)."""
        prompt = self.prompt_key(req)
        decision = self.balancer.decide(prompt, now)
        self.bookings[req.index] = self.balancer.dispatch(decision, prompt, now)
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        return decision

    def on_first_token(self, req: SimRequest, now: float) -> None:
        """The request's first token left the worker."""
        booking = self.bookings.get(req.index)
        if booking is not None:
            self.balancer.first_byte(booking, now)

    def on_finish(self, req: SimRequest, now: float) -> None:
        """The request completed: usage goes back as feedback."""
        booking = self.bookings.pop(req.index, None)
        if booking is not None:
            self.balancer.finish(booking, now, usage=(req.num_prompt, max(0, req.cached_tokens)))

    def on_kv(self, worker_id: str, kind: str, hashes: list[int], now: float) -> None:
        """A worker's KV event batch (``stored`` or ``removed``)."""
        seq = self._event_seq.get(worker_id, 0) + 1
        self._event_seq[worker_id] = seq
        self.balancer.apply_kv_event(KVEvent(worker_id, kind, list(hashes), chunk_size=self.unit, seq=seq,
                                             ts=now), now)

    def report(self, worker: SimWorker, now: float, prefill_tokens_per_s: float, decode_step_s: float) -> None:
        """A worker's heartbeat load report (with its adapters, as the worker reports them)."""
        lora = {}
        if worker.lora is not None:
            running: dict[str, int] = {}
            waiting: dict[str, int] = {}
            for req in worker.running:
                if req.lora_name is not None:
                    running[req.lora_name] = running.get(req.lora_name, 0) + 1
            for req in worker.waiting:
                if req.lora_name is not None:
                    waiting[req.lora_name] = waiting.get(req.lora_name, 0) + 1
            lora = dict(max_loras=worker.lora.max_loras, lora_gpu=worker.lora.gpu(), lora_cpu=worker.lora.cpu(),
                        lora_running=running, lora_waiting=waiting, lora_disk_load_s=worker.lora.disk_load_s,
                        lora_slot_load_s=worker.lora.slot_load_s)
        self.balancer.apply_report(LoadReport(
            worker_id=worker.worker_id, running=len(worker.running), waiting=len(worker.waiting),
            queued_prefill_tokens=worker.queued_prefill_tokens, running_tokens=worker.running_tokens,
            free_blocks=worker.pool.get_num_free_blocks(), total_blocks=worker.pool.num_blocks,
            capacity_tokens=worker.pool.num_blocks * worker.unit,
            max_num_seqs=worker.max_num_seqs, max_num_batched_tokens=worker.max_num_batched_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s, decode_step_s=decode_step_s, ts=now, **lora), now)


__all__ = ["NoCapacity", "SimRouter", "SimRouterConfig"]
