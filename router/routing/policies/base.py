"""The interface every routing policy implements, and the registry of policies by name.

A policy is one module of ``router/routing/policies/``: a :class:`Policy` subclass decorated
with :func:`register` (the package imports every module in it). Whatever lists or checks policy
names asks the registry -- ``--policy``'s choices (the router's and the simulator's settings),
``PUT /admin/config``, the routing report's rows -- and the Balancer asks :func:`get_policy` on
every decision, so adding a policy touches one file::

    @register
    class PowerOfTwo(Policy):
        name = "power_of_two"

        def candidates(self, view, request, prompt, matches, now, exclude, config):
            return view.candidate_set(prompt, matches, request.prompt_tokens, now, exclude, config)

        def choose(self, request, candidates, config):
            best = min(under_limit(candidates), key=lambda c: c.pending_s)
            return decision_for(request, best, "least_load", best.pending_s)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, AbstractSet, ClassVar, Mapping, Sequence, TypeVar

from router.routing.policy import Candidate, Decision, NoCapacity, PolicyConfig, RouteRequest

if TYPE_CHECKING:
    from router.routing.balancer import Balancer
    from router.routing.prompt import PromptKey


class Policy(ABC):
    """A routing policy: which workers it scores, and how it picks one of them. No I/O.

    ``candidates`` reads the Balancer's view (the index matches it looked up for the request,
    its ring, its load board) and may set ``request.load_bound``; ``choose`` sees only the
    request, the candidates and the knobs, so it can be tested on hand-made candidates.
    """

    name: ClassVar[str]
    order: ClassVar[int] = 100  # where it is listed (choices, the report's rows): lower first, then by name
    uses_affinity: ClassVar[bool] = False  # reads the affinity strength (the report runs it at several)

    @abstractmethod
    def candidates(self, view: Balancer, request: RouteRequest, prompt: PromptKey, matches: Mapping[str, int],
                   now: float, exclude: AbstractSet[str], config: PolicyConfig) -> list[Candidate]:
        """The workers ``choose`` will see for ``request`` (never one in ``exclude``)."""

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
        """Pick one of ``candidates``; raises :class:`NoCapacity` when none can take the request."""


_REGISTRY: dict[str, Policy] = {}
P = TypeVar("P", bound=type[Policy])


def register(cls: P) -> P:
    """Class decorator: route with ``cls`` (a :class:`Policy` subclass) under ``cls.name``."""
    name = cls.name
    if name in _REGISTRY:
        raise ValueError(f"policy {name!r} is already registered")
    _REGISTRY[name] = cls()
    return cls


def unregister(name: str) -> None:
    """Forget the policy ``name`` (a no-op if there is none)."""
    _REGISTRY.pop(name, None)


def get_policy(name: str) -> Policy:
    """The registered policy ``name``; raises ``ValueError`` for an unknown one."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}") from None


def policy_names() -> tuple[str, ...]:
    """Every registered policy's name, in listing order (:attr:`Policy.order`, then name)."""
    return tuple(sorted(_REGISTRY, key=lambda n: (_REGISTRY[n].order, n)))


def choose(request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
    """Pick a worker for ``request`` among ``candidates`` with the policy ``config.policy``.

    Raises :class:`NoCapacity` when no candidate can take it, ``ValueError`` for an unknown policy.
    """
    return get_policy(config.policy).choose(request, candidates, config)


def under_limit(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates under their hard limit; raises :class:`NoCapacity` when there are none."""
    usable = [c for c in candidates if not c.over_limit]
    if not usable:
        raise NoCapacity("every worker is at its in-flight limit" if candidates else "no workers",
                         len(candidates))
    return usable


def decision_for(request: RouteRequest, chosen: Candidate, reason: str, cost: float,
                 costs: tuple[tuple[str, float], ...] = ()) -> Decision:
    """The :class:`Decision` sending ``request`` to ``chosen``."""
    # Decision.__init__ called directly: calling the class with keywords packs them into a dict
    # and unpacks it again (CPython 3.11), a microsecond of every decision.
    decision = object.__new__(Decision)
    _init_decision(decision, worker_id=chosen.worker_id, reason=reason,
                   predicted_cached_tokens=chosen.cached_tokens, cost_s=cost, costs=costs,
                   prompt_tokens=request.prompt_tokens, matched_chunks=chosen.matched_chunks)
    return decision


_init_decision = Decision.__init__
