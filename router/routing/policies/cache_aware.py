"""``cache_aware``: the least predicted time to first token, minus a locality bonus (the default).

The cost of each candidate is the cost model of ``router/routing/policy.py``: its pending work,
its fair-share wait, and this prompt's prefill there, less the locality bonus its cache earns at
affinity ``a``. The candidates are the Balancer's candidate set (the longest prefix matches, the
key's ring successors, the least-loaded workers: :meth:`Balancer.candidate_set`).

Near-ties -- candidates within ``tie_tolerance`` (relative) + ``tie_floor_s`` of the best cost --
go to one whose cached prefix needs no load from a CPU KV tier (``Candidate.transfer_s`` 0), then
to the earliest of them on the request key's ring (its session key, or its first chunks),
so two routers that see the same costs place a new prefix on the same worker, and a hot prefix
spills to the next worker on its ring rather than to an arbitrary one.

Reasons: ``prefix`` (it went where its prefix is cached), ``spill`` (a worker holds a prefix but
another was cheaper), ``ring`` / ``session`` (nothing cached: the key's ring placed it),
``least_load`` (nothing cached, off the ring, or ``a = 0``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, AbstractSet, Mapping, Sequence

from router.routing import hotloop
from router.routing.policies.base import Policy, decision_for, register, under_limit
from router.routing.policy import (NOT_ON_RING, Candidate, Decision, PolicyConfig, RouteRequest,
                                   hash_load_bound, locality_weight)

if TYPE_CHECKING:
    from router.routing.balancer import Balancer
    from router.routing.prompt import PromptKey


FAIR_SHARE_CAP = 2  # in flight on one worker at most: this many times the fleet's fair share


@register
class CacheAware(Policy):
    """Minimise predicted TTFT minus the locality bonus; near-ties go to the key's ring."""

    name = "cache_aware"
    order = 0
    uses_affinity = True

    def candidates(self, view: Balancer, request: RouteRequest, prompt: PromptKey, matches: Mapping[str, int],
                   now: float, exclude: AbstractSet[str], config: PolicyConfig) -> list[Candidate]:
        """The Balancer's candidate set; sets the fleet's fair share as ``request.load_bound``."""
        # The fair share of requests in flight: bounded-load consistent hashing's bound, taken
        # as if every worker held at least one request -- at light load a worker holding
        # one more request than the others is not overloaded.
        workers = len(view.routable_ids)
        request.load_bound = hash_load_bound(max(view.board.total_in_system, workers - 1), workers,
                                             config.hash_load_factor)
        return view.candidate_set(prompt, matches, request.prompt_tokens, now, exclude, config)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
        """The candidate of least cost (see the module docstring); near-ties by ring order."""
        bound = request.load_bound
        affinity = config.affinity if request.affinity is None else request.affinity
        weight = locality_weight(affinity)
        shared_weight = min(weight, 1.0)
        knee = config.attention_knee_tokens
        prompt = max(1, request.prompt_tokens)
        hot = hotloop.hot
        if hot is not None and type(candidates) is list:
            # This method's loops compiled (router/routing/_hotloop.c): the same costs and choice,
            # None if no candidate is under its hard limit, NotImplemented for a value they were
            # not written for (then the loops below run).
            scored = hot.choose(candidates, FAIR_SHARE_CAP * bound if bound > 0 else 0, prompt, bound, weight,
                                shared_weight, knee, config.tie_floor_s, config.tie_tolerance)
            if scored is None:
                under_limit(candidates)  # raises NoCapacity
            if scored is not NotImplemented:
                chosen, chosen_cost, costs, near = scored
                return _decision(request, candidates, chosen, chosen_cost, costs, near, weight)
        if bound > 0:
            # The spill allowance is a hard cap: past twice its fair share of requests in flight no
            # worker takes more, whatever its cache or its reported speed (a worker that lies about
            # its load cannot take the fleet; bounded-load consistent hashing's guarantee). If
            # every worker under its hard limit is past it, any of them.
            spill_cap = FAIR_SHARE_CAP * bound
            usable = ([c for c in candidates if not c.over_limit and c.in_system < spill_cap]
                      or under_limit(candidates))
        else:
            usable = under_limit(candidates)
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
            second = max(matched[:owner] + matched[owner + 1:], default=0)
        follow_cache = weight == math.inf and owner >= 0
        costs: list[tuple[str, float]] = []
        pool: list[tuple[float, float, Candidate]] = []  # (cost, full prefill, candidate)
        best_cost = math.inf
        best_full = 0.0
        # The hot loop of every decision: prefill_seconds and fair_share_wait_s written out (the
        # same expressions, so the same floats; every new-token count here is >= 1).
        half_prompt = prompt * 0.5
        for i, c in enumerate(usable):
            rate = c.tokens_per_s
            full = prompt / rate * (1.0 + half_prompt / knee)
            cached = matched[i]
            # A CPU-tier part of the hit costs its transfer (c.transfer_s, see tier_credit).
            if cached > 0:
                new = prompt - cached
                actual = new / rate * (1.0 + (cached + new * 0.5) / knee) + c.transfer_s
            else:
                actual = full
            cost = c.pending_s + c.adapter_s
            ahead = c.in_system + 1 - bound
            if bound > 0 and ahead > 0:
                cost += ahead * c.service_s / bound
            if i != owner:
                cost += full - shared_weight * (full - actual)
            elif follow_cache:
                cost += actual
            else:
                if second > 0:
                    new = prompt - second
                    common = new / rate * (1.0 + (second + new * 0.5) / knee)
                else:
                    common = full
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
        chosen_key: tuple[bool, int, float, str] = (True, 0, 0.0, "")
        chosen_cost = 0.0
        near = 0
        for cost, _, c in pool:
            if cost > limit:
                continue
            near += 1
            # One whose hit needs no transfer from a CPU tier first (the GPU copy is there already,
            # and the link stays free); then earliest on the key's ring; off the ring, the lowest
            # cost, then the worker id.
            key = (c.transfer_s > 0, c.ring_rank, cost if c.ring_rank == NOT_ON_RING else 0.0, c.worker_id)
            if chosen is None or key < chosen_key:
                chosen, chosen_key, chosen_cost = c, key, cost
        assert chosen is not None
        return _decision(request, candidates, chosen, chosen_cost, tuple(costs), near, weight)


def _decision(request: RouteRequest, candidates: Sequence[Candidate], chosen: Candidate, cost: float,
              costs: tuple[tuple[str, float], ...], near: int, weight: float) -> Decision:
    """The decision for ``chosen`` among ``near`` near-ties, with its reason."""
    # The ring decided if it broke a tie, or if the request simply went to the key's owner.
    by_ring = chosen.ring_rank != NOT_ON_RING and (near > 1 or chosen.ring_rank == 0)
    reason = ""
    if weight > 0:
        if chosen.cached_tokens > 0:
            reason = "prefix"
        else:  # (a loop, not any() over a generator: this runs for every request)
            for c in candidates:
                if c.cached_tokens > 0:
                    reason = "spill"
                    break
    if not reason:
        reason = ("session" if request.session else "ring") if by_ring else "least_load"
    return decision_for(request, chosen, reason, cost, costs)
