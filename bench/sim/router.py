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
_init_report = LoadReport.__init__


@dataclass(slots=True)
class SimRouterConfig:
    """How the simulated router is set up (the router's own knobs, and the heartbeat)."""

    policy: str = DEFAULT_POLICY
    affinity: float = DEFAULT_AFFINITY
    ring_key_bytes: int = DEFAULT_RING_KEY_CHUNKS * DEFAULT_CHUNK_SIZE  # the router's default
    report_interval_s: float = 0.5  # the worker's --heartbeat-interval default
    # What the HTTP router sees, and when (0 everywhere: the router sees everything at once).
    # ``report_poll_s``: the router reads each worker's latest report on this period (its
    # --registry-interval over Redis), not when the worker sends it; ``kv_event_delay_s``: a KV
    # event reaches the router this long after the worker's step (Redis stream, XREAD);
    # ``hop_s``: one HTTP hop router <-> worker (the client's TTFT pays two, the router's first
    # byte and finish feedback one).
    report_poll_s: float = 0.0
    kv_event_delay_s: float = 0.0
    hop_s: float = 0.0
    # Host work on a request before its first token that the latency model does not count (HTTP
    # body, tokenizing, block hashing in the worker; the router's prompt hashing), per prompt token.
    ingest_s_per_token: float = 0.0
    optimistic_ttl_s: float = DEFAULT_OPTIMISTIC_TTL_S
    index_entries: int = 2_000_000
    # "measured": each replica reports its own SpeedMeter EMA, as the worker does; "nominal": all
    # report the profile's nominal prefill speed (what a context-normalised measurement would give
    # identical GPUs; the report's "control" rows).
    speed_report: str = "measured"
    adapter_routing: bool = True  # LoRA requests: the router's adapter-aware placement (router/routing/adapters.py)
    adapter_spare: int = PolicyConfig().adapter_spare  # workers an adapter may use beyond its traffic's need


# One HTTP hop router <-> worker on loopback, router and worker processing included (the worker's
# one-token request costs ~1.2 ms, the router adds ~3 ms per request both ways: docs/benchmarks.md).
HTTP_HOP_S = 0.002
# A KV event's way from the worker's step to the router's index: an XADD, then the router's XREAD.
KV_EVENT_DELAY_S = 0.002
# Measured: a 1-token answer from a simulated worker at an infinite time scale takes 2.3 ms for a
# 100-token prompt, 11.7 ms for 8K tokens, 35 ms for 32K (docs/benchmarks.md): ~1 us per token.
INGEST_S_PER_TOKEN = 1.0e-6


