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
        n = min(n, limit)
    view = memoryview(data)
    out = [0] * n
    h = seed
    digest = xxhash.xxh3_64_intdigest
    for i in range(n):
        start = i * chunk_size
        h = digest(view[start:start + chunk_size], seed=h)
        out[i] = h
    return out


def session_hash(session_key: str, seed: int) -> int:
    """Hash of a session key under a namespace (for ring placement of sessions)."""
    return xxhash.xxh3_64_intdigest(session_key.encode("utf-8", "surrogatepass"), seed=seed)
