"""Messages that cross between workers and routers: registry entries, load reports, KV events.

All are plain dataclasses with ``to_dict`` / ``from_dict`` (JSON-friendly; unknown fields are
ignored so that newer workers can talk to older routers and the other way round).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from protocol import untrusted_json
from protocol.hashing import DEFAULT_CHUNK_SIZE

T = TypeVar("T")


class MessageError(ValueError):
    """A message could not be decoded (wrong types, missing fields)."""


STATUSES = ("ready", "draining")


# What a decoded message may hold (design.md section 8, "Trust"): everything a worker or Redis
# sends is input. Integers are in [0, 2^63) unless a field says otherwise, floats finite, text
# bounded and free of control characters, containers bounded. A message outside its schema is
# refused whole (MessageError): the caller drops it and counts it.
MAX_INT = 2**63 - 1
MAX_HASH = 2**64 - 1
MAX_TEXT = 2048  # URLs
MAX_NAME = 256  # ids, model and adapter names, statuses
MAX_ITEMS = 4096  # entries of a list or map field (KVEvent.hashes has its own bound)
MAX_HASHES = 65536


def is_short_text(value: Any, limit: int = MAX_NAME) -> bool:
    """A string of at most ``limit`` characters and no control characters (ids, names, URLs)."""
    return (isinstance(value, str) and len(value) <= limit
            and not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value))


def _number(cls_name: str, name: str, value: Any, kind: type, bounds: tuple[float, float] | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise MessageError(f"{cls_name}.{name}: expected {'a number' if kind is float else 'an integer'}")
    if kind is float and not math.isfinite(value):
        raise MessageError(f"{cls_name}.{name}: must be finite")
    low, high = bounds if bounds is not None else ((0, MAX_INT) if kind is int else (-math.inf, math.inf))
    if not low <= value <= high:
        raise MessageError(f"{cls_name}.{name}: {value!r} out of range [{low}, {high}]")


def _check_field(cls: type, name: str, hint: Any, value: Any) -> None:
    """Raise MessageError unless ``value`` fits the field's declared type and bounds."""
    cls_name = cls.__name__
    bounds = getattr(cls, "_BOUNDS", {}).get(name)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is int or hint is float:
        _number(cls_name, name, value, hint, bounds)
    elif hint is bool:
        if not isinstance(value, bool):
            raise MessageError(f"{cls_name}.{name}: expected true or false")
    elif hint is str:
        if not is_short_text(value, int(bounds[1]) if bounds else MAX_NAME):
            raise MessageError(f"{cls_name}.{name}: expected a short text without control characters")
    elif origin is list:
        limit = MAX_HASHES if args == (int,) else MAX_ITEMS
        if not isinstance(value, list) or len(value) > limit:
            raise MessageError(f"{cls_name}.{name}: expected a list of at most {limit} items")
        for item in value:
            if args == (int,):
                _number(cls_name, name, item, int, bounds or (0, MAX_HASH))
            elif not is_short_text(item, MAX_NAME):
                raise MessageError(f"{cls_name}.{name}: expected short texts")
    elif origin is dict:
        if not isinstance(value, dict) or len(value) > MAX_ITEMS:
            raise MessageError(f"{cls_name}.{name}: expected a map of at most {MAX_ITEMS} entries")
        for key, item in value.items():
            if not is_short_text(key, MAX_NAME):
                raise MessageError(f"{cls_name}.{name}: expected short texts as keys")
            if args[1] is int:
                _number(cls_name, name, item, int, bounds or (0, 10_000_000))
            elif not is_short_text(item, MAX_NAME):
                raise MessageError(f"{cls_name}.{name}: expected short texts as values")


