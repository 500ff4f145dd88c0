"""vLLM's KV-cache events as they arrive over ZMQ, decoded into plain dataclasses. No I/O.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``; SGLang
publishes the same shapes) sends each batch as a three-frame ZMQ message on a PUB socket::

    frame 0  topic        the configured "topic" as UTF-8 ("" by default)
    frame 1  seq          8-byte big-endian unsigned: 0, 1, 2, ... per publisher start
    frame 2  payload      msgpack of KVEventBatch, an *array*: [ts, events, data_parallel_rank]

Each event is a msgpack *map* tagged with its class name under ``"type"`` (msgspec
``tag=True``)::

    {"type": "BlockStored", "block_hashes": [u64, ...], "parent_block_hash": u64 | None,
     "token_ids": [int, ...], "block_size": int, "lora_id": int | None, "medium": "GPU" | "CPU" ...,
     "lora_name": str | None, "extra_keys": [[...] | None, ...] | None, "group_idx": int,
     "kv_cache_spec_kind": "full_attention", ...}
    {"type": "BlockRemoved", "block_hashes": [u64, ...], "medium": str | None, "group_idx": int}
    {"type": "AllBlocksCleared"}

``token_ids`` of a BlockStored holds ``block_size`` tokens per hash, in order; the first block's
parent is ``parent_block_hash`` and each next block's parent is the previous hash. Fields vLLM
leaves at their default are omitted from the map (``omit_defaults``); unknown fields are
ignored here so newer engines still decode. A malformed message raises :class:`KVEventDecodeError`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

END_OF_REPLAY_SEQ = -1  # the replay socket's last message carries seq -1 and an empty payload


class KVEventDecodeError(ValueError):
    """A KV-event message that is not vLLM's wire format."""


@dataclass(slots=True, frozen=True)
class BlockStored:
    """The engine now holds ``block_hashes``: a chain of full blocks after ``parent_block_hash``.

    ``extra_keys[i]`` is what besides the tokens went into block i's hash (the LoRA name, the
    ``cache_salt`` for block 0, multimodal identifiers), or None.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] = ()
    group_idx: int = 0

    def blocks(self) -> list[tuple[int | None, int, tuple[int, ...], tuple[Any, ...] | None]]:
        """``(parent hash, hash, tokens, extra key)`` for each stored block, in chain order."""
        out = []
        parent = self.parent_block_hash
        for i, h in enumerate(self.block_hashes):
            tokens = self.token_ids[i * self.block_size:(i + 1) * self.block_size]
            extra = self.extra_keys[i] if i < len(self.extra_keys) else None
            out.append((parent, h, tokens, extra))
            parent = h
        return out


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """The engine no longer holds ``block_hashes`` (one physical copy each) on ``medium``."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int = 0


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The engine's prefix cache was reset: it holds nothing."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True, frozen=True)
class KVEventBatch:
    """One published batch: its sequence number, engine timestamp, events and DP rank."""

    seq: int
    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int = 0


def _hashes(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(h, int) for h in value):
        raise KVEventDecodeError(f"{what}: block_hashes must be a list of integers")
    return tuple(value)


def _extra_key(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    raise KVEventDecodeError("extra_keys entries must be lists or null")


def _group(event: dict[str, Any]) -> int:
    group = event.get("group_idx", 0)
    return group if isinstance(group, int) else 0


def decode_event(event: Any) -> KVCacheEvent:
    """One event map as a dataclass (raises KVEventDecodeError on a malformed one)."""
    if not isinstance(event, dict):
        raise KVEventDecodeError("an event must be a map")
    kind = event.get("type")
    if kind == "BlockStored":
        hashes = _hashes(event.get("block_hashes"), kind)
        parent = event.get("parent_block_hash")
        tokens = event.get("token_ids")
        size = event.get("block_size")
        if parent is not None and not isinstance(parent, int):
            raise KVEventDecodeError("BlockStored: parent_block_hash must be an integer or null")
        if not isinstance(size, int) or size < 1:
            raise KVEventDecodeError("BlockStored: block_size must be a positive integer")
        if (not isinstance(tokens, (list, tuple)) or not all(isinstance(t, int) for t in tokens)
                or len(tokens) != size * len(hashes)):
            raise KVEventDecodeError("BlockStored: token_ids must hold block_size integers per hash")
        extra = event.get("extra_keys") or ()
        if not isinstance(extra, (list, tuple)):
            raise KVEventDecodeError("BlockStored: extra_keys must be a list or null")
        lora = event.get("lora_name")
        medium = event.get("medium")
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tuple(tokens),
                           block_size=size, medium=medium if isinstance(medium, str) else None,
                           lora_name=lora if isinstance(lora, str) else None,
                           extra_keys=tuple(_extra_key(e) for e in extra), group_idx=_group(event))
    if kind == "BlockRemoved":
        medium = event.get("medium")
        return BlockRemoved(block_hashes=_hashes(event.get("block_hashes"), kind),
                            medium=medium if isinstance(medium, str) else None, group_idx=_group(event))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventDecodeError(f"unknown KV event type {kind!r}")


def decode_payload(seq: int, payload: bytes) -> KVEventBatch:
    """The msgpack payload (frame 2) of the batch numbered ``seq``."""
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise KVEventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(data, (list, tuple)) or len(data) < 2:
        raise KVEventDecodeError("a batch must be an array [ts, events, data_parallel_rank]")
    ts, events = data[0], data[1]
    rank = data[2] if len(data) > 2 and isinstance(data[2], int) else 0
    if not isinstance(ts, (int, float)) or not isinstance(events, (list, tuple)):
        raise KVEventDecodeError("a batch must be an array [ts, events, data_parallel_rank]")
    return KVEventBatch(seq=seq, ts=float(ts), events=tuple(decode_event(e) for e in events),
                        data_parallel_rank=rank)


def decode_frames(frames: list[bytes]) -> tuple[str, KVEventBatch | None]:
    """``(topic, batch)`` of one ZMQ message; batch is None for the replay's end marker."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"a KV-event message has 3 frames, got {len(frames)}")
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise KVEventDecodeError("the sequence frame must be 8 bytes")
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    try:
        topic_text = bytes(topic).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVEventDecodeError("the topic frame is not UTF-8") from exc
    if seq == END_OF_REPLAY_SEQ:
        return topic_text, None
    if seq < 0:
        raise KVEventDecodeError(f"negative sequence number {seq}")
    return topic_text, decode_payload(seq, bytes(payload))


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends vLLM's replay ROUTER socket to get batches from ``start_seq`` on.

    The replies are ``[b"", topic, seq, payload]`` per buffered batch with seq >= start_seq, then
    ``[b"", b"", seq -1, b""]``; drop the empty delimiter frame and pass the rest to decode_frames.
    """
    return [b"", start_seq.to_bytes(8, "big")]
