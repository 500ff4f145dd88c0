"""A hosted API's prompt cache replayed over a workload: what each request reads and writes.

The model (hosted APIs with a TTL, block granularity like automatic prefix caching):

- A prompt is a chain of ``block_tokens``-token blocks (``unit_hashes``: a block's hash names
  its whole prefix). A trailing partial block is never cached: it is billed as plain input,
  like the question after a shared document.
- A request at time ``t`` reads the longest chain of leading blocks still alive (written or
  last read less than ``ttl_s`` ago) and refreshes them (reads extend the lifetime, as the
  hosted caches do); it writes every following full block (a breakpoint at the prompt's end).
- A prompt whose full blocks are fewer than ``min_cacheable_tokens`` neither reads nor writes
  (the hosted APIs silently do not cache short prompts).
- ``ttl_s=None``: the ideal cache (infinite lifetime and capacity), a self-hosted bound.

Each write starts an *episode* of that prefix, which counts its reads until the prefix expires
(or the trace ends: ``censored``, its reads are a lower bound). Episodes are what "would this
write have paid" is asked of: it pays when its reads exceed the price's break-even count.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from bench.workloads.base import RequestSpec, unit_hashes


@dataclass(slots=True)
class Episode:
    """One lifetime of one cached prefix (the chain ending at block ``depth``)."""

    block: int
    depth: int
    written_s: float
    expires_s: float
    reads: int = 0
    censored: bool = False


@dataclass(frozen=True, slots=True)
class CacheUse:
    """What one request did with the cache, in tokens (``plain`` = billed as normal input)."""

    index: int
    prompt_tokens: int
    read_tokens: int
    write_tokens: int
    completion_tokens: int

    @property
    def plain_tokens(self) -> int:
        return self.prompt_tokens - self.read_tokens - self.write_tokens


@dataclass(slots=True)
class CacheReplay:
    """The outcome of :func:`replay_ttl_cache`."""

    ttl_s: float | None
    block_tokens: int
    min_cacheable_tokens: int
    uses: list[CacheUse] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)

    @property
    def read_tokens(self) -> int:
        return sum(u.read_tokens for u in self.uses)

    @property
    def write_tokens(self) -> int:
        return sum(u.write_tokens for u in self.uses)


def replay_ttl_cache(requests: Iterable[RequestSpec], ttl_s: float | None, block_tokens: int = 512,
                     min_cacheable_tokens: int = 0) -> CacheReplay:
    """Replay ``requests`` (in arrival order) through the cache of the module docstring."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    if ttl_s is not None and ttl_s <= 0:
        raise ValueError("ttl_s must be positive (or None for an unbounded lifetime)")
    out = CacheReplay(ttl_s, block_tokens, min_cacheable_tokens)
    live: dict[int, Episode] = {}
    lifetime = float("inf") if ttl_s is None else ttl_s
    last_t = 0.0
    for spec in sorted(requests, key=lambda r: (r.arrival_s, r.index)):
        t = spec.arrival_s
        last_t = max(last_t, t)
        hashes = unit_hashes(spec.segments, block_tokens)
        if len(hashes) * block_tokens < max(1, min_cacheable_tokens):
            out.uses.append(CacheUse(spec.index, spec.prompt_tokens, 0, 0, spec.max_tokens))
            continue
        hit = 0
        for h in hashes:
            ep = live.get(h)
            if ep is None or ep.expires_s <= t:
                break
            hit += 1
        for h in hashes[:hit]:
            ep = live[h]
            ep.reads += 1
            ep.expires_s = t + lifetime
        for depth, h in enumerate(hashes[hit:], start=hit + 1):
            old = live.get(h)
            if old is not None:  # expired (a live one would have been read): its episode ends
                out.episodes.append(old)
            live[h] = Episode(h, depth, t, t + lifetime)
        out.uses.append(CacheUse(spec.index, spec.prompt_tokens, hit * block_tokens,
                                 (len(hashes) - hit) * block_tokens, spec.max_tokens))
    for ep in live.values():
        ep.censored = ep.expires_s > last_t
        out.episodes.append(ep)
    out.episodes.sort(key=lambda e: (e.written_s, e.depth))
    return out
