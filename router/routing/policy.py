"""Routing policies: pure functions from (request, candidates, config) to a Decision.

``cache_aware`` (the default) minimises each candidate's predicted time to first token, minus a
locality bonus, plus a fair-share wait (design.md section 4)::

    cost(w) = pending_s(w) + fair_wait_s(w) + prefill_s(P, 0, w)
              - min(L, 1) * shared_saved_s(w) - L(a) * exclusive_saved_s(w)

with ``P`` prompt tokens, ``c_w`` predicted cached tokens on ``w``, and the prefill cost of
``u`` new tokens over ``c`` cached ones ``prefill_s(u, c, w) = u / rate_w * (1 + (c + u/2) /
knee)`` (linear work plus attention over the cached prefix and the new tokens themselves).

**Shared and exclusive.** ``saved_s(w) = prefill_s(P, 0, w) - prefill_s(P - c_w, c_w, w)`` is
what w's cache saves this request. The part of ``c_w`` that another candidate also holds (the
second-longest match ``c_2``) is *shared*; only a unique longest match has an *exclusive* part
``c_w - c_2``, and only that part is worth ``L`` times its saving: it is what keeps a session's
history or a document with the worker that holds it. A shared prefix (a system prompt many
workers hold) is worth the time it saves and no more, so it replicates as soon as its holders
queue up, instead of drawing every request that starts with it.

**Fair share.** ``fair_wait_s(w)`` (:func:`fair_share_wait_s`) makes a worker holding more than
its share of the requests in flight -- bounded-load consistent hashing's ``ceil(1.25 x mean)``
-- look busier by one fair-share slot turnover (its ``service_s / share``) per request beyond
it. A long exclusive prefix still outweighs it; a small saving (the first copy of a popular
prompt, a short document) does not, so locality never piles the fleet's work onto a few
workers while others idle. Within the share it is 0.

``L(a)`` is the **locality weight** for affinity ``a`` in [0, 1], the squared odds of ``a``::

    L(a) = (a / (1 - a))**2      a:  0    0.2    0.5    0.8    0.9    1
                                 L:  0    1/16   1      16     81     inf

* ``a = 0``: ``L = 0``, the cache is ignored: the least pending work (and fair-share wait) wins;
* ``a = 0.5``: ``L = 1``, every saving at its physical value: ``cost`` is the predicted TTFT
  (plus the fair-share wait);
* ``a = 0.8`` (the default, chosen from the sweep in docs/benchmarks.md): ``L = 16``;
* ``a = 1``: ``L = inf``: a unique longest match wins outright (then nothing but the hard limit
  counts); a longest match several workers hold is placed by predicted TTFT, as the limit of
  ``a -> 1`` does.

Near-ties -- candidates within ``tie_tolerance`` (relative) + ``tie_floor_s`` of the best cost --
go to the earliest of them on the request key's ring (its session key, or its first chunks),
so two routers that see the same costs place a new prefix on the same worker, and a hot prefix
spills to the next worker on its ring rather than to an arbitrary one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from protocol import ATTENTION_KNEE_TOKENS

POLICIES = ("cache_aware", "least_load", "consistent_hash", "round_robin")
REASONS = ("prefix", "session", "ring", "spill", "least_load", "round_robin", "hash")
NOT_ON_RING = 1 << 30  # ring_rank of a candidate that is not among the key's ring successors


class NoCapacity(Exception):
    """Every candidate is over its hard limit (or there are none): the caller answers 429/503."""

    def __init__(self, message: str, candidates: int) -> None:
        super().__init__(message)
        self.candidates = candidates


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The knobs of the policies (and of the candidate set they see)."""

    policy: str = "cache_aware"
    affinity: float = 0.8
    tie_tolerance: float = 0.05
    tie_floor_s: float = 0.001
    attention_knee_tokens: float = ATTENTION_KNEE_TOKENS
    hash_load_factor: float = 1.25
    ring_candidates: int = 3
    load_candidates: int = 2
    match_candidates: int = 8  # most prefix holders scored (the longest matches)


