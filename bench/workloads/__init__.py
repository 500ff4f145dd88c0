"""Workloads by name: ``system-prompt``, ``doc-qa``, ``multi-turn``, ``conversation``, ``multi-lora``,
``mooncake:FILE``, ``azure:FILE``.

``load_workload(spec, seed, num_requests, options)`` returns a :class:`Workload`; ``options`` are
``key=value`` strings for the generator's parameters (``tenants=50``, ``question_tokens=64-256``).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from bench.workloads.adapters import multi_lora
from bench.workloads.base import RequestSpec, TextSource, Workload, WorkloadError, unit_hashes
from bench.workloads.generated import conversation, doc_qa, multi_turn, system_prompt
from bench.workloads.traces import MOONCAKE_BLOCK_TOKENS, azure, mooncake

GENERATED: dict[str, Callable[..., Workload]] = {
    "system-prompt": system_prompt,
    "doc-qa": doc_qa,
    "multi-turn": multi_turn,
    "conversation": conversation,
    "multi-lora": multi_lora,
}
TRACES: dict[str, Callable[..., Workload]] = {"mooncake": mooncake, "azure": azure}

__all__ = [
    "GENERATED", "MOONCAKE_BLOCK_TOKENS", "RequestSpec", "TRACES", "TextSource", "Workload",
    "WorkloadError", "load_workload", "parse_options", "unit_hashes",
]


def _convert(name: str, text: str, default: Any) -> Any:
    try:
        if isinstance(default, tuple):
            lo, sep, hi = text.replace(",", "-").partition("-")
            return (int(lo), int(hi if sep else lo))
        if isinstance(default, bool):
            return text.lower() in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError as exc:
        raise WorkloadError(f"workload option {name}={text!r}: {exc}") from exc
    return text


def parse_options(fn: Callable[..., Workload], options: list[str] | dict[str, str] | None) -> dict[str, Any]:
    """Turn ``key=value`` strings into typed keyword arguments of the generator ``fn``."""
    params = inspect.signature(fn).parameters
    items = options.items() if isinstance(options, dict) else (
        o.partition("=")[::2] for o in (options or []))
    out: dict[str, Any] = {}
    for key, value in items:
        name = str(key).strip().replace("-", "_")
        if name not in params or name in ("seed", "num_requests", "path"):
            allowed = ", ".join(p for p in params if p not in ("seed", "num_requests", "path"))
            raise WorkloadError(f"unknown workload option {key!r} (options: {allowed})")
        out[name] = _convert(name, str(value), params[name].default)
    return out


def load_workload(spec: str, seed: int = 0, num_requests: int | None = None,
                  options: list[str] | dict[str, str] | None = None) -> Workload:
    """The workload named by ``spec`` (``NAME`` or ``NAME:FILE``), deterministic given ``seed``."""
    name, _, arg = spec.partition(":")
    if name in GENERATED:
        fn = GENERATED[name]
        kwargs = parse_options(fn, options)
        if num_requests is not None:
            kwargs["num_requests"] = num_requests
        return fn(seed=seed, **kwargs)
    if name in TRACES:
        if not arg:
            raise WorkloadError(f"workload {name} needs a file: {name}:PATH")
        if options:
            raise WorkloadError(f"workload {name} takes no options")
        return TRACES[name](arg, num_requests=num_requests, seed=seed)
    known = ", ".join([*GENERATED, *(f"{t}:FILE" for t in TRACES)])
    raise WorkloadError(f"unknown workload {spec!r} (known: {known})")
