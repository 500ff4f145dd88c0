"""The records every routing policy reads and writes, and the cost model ``cache_aware`` minimises.

The policies themselves -- one module each, behind one small interface, in a registry -- live in
``router/routing/policies/``; this module holds what they share: the request (:class:`RouteRequest`),
the workers as a policy sees them (:class:`Candidate`), the answer (:class:`Decision`), the knobs
(:class:`PolicyConfig`) and the pure functions of the cost model.

``cache_aware`` (the default) minimises each candidate's predicted time to first token, minus a
locality bonus, plus a fair-share wait (design.md section 4)::

    cost(w) = pending_s(w) + adapter_s(w) + fair_wait_s(w) + prefill_s(P, 0, w)
              - min(L, 1) * shared_saved_s(w) - L(a) * exclusive_saved_s(w)

with ``P`` prompt tokens, ``c_w`` predicted cached tokens on ``w``, and the prefill cost of
``u`` new tokens over ``c`` cached ones ``prefill_s(u, c, w) = u / rate_w * (1 + (c + u/2) /
knee)`` (linear work plus attention over the cached prefix and the new tokens themselves;
:func:`prefill_seconds`). ``adapter_s(w)`` is 0 but for a LoRA request: the time its adapter
needs to be loaded on ``w`` and to find a free GPU slot there (``router/routing/adapters.py``).

**Shared and exclusive.** ``saved_s(w) = prefill_s(P, 0, w) - prefill_s(P - c_w, c_w, w)`` is
what w's cache saves this request. The part of ``c_w`` that another candidate also holds (the
second-longest match ``c_2``) is *shared*; only a unique longest match has an *exclusive* part
``c_w - c_2``, and only that part is worth ``L`` times its saving: it is what keeps a session's
history or a document with the worker that holds it. A shared prefix (a system prompt many
workers hold) is worth the time it saves and no more, so it replicates as soon as its holders
queue up, instead of drawing every request that starts with it.

**Fair share.** ``fair_wait_s(w)`` (:func:`fair_share_wait_s`) makes a worker holding more than
its share of the requests in flight -- bounded-load consistent hashing's ``ceil(1.25 x mean)``,
:func:`hash_load_bound` -- look busier by one fair-share slot turnover (its ``service_s /
share``) per request beyond it. A long exclusive prefix still outweighs it; a small saving (the
first copy of a popular prompt, a short document) does not, so locality never piles the fleet's
work onto a few workers while others idle. Within the share it is 0.

``L(a)`` is the **locality weight** for affinity ``a`` in [0, 1], the squared odds of ``a``
(:func:`locality_weight`; the table of what each value does is docs/routing.md, "Affinity
strength")::

    L(a) = (a / (1 - a))**2      a:  0    0.2    0.5    0.8    0.9    1
                                 L:  0    1/16   1      16     81     inf

* ``a = 0``: ``L = 0``, the cache is ignored: the least pending work (and fair-share wait) wins;
* ``a = 0.5``: ``L = 1``, every saving at its physical value: ``cost`` is the predicted TTFT
  (plus the fair-share wait);
* ``a = 0.8`` (:data:`DEFAULT_AFFINITY`, chosen from the sweep in docs/benchmarks.md): ``L = 16``;
* ``a = 1``: ``L = inf``: a unique longest match wins outright (then nothing but the hard limit
  counts); a longest match several workers hold is placed by predicted TTFT, as the limit of
  ``a -> 1`` does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from protocol import ATTENTION_KNEE_TOKENS

DEFAULT_POLICY = "cache_aware"
DEFAULT_AFFINITY = 0.8  # the default affinity strength everywhere: router, simulator, reports
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

    policy: str = DEFAULT_POLICY
    affinity: float = DEFAULT_AFFINITY
    tie_tolerance: float = 0.05
    tie_floor_s: float = 0.001
    attention_knee_tokens: float = ATTENTION_KNEE_TOKENS
    hash_load_factor: float = 1.25
    ring_candidates: int = 3
    load_candidates: int = 2
    match_candidates: int = 8  # most prefix holders scored (the longest matches)
    adapter_routing: bool = True  # LoRA requests: adapter residency in the cost, bounded replication
    adapter_spare: int = 1  # workers an adapter may run on beyond what its traffic needs


@dataclass(slots=True, kw_only=True)
class Candidate:
    """One worker as the policy sees it (built by keyword: nine numbers are easy to misorder)."""

    worker_id: str
    tokens_per_s: float  # its effective prefill speed (``WorkerLoad.rate``)
    cached_tokens: int = 0
    pending_s: float = 0.0
    in_system: int = 0
    over_limit: bool = False
    ring_rank: int = NOT_ON_RING
    matched_chunks: int = 0  # leading chunk hashes of the request the index says it holds
    service_s: float = 0.0  # mean time one of its requests holds a batch slot (s)
    transfer_s: float = 0.0  # loading the CPU-tier part of ``cached_tokens`` (s; 0: all on the GPU)
    adapter_s: float = 0.0  # seconds before the request's LoRA adapter can run there (router/routing/adapters.py)


@dataclass(slots=True, kw_only=True)
class RouteRequest:
    """What the policy needs to know about the request itself."""

    prompt_tokens: int
    affinity: float | None = None
    session: bool = False
    sequence: int = 0
    load_bound: int = 0


@dataclass(slots=True, kw_only=True)
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


def tier_credit(gpu_tokens: int, cpu_tokens: int, tokens_per_s: float, transfer_tokens_per_s: float,
                knee: float) -> tuple[int, float]:
    """What a worker's CPU KV tier adds to a request's cached prefix: ``(tokens, transfer_s)``.

    ``cpu_tokens`` held in the tier right after a GPU hit of ``gpu_tokens`` are loaded -- and
    count as cached, at their transfer time -- when the transfer beats recomputing them there,
    the worker's own rule (worker/engine/kv_cache/kv_tier.py); otherwise they are recomputed and
    credit nothing: ``(0, 0.0)``. So a CPU hit is worth its prefill minus its transfer, never a
    GPU hit's whole prefill.
    """
    if cpu_tokens <= 0 or transfer_tokens_per_s <= 0:
        return 0, 0.0
    transfer = cpu_tokens / transfer_tokens_per_s
    if transfer < prefill_seconds(cpu_tokens, gpu_tokens, tokens_per_s, knee):
        return cpu_tokens, transfer
    return 0, 0.0


def hash_load_bound(total_in_system: int, workers: int, factor: float) -> int:
    """Bounded-load consistent hashing: no worker may hold more than this many requests."""
    return max(1, math.ceil(factor * (total_in_system + 1) / max(1, workers)))


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
