"""One simulated replica in virtual time: the engine's scheduling rules, its BlockPool, the latency model.

Fidelity to the engine (``worker/engine/scheduler.py``, ``worker/engine/kv_cache/``):

- the prefix cache *is* the engine's :class:`~worker.engine.kv_cache.BlockPool` (ref counts, LRU free
  queue, hash map, KV events), driven by the engine's own rules, the
  :class:`~worker.engine.kv_cache.KVCacheManager`: the longest run of cached leading blocks is
  reused but never the block holding the last token, blocks are registered after the step that
  wrote them, a finished request frees its blocks tail first (:class:`SimRequest` is a
  :class:`~worker.engine.kv_cache.kv_cache_manager.KVCacheRequest`);
- the scheduler follows the engine's: each step has a token budget; running requests first in
  admission order (a decode takes 1 token, a partial prefill its next chunk), preempting the
  most recently admitted one by recompute when blocks run out; then strict-FCFS admission of
  waiting requests while budget, ``max_num_seqs`` and blocks allow; prefill and decode share
  steps, labelled as the engine labels them (:func:`is_decode`); a step's duration is the
  latency model's :meth:`step_time`;
- ``tests/unit/test_sim_engine_parity.py`` runs the engine's own ``Scheduler`` and this worker on
  one workload and checks they schedule the same steps.

Differences, for speed (1,000 workers × 1,000,000 requests is the target):

- blocks are ``unit`` tokens, not 16: a workload's prefixes are shared in whole units (Mooncake:
  512-token blocks), so the cached-token counts are the engine's up to the last partial unit;
- prompt blocks only carry hashes (the engine also registers full blocks of generated tokens,
  which no later prompt of our workloads can match; here they are freed as plain blocks:
  :meth:`SimRequest.hash_blocks` adds none);
- runs of decode-only steps between events are summed in closed form (:mod:`bench.sim.decode_run`)
  instead of stepping one by one: the batch is fixed until a request finishes, needs a new block
  or a new request arrives, and the roofline time of each step is affine in its index.

With a CPU KV tier (``tier``, the engine's :class:`~worker.engine.kv_cache.kv_tier.KVTier`) the
admission follows the engine's: the GPU hit, then the tier's run after it, loaded when the
transfer beats recomputing it at the worker's measured speed; a step's copies (write-back stores
of the blocks it evicts, then its loads) add their bytes over the GPU profile's host <-> device
bandwidth to its time.

LoRA adapters (``lora``: a :class:`~bench.sim.lora.SimLoRA`, None for the base model only): the
engine's slot rules decide admission (a request whose adapter finds no slot waits, those behind it
may go), a slot load adds its copy time to the step that admits the request, and every step adds
its adapters' cost to the roofline: each distinct pinned adapter's weights read once, and
``2 · params`` FLOPs per token of the requests with an adapter (counted as the step's tokens times
the share of running requests that have one: every request has one in the multi-LoRA workload).
While a request waits, steps are taken one by one (no closed-form decode runs).
"""
from __future__ import annotations

from collections import deque

from worker.engine.kv_cache import BlockRemoved, BlockStored, KVCacheManager
from worker.engine.kv_cache.kv_cache_manager import cdiv
from worker.engine.kv_cache.kv_tier import KVTier
from worker.engine.stats import ATTENTION_KNEE_TOKENS, engine_speed_meter
from worker.simulator.latency import LatencyModel, StepShape
from worker.simulator.runner import nominal_speed

from bench.sim.simloop import decode_run_cut, decode_run_time, decode_steps_done_by, observe_decode_run
from bench.sim.lazy_pool import LazyBlockPool
from bench.sim.lora import SimLoRA


def is_decode(req: "SimRequest", n: int) -> bool:
    """Whether the engine labels ``n`` scheduled tokens of ``req`` a decode (``worker.engine.scheduler``).

    They are when they are the request's last token alone and its first token is out: a decoding
    request, or a preempted one whose recompute is down to its last token (cache hits or chunks
    computed the rest). A prompt's last token alone is still prefill: the first token comes out of
    it. The label is what the speed meter counts (prefill tokens vs decoding sequences); the step's
    shape, hence its time, is the same either way.
    """
    return n == 1 and req.prefill_left <= 1 and req.num_output > 0