@functools.lru_cache(maxsize=None)
def _schema(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def _from_dict(cls: type[T], data: Any) -> T:
    if not isinstance(data, dict):
        raise MessageError(f"{cls.__name__}: expected an object")
    schema = _schema(cls)
    kwargs = {k: v for k, v in data.items() if k in schema}
    for name, value in kwargs.items():
        _check_field(cls, name, schema[name], value)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise MessageError(f"{cls.__name__}: {exc}") from exc


class _Message:
    def to_dict(self) -> dict[str, Any]:
        """The message as a JSON-friendly dict."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        """The message as compact JSON."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls: type[T], data: Any) -> T:
        """Decode from a dict; unknown keys are ignored, missing required ones raise."""
        return _from_dict(cls, data)

    @classmethod
    def from_json(cls: type[T], text: str | bytes) -> T:
        """Decode from JSON text."""
        try:
            return _from_dict(cls, untrusted_json.loads(text))
        except json.JSONDecodeError as exc:
            raise MessageError(str(exc)) from exc


@dataclass(slots=True)
class WorkerInfo(_Message):
    """A worker's registry entry: who it is, where it listens, what it serves."""

    worker_id: str
    url: str
    model: str
    block_size: int = 16
    chunk_size: int = DEFAULT_CHUNK_SIZE
    capacity_tokens: int = 0
    max_num_seqs: int = 0
    status: str = "ready"  # "ready" | "draining"
    simulated: bool = False
    started_at: float = field(default_factory=time.time)

    _BOUNDS = {"url": (0, MAX_TEXT), "block_size": (1, 1 << 20), "chunk_size": (1, 1 << 20),
               "capacity_tokens": (0, 1 << 40), "max_num_seqs": (0, 1 << 20)}

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise MessageError(f"WorkerInfo: unknown status {self.status!r}")


# The context length at which a prefill token's attention costs as much as its linear work: the
# unit of ``LoadReport.prefill_tokens_per_s`` (linear-equivalent tokens per second: a prefill of
# ``n`` new tokens over ``c`` computed ones is ``n * (1 + (c + n/2) / knee)`` of work), and the
# default of the router's ``--attention-knee-tokens``. Llama-3-8B's ratio is ~28.6K tokens, 70B's ~53K.
ATTENTION_KNEE_TOKENS = 32768.0


@dataclass(slots=True)
class LoadReport(_Message):
    """A worker's load and measured speed, sent as a heartbeat and served at ``GET /load``.

    The router converts ``queued_prefill_tokens`` and ``running`` into seconds of pending work
    with ``prefill_tokens_per_s`` (in linear-equivalent tokens, see ``ATTENTION_KNEE_TOKENS``)
    and ``decode_step_s``; those are measured by the worker on its recent steps (a profile's
    values until it has measured).

    LoRA (all empty / 0 on a worker without adapters, and from older workers):
    ``max_loras`` GPU slots; ``lora_adapters`` every adapter it serves, name -> the first 16 hex
    digits of its content digest (changes when a name is reloaded with other weights);
    ``lora_gpu`` in a GPU slot now, ``lora_cpu`` in host memory but not in a slot (the rest are
    on disk: cold); ``lora_running`` / ``lora_waiting`` requests per adapter (vLLM's
    ``running_lora_adapters`` / ``waiting_lora_adapters``); ``lora_disk_load_s`` /
    ``lora_slot_load_s`` the measured seconds of one disk -> host read and one host -> slot copy
    (0 until measured): what a cold adapter adds to a request's time to first token.

    CPU KV tier: ``kv_tier_load_tokens_per_s`` is how many tokens of KV per second the worker
    loads from its host-memory tier (its measured host -> device bandwidth over its KV bytes per
    token; 0: no tier, or an older worker): what a ``cpu`` hit costs instead of its prefill.
    """

    worker_id: str
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    running_tokens: int = 0  # context tokens of running requests (decode pressure)
    kv_usage: float = 0.0  # used blocks / total blocks
    free_blocks: int = 0
    total_blocks: int = 0
    cached_blocks: int = 0
    block_size: int = 16
    capacity_tokens: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    status: str = "ready"
    ts: float = field(default_factory=time.time)
    max_loras: int = 0
    lora_adapters: dict[str, str] = field(default_factory=dict)
    lora_gpu: list[str] = field(default_factory=list)
    lora_cpu: list[str] = field(default_factory=list)
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    lora_disk_load_s: float = 0.0
    lora_slot_load_s: float = 0.0
    kv_tier_load_tokens_per_s: float = 0.0

    # physical ranges: no engine runs a million requests at once or prefills 1e9 tokens a second
    _BOUNDS = {"running": (0, 1 << 20), "waiting": (0, 1 << 24), "queued_prefill_tokens": (0, 1 << 40),
               "running_tokens": (0, 1 << 40), "kv_usage": (0.0, 1.0), "free_blocks": (0, 1 << 32),
               "total_blocks": (0, 1 << 32), "cached_blocks": (0, 1 << 32), "block_size": (0, 1 << 20),
               "capacity_tokens": (0, 1 << 40), "max_num_seqs": (0, 1 << 20),
               "max_num_batched_tokens": (0, 1 << 30), "prefill_tokens_per_s": (0.0, 1e9),
               "decode_step_s": (0.0, 3600.0), "max_loras": (0, 1 << 16), "lora_disk_load_s": (0.0, 3600.0),
               "lora_slot_load_s": (0.0, 3600.0), "kv_tier_load_tokens_per_s": (0.0, 1e10)}

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise MessageError(f"LoadReport: unknown status {self.status!r}")


KV_STORED = "stored"
KV_REMOVED = "removed"
KV_CLEARED = "cleared"
KV_EVENT_KINDS = (KV_STORED, KV_REMOVED, KV_CLEARED)
MEDIUM_GPU = "gpu"
MEDIUM_CPU = "cpu"
KV_MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU)


@dataclass(slots=True)
class KVEvent(_Message):
    """A batch of changes to what a worker holds, in the router's chunk hashes.

    ``stored``: the worker now holds the prefixes named by ``hashes``; ``removed``: it no
    longer does; ``cleared``: it holds nothing (start-up, cache reset); ``hashes`` is empty.
    ``seq`` increases by one per event of a worker so that a gap (lost events) is visible.
    ``lora_name``: on ``stored``, the LoRA adapter whose KV it is (None: the base model).
    ``medium``: the tier a ``stored`` / ``removed`` is about: ``gpu`` (device memory: a hit
    skips the prefill) or ``cpu`` (the worker's host-memory tier: a hit is a transfer); older
    workers send none, which means ``gpu``. ``cleared`` clears both.
    """

    worker_id: str
    kind: str
    hashes: list[int] = field(default_factory=list)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    seq: int = 0
    ts: float = field(default_factory=time.time)
    lora_name: str | None = None
    medium: str = MEDIUM_GPU

    _BOUNDS = {"chunk_size": (1, 1 << 20)}

    def __post_init__(self) -> None:
        if self.kind not in KV_EVENT_KINDS:
            raise MessageError(f"KVEvent: unknown kind {self.kind!r}")
        if not isinstance(self.hashes, list) or not all(isinstance(h, int) for h in self.hashes):
            raise MessageError("KVEvent: hashes must be a list of integers")
        if self.lora_name is not None and not isinstance(self.lora_name, str):
            raise MessageError("KVEvent: lora_name must be a string or null")
        if self.medium not in KV_MEDIUMS:
            raise MessageError(f"KVEvent: unknown medium {self.medium!r}")
