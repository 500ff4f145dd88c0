"""A simulated replica whose decoding requests are kept as aggregates: step cost O(prefills), not O(batch).

:class:`~bench.sim.worker.SimWorker` is the reference: it restates the engine's scheduling rules
by touching every running request on every step. At 1,000 replicas a hot one runs 256 requests
and that loop is most of the simulator's time. :class:`AggregateWorker` gives exactly the same
results (the same step shapes, the same BlockPool calls in the same order, hence bit-identical
times and KV events; tests compare the two) by using what the rules imply about decoding
requests:

- the running list is always ``[decoding ... | prefilling ...]`` in admission order: a request
  is admitted at the tail, only the last one scheduled in a step can be left partially
  prefilled, and preemption takes from the tail; so the decoding ones are a prefix of
  ``running`` (``_ndec`` long);
- while ``max_num_seqs <= max_num_batched_tokens`` every decoding request gets exactly one
  token every step, so its progress is the replica's decode clock ``_tick``: a decoding
  request's true ``num_output`` is ``_tick + req.tick0`` (its stored counters are stale until
  it leaves the decoding prefix, when :meth:`_sync` writes them);
- a decoding request changes anything else only when it finishes or needs a new block, at
  known clock values: two heaps (``_finish_at``, ``_block_at``) hold them, so a step or a
  closed-form decode run looks only at the requests whose moment has come.

A heap entry is ``(tick, dseq, ...)``; ``dseq`` numbers a request's membership of the decoding
prefix (in running order), so an entry is stale once ``req.dseq`` changed (finished,
preempted) or, for a block entry, once the request holds another number of blocks.
"""
from __future__ import annotations

import heapq

from worker.engine.kv_cache.kv_tier import KVTier
from worker.simulator.latency import LatencyModel, StepShape

from bench.sim.simloop import decode_run_time, next_block_need, next_finish, observe_decode_run, pop_block_needs, pop_finished
from bench.sim.lora import SimLoRA
from bench.sim.worker import SimRequest, SimWorker, is_decode