class SimRequest:
    """One request's progress inside a simulated worker (times in virtual seconds).

    ``block_hashes`` are the hashes of the prompt's full units, precomputed by the workload (the
    router reads them as its chunk hashes: a unit is a chunk). The KV-cache fields (``blocks``,
    ``num_computed_tokens``, ``num_registered_blocks``) are the engine's
    :class:`~worker.engine.sequence.Sequence`'s, so the engine's KV-cache rules run on it.
    """

    __slots__ = ("index", "arrival", "block_hashes", "num_prompt", "max_tokens", "session",
                 "num_computed_tokens", "num_output", "cached_tokens", "first_token_at", "finished_at",
                 "blocks", "num_registered_blocks", "worker_id", "error", "prefill_left", "tick0", "dseq",
                 "loaded_tokens", "lora_name")

    def __init__(self, index: int, arrival: float, block_hashes: list[int], num_prompt: int, max_tokens: int,
                 session: str | None = None, lora_name: str | None = None) -> None:
        self.lora_name = lora_name  # its LoRA adapter (None: the base model)
        self.index = index
        self.arrival = arrival
        self.block_hashes = block_hashes
        self.num_prompt = num_prompt
        self.max_tokens = max_tokens
        self.session = session
        self.num_computed_tokens = 0
        self.num_output = 0
        self.cached_tokens = -1
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.blocks: list = []
        self.num_registered_blocks = 0
        self.worker_id: str | None = None
        self.error: str | None = None
        self.prefill_left = 0  # tokens still to prefill (0 once decoding)
        # AggregateWorker's decode bookkeeping: num_output = worker tick + tick0 while dseq >= 0.
        self.tick0 = 0
        self.dseq = -1
        self.loaded_tokens = 0  # of cached_tokens, loaded from the CPU KV tier

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return self.num_prompt + self.num_output

    def hash_blocks(self, block_size: int, num_blocks: int) -> None:
        """Nothing to add: the prompt's units are hashed up front and generated tokens never are."""


