"""Index snapshots: a compact, versioned encoding of the prefix index for Redis.

A snapshot is one Redis string: a JSON header line, then per worker a packed block::

    {"v": 1, "stream_id": "1712345678901-0", "taken_at": ..., "chunk_size": 128,
     "ratios": {"tiny": 1.02}, "workers": ["w1", "w2"], "counts": [n1, n2]}\\n
    <n1 x uint64 hash><n1 x float32 seconds left>  <n2 x uint64 ...><n2 x float32 ...>

``stream_id`` is the last KV-event stream entry already reflected in the snapshot: a router
that loads it replays the stream from there (events are idempotent, so replaying one that is
already reflected does no harm). ``ratios`` carries the learned tokens-per-byte so that a new
router predicts cached tokens right from its first request.
"""
from __future__ import annotations

import json
import math
import sys
from array import array
from dataclasses import dataclass, field
from typing import Iterable

from protocol import untrusted_json
from protocol.messages import is_short_text

VERSION = 1


class SnapshotError(ValueError):
    """A snapshot that cannot be decoded (another version, truncated, not ours)."""


@dataclass(slots=True)
class Snapshot:
    """A decoded snapshot."""

    stream_id: str
    taken_at: float
    chunk_size: int
    ratios: dict[str, float] = field(default_factory=dict)
    entries: list[tuple[int, str, float]] = field(default_factory=list)


MAX_WORKERS = 10_000  # worker ids a snapshot may name


def encode(entries: Iterable[tuple[int, str, float]], stream_id: str, taken_at: float, chunk_size: int,
           ratios: dict[str, float]) -> bytes:
    """Pack ``(hash, worker_id, seconds_left)`` entries and the header into snapshot bytes."""
    hashes: dict[str, array] = {}
    ttls: dict[str, array] = {}
    for h, worker_id, ttl in entries:
        if worker_id not in hashes:
            hashes[worker_id] = array("Q")
            ttls[worker_id] = array("f")
        hashes[worker_id].append(h)
        ttls[worker_id].append(ttl)
    workers = list(hashes)
    header = {"v": VERSION, "stream_id": stream_id, "taken_at": taken_at, "chunk_size": chunk_size,
              "ratios": ratios, "workers": workers, "counts": [len(hashes[w]) for w in workers]}
    parts = [json.dumps(header, separators=(",", ":")).encode() + b"\n"]
    for w in workers:
        parts.append(_little_endian(hashes[w]).tobytes())
        parts.append(_little_endian(ttls[w]).tobytes())
    return b"".join(parts)


def decode(data: bytes) -> Snapshot:
    """Unpack snapshot bytes; raises :class:`SnapshotError` if they are not a v1 snapshot."""
    newline = data.find(b"\n")
    if newline < 0:
        raise SnapshotError("no header")
    try:
        header = untrusted_json.loads(data[:newline])
        if header.get("v") != VERSION:
            raise SnapshotError(f"unsupported snapshot version {header.get('v')!r}")
        workers = [str(w) for w in header["workers"]]
        counts = [int(c) for c in header["counts"]]
        snap = Snapshot(str(header["stream_id"]), float(header["taken_at"]), int(header["chunk_size"]),
                        {str(k): float(v) for k, v in (header.get("ratios") or {}).items()})
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"bad header: {exc}") from exc
    if len(workers) != len(counts):
        raise SnapshotError("bad header: workers and counts differ")
    if len(workers) > MAX_WORKERS or not all(w and is_short_text(w) for w in workers):
        raise SnapshotError("bad header: too many workers, or a worker id that is not a short text")
    if not math.isfinite(snap.taken_at):
        raise SnapshotError("bad header: taken_at must be finite")
    offset = newline + 1
    for worker_id, n in zip(workers, counts):
        end = offset + 12 * n
        if n < 0 or end > len(data):
            raise SnapshotError("truncated")
        hashes = array("Q", data[offset:offset + 8 * n])
        ttls = array("f", data[offset + 8 * n:end])
        snap.entries.extend((h, worker_id, ttl) for h, ttl in zip(_little_endian(hashes), _little_endian(ttls))
                            if math.isfinite(ttl))
        offset = end
    return snap


def _little_endian(values: array) -> array:
    if sys.byteorder == "big":
        values = array(values.typecode, values)
        values.byteswap()
    return values