@dataclass(slots=True)
class Candidate:
    """One worker as the policy sees it."""

    worker_id: str
    cached_tokens: int = 0
    pending_s: float = 0.0
    tokens_per_s: float = 4000.0
    in_system: int = 0
    over_limit: bool = False
    ring_rank: int = NOT_ON_RING
    matched_chunks: int = 0  # leading chunk hashes of the request the index says it holds
    service_s: float = 0.0  # mean time one of its requests holds a batch slot (s)


@dataclass(slots=True)
class RouteRequest:
    """What the policy needs to know about the request itself."""

    prompt_tokens: int
    affinity: float | None = None
    session: bool = False
    sequence: int = 0
    load_bound: int = 0


@dataclass(slots=True)
class Decision:
    """Where a request goes, why, and what the router expects to find cached there."""

    worker_id: str
    reason: str
    predicted_cached_tokens: int
    cost_s: float = 0.0
    costs: tuple[tuple[str, float], ...] = ()
    prompt_tokens: int = 0
    matched_chunks: int = 0


def locality_weight(affinity: float) -> float:
    """``L(a) = (a / (1 - a))**2``: 0 at a=0, 1 at a=0.5, 16 at a=0.8, infinite at a=1."""
    if affinity <= 0.0:
        return 0.0
    if affinity >= 1.0:
        return math.inf
    odds = affinity / (1.0 - affinity)
    return odds * odds


def prefill_seconds(new_tokens: int, cached_tokens: int, tokens_per_s: float, knee: float) -> float:
    """Predicted prefill time of ``new_tokens`` over a cached prefix of ``cached_tokens``."""
    if new_tokens <= 0:
        return 0.0
    return new_tokens / tokens_per_s * (1.0 + (cached_tokens + new_tokens * 0.5) / knee)


def hash_load_bound(total_in_system: int, workers: int, factor: float) -> int:
    """Bounded-load consistent hashing: no worker may hold more than this many requests."""
    return max(1, math.ceil(factor * (total_in_system + 1) / max(1, workers)))