def http_view(time_scale: float = 1.0, report_interval_s: float = 0.5,
              registry_interval_s: float = 1.0) -> dict[str, float]:
    """The :class:`SimRouterConfig` delays of the HTTP router, in workload time.

    Defaults are the deployed ones (the worker's ``--heartbeat-interval``, the router's
    ``--registry-interval``); an HTTP replay whose simulated workers run ``time_scale`` times
    faster than real time sees every wall-clock period and delay ``time_scale`` times longer.
    """
    return {"report_interval_s": report_interval_s * time_scale,
            "report_poll_s": registry_interval_s * time_scale,
            "kv_event_delay_s": KV_EVENT_DELAY_S * time_scale,
            "hop_s": HTTP_HOP_S * time_scale,
            "ingest_s_per_token": INGEST_S_PER_TOKEN * time_scale}


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
        self._ring_key_chunks = max(1, -(-cfg.ring_key_bytes // unit))
        self.reasons: dict[str, int] = {}
        self._event_seq: dict[str, int] = {}
        self._reports: dict[str, LoadReport] = {}  # each worker's last report (refilled_report)

    def prompt_key(self, req: SimRequest) -> PromptKey:
        """The routing view of a simulated request (its text is never built)."""
        num_bytes = req.num_prompt - 1 if req.num_prompt > 1 else req.num_prompt
        data = req.index.to_bytes(8, "little")  # stands in for a prompt shorter than one unit
        key = ring_key_of(data, req.block_hashes, 0, self._ring_key_chunks, req.session)
        # positional (model, num_bytes, hashes, ring_key, session_key, chat, tokens, known_cached,
        # adapter): a keyword would make CPython 3.11 pack the call into a dict, once per request
        return PromptKey(SIM_MODEL, num_bytes, req.block_hashes, key, req.session, False, None, None, req.lora_name)

    def route(self, req: SimRequest, now: float) -> Decision:
        """Choose a worker for ``req`` and book it (raises ``NoCapacity`` like the router)."""
        prompt = self.prompt_key(req)
        balancer = self.balancer
        decision = balancer.decide(prompt, now)
        self.bookings[req.index] = balancer.dispatch(decision, prompt, now)
        reasons = self.reasons
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
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

    def on_kv(self, worker_id: str, kind: str, hashes: list[int], now: float, medium: str = "gpu") -> None:
        """A worker's KV event batch (``stored`` or ``removed``, in its GPU or CPU tier)."""
        seq = self._event_seq.get(worker_id, 0) + 1
        self._event_seq[worker_id] = seq
        self.balancer.apply_kv_event(KVEvent(worker_id, kind, list(hashes), chunk_size=self.unit, seq=seq,
                                             ts=now, medium=medium), now)

    def report(self, worker: SimWorker, now: float, prefill_tokens_per_s: float, decode_step_s: float) -> None:
        """A worker's heartbeat load report, taken by the router at once."""
        self.apply_report(self.refilled_report(worker, now, prefill_tokens_per_s, decode_step_s), now)

    def refilled_report(self, worker: SimWorker, now: float, prefill_tokens_per_s: float,
                        decode_step_s: float) -> LoadReport:
        """:meth:`make_report`'s report, written into the one made for ``worker`` last: valid until
        the next call for that worker (the router reads a report and keeps nothing of it; the
        adapter fields are new objects each time, as it may keep those)."""
        report = self._reports.get(worker.worker_id)
        if report is None:
            report = self._reports[worker.worker_id] = self.make_report(worker, now, prefill_tokens_per_s,
                                                                        decode_step_s)
            return report
        # Every field make_report sets but worker_id, as attribute stores: a heartbeat of each of
        # 1,000 workers every 0.5 s of virtual time costs less than the constructor.
        pool = worker.pool
        tier = worker.tier
        report.running = len(worker.running)
        report.waiting = len(worker.waiting)
        report.queued_prefill_tokens = worker.queued_prefill_tokens
        report.running_tokens = worker.running_tokens
        report.free_blocks = pool.get_num_free_blocks()
        report.total_blocks = pool.num_blocks
        report.capacity_tokens = pool.num_blocks * worker.unit
        report.max_num_seqs = worker.max_num_seqs
        report.max_num_batched_tokens = worker.max_num_batched_tokens
        report.prefill_tokens_per_s = prefill_tokens_per_s
        report.decode_step_s = decode_step_s
        report.ts = now
        report.kv_tier_load_tokens_per_s = tier.stats().load_tokens_per_s if tier is not None else 0.0
        if worker.lora is not None:
            _fill_adapters(report, worker)
        return report

    @staticmethod
    def make_report(worker: SimWorker, now: float, prefill_tokens_per_s: float, decode_step_s: float) -> LoadReport:
        """The load report ``worker`` sends at ``now`` (with its adapters, as the worker reports them)."""
        tier = worker.tier
        pool = worker.pool
        # LoadReport.__init__ called directly (calling the class with keywords packs them into a
        # dict and unpacks it again, CPython 3.11).
        report = object.__new__(LoadReport)
        _init_report(
            report, worker_id=worker.worker_id, running=len(worker.running), waiting=len(worker.waiting),
            queued_prefill_tokens=worker.queued_prefill_tokens, running_tokens=worker.running_tokens,
            free_blocks=pool.get_num_free_blocks(), total_blocks=pool.num_blocks,
            capacity_tokens=pool.num_blocks * worker.unit,
            max_num_seqs=worker.max_num_seqs, max_num_batched_tokens=worker.max_num_batched_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s, decode_step_s=decode_step_s, ts=now,
            kv_tier_load_tokens_per_s=tier.stats().load_tokens_per_s if tier is not None else 0.0)
        if worker.lora is not None:
            _fill_adapters(report, worker)
        return report

    def apply_report(self, report: LoadReport, now: float) -> None:
        """The router reads ``report`` at ``now`` (it may be older: stamped with its ``ts``)."""
        self.balancer.apply_report(report, now)


def _fill_adapters(report: LoadReport, worker: SimWorker) -> None:
    """The adapter fields of ``worker``'s report (new objects: the router's adapter board may keep them)."""
    lora = worker.lora
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    for req in worker.running:
        if req.lora_name is not None:
            running[req.lora_name] = running.get(req.lora_name, 0) + 1
    for req in worker.waiting:
        if req.lora_name is not None:
            waiting[req.lora_name] = waiting.get(req.lora_name, 0) + 1
    report.max_loras = lora.max_loras
    report.lora_gpu = lora.gpu()
    report.lora_cpu = lora.cpu()
    report.lora_running = running
    report.lora_waiting = waiting
    report.lora_disk_load_s = lora.disk_load_s
    report.lora_slot_load_s = lora.slot_load_s


__all__ = ["HTTP_HOP_S", "INGEST_S_PER_TOKEN", "KV_EVENT_DELAY_S", "NoCapacity", "SimRouter", "SimRouterConfig", "http_view"]