class SimWorker:
    """A replica's queues, KV blocks and clock. The fleet calls :meth:`add` and :meth:`on_event`.

    Both return the virtual time of this worker's next event (the end of the step or decode run
    it starts), or None when it is idle; the fleet keeps those in its event heap, and bumps
    :attr:`version` to invalidate older entries.
    """

    def __init__(self, worker_id: str, latency: LatencyModel, num_blocks: int, unit: int,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_caching: bool = True, decode_runs: bool = True, tier: KVTier | None = None,
                 lora: SimLoRA | None = None, lora_params: float = 0.0) -> None:
        self.worker_id = worker_id
        self.lora = lora
        self.lora_params = lora_params  # parameters of one adapter (all the same size)
        self.lora_running = 0  # running requests with an adapter
        self.decode_runs = decode_runs
        self.latency = latency
        self.unit = unit
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The engine's KV-cache rules on the engine's BlockPool (its blocks made on first use).
        self.kv = KVCacheManager(num_blocks, unit, enable_caching, pool_class=LazyBlockPool, tier=tier)
        self.pool = self.kv.block_pool
        self.tier = self.kv.tier
        self._copy_s = 0.0  # the step in flight's tier copies (s), and of them its loads
        self._load_s = 0.0
        self.prefill_tokens_computed = 0
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.version = 0
        self.finished: list[SimRequest] = []
        self.first_tokens: list[SimRequest] = []
        # The step (or decode run) in flight: its batch, start, end, and for a run its length.
        self._batch: list[tuple[SimRequest, int]] = []
        self._start = 0.0
        self._end: float | None = None
        self._run: tuple[float, float, float, float, int] | None = None  # (c0, c1, m0, m1, k)
        self.busy_s = 0.0
        self.num_preemptions = 0
        self._head_hits: tuple[SimRequest, list, int] | None = None  # see _can_admit_head
        # Measured speed, as the engine measures it (``worker.engine.stats.SpeedMeter``) and reports it.
        self.speed = engine_speed_meter(*nominal_speed(latency), max_num_batched_tokens)
        # (prefill tokens, decoding sequences, prefill work) of the step in flight (SpeedMeter.observe)
        self._step_work: tuple[int, int, float] = (0, 0, 0.0)
        self._prefill_pairs = 0
        self._decodes = 0
        # Sums the policy reads as load, kept incrementally (no per-decision scans).
        self.queued_prefill_tokens = 0
        self.running_tokens = 0
        self._oh = latency.step_overhead_s
        m = latency.model
        self._c_tok = (2.0 * m.matmul_params + 2.0 * m.vocab_size * m.hidden_size) / latency._flops_per_s
        self._c_ctx = 4.0 * m.num_layers * m.num_heads * m.head_dim / latency._flops_per_s
        self._m_base = m.weight_bytes / latency._bytes_per_s
        self._m_ctx = m.kv_bytes_per_token / latency._bytes_per_s
        self._c_lora = 2.0 * lora_params / latency._flops_per_s  # per token with an adapter
        # LatencyModel.step_time's factors (its flops() and bytes_moved() products up to the step's
        # sums), for the step time written out in _start_scheduled; None: call the model's.
        self._flops_tok: float | None = None
        if type(latency) is LatencyModel:
            self._flops_tok = 2.0 * m.matmul_params
            self._flops_sampled = 2.0 * m.vocab_size * m.hidden_size
            self._flops_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim
            self._flops_s = latency._flops_per_s
            self._weight_bytes = m.weight_bytes
            self._kv_bytes_tok = m.kv_bytes_per_token
            self._bytes_s = latency._bytes_per_s
        self._m_lora = latency.lora_bytes(lora_params) / latency._bytes_per_s  # per distinct adapter in a step

    # ------------------------------------------------------------------ fleet interface

    @property
    def idle(self) -> bool:
        """True when nothing is in flight."""
        return self._end is None

    def fits(self, req: SimRequest) -> bool:
        """Whether the request could ever run here (its prompt and output fit the pool)."""
        return cdiv(req.num_prompt + req.max_tokens, self.unit) <= self.pool.num_blocks

    def add(self, req: SimRequest, now: float) -> float | None:
        """Queue ``req`` at ``now``; returns the time of this worker's next event."""
        req.worker_id = self.worker_id
        req.prefill_left = left = req.num_prompt + req.num_output - req.num_computed_tokens
        self.waiting.append(req)
        self.queued_prefill_tokens += left
        end = self._end
        if end is None:
            return self._start_step(now)
        run = self._run
        if run is not None and end > now:
            # A decode run in flight is cut after the step in progress at ``now``: the new
            # request joins the batch from the next step on, as in the engine.
            c0, c1, m0, m1, k = run
            cut = decode_run_cut(now - self._start, self._oh, c0, c1, m0, m1, k)
            if cut is not None:
                m, seconds = cut
                self._run = (c0, c1, m0, m1, m)
                self._end = end = self._start + seconds
                self.version += 1
                return end
        return None

    def on_event(self, now: float) -> float | None:
        """The step or run in flight ended at ``now``: apply it, start the next one."""
        self.busy_s += now - self._start
        if self._run is not None:
            c0, c1, m0, m1, k = self._run
            b = len(self._batch)
            # The engine measures every step; the run's k steps are folded in at once.
            observe_decode_run(self.speed, self._oh, c0, c1, m0, m1, k, b)
            done = []
            for req in self._batch:
                req.num_output += k
                req.num_computed_tokens += k
                if req.num_output >= req.max_tokens:
                    done.append(req)
            self.running_tokens += k * len(self._batch)
            self._finish(done, now)
        else:
            self.speed.observe(now - self._start - self._finish_copies(), *self._step_work)
            self._apply_step(now)
        self._run = None
        self._batch = []
        self._end = None
        if self.waiting or self.running:
            return self._start_step(now)
        return None

    def _finish_copies(self) -> float:
        """The step's tier copies are done: commit them; their seconds (not the model's speed)."""
        copy_s = self._copy_s
        if self.tier is not None and copy_s:
            self.tier.finish_copies(True, self._load_s)
            self._copy_s = self._load_s = 0.0
        return copy_s

    def take_kv_events(self) -> list[tuple[str, list[int], str]]:
        """The BlockPool's KV events since the last call, as (``stored`` | ``removed``, hashes, medium)."""
        out = []
        for ev in self.pool.take_events():
            if isinstance(ev, BlockStored):
                out.append(("stored", ev.block_hashes, ev.medium))
            elif isinstance(ev, BlockRemoved):
                out.append(("removed", ev.block_hashes, ev.medium))
        return out

    def take_first_tokens(self) -> list[SimRequest]:
        """Requests whose first token came out since the last call."""
        out, self.first_tokens = self.first_tokens, []
        return out

    def take_finished(self) -> list[SimRequest]:
        """Requests that finished since the last call."""
        out, self.finished = self.finished, []
        return out

    # ------------------------------------------------------------------ stepping

    def _start_step(self, now: float) -> float | None:
        self.version += 1
        self._start = now
        run = self._decode_run()
        if run is not None:
            self._batch = list(self.running)
            self._run = run
            self._end = now + decode_run_time(self._oh, *run)
            return self._end
        return self._start_scheduled(now)

    def _start_scheduled(self, now: float) -> float | None:
        """Start the step :meth:`_schedule` makes (no decode run applies); its end, None if empty."""
        batch, shape = self._schedule()
        if not batch and not self._decodes:  # (AggregateWorker's batch lists prefill chunks only)
            self._end = None
            return None
        self._batch = batch
        prefill = shape.tokens - self._decodes
        # worker.engine.stats.prefill_work from the shape's sums (n(n+1)/2 vs n^2/2: half a token per chunk)
        self._step_work = (prefill, self._decodes, prefill + self._prefill_pairs / ATTENTION_KNEE_TOKENS)
        if self.lora is not None and self.lora_running:
            shape.add_lora(round(shape.tokens * self.lora_running / max(1, len(self.running))), self.lora_params)
            shape.add_lora_weights(self.lora.busy() * self.latency.lora_bytes(self.lora_params))
        if self._flops_tok is None or not shape.num_seqs:
            step_s = self.latency.step_time(shape)
        else:  # LatencyModel.step_time written out: the same float expressions, in the same order
            compute = (self._flops_tok * shape.tokens + self._flops_sampled * shape.sampled
                       + self._flops_pair * shape.attention_pairs + 2.0 * shape.lora_token_params) / self._flops_s
            memory = (self._weight_bytes + self._kv_bytes_tok * shape.kv_tokens + shape.lora_weight_bytes) / self._bytes_s
            step_s = self._oh + (memory if memory > compute else compute)  # max(compute, memory)
        self._end = now + (step_s + (self._start_copies() if self.tier is not None else 0.0)
                           + (self.lora.take_load_s() if self.lora is not None else 0.0))
        return self._end

    def _start_copies(self) -> float:
        """Hand the step its queued tier copies; their modelled seconds."""
        tier = self.tier
        if tier is None or not tier.has_queued_copies:
            return 0.0
        copies = tier.take_copies()
        rate = self.latency.gpu.host_to_device_bandwidth
        self._load_s = len(copies.loads) * tier.block_bytes / rate
        self._copy_s = self._load_s + len(copies.stores) * tier.block_bytes / rate
        if not self._copy_s:  # zero-byte blocks: commit at the step's end all the same
            self._copy_s = 1e-12
        return self._copy_s

    def _decode_run(self) -> tuple[float, float, float, float, int] | None:
        """A run of identical decode-only steps, if nothing but time can change the batch."""
        running = self.running
        if not self.decode_runs or not running or self.waiting and self._can_admit_head():
            return None
        unit = self.unit
        k = 1 << 62
        ctx = 0
        for req in running:
            if req.prefill_left:
                return None  # still prefilling (even with 1 token left: its first token is not out)
            n = req.num_tokens
            k = min(k, req.max_tokens - req.num_output, len(req.blocks) * unit - n + 1)
            ctx += n
        if k < 2:
            return None
        b = len(running)
        c0 = self._c_tok * b + self._c_ctx * ctx
        m0 = self._m_base + self._m_ctx * ctx
        if self.lora is not None:
            c0, m0 = self._with_lora(c0, m0, b)
        return (c0, self._c_ctx * b, m0, self._m_ctx * b, k)

    def _with_lora(self, c0: float, m0: float, b: int) -> tuple[float, float]:
        """A decode step's compute and memory seconds with its adapters' cost (see the module docstring)."""
        return c0 + self._c_lora * self.lora_running * b / max(1, len(self.running)), m0 + self._m_lora * self.lora.busy()

    def _can_admit_head(self) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        if self.lora is not None:
            return True  # adapters may block the head and not those behind it: step by step
        req = self.waiting[0]
        kv = self.kv
        hits, hit_tokens = kv.get_computed_blocks(req)
        n = min(req.num_prompt + req.num_output - hit_tokens, max(1, self.max_num_batched_tokens - len(self.running)))
        if not kv.can_allocate(req, n, hits):
            return False
        # The step scheduled next admits it first with these hits, unless a running request
        # allocates before (which may evict cached blocks): _allocate_or_preempt forgets them.
        self._head_hits = (req, hits, hit_tokens)
        return True

    def _run_time(self, c0: float, c1: float, m0: float, m1: float, k: int) -> float:
        return decode_run_time(self._oh, c0, c1, m0, m1, k)

    def _steps_done_by(self, elapsed: float, c0: float, c1: float, m0: float, m1: float, k: int) -> int:
        return decode_steps_done_by(elapsed, self._oh, c0, c1, m0, m1, k)

    def _preempt(self, req: SimRequest) -> None:
        if req.lora_name is not None and self.lora is not None:
            self.lora.unpin(req.lora_name)
            self.lora_running -= 1
        self.running.remove(req)
        self.running_tokens -= req.num_tokens
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.queued_prefill_tokens += req.num_tokens - req.prefill_left
        req.prefill_left = req.num_tokens
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], StepShape]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        shape = StepShape()
        unit = self.unit
        running = self.running
        decodes = decode_ctx = 0
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.prefill_left == 0:
                ctx = req.num_prompt + req.num_output
                if ctx <= len(req.blocks) * unit:  # fast path: a decode whose block exists
                    scheduled.append((req, 1))
                    decodes += 1
                    decode_ctx += ctx
                    budget -= 1
                    i += 1
                    continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            ok, evicted = self._allocate_or_preempt(req, n)
            preempted |= evicted
            if not ok:
                break
            scheduled.append((req, n))
            if is_decode(req, n):
                decodes += 1
                decode_ctx += req.num_tokens
            else:
                shape.add_prefill(n, req.num_computed_tokens, samples=req.num_computed_tokens + n == req.num_tokens)
            budget -= n
            i += 1
        if not preempted:
            admitted_decodes, admitted_ctx = self._admit(scheduled, shape, budget)
            decodes += admitted_decodes
            decode_ctx += admitted_ctx
        self._add_decodes(shape, decodes, decode_ctx)
        return scheduled, shape

    def _allocate_or_preempt(self, req: SimRequest, n: int) -> tuple[bool, bool]:
        """Blocks for ``n`` more tokens of ``req``, preempting the most recently admitted running
        requests (``req`` itself last) until they fit: (allocated, preempted any)."""
        self._head_hits = None
        preempted = False
        allocate = self.kv.allocate_slots
        while not allocate(req, n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted = True
            if victim is req:
                return False, True
        return True, preempted

    def _admit(self, scheduled: list[tuple[SimRequest, int]], shape: StepShape, budget: int) -> tuple[int, int]:
        """Strict-FCFS admission of waiting requests into what is left of the step's budget.

        Returns the decodes among them (:func:`is_decode`: preempted requests left with their last
        token) and their context tokens, for the caller's decode sums.
        """
        running, kv, lora = self.running, self.kv, self.lora
        head, self._head_hits = self._head_hits, None  # _can_admit_head's lookup for waiting[0], if still valid
        decodes = decode_ctx = 0
        tier = self.tier
        blocked: list[str] = []
        if lora is not None:
            lora.begin_admission()
        i = 0
        while i < len(self.waiting) and budget > 0 and len(running) < self.max_num_seqs:
            req = self.waiting[i]
            if lora is not None and req.lora_name is not None and not lora.available(req.lora_name, blocked):
                i += 1  # it waits for a slot; those behind it may still go
                continue
            if head is not None and head[0] is req:
                _, hits, gpu_tokens = head
            else:
                hits, gpu_tokens = kv.get_computed_blocks(req)
            run = kv.get_tier_run(req, len(hits)) if tier is not None else []
            recomputed = 0
            if run and tier is not None:  # the engine's rule (worker/engine/scheduler.py)
                if tier.should_load(len(run), gpu_tokens, self.speed):
                    tier.pin(run)
                else:
                    recomputed, run = len(run), []
            loaded = len(run) * self.unit
            hit_tokens = gpu_tokens + loaded
            num_tokens = req.num_prompt + req.num_output  # (req.num_tokens, without the property call)
            n = min(num_tokens - hit_tokens, budget)
            if not kv.allocate_slots(req, loaded + n, hits):
                if run and tier is not None:
                    tier.unpin(run)
                break
            if tier is not None:
                if run:
                    kv.plan_tier_load(req, run, len(hits))
                elif recomputed:
                    tier.note_recomputed(recomputed)
                tier.note_hits(req.block_hashes[:len(hits)])
            if i:
                del self.waiting[i]
            else:
                self.waiting.popleft()
            if lora is not None and req.lora_name is not None:
                lora.pin(req.lora_name)
                self.lora_running += 1
            self.queued_prefill_tokens -= hit_tokens
            req.prefill_left -= hit_tokens
            req.num_computed_tokens = hit_tokens
            if req.cached_tokens < 0:
                req.cached_tokens = hit_tokens
                req.loaded_tokens = loaded
            running.append(req)
            self.running_tokens += num_tokens
            scheduled.append((req, n))
            if is_decode(req, n):
                decodes += 1
                decode_ctx += num_tokens
            else:
                shape.add_prefill(n, hit_tokens, samples=hit_tokens + n == num_tokens)
            budget -= n
        if lora is not None:
            lora.end_admission(i >= len(self.waiting), blocked)
        return decodes, decode_ctx

    def _add_decodes(self, shape: StepShape, decodes: int, decode_ctx: int) -> None:
        """Decodes summed at once: what ``StepShape.add_decode`` adds, per decoding sequence.

        ``decodes`` counts every sequence the engine would label a decode (:func:`is_decode`).
        """
        self._decodes = decodes
        self._prefill_pairs = shape.attention_pairs
        shape.tokens += decodes
        shape.sampled += decodes
        shape.attention_pairs += decode_ctx
        shape.kv_tokens += decode_ctx
        shape.num_seqs += decodes

    def _apply_step(self, now: float) -> None:
        done = []
        decodes = 0
        for req, n in self._batch:
            if req.prefill_left == 0:
                req.num_computed_tokens += 1
                req.num_output += 1
            elif not self._apply_prefill(req, n, now):
                continue
            decodes += 1
            if req.num_output >= req.max_tokens:
                done.append(req)
        self.running_tokens += decodes
        self._finish(done, now)

    def _apply_prefill(self, req: SimRequest, n: int, now: float) -> bool:
        """A prefill chunk of ``n`` tokens is computed: its full blocks are registered and, when it
        ends the prompt (or the recompute), a token comes out (True)."""
        req.prefill_left -= n
        self.queued_prefill_tokens -= n
        self.prefill_tokens_computed += n
        req.num_computed_tokens += n
        self.kv.cache_computed_blocks(req)
        if req.prefill_left:
            return False
        req.num_output += 1
        if req.first_token_at is None:
            req.first_token_at = now
            self.first_tokens.append(req)
        return True

    def _finish(self, done: list[SimRequest], now: float) -> None:
        lora = self.lora
        for req in done:
            if lora is not None and req.lora_name is not None:
                lora.unpin(req.lora_name)
                lora.left(req.lora_name)
                self.lora_running -= 1
            self.running.remove(req)
            self.running_tokens -= req.num_tokens
            req.finished_at = now
            self.kv.free(req)
            self.finished.append(req)
