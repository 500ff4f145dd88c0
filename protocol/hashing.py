"""Chained chunk hashes over rendered prompt bytes: the router's names for prefixes.

``h_0`` is the namespace seed (model, LoRA adapter, cache_salt), and for each *full* chunk of
``chunk_size`` bytes ``h_i = xxh3_64(chunk_i, seed=h_{i-1})``. One hash therefore names a whole
prefix: two requests share ``h_i`` exactly when their first ``i`` chunks are byte-identical and
their namespaces are equal. A trailing partial chunk gets no hash (like a partial KV block, it is
not a reusable unit).

64-bit hashes suffice here: a collision can only make the router mispredict a hit (the worker's
own cache compares with 128-bit hashes), and the feedback path corrects mispredictions.
"""
from __future__ import annotations

import struct
from functools import lru_cache
from itertools import chain, repeat
from typing import Callable, Iterable

import xxhash

DEFAULT_CHUNK_SIZE = 128


def namespace_seed(model: str, adapter: str | None = None, cache_salt: str | None = None) -> int:
    """Seed of the chain for one (model, adapter, cache_salt): different ones never share."""
    key = "\x00".join((model or "", adapter or "", cache_salt or ""))
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


def chunk_hashes(data: bytes, chunk_size: int, seed: int, limit: int | None = None) -> list[int]:
    """Chain hashes of the full ``chunk_size``-byte chunks of ``data`` (at most ``limit``)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    n = len(data) // chunk_size
    if limit is not None:
        n = max(0, min(n, limit))
    # No Python bytecode per chunk (a 400 KB prompt has 3,125 chunks: half the cost of a long
    # prompt's decision was this loop's interpreter overhead): struct cuts the chunks, 64 per C
    # call, and each hash is fed back as the next one's seed by iterating ``out`` while
    # ``list.extend`` appends to it -- a list iterator sees items appended after it was created,
    # so ``map`` gets h_{i-1} right after it produced it.
    full, rest = divmod(n, _BATCH)
    step = _BATCH * chunk_size
    chunks: Iterable[bytes] = ()
    if full:
        chunks = chain.from_iterable(map(_cutter(chunk_size, _BATCH), repeat(data, full), range(0, full * step, step)))
    if rest:
        chunks = chain(chunks, _cutter(chunk_size, rest)(data, full * step))
    out: list[int] = []
    out.extend(map(xxhash.xxh3_64_intdigest, chunks, chain((seed,), out)))
    return out


_BATCH = 64  # chunks cut by one struct call


@lru_cache(maxsize=256)
def _cutter(chunk_size: int, count: int) -> Callable[..., tuple[bytes, ...]]:
    """``unpack_from(buffer, offset)``: ``count`` consecutive ``chunk_size``-byte chunks as bytes."""
    return struct.Struct(f"{chunk_size}s" * count).unpack_from


def session_hash(session_key: str, seed: int) -> int:
    """Hash of a session key under a namespace (for ring placement of sessions)."""
    return xxhash.xxh3_64_intdigest(session_key.encode("utf-8", "surrogatepass"), seed=seed)