def choose(request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
    """Pick a worker for ``request`` among ``candidates`` with ``config.policy``.

    Raises :class:`NoCapacity` when no candidate is under its hard limit.
    """
    policy = config.policy
    if policy == "cache_aware":
        return _cache_aware(request, candidates, config)
    if policy == "least_load":
        return _least_load(request, candidates, config)
    if policy == "consistent_hash":
        return _consistent_hash(request, candidates)
    if policy == "round_robin":
        return _first_available(request, candidates, "round_robin")
    raise ValueError(f"unknown policy {policy!r}")


def _open(candidates: Sequence[Candidate]) -> list[Candidate]:
    usable = [c for c in candidates if not c.over_limit]
    if not usable:
        raise NoCapacity("every worker is at its in-flight limit" if candidates else "no workers",
                         len(candidates))
    return usable


def _decide(request: RouteRequest, chosen: Candidate, reason: str, cost: float,
            costs: tuple[tuple[str, float], ...] = ()) -> Decision:
    return Decision(chosen.worker_id, reason, chosen.cached_tokens, cost, costs, request.prompt_tokens,
                    chosen.matched_chunks)


def fair_share_wait_s(in_system: int, service_s: float, bound: int) -> float:
    """The wait a new request would have on a worker with only its fair share of slots.

    ``bound`` is the fleet's fair share of requests in flight (:func:`hash_load_bound`); a
    worker holding ``in_system`` requests looks busier by ``service_s / bound`` (one fair-share
    slot turnover) per request beyond it. 0 within the share, or when ``bound`` is 0 (unknown).
    """
    ahead = in_system + 1 - bound
    if bound <= 0 or ahead <= 0:
        return 0.0
    return ahead * service_s / bound


def _cache_aware(request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
    usable = _open(candidates)
    affinity = config.affinity if request.affinity is None else request.affinity
    weight = locality_weight(affinity)
    shared_weight = min(weight, 1.0)
    knee = config.attention_knee_tokens
    prompt = max(1, request.prompt_tokens)
    bound = request.load_bound
    # Only a unique longest match holds a part of the prompt that no other candidate could serve
    # from its cache: that exclusive part is what locality weights beyond its physical value. The
    # part others hold too is valued at most as the TTFT it saves, so a popular prefix (a shared
    # system prompt) replicates as soon as its holders queue up.
    matched = [c.cached_tokens if c.cached_tokens < prompt else prompt - 1 for c in usable]
    first = max(matched)
    owner = -1
    second = 0
    if first > 0 and matched.count(first) == 1:
        owner = matched.index(first)
        second = max((m for i, m in enumerate(matched) if i != owner), default=0)
    follow_cache = weight == math.inf and owner >= 0
    costs: list[tuple[str, float]] = []
    pool: list[tuple[float, float, Candidate]] = []  # (cost, full prefill, candidate)
    best_cost = math.inf
    best_full = 0.0
    for i, c in enumerate(usable):
        rate = c.tokens_per_s
        full = prefill_seconds(prompt, 0, rate, knee)
        cached = matched[i]
        actual = prefill_seconds(prompt - cached, cached, rate, knee) if cached > 0 else full
        cost = c.pending_s + fair_share_wait_s(c.in_system, c.service_s, bound)
        if i != owner:
            cost += full - shared_weight * (full - actual)
        elif follow_cache:
            cost += actual
        else:
            common = prefill_seconds(prompt - second, second, rate, knee) if second > 0 else full
            cost += full - shared_weight * (full - common) - weight * (common - actual)
        costs.append((c.worker_id, cost))
        if follow_cache and i != owner:
            continue  # following the cache: only its one exclusive holder competes
        pool.append((cost, full, c))
        if cost < best_cost:
            best_cost, best_full = cost, full
    tolerance = config.tie_floor_s + config.tie_tolerance * max(abs(best_cost), best_full)
    limit = best_cost + tolerance
    chosen: Candidate | None = None
    chosen_cost = 0.0
    near = 0
    for cost, _, c in pool:
        if cost > limit:
            continue
        near += 1
        # Earliest on the key's ring first; off the ring, the lowest cost, then the worker id.
        if chosen is None or (c.ring_rank, cost if c.ring_rank == NOT_ON_RING else 0.0, c.worker_id) < (
                chosen.ring_rank, chosen_cost if chosen.ring_rank == NOT_ON_RING else 0.0, chosen.worker_id):
            chosen, chosen_cost = c, cost
    assert chosen is not None
    # The ring decided if it broke a tie, or if the request simply went to the key's owner.
    by_ring = chosen.ring_rank != NOT_ON_RING and (near > 1 or chosen.ring_rank == 0)
    if weight > 0 and chosen.cached_tokens > 0:
        reason = "prefix"
    elif weight > 0 and any(c.cached_tokens > 0 for c in candidates):
        reason = "spill"
    elif by_ring:
        reason = "session" if request.session else "ring"
    else:
        reason = "least_load"
    return _decide(request, chosen, reason, chosen_cost, tuple(costs))


def _least_load(request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
    usable = _open(candidates)
    best = min(usable, key=lambda c: c.pending_s)
    tolerance = config.tie_floor_s + config.tie_tolerance * best.pending_s
    near = [c for c in usable if c.pending_s <= best.pending_s + tolerance]
    chosen = min(near, key=lambda c: (c.in_system, c.ring_rank, c.worker_id))
    costs = tuple((c.worker_id, c.pending_s) for c in usable)
    return _decide(request, chosen, "least_load", chosen.pending_s, costs)


def _consistent_hash(request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
    """Candidates come in ring order from the key's owner; take the first under the bound."""
    bound = request.load_bound
    for hops, c in enumerate(candidates):
        if not c.over_limit and (bound <= 0 or c.in_system < bound):
            return _decide(request, c, "hash" if hops == 0 else "spill", c.pending_s)
    raise NoCapacity("every worker on the ring is over the load bound", len(candidates))


def _first_available(request: RouteRequest, candidates: Sequence[Candidate], reason: str) -> Decision:
    for c in candidates:
        if not c.over_limit:
            return _decide(request, c, reason, c.pending_s)
    raise NoCapacity("every worker is at its in-flight limit" if candidates else "no workers",
                     len(candidates))
