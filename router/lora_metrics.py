"""The router's per-adapter metrics (``GET /metrics``), read at scrape time from its AdapterBoard.

Labelled by adapter name only for adapters some worker reports serving or holding (a client's
``model`` or ``lora_adapter`` string never creates a series by itself), at most
``MAX_KNOWN_ADAPTERS`` of them (``router/routing/adapters.py``).
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.routing.adapters import TIER_CPU, TIER_DISK, TIER_GPU, AdapterBoard


def adapter_metrics(board: AdapterBoard) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
    """Requests, loads caused, observed evictions, predicted slot wait, and where each adapter is."""
    requests = CounterMetricFamily("prefixlb_router_lora_requests", "Requests routed for a LoRA adapter",
                                   labels=["adapter"])
    loads = CounterMetricFamily("prefixlb_router_lora_loads",
                                "Requests sent to a worker that did not have their adapter in a GPU slot, by "
                                "where it was there (cpu: a host -> GPU copy; disk: a disk read first)",
                                labels=["adapter", "tier"])
    evictions = CounterMetricFamily("prefixlb_router_lora_evictions_observed",
                                    "Times an adapter left a worker's GPU slots between two of its load reports",
                                    labels=["adapter"])
    wait = CounterMetricFamily("prefixlb_router_lora_predicted_slot_wait_seconds",
                               "Predicted seconds the routed requests wait for a free GPU slot (the router's "
                               "estimate at each decision; the workers count the real wait)", labels=["adapter"])
    for name, stats in sorted(board.stats.items()):
        requests.add_metric([name], stats.requests)
        for tier in (TIER_CPU, TIER_DISK):
            loads.add_metric([name, tier], stats.loads[tier])
        evictions.add_metric([name], stats.evictions)
        wait.add_metric([name], stats.predicted_slot_wait_s)
    yield requests
    yield loads
    yield evictions
    yield wait
    workers = GaugeMetricFamily("prefixlb_router_lora_adapter_workers",
                                "Workers holding an adapter, by tier (gpu: in a slot; cpu: in host memory), "
                                "by their load reports and this router's requests since", labels=["adapter", "tier"])
    for name, (gpu, cpu) in sorted(board.residency().items()):
        workers.add_metric([name, TIER_GPU], gpu)
        workers.add_metric([name, TIER_CPU], cpu)
    yield workers
