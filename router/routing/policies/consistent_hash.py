"""``consistent_hash``: the key's ring owner, or the next worker on the ring under the bounded load.

Bounded-load consistent hashing (Mirrokni et al.): no worker may hold more than
``ceil(hash_load_factor x (requests in flight + 1) / workers)`` requests
(:func:`~router.routing.policy.hash_load_bound`); a request walks the key's ring from its owner
to the first worker under that bound and its hard limit. Reasons: ``hash`` (the owner took it),
``spill`` (a later worker on the ring did).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Mapping, Sequence

from router.routing.policies.base import Policy, decision_for, register
from router.routing.policy import Candidate, Decision, NoCapacity, PolicyConfig, RouteRequest, hash_load_bound

if TYPE_CHECKING:
    from router.routing.balancer import Balancer
    from router.routing.prompt import PromptKey


@register
class ConsistentHash(Policy):
    """The first worker on the key's ring under the bounded load."""

    name = "consistent_hash"
    order = 20

    def candidates(self, view: Balancer, request: RouteRequest, prompt: PromptKey, matches: Mapping[str, int],
                   now: float, exclude: AbstractSet[str], config: PolicyConfig) -> list[Candidate]:
        """The ring from the key's owner up to the first worker under the bound (in ring order)."""
        bound = request.load_bound = hash_load_bound(view.board.total_in_system, len(view.routable_ids),
                                                     config.hash_load_factor)
        out: list[Candidate] = []
        for worker_id in view.ring.walk(prompt.ring_key):
            if worker_id in exclude:
                continue
            c = view.candidate(worker_id, matches.get(worker_id, 0), prompt, request.prompt_tokens, now, len(out))
            out.append(c)
            if not c.over_limit and c.in_system < bound:
                break
        return out

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
        """Candidates come in ring order from the key's owner; take the first under the bound."""
        bound = request.load_bound
        for hops, c in enumerate(candidates):
            if not c.over_limit and (bound <= 0 or c.in_system < bound):
                return decision_for(request, c, "hash" if hops == 0 else "spill", c.pending_s)
        raise NoCapacity("every worker on the ring is over the load bound", len(candidates))
