"""``round_robin``: each routable worker in turn (sorted by id), skipping those at their hard limit."""
from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Mapping, Sequence

from router.routing.policies.base import Policy, decision_for, register, under_limit
from router.routing.policy import Candidate, Decision, PolicyConfig, RouteRequest

if TYPE_CHECKING:
    from router.routing.balancer import Balancer
    from router.routing.prompt import PromptKey


@register
class RoundRobin(Policy):
    """The next worker in the rotation under its hard limit."""

    name = "round_robin"
    order = 30

    def candidates(self, view: Balancer, request: RouteRequest, prompt: PromptKey, matches: Mapping[str, int],
                   now: float, exclude: AbstractSet[str], config: PolicyConfig) -> list[Candidate]:
        """The rotation from the request's turn (its decision sequence number) to the first open worker."""
        order = view.rotation_order
        out: list[Candidate] = []
        n = len(order)
        for i in range(n):
            worker_id = order[(request.sequence + i) % n]
            if worker_id in exclude:
                continue
            c = view.candidate(worker_id, matches.get(worker_id, 0), prompt, request.prompt_tokens, now)
            out.append(c)
            if not c.over_limit:
                break
        return out

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
        """The first candidate under its hard limit."""
        chosen = under_limit(candidates)[0]
        return decision_for(request, chosen, "round_robin", chosen.pending_s)
