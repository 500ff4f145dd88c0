"""Chained 128-bit block hashes: the prefix cache's keys.

``h_i = xxh3_128(h_{i-1} as 16 bytes || token ids of block i as little-endian int64, seed=ns)``
where ``ns`` is the namespace seed (``protocol.namespace_seed(model, adapter, cache_salt)``,
mixed with the LoRA adapter's identity by :func:`adapter_namespace` when the request runs with
one) and the first block has no parent bytes. So one hash names a whole prefix of full blocks, and
different namespaces never share blocks. At 128 bits a collision is not a practical concern
(vLLM and SGLang rely on the same argument), so blocks are not compared token by token.

The KV-event publisher imports this module to compute the hash of any prompt block itself.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import xxhash

_SEED_MASK = (1 << 64) - 1


def adapter_namespace(namespace: int, adapter_identity: str | None) -> int:
    """The block-hash seed of a request run with a LoRA adapter: ``namespace`` mixed with the
    adapter's identity (name and content digest), so two adapters, or one name reloaded with
    other weights, never share a block. ``None`` (the base model) returns ``namespace``."""
    if adapter_identity is None:
        return namespace
    return xxhash.xxh3_64_intdigest(adapter_identity.encode("utf-8", "surrogatepass"),
                                    seed=namespace & _SEED_MASK)


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], namespace: int) -> int:
    """128-bit hash of one block of ``token_ids`` following the block named ``parent_hash``."""
    data = array("q", token_ids).tobytes()
    if parent_hash is not None:
        data = parent_hash.to_bytes(16, "little") + data
    return xxhash.xxh3_128_intdigest(data, seed=namespace & _SEED_MASK)


def hash_request_blocks(token_ids: Sequence[int], block_size: int, namespace: int,
                        num_blocks: int | None = None) -> list[int]:
    """Chain hashes of the first ``num_blocks`` (default: all) full blocks of ``token_ids``."""
    n = len(token_ids) // block_size
    if num_blocks is not None:
        n = min(n, num_blocks)
    out: list[int] = []
    parent: int | None = None
    for i in range(n):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], namespace)
        out.append(parent)
    return out
