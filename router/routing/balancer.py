"""Balancer: the router's routing brain -- prefix index, ring, loads and policy -- with no I/O.

The HTTP router and the offline fleet simulator drive the same object::

    balancer = Balancer(PolicyConfig(), chunk_size=DEFAULT_CHUNK_SIZE)
    balancer.add_worker("w1", block_size=16)
    decision = balancer.decide(prompt_key, now)          # hash lookup + candidates + policy
    booking = balancer.dispatch(decision, prompt_key, now)  # optimistic insert, in-flight
    balancer.first_byte(booking, now)                    # prefill done: not pending any more
    balancer.finish(booking, now, usage=(prompt_tokens, cached_tokens))  # feedback
    balancer.apply_kv_event(event, now); balancer.apply_report(report, now)

**Candidates.** A decision never scores the whole fleet: its policy (``router/routing/policies/``)
asks this object for the workers it will score. ``cache_aware`` and ``least_load`` take
:meth:`Balancer.candidate_set`: the workers that match a prefix of the request (at most the
``match_candidates`` longest matches), the first ``ring_candidates`` workers on the request key's
ring, and the ``load_candidates`` workers with the least prefill backlog (a heap on their virtual
finish time, see ``router/routing/load.py``). That keeps a decision at a few microseconds for
1,000 workers, and it is a heuristic, not a full scan: the best-cached worker, the key's owner
and the idlest prefill queue are always scored, but a worker outside the set can have a lower
cost than every one in it -- one with a short match beyond the ``match_candidates`` longest, or a
little more prefill backlog but no wait for a batch slot or fair share, when the least-backlogged
ones are busy decoding. ``consistent_hash`` walks the key's ring, ``round_robin`` the rotation.

**Predicted cached tokens.** The index matches bytes (chunks); the worker counts tokens. The
router learns tokens per byte from the ``prompt_tokens`` workers report, per model and per
endpoint (``PromptKey.ratio_key``: a chat template adds tokens a completion does not), as an EMA
(``tokens_per_byte_alpha``; ``tokens_per_byte`` until the first report), and predicts
``floor(min(m * chunk_size * tokens_per_byte, P - 1) / block_size) * block_size`` for ``m``
matched chunks of a ``P``-token prompt: a worker's prefix cache only ever serves whole blocks,
and always recomputes the last prompt token.

**Precise backends.** Where the router reads a backend's own KV events and has the request's
token ids (``PromptKey.tokens``, ``router/routing/precise.py``), that backend's predicted cached
tokens are the engine's exact answer instead of the byte-level estimate, and the prompt's token
count is exact too. A backend whose event stream is not synchronised is estimated as any other.

**Mediums.** ``index`` holds what workers keep in GPU memory; ``cpu_index`` (same class, fed by
``medium="cpu"`` KV events) what their CPU KV tiers keep. A candidate's cached prefix is its GPU
match plus the run of chunks right after it that its tier holds, credited by
:func:`~router.routing.policy.tier_credit`: at its transfer time (the worker's reported load
rate) if loading beats recomputing it, else not at all. Workers holding a prefix only in their
tier are candidates too, so a CPU holder wins over a cold worker and a GPU holder over both.

**Feedback.** When a worker reports fewer cached tokens than predicted (by more than a chunk's
tokens and a block: the prediction's own granularity), the entries past what it reported are
demoted to short-lived optimistic ones, and after
``feedback_clear_after`` such misses in a row the worker's entries are cleared (its cache
evidently no longer matches what we believe: a restart, lost events). For workers that send no
KV events (an unmodified vLLM / SGLang backend), reported hits also confirm entries.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import AbstractSet, Mapping, TypeVar

from protocol import DEFAULT_CHUNK_SIZE, KVEvent, LoadReport
from protocol.messages import KV_CLEARED, KV_REMOVED, KV_STORED
from router.routing import hotloop
from router.routing.adapters import AdapterBoard
from router.routing.index import PrefixIndex
from router.routing.load import LoadBoard, SpeedProfile, Ticket
from router.routing.precise import Pending, PreciseIndex
from router.routing.policies import get_policy
from protocol.messages import MEDIUM_CPU
from router.routing.policy import (NOT_ON_RING, Candidate, Decision, NoCapacity, PolicyConfig, RouteRequest,
                                   tier_credit)
from router.routing.prompt import PromptKey
from router.routing.ring import DEFAULT_VNODES, WorkerRing


DEFAULT_TOKENS_PER_BYTE = 0.25  # until learned: about 4 bytes per token, typical of BPE on English
# A tokenizer makes at most one token per byte (byte-level fallback), plus what a chat template
# adds around short messages; no tokenizer packs more than 64 bytes into a token on real text.
MIN_TOKENS_PER_BYTE, MAX_TOKENS_PER_BYTE = 1 / 64, 4.0
MAX_RATIOS = 10_000  # learned ratio keys (model x endpoint) kept at most
MAX_RATIO_KEY = 300
MAX_EVENT_SOURCES = 10_000  # workers whose KV events are tracked at most
DEFAULT_FEEDBACK_CLEAR_AFTER = 3
_init_request = RouteRequest.__init__


class _DepthLookup(dict):
    """The longest matches, and for any other worker its depth looked up on demand.

    Used when too many workers hold the request's first chunk to list them all (see
    ``PrefixIndex.match_top``): ``keys()`` are the longest matches, ``get`` answers for anyone.
    (The compiled candidate set reads ``_index``, ``_hashes`` and ``_now`` to answer as ``get``
    does without calling it: router/routing/_hotloop.c.)
    """

    def __init__(self, top: dict[str, int], index: PrefixIndex, hashes: list[int], now: float) -> None:
        super().__init__(top)
        self._index, self._hashes, self._now = index, hashes, now

    def get(self, worker_id: str, default: int = 0) -> int:  # type: ignore[override]
        if worker_id in self:
            return self[worker_id]
        return self._index.depth_of(self._hashes, worker_id, self._now) or default


@dataclass(slots=True, eq=False)
class Booking:
    """A dispatched request: its decision, its prompt and its in-flight ticket."""

    decision: Decision
    prompt: PromptKey
    ticket: Ticket
    pending: Pending | None = None  # its blocks on a precise backend, until they are indexed
    adapter_tier: str = ""  # a LoRA request: where its adapter was on the worker (gpu, cpu, disk)


B = TypeVar("B", bound=Booking)


class Balancer:
    """Decides where each request goes and keeps the books. No I/O; ``now`` is passed in."""

    def __init__(self, config: PolicyConfig | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 index: PrefixIndex | None = None, board: LoadBoard | None = None,
                 tokens_per_byte: float = DEFAULT_TOKENS_PER_BYTE, tokens_per_byte_alpha: float = 0.2,
                 feedback_clear_after: int = DEFAULT_FEEDBACK_CLEAR_AFTER, vnodes: int = DEFAULT_VNODES,
                 precise: PreciseIndex | None = None) -> None:
        self.config = config if config is not None else PolicyConfig()
        self.precise = precise if precise is not None else PreciseIndex()
        self.chunk_size = chunk_size
        self.index = index if index is not None else PrefixIndex()
        self.cpu_index = PrefixIndex(self.index.max_entries, self.index.optimistic_ttl_s, self.index.confirmed_ttl_s)
        self.board = board if board is not None else LoadBoard(SpeedProfile())
        self.adapters = AdapterBoard()
        self.ring = WorkerRing(vnodes=vnodes)
        self.default_tokens_per_byte = tokens_per_byte
        self.tokens_per_byte_alpha = tokens_per_byte_alpha
        self.feedback_clear_after = feedback_clear_after
        self._ratios: dict[str, float] = {}
        self._sequence = itertools.count()
        self._rr_order: tuple[str, ...] = ()
        self.routable_ids: frozenset[str] = frozenset()  # the ring's members (for membership tests, len)
        self._event_sources: set[str] = set()
        self._miss_streak: dict[str, int] = {}
        self._last_seq: dict[str, int] = {}
        self.event_gaps = 0
        self.events_ignored = 0

    # -- the fleet ---------------------------------------------------------------------------
    def add_worker(self, worker_id: str, block_size: int | None = None,
                   max_num_seqs: int | None = None, routable: bool = True) -> None:
        """Track a worker (idempotent) and, if ``routable``, put it on the ring."""
        self.board.add_worker(worker_id, block_size, max_num_seqs)
        self.set_routable(worker_id, routable)

    def set_routable(self, worker_id: str, routable: bool) -> None:
        """(Un)list a tracked worker for new requests; its load and index entries are kept."""
        if worker_id not in self.board:
            return
        if routable:
            self.ring.add(worker_id)
        else:
            self.ring.remove(worker_id)
        self.board.set_routable(worker_id, routable)
        self.routable_ids = self.ring.members
        self._rr_order = tuple(sorted(self.routable_ids))

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker entirely: ring, load, and every index entry it had."""
        self.ring.remove(worker_id)
        self.board.remove_worker(worker_id)
        self.adapters.remove_worker(worker_id)
        self.index.forget_worker(worker_id)
        self.cpu_index.forget_worker(worker_id)
        self._miss_streak.pop(worker_id, None)
        self._event_sources.discard(worker_id)
        self._last_seq.pop(worker_id, None)
        self.routable_ids = self.ring.members
        self._rr_order = tuple(sorted(self.routable_ids))

    def routable(self) -> list[str]:
        """The workers new requests may go to."""
        return list(self._rr_order)

    @property
    def rotation_order(self) -> tuple[str, ...]:
        """The routable workers sorted by id: ``round_robin``'s rotation (not copied)."""
        return self._rr_order

    # -- tokens ------------------------------------------------------------------------------
    def tokens_per_byte(self, key: str) -> float:
        """The learned tokens-per-byte ratio for a ``PromptKey.ratio_key`` (the default until learned)."""
        return self._ratios.get(key, self.default_tokens_per_byte)

    def token_ratios(self) -> dict[str, float]:
        """Every learned ratio (for snapshots)."""
        return dict(self._ratios)

    def load_token_ratios(self, ratios: dict[str, float]) -> None:
        """Adopt learned ratios (from a snapshot) for models this router has not seen yet."""
        for model, ratio in ratios.items():
            if (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio)
                    and isinstance(model, str) and len(model) <= MAX_RATIO_KEY and len(self._ratios) < MAX_RATIOS):
                self._ratios.setdefault(model, min(MAX_TOKENS_PER_BYTE, max(MIN_TOKENS_PER_BYTE, float(ratio))))

    def observe_prompt_tokens(self, key: str, num_bytes: int, prompt_tokens: int) -> None:
        """Learn from a worker's reported ``prompt_tokens`` for a rendering of ``num_bytes``."""
        if num_bytes <= 0 or prompt_tokens <= 0 or (key not in self._ratios and len(self._ratios) >= MAX_RATIOS):
            return
        # Clamped to what a tokenizer can do: a usage block claiming 10^310 tokens (or 0.0001 per
        # byte) is not evidence, and one bad answer must not poison every later decision.
        ratio = min(MAX_TOKENS_PER_BYTE, max(MIN_TOKENS_PER_BYTE, prompt_tokens / num_bytes))
        old = self._ratios.get(key)
        a = self.tokens_per_byte_alpha
        self._ratios[key] = ratio if old is None else old + a * (ratio - old)

    def estimate_tokens(self, prompt: PromptKey) -> int:
        """Estimated prompt tokens of a request (exact where its token ids are known)."""
        if prompt.tokens is not None and prompt.tokens.token_ids:
            return len(prompt.tokens.token_ids)
        return max(1, round(prompt.num_bytes * self.tokens_per_byte(prompt.ratio_key)))

    def cached_tokens_for(self, matched_chunks: int, prompt: PromptKey, prompt_tokens: int,
                          block_size: int) -> int:
        """Predicted cached tokens for ``matched_chunks`` leading chunks (see module docstring)."""
        if matched_chunks <= 0:
            return 0
        tokens = matched_chunks * self.chunk_size * self.tokens_per_byte(prompt.ratio_key)
        tokens = min(tokens, prompt_tokens - 1)
        return max(0, int(tokens // block_size) * block_size)

    # -- decisions ---------------------------------------------------------------------------
    def decide(self, prompt: PromptKey, now: float, affinity: float | None = None,
               exclude: frozenset[str] | set[str] = frozenset(),
               config: PolicyConfig | None = None) -> Decision:
        """Choose a worker for ``prompt`` with the policy ``config.policy`` (default: the balancer's).

        Raises ``NoCapacity`` when none can take it, ``ValueError`` for an unknown policy.
        """
        cfg = config or self.config
        policy = get_policy(cfg.policy)
        matches, complete = self.index.match_top(prompt.hashes, now, cfg.match_candidates)
        if not complete:
            matches = _DepthLookup(matches, self.index, prompt.hashes, now)
        if prompt.adapter is None and self.adapters.knows(prompt.model):
            prompt.adapter = prompt.model  # vLLM's convention: "model": the adapter's name
        if prompt.tokens is not None and self.precise.has_backends():
            prompt.known_cached = self.precise.cached_tokens(prompt.tokens, now) or None
        request = object.__new__(RouteRequest)  # __init__ called directly: see candidate_set
        _init_request(request, prompt_tokens=self.estimate_tokens(prompt), affinity=affinity,
                      session=prompt.session_key is not None, sequence=next(self._sequence))
        candidates = policy.candidates(self, request, prompt, matches, now, exclude, cfg)
        if not candidates:
            raise NoCapacity("no workers available", 0)
        return policy.choose(request, candidates, cfg)

    def candidate_ids(self, prompt: PromptKey, matches: Mapping[str, int], now: float,
                      exclude: frozenset[str] | set[str] = frozenset(),
                      config: PolicyConfig | None = None) -> tuple[list[str], list[str]]:
        """(candidate worker ids, the key's ring successors) of :meth:`candidate_set`.

        The ids are, in this order and without repeats, never one in ``exclude``: the routable
        workers among ``matches`` (the index's longest matches), the key's first
        ``ring_candidates`` ring successors, and :meth:`LoadBoard.least_loaded`'s
        ``load_candidates`` workers (least prefill backlog, under their hard limit).
        """
        cfg = config or self.config
        ring = self.ring
        routable = self.routable_ids
        if exclude:
            successors = [w for w in ring.successors(prompt.ring_key, cfg.ring_candidates + len(exclude))
                          if w not in exclude][:cfg.ring_candidates]
        else:
            successors = ring.successors(prompt.ring_key, cfg.ring_candidates)
        ids = {w: None for w in matches.keys() if w in routable and w not in exclude}
        if len(self.cpu_index):
            in_tier, _ = self.cpu_index.match_top(prompt.hashes, now, cfg.match_candidates)
            ids.update(dict.fromkeys(w for w in in_tier if w in routable and w not in exclude))
        known = prompt.known_cached
        if known:
            ids.update(dict.fromkeys(w for w, cached in known.items() if cached and w in routable and w not in exclude))
        ids.update(dict.fromkeys(successors))
        ids.update(dict.fromkeys(self.board.least_loaded(cfg.load_candidates, now, exclude)))
        return list(ids), successors

    def candidate(self, worker_id: str, matched: int, prompt: PromptKey, prompt_tokens: int,
                  now: float, ring_rank: int = NOT_ON_RING) -> Candidate:
        """A tracked worker as a policy sees it, holding ``matched`` leading chunks of ``prompt``."""
        w = self.board.get(worker_id)
        assert w is not None
        known = prompt.known_cached
        cached = (known[worker_id] if known and worker_id in known
                  else self.cached_tokens_for(matched, prompt, prompt_tokens, w.block_size))
        transfer_s = 0.0
        if not (known and worker_id in known) and len(self.cpu_index):
            cached, transfer_s = self._with_tier(worker_id, matched, cached, prompt, prompt_tokens, now,
                                                 self.config.attention_knee_tokens)
        adapter = prompt.adapter if self.config.adapter_routing else None
        return Candidate(worker_id=worker_id, cached_tokens=cached,
                         pending_s=w.pending_s(now), tokens_per_s=w.rate(), in_system=w.in_system,
                         over_limit=w.over_limit(), ring_rank=ring_rank, matched_chunks=matched,
                         service_s=w.service_s, transfer_s=transfer_s,
                         adapter_s=self.adapters.ready_s(worker_id, adapter, w.service_s) if adapter else 0.0)

    def _with_tier(self, worker_id: str, matched: int, gpu_cached: int, prompt: PromptKey,
                   prompt_tokens: int, now: float, knee: float) -> tuple[int, float]:
        """``(cached tokens, transfer seconds)`` of a worker whose GPU holds ``matched`` chunks
        (``gpu_cached`` tokens), with the run its CPU tier holds right after them credited."""
        run = self.cpu_index.depth_of(prompt.hashes, worker_id, now, start=matched)
        if not run:
            return gpu_cached, 0.0
        w = self.board.get(worker_id)
        assert w is not None
        total = self.cached_tokens_for(matched + run, prompt, prompt_tokens, w.block_size)
        loaded, transfer_s = tier_credit(gpu_cached, total - gpu_cached, w.rate(),
                                         w.transfer_tokens_per_s or self.board.profile.transfer_tokens_per_s, knee)
        return gpu_cached + loaded, transfer_s

    def candidate_set(self, prompt: PromptKey, matches: Mapping[str, int], prompt_tokens: int,
                      now: float, exclude: AbstractSet[str], cfg: PolicyConfig) -> list[Candidate]:
        """The workers of :meth:`candidate_ids` as candidates (see the module docstring).

        ``ring_rank`` is a worker's place among the key's ring successors (``NOT_ON_RING`` if
        it is not one of them). A LoRA request, with ``cfg.adapter_routing``, is scored among
        its adapter's workers instead, its adapter's readiness in the cost
        (:meth:`AdapterBoard.candidate_ids`, ``router/routing/adapters.py``).
        """
        adapter = prompt.adapter if cfg.adapter_routing else None
        hot = hotloop.hot
        if (hot is not None and not adapter and not exclude and not prompt.known_cached and not len(self.cpu_index)
                and (type(matches) is dict or type(matches) is _DepthLookup) and self.routable_ids):
            # The common request, this method and candidate_ids compiled whole (router/routing/_hotloop.c);
            # NotImplemented for a value it was not written for, and then the Python below runs.
            points, owners = self.ring.compiled_view()
            heap, loads = self.board.heap_view()
            built = hot.candidate_set(matches, type(matches) is _DepthLookup, self.routable_ids, points, owners,
                                      prompt.ring_key, min(cfg.ring_candidates, len(self.routable_ids)), heap, loads,
                                      cfg.load_candidates, self.chunk_size * self.tokens_per_byte(prompt.ratio_key),
                                      prompt_tokens - 1, now)
            if built is not NotImplemented:
                return built
        if adapter:
            ids, successors = self.adapters.candidate_ids(self, adapter, exclude, cfg)
        else:
            ids, successors = self.candidate_ids(prompt, matches, now, exclude, cfg)
        adapters = self.adapters
        # The hot loop of every decision (the simulator makes a million): locals, no helpers, and
        # each worker's load as the board keeps it current (WorkerLoad.rate_now, slot_wait_s,
        # over_limit_now: the values of rate(), pending_s()'s slot wait and over_limit()).
        chunk_tokens = self.chunk_size * self.tokens_per_byte(prompt.ratio_key)
        cap = prompt_tokens - 1
        load_of = self.board.loads().__getitem__
        out = []
        # Calling the class with keywords makes CPython 3.11 pack them into a dict and unpack it
        # again for __init__ (~0.45 us per candidate); calling __init__ itself passes them
        # straight through, as fast as positional arguments.
        new, init = object.__new__, Candidate.__init__
        known = prompt.known_cached or {}
        tiered = len(self.cpu_index) > 0
        # A _DepthLookup answers its longest matches as a dict would, and looks any other worker up.
        plain_get = dict.get if type(matches) is _DepthLookup else None
        if hot is not None and not adapter and not tiered and (plain_get is not None or type(matches) is dict):
            # The same loop compiled (router/routing/_hotloop.c): NotImplemented if a value is not
            # one it was written for, and then this one runs.
            built = hot.candidates(ids, successors, matches, plain_get is not None, known, self.board.loads(),
                                   chunk_tokens, cap, now)
            if built is not NotImplemented:
                return built
        for worker_id in ids:
            w = load_of(worker_id)
            if plain_get is None:
                matched = matches.get(worker_id, 0)
            else:
                matched = plain_get(matches, worker_id)
                if matched is None:
                    matched = matches.get(worker_id, 0)
            cached = 0
            if worker_id in known:
                cached = known[worker_id]
            elif matched:
                tokens = matched * chunk_tokens
                if cap < tokens:  # min(tokens, cap), max(0, ...) without the calls
                    tokens = cap
                block = w.block_size
                cached = int(tokens // block) * block
                if cached < 0:
                    cached = 0
            transfer_s = 0.0
            if tiered and worker_id not in known:
                cached, transfer_s = self._with_tier(worker_id, matched, cached, prompt, prompt_tokens, now,
                                                     cfg.attention_knee_tokens)
            backlog = w.busy_until - now
            c = new(Candidate)
            init(c, worker_id=worker_id, tokens_per_s=w.rate_now, cached_tokens=cached,
                 pending_s=(backlog if backlog > 0.0 else 0.0) + w.slot_wait_s,
                 in_system=w.in_system, over_limit=w.over_limit_now,
                 ring_rank=successors.index(worker_id) if worker_id in successors else NOT_ON_RING,
                 matched_chunks=matched, service_s=w.service_s, transfer_s=transfer_s,
                 adapter_s=adapters.ready_s(worker_id, adapter, w.service_s) if adapter else 0.0)
            out.append(c)
        return out

    # -- bookkeeping -------------------------------------------------------------------------
    def dispatch(self, decision: Decision, prompt: PromptKey, now: float,
                 booking_type: type[B] = Booking) -> B:  # type: ignore[assignment]
        """Record that ``decision`` was acted on: optimistic index insert and in-flight work.
        Returns the :class:`Booking` (of ``booking_type``: a subclass, whose added fields have
        defaults, for a caller that keeps more with it).

        Only the part of the chain the worker does not already hold is inserted: the matched
        prefix was made most recently used by the lookup itself.
        """
        worker_id = decision.worker_id
        hashes = prompt.hashes
        if len(hashes) > decision.matched_chunks:
            self.index.insert(hashes[decision.matched_chunks:] if decision.matched_chunks else hashes,
                              worker_id, now, confirmed=False)
        prefill = max(1, decision.prompt_tokens - decision.predicted_cached_tokens)
        ticket = self.board.dispatch(worker_id, prefill, now)
        pending = self.precise.dispatched(worker_id, prompt.tokens, now) if prompt.tokens is not None else None
        tier = self.adapters.dispatched(worker_id, prompt.adapter, self.board, now) if prompt.adapter else ""
        return booking_type(decision, prompt, ticket, pending, tier)

    def first_byte(self, booking: Booking, now: float) -> None:
        """The worker started answering: the request's prefill is done."""
        self.board.prefilled(booking.ticket, now)

    def finish(self, booking: Booking, now: float, usage: tuple[int, int | None] | None = None) -> None:
        """The request ended; ``usage`` = (prompt_tokens, cached_tokens) if the worker said.

        ``cached_tokens`` None (a backend that does not report it) teaches only the token ratio.
        """
        if booking.adapter_tier and not booking.ticket.finished:
            self.adapters.finished(booking.decision.worker_id, booking.prompt.adapter or "", now)
        self.board.finish(booking.ticket, now)
        if booking.pending is not None:
            self.precise.finished(booking.pending, now)
        if usage is None:
            return
        prompt_tokens, cached = usage
        prompt = booking.prompt
        worker_id = booking.decision.worker_id
        self.observe_prompt_tokens(prompt.ratio_key, prompt.num_bytes, prompt_tokens)
        w = self.board.get(worker_id)
        if cached is None or w is None:
            # w None: the worker left while this request ran; what it had cached left with it (a
            # worker re-added under the same id, e.g. a restarted pod, starts with no entries).
            return
        block = w.block_size
        chunk_tokens = max(1e-9, self.chunk_size * self.tokens_per_byte(prompt.ratio_key))
        covered = min(len(prompt.hashes), int(cached // chunk_tokens))
        has_events = worker_id in self._event_sources
        # Within the prediction's own granularity (one chunk's tokens + one block) is not a miss.
        if cached + block + chunk_tokens < booking.decision.predicted_cached_tokens:
            self.index.demote(prompt.hashes[covered:], worker_id, now)
            streak = self._miss_streak.get(worker_id, 0) + 1
            if streak >= self.feedback_clear_after:
                self.index.clear_worker(worker_id)
                streak = 0
            self._miss_streak[worker_id] = streak
        else:
            self._miss_streak[worker_id] = 0
        if not has_events:
            if covered:
                self.index.insert(prompt.hashes[:covered], worker_id, now, confirmed=True)
            self.index.insert(prompt.hashes[covered:], worker_id, now, confirmed=False)

    def event_sources_full(self) -> bool:
        """True when ``MAX_EVENT_SOURCES`` workers have sent KV events: a new id is not taken on."""
        return len(self._event_sources) >= MAX_EVENT_SOURCES

    def apply_kv_event(self, event: KVEvent, now: float) -> bool:
        """Apply a worker's KV event; False if it was ignored (another chunk size)."""
        if event.chunk_size != self.chunk_size:
            self.events_ignored += 1
            return False
        worker_id = event.worker_id
        self._event_sources.add(worker_id)
        last = self._last_seq.get(worker_id)
        if last is not None and event.seq > last + 1:
            self.event_gaps += 1
        if last is None or event.seq > last:
            self._last_seq[worker_id] = event.seq
        index = self.cpu_index if event.medium == MEDIUM_CPU else self.index
        if event.kind == KV_STORED:
            index.insert(event.hashes, worker_id, now, confirmed=True)
        elif event.kind == KV_REMOVED:
            index.remove(event.hashes, worker_id)
        elif event.kind == KV_CLEARED:
            self.index.clear_worker(worker_id)
            self.cpu_index.clear_worker(worker_id)
            self._last_seq.pop(worker_id, None)
        return True

    def apply_report(self, report: LoadReport, now: float) -> bool:
        """Apply a worker's load report (ignored for unknown workers or when stale)."""
        if not self.board.apply_report(report, now):
            return False
        self.adapters.apply_report(report, min(now, report.ts))
        return True
