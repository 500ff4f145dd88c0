"""``multi-lora``: tenants with Zipf popularity, each its own LoRA adapter and system prompt.

The multi-tenant shape of LoRA serving (S-LoRA, Punica): one base model, many fine-tunes, a few of
them hot and a long tail cold. Tenant ``t`` (popularity rank ``t + 1``) sends requests to adapter
``tenant-t`` that start with its own system prompt of ``system_tokens`` (shared by all its
requests: prefix locality exists only within an adapter, whose namespace keys the cache), then a
distinct question. Deterministic given the seed.
"""
from __future__ import annotations

import itertools
import random

from bench.workloads.base import RequestSpec, Workload, WorkloadError, poisson_arrivals

_SYSTEM, _QUESTION = 7 << 40, 8 << 40  # content-id kinds of their own (generated.py uses 1..5)


def adapter_name(tenant: int) -> str:
    """The adapter of tenant ``tenant``."""
    return f"tenant-{tenant}"


def multi_lora(num_requests: int = 10_000, seed: int = 0, adapters: int = 200, zipf: float = 1.1,
               system_tokens: int = 1024, question_tokens: tuple[int, int] = (64, 256),
               output_tokens: tuple[int, int] = (32, 128), rate: float = 40.0) -> Workload:
    """``num_requests`` requests over ``adapters`` tenant adapters with Zipf(``zipf``) popularity."""
    if adapters < 1 or num_requests < 0:
        raise WorkloadError("multi-lora needs adapters >= 1 and num_requests >= 0")
    rng = random.Random(seed)
    cum = list(itertools.accumulate(1.0 / (rank ** zipf) for rank in range(1, adapters + 1)))
    arrivals = poisson_arrivals(num_requests, rate, seed + 1)
    requests = []
    for i in range(num_requests):
        tenant = rng.choices(range(adapters), cum_weights=cum)[0]
        segments = ((_SYSTEM + tenant, system_tokens), (_QUESTION + i, rng.randint(*question_tokens)))
        requests.append(RequestSpec(i, arrivals[i], segments, rng.randint(*output_tokens),
                                    adapter=adapter_name(tenant)))
    return Workload("multi-lora", requests, params=dict(
        num_requests=num_requests, seed=seed, adapters=adapters, zipf=zipf, system_tokens=system_tokens,
        question_tokens=list(question_tokens), output_tokens=list(output_tokens), rate=rate))
