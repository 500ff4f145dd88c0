"""What a workload is: a deterministic list of requests whose prompts are made of segments.

A prompt is a sequence of *segments*, each a ``(content_id, tokens)`` pair: equal content ids
always render to the same text, so two requests share a prefix exactly as far as their leading
segments agree. Keeping prompts symbolic lets the fleet simulator work on a million requests
without building a byte of text, while the HTTP load generator renders the very same prompts.

Token counts. Text is ASCII only, so with the worker's byte-level tokenizer one character is one
token; the worker may add a BOS token (``prompt_tokens`` it reports is then ``tokens + 1``).
Every request is sent to ``/v1/completions`` (no chat template), so the counts map exactly.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import xxhash

ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ", dtype=np.uint8)


class WorkloadError(ValueError):
    """A workload name, option or trace file is invalid."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, before rendering.

    ``arrival_s`` is in workload time (trace seconds), before any ``--speedup``; ``segments``
    are ``(content_id, tokens)`` pairs; ``session`` is sent as the ``x-session-id`` header;
    ``adapter`` names the request's LoRA adapter (None: the base model).
    """

    index: int
    arrival_s: float
    segments: tuple[tuple[int, int], ...]
    max_tokens: int
    session: str | None = None
    adapter: str | None = None

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens (= characters), without a BOS token."""
        return sum(n for _, n in self.segments)


@dataclass(slots=True)
class Workload:
    """A named, deterministic list of requests sorted by arrival."""

    name: str
    requests: list[RequestSpec]
    model: str = "sim"
    params: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self.requests)


class TextSource:
    """Deterministic text for content ids: the same id always gives the same characters.

    The text of an id is a fixed pseudo-random string of lowercase letters and spaces; a segment
    of ``n`` tokens is its first ``n`` characters, so a truncated block (a trace's last,
    partial block) is a prefix of the full one.
    """

    def __init__(self, seed: int = 0, cache_limit: int = 200_000) -> None:
        self.seed = seed
        self._cache: dict[tuple[int, int], str] = {}
        self._cache_limit = cache_limit

    def text(self, content_id: int, tokens: int) -> str:
        """``tokens`` characters of the text of ``content_id``."""
        # Round the generated length up so that truncations of one id share one cache entry.
        length = max(512, 1 << (max(tokens, 1) - 1).bit_length())
        key = (content_id, length)
        full = self._cache.get(key)
        if full is None:
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, content_id & 0xFFFFFFFFFFFF])
            full = ALPHABET[rng.integers(0, len(ALPHABET), length)].tobytes().decode("ascii")
            if len(self._cache) >= self._cache_limit:
                self._cache.clear()
            self._cache[key] = full
        return full[:tokens]

    def prompt(self, spec: RequestSpec) -> str:
        """The full prompt text of a request."""
        return "".join(self.text(cid, n) for cid, n in spec.segments)


def unit_hashes(segments: tuple[tuple[int, int], ...], unit: int, seed: int = 0) -> list[int]:
    """Chained hashes of the full ``unit``-token blocks of a prompt, computed from its segments.

    Block ``j`` covers tokens ``[j·unit, (j+1)·unit)``; its hash chains the previous one with the
    exact pieces of segments it covers, so two prompts get equal hashes for block ``j`` exactly
    when their first ``(j+1)·unit`` tokens are equal (different content ids never render to the
    same text). A trailing partial block gets no hash, as in a paged KV cache.
    """
    out: list[int] = []
    h = seed
    pieces: list[int] = []
    filled = 0
    digest = xxhash.xxh3_64_intdigest
    for cid, n in segments:
        offset = 0
        while offset < n:
            take = min(n - offset, unit - filled)
            pieces.extend((cid, offset, take))
            offset += take
            filled += take
            if filled == unit:
                h = digest(np.asarray(pieces, dtype=np.int64).tobytes(), seed=h)
                out.append(h)
                pieces.clear()
                filled = 0
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (s) of a Poisson process of ``rate`` per second, starting at 0."""
    if rate <= 0:
        raise WorkloadError("rate must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def retime_poisson(workload: Workload, rate: float, seed: int) -> Workload:
    """The same requests with arrivals replaced by a Poisson process of ``rate`` per second."""
    times = poisson_arrivals(len(workload.requests), rate, seed + 7)
    workload.requests = [RequestSpec(r.index, t, r.segments, r.max_tokens, r.session, r.adapter)
                         for r, t in zip(workload.requests, times)]
    return workload
