"""A request's unit hashes, memoised: what :func:`bench.workloads.unit_hashes` returns, computed once per prefix.

A million requests of a workload share a few thousand system prompts, documents or trace blocks;
``unit_hashes`` hashes every full unit of every request again (a numpy buffer and an xxh3 call
per unit). :class:`UnitHasher` walks the segments the same way but looks the chain up where a
segment starts on a unit boundary: the hashes of that segment's full units depend only on the
chain so far, the segment's content id and how many full units it has. Anything else (units
straddling segments, partial tails) is hashed exactly as ``unit_hashes`` does.
"""
from __future__ import annotations

import numpy as np
import xxhash


def _digest(pieces: tuple[int, ...] | list[int], seed: int) -> int:
    # bench.workloads.unit_hashes' hash of one unit: its (content id, offset, tokens) pieces.
    return xxhash.xxh3_64_intdigest(np.asarray(pieces, dtype=np.int64).tobytes(), seed=seed)


class UnitHasher:
    """``hasher(segments)`` == ``unit_hashes(segments, unit, seed)``, faster on repeated prefixes."""

    def __init__(self, unit: int, seed: int = 0, max_entries: int = 4_000_000) -> None:
        self.unit = unit
        self.seed = seed
        self.max_entries = max_entries
        self._chains: dict[tuple[int, int, int], list[int]] = {}

    def __call__(self, segments: tuple[tuple[int, int], ...]) -> list[int]:
        unit = self.unit
        chains = self._chains
        out: list[int] = []
        h = self.seed
        pieces: list[int] = []
        filled = 0
        for cid, n in segments:
            offset = 0
            if not filled and n >= unit:
                full = n // unit
                key = (h, cid, full)
                chain = chains.get(key)
                if chain is None:
                    if len(chains) >= self.max_entries:
                        chains.clear()
                    chain = []
                    x = h
                    for j in range(full):
                        x = _digest((cid, j * unit, unit), x)
                        chain.append(x)
                    chains[key] = chain
                out += chain
                h = chain[-1]
                offset = full * unit
            while offset < n:
                take = min(n - offset, unit - filled)
                pieces += (cid, offset, take)
                offset += take
                filled += take
                if filled == unit:
                    h = _digest(pieces, h)
                    out.append(h)
                    pieces.clear()
                    filled = 0
        return out