class AggregateWorker(SimWorker):
    """:class:`SimWorker` with decode state as aggregates; same interface, same results.

    Requires ``max_num_seqs <= max_num_batched_tokens`` (every decode fits each step's budget);
    :func:`make_worker` falls back to the reference otherwise.
    """

    def __init__(self, worker_id: str, latency: LatencyModel, num_blocks: int, unit: int,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_caching: bool = True, decode_runs: bool = True, tier: KVTier | None = None,
                 lora: SimLoRA | None = None, lora_params: float = 0.0) -> None:
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError("AggregateWorker needs max_num_seqs <= max_num_batched_tokens")
        super().__init__(worker_id, latency, num_blocks, unit, max_num_seqs, max_num_batched_tokens,
                         enable_caching, decode_runs, tier, lora, lora_params)
        self._tick = 0  # decode steps this replica has run: the decoding requests' shared clock
        self._ndec = 0  # running[:_ndec] are decoding
        self._dseq = 0
        self._dec_base = 0  # sum of (num_prompt + tick0) over decoding requests: their context - ndec * tick
        self._finish_at: list[tuple[int, int, SimRequest]] = []  # (tick it finishes at, dseq, req)
        self._block_at: list[tuple[int, int, int, SimRequest]] = []  # (tick it needs a block at, dseq, blocks, req)

    # ------------------------------------------------------------------ decoding prefix

    def _sync(self, req: SimRequest) -> None:
        """Write a decoding request's true counters into it."""
        req.num_output = self._tick + req.tick0
        req.num_computed_tokens = req.num_prompt + req.num_output - 1

    def _push_block_need(self, req: SimRequest) -> None:
        # A decode needs a new block on the step whose context exceeds its blocks' capacity.
        nblocks = len(req.blocks)
        heapq.heappush(self._block_at, (nblocks * self.unit - req.num_prompt - req.tick0 + 1, req.dseq,
                                        nblocks, req))

    def _leave(self, req: SimRequest) -> None:
        """``req`` stops decoding (finished or preempted); its counters are made true first."""
        self._sync(req)
        self._ndec -= 1
        self._dec_base -= req.num_prompt + req.tick0
        req.dseq = -1

    # ------------------------------------------------------------------ stepping

    def _start_step(self, now: float) -> float | None:
        # SimWorker's, with _decode_run written in: most of a replica's events start a decode run.
        self.version += 1
        self._start = now
        b = self._ndec
        if (self.decode_runs and b and b == len(self.running)
                and not (self.waiting and self._can_admit_head())):
            k = min(next_finish(self._finish_at), next_block_need(self._block_at)) - self._tick
            if k >= 2:
                ctx = self.running_tokens  # every running request is decoding
                c_ctx, m_ctx = self._c_ctx, self._m_ctx
                c0 = self._c_tok * b + c_ctx * ctx
                m0 = self._m_base + m_ctx * ctx
                if self.lora is not None:
                    c0, m0 = self._with_lora(c0, m0, b)
                c1 = c_ctx * b
                m1 = m_ctx * b
                self._run = (c0, c1, m0, m1, k)
                self._end = end = now + decode_run_time(self._oh, c0, c1, m0, m1, k)
                return end
        return self._start_scheduled(now)

    def on_event(self, now: float) -> float | None:
        self.busy_s += now - self._start
        run = self._run
        if run is not None:
            c0, c1, m0, m1, k = run
            b = self._ndec
            # The engine measures every step; the run's k steps are folded in at once.
            observe_decode_run(self.speed, self._oh, c0, c1, m0, m1, k, b)
            self._tick = tick = self._tick + k
            self.running_tokens += k * b
            heap = self._finish_at
            if heap and heap[0][0] <= tick:  # most runs end on a finish; the others on a block need
                self._finish(pop_finished(heap, tick), now)
            self._run = None
        else:
            copy_s = self._finish_copies() if self.tier is not None else 0.0
            self.speed.observe(now - self._start - copy_s, *self._step_work)
            self._apply_step(now)
            self._batch = []
        self._end = None
        if self.waiting or self.running:
            return self._start_step(now)
        return None

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], StepShape]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        shape = StepShape()
        running = self.running
        preempted = stopped = False
        # Decodes whose context outgrew their blocks get one now, in running order; when none is
        # free, the most recently admitted requests are preempted (the reference's loop, for them).
        tick = self._tick
        if self._ndec and next_block_need(self._block_at) <= tick:
            for req in pop_block_needs(self._block_at, tick):
                if req.dseq < 0:
                    continue  # preempted for an earlier one
                self._sync(req)
                ok, evicted = self._allocate_or_preempt(req, 1)
                preempted |= evicted
                if not ok:
                    stopped = True  # the reference's scheduling loop ends at this request
                    break
                self._push_block_need(req)
        decodes = self._ndec
        decode_ctx = self._dec_base + decodes * tick
        budget -= decodes
        i = decodes
        while not stopped and i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            ok, evicted = self._allocate_or_preempt(req, n)
            preempted |= evicted
            if not ok:
                break
            scheduled.append((req, n))
            if is_decode(req, n):  # a recompute down to its last token: the engine calls it a decode
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

    def _apply_step(self, now: float) -> None:
        self._tick = tick = self._tick + 1  # every decoding request got its token
        heap = self._finish_at
        done = pop_finished(heap, tick) if heap and heap[0][0] <= tick else []
        decodes = self._ndec  # the decoding prefix, as scheduled: one token each
        for req, n in self._batch:  # the other chunks
            if not self._apply_prefill(req, n, now):
                continue
            num_output = req.num_output
            decodes += 1
            if num_output >= req.max_tokens:
                done.append(req)
                continue
            # Its first token is out: it starts decoding, at running[_ndec], until max_tokens.
            req.tick0 = tick0 = num_output - tick
            self._dseq = dseq = self._dseq + 1
            req.dseq = dseq
            self._ndec += 1
            self._dec_base += req.num_prompt + tick0
            heapq.heappush(heap, (req.max_tokens - tick0, dseq, req))
            self._push_block_need(req)
        self.running_tokens += decodes
        if done:
            self._finish(done, now)

    def _preempt(self, req: SimRequest) -> None:
        if req.dseq >= 0:
            self._leave(req)
        super()._preempt(req)

    def _finish(self, done: list[SimRequest], now: float) -> None:
        for req in done:
            if req.dseq >= 0:
                self._leave(req)
        super()._finish(done, now)


def make_worker(worker_id: str, latency: LatencyModel, num_blocks: int, unit: int, max_num_seqs: int,
                max_num_batched_tokens: int, decode_runs: bool = True, aggregate: bool = True,
                tier: KVTier | None = None, lora: SimLoRA | None = None, lora_params: float = 0.0) -> SimWorker:
    """A replica: :class:`AggregateWorker` when it applies and is asked for, else the reference
    (``tier``: its CPU KV tier, None: none; ``lora``: its adapter slots, None: base model only)."""
    cls = AggregateWorker if aggregate and max_num_seqs <= max_num_batched_tokens else SimWorker
    return cls(worker_id, latency, num_blocks, unit, max_num_seqs, max_num_batched_tokens,
               decode_runs=decode_runs, tier=tier, lora=lora, lora_params=lora_params)


__all__ = ["AggregateWorker", "make_worker"]
