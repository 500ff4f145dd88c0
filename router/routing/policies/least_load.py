"""``least_load``: the least pending work; the cache is ignored (a baseline, and ``a = 0`` by another road).

Among the candidates within ``tie_tolerance`` of the least pending work, the one with the fewest
requests in its system wins, then the earliest on the key's ring, then the worker id. It scores
the same candidate set as ``cache_aware`` (:meth:`Balancer.candidate_set`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Mapping, Sequence

from router.routing.policies.base import Policy, decision_for, register, under_limit
from router.routing.policy import Candidate, Decision, PolicyConfig, RouteRequest

if TYPE_CHECKING:
    from router.routing.balancer import Balancer
    from router.routing.prompt import PromptKey


@register
class LeastLoad(Policy):
    """The least pending work, near-ties by fewest requests in system."""

    name = "least_load"
    order = 10

    def candidates(self, view: Balancer, request: RouteRequest, prompt: PromptKey, matches: Mapping[str, int],
                   now: float, exclude: AbstractSet[str], config: PolicyConfig) -> list[Candidate]:
        """The Balancer's candidate set."""
        return view.candidate_set(prompt, matches, request.prompt_tokens, now, exclude, config)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
        """The least pending work; within the tie tolerance, the fewest requests in system."""
        usable = under_limit(candidates)
        best = min(usable, key=lambda c: c.pending_s)
        tolerance = config.tie_floor_s + config.tie_tolerance * best.pending_s
        near = [c for c in usable if c.pending_s <= best.pending_s + tolerance]
        chosen = min(near, key=lambda c: (c.in_system, c.ring_rank, c.worker_id))
        costs = tuple((c.worker_id, c.pending_s) for c in usable)
        return decision_for(request, chosen, "least_load", chosen.pending_s, costs)
