"""The worker's Prometheus metrics (``GET /metrics``), in one registry per server.

Engine state (KV blocks, queue lengths, cumulative token counters) is read from the engine's
latest stats snapshot at scrape time, so the engine thread never touches Prometheus; latency
histograms are observed by the server as outputs arrive. Names follow Prometheus conventions:
``prefixlb_worker_`` prefix, base units in the name, ``_total`` for counters.

With LoRA, vLLM's ``vllm:lora_requests_info`` gauge too, with vLLM's exact labels (``max_lora``,
``waiting_lora_adapters``, ``running_lora_adapters``: comma-separated adapter names; value: the
time of the scrape, as vLLM sets it), so tools that read it from vLLM read it from us, plus
per-adapter counters (``lora_name`` label).

With a CPU KV tier, ``kv_tier_*``: tokens loaded from it, tokens it held but the
transfer-vs-recompute decision recomputed, blocks and bytes moved each way, failed stores, its
size and use, and the host -> device bandwidth it measured. ``cached_prompt_tokens`` (GPU hit +
loaded, as ``usage`` reports) is split by ``medium`` in ``cached_prompt_tokens_by_medium``.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from worker.engine.kv_cache.kv_tier import KVTierStats
from worker.engine.stats import EngineStats, LoRAStats

P = "prefixlb_worker_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                   0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    """Turns the engine's stats snapshot (and the publisher's counters) into metric families."""

    def __init__(self, stats: Callable[[], EngineStats], extra: Callable[[], dict[str, float]]) -> None:
        self._stats = stats
        self._extra = extra

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        counters = {
            "prefix_cache_queried_tokens": (s.prefix_cache_queries, "prompt tokens looked up in the prefix cache"),
            "prefix_cache_hit_tokens": (s.prefix_cache_hits, "prompt tokens served from the prefix cache"),
            "preemptions": (s.num_preemptions, "requests preempted (recomputed later) for lack of KV blocks"),
            "prompt_tokens": (s.prompt_tokens_total, "prompt tokens of admitted requests"),
            "generation_tokens": (s.generation_tokens_total, "tokens generated"),
            "engine_steps": (s.num_steps, "engine steps run"),
            "prefill_computed_tokens": (s.prefill_tokens_computed, "prompt (and recompute) tokens the model computed"),
        }
        for name, (value, doc) in counters.items():
            yield CounterMetricFamily(P + name, doc, value=value)
        gauges = {
            "kv_blocks_used": (s.used_blocks, "KV blocks referenced by live requests"),
            "kv_blocks_free": (s.free_blocks, "KV blocks holding nothing"),
            "kv_blocks_cached": (s.cached_blocks, "unreferenced KV blocks holding reusable cached KV"),
            "kv_blocks": (s.total_blocks, "KV blocks in the pool"),
            "kv_usage_ratio": (s.kv_usage, "used / total KV blocks"),
            "requests_running": (s.running, "requests in the running batch"),
            "requests_waiting": (s.waiting, "requests waiting to be scheduled"),
            "queued_prefill_tokens": (s.queued_prefill_tokens, "prompt tokens still to prefill"),
            "prefill_tokens_per_second": (s.prefill_tokens_per_s, "measured prefill throughput (EMA)"),
            "decode_step_seconds": (s.decode_step_s, "measured decode step time (EMA)"),
        }
        for name, (value, doc) in gauges.items():
            yield GaugeMetricFamily(P + name, doc, value=value)
        if s.lora is not None:
            yield from _lora_metrics(s.lora)
        if s.kv_tier is not None:
            yield from _kv_tier_metrics(s.kv_tier)
        for name, value in self._extra().items():
            if name.endswith("_total"):
                yield CounterMetricFamily(P + name[:-len("_total")], name, value=value)
            else:
                yield GaugeMetricFamily(P + name, name, value=value)


def _lora_metrics(lora: LoRAStats) -> Iterator[Metric]:
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    info.add_metric([str(lora.max_loras), ",".join(lora.waiting), ",".join(lora.running)], time.time())
    yield info
    yield GaugeMetricFamily(P + "lora_slots", "GPU slots for LoRA adapters (--max-loras)", value=lora.max_loras)
    tiers = GaugeMetricFamily(P + "lora_adapters", "LoRA adapters served, by the fastest tier holding them",
                              labels=["tier"])
    disk = len(lora.adapters) - len(lora.gpu) - len(lora.cpu)
    for tier, n in (("gpu", len(lora.gpu)), ("cpu", len(lora.cpu)), ("disk", disk)):
        tiers.add_metric([tier], n)
    yield tiers
    yield GaugeMetricFamily(P + "lora_disk_load_seconds", "measured disk -> host read of one adapter (EMA)",
                            value=lora.disk_load_s)
    yield GaugeMetricFamily(P + "lora_slot_load_seconds", "measured host -> GPU slot copy of one adapter (EMA)",
                            value=lora.slot_load_s)
    requests = CounterMetricFamily(P + "lora_requests", "requests admitted per LoRA adapter", labels=["lora_name"])
    loads = CounterMetricFamily(P + "lora_loads", "adapter loads: tier cpu = disk -> host, gpu = host -> slot",
                                labels=["lora_name", "tier"])
    evictions = CounterMetricFamily(P + "lora_evictions", "adapters evicted from host memory (cpu) or a slot (gpu)",
                                    labels=["lora_name", "tier"])
    wait = CounterMetricFamily(P + "lora_slot_wait_seconds", "seconds requests waited for a GPU slot",
                               labels=["lora_name"])
    for name, c in lora.counters.items():
        requests.add_metric([name], c.requests)
        loads.add_metric([name, "cpu"], c.disk_loads)
        loads.add_metric([name, "gpu"], c.slot_loads)
        evictions.add_metric([name, "cpu"], c.cpu_evictions)
        evictions.add_metric([name, "gpu"], c.slot_evictions)
        wait.add_metric([name], c.slot_wait_s)
    yield from (requests, loads, evictions, wait)


def _kv_tier_metrics(tier: KVTierStats) -> Iterator[Metric]:
    c = tier.counters
    counters = {
        "kv_tier_loaded_tokens": (c.loaded_tokens, "prompt tokens loaded from the CPU KV tier instead of recomputed"),
        "kv_tier_recomputed_tokens": (c.recomputed_tokens, "tokens the CPU tier held but the decision recomputed"),
        "kv_tier_loaded_blocks": (c.loaded_blocks, "blocks copied host -> device"),
        "kv_tier_stored_blocks": (c.stored_blocks, "blocks copied device -> host"),
        "kv_tier_loaded_bytes": (c.bytes_loaded, "bytes copied host -> device"),
        "kv_tier_stored_bytes": (c.bytes_stored, "bytes copied device -> host"),
        "kv_tier_failed_stores": (c.failed_stores, "blocks whose copy to the host failed (not loadable)"),
        "kv_tier_skipped_stores": (c.skipped_stores, "blocks not stored: every host slot was pinned"),
    }
    for name, (value, doc) in counters.items():
        yield CounterMetricFamily(P + name, doc, value=value)
    gauges = {
        "kv_tier_blocks": (tier.total_blocks, "host blocks of the CPU KV tier"),
        "kv_tier_blocks_stored": (tier.stored_blocks, "host blocks holding loadable KV"),
        "kv_tier_usage_ratio": (tier.usage, "stored / total host blocks"),
        "kv_tier_load_bytes_per_second": (tier.load_bytes_per_s, "host -> device bandwidth (measured EMA once loaded)"),
    }
    for name, (value, doc) in gauges.items():
        yield GaugeMetricFamily(P + name, doc, value=value)


class WorkerMetrics:
    """All metrics of one worker server; :meth:`render` gives the exposition text."""

    def __init__(self, stats: Callable[[], EngineStats],
                 extra: Callable[[], dict[str, float]] = dict) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(stats, extra))  # type: ignore[arg-type]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(P + "inter_token_latency_seconds", "time between consecutive tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter(P + "requests", "finished requests", ["endpoint", "finish_reason"],
                                registry=self.registry)
        self.errors = Counter(P + "request_errors", "requests answered with an error", ["status"],
                              registry=self.registry)
        self.cached_tokens = Counter(P + "cached_prompt_tokens", "cached_tokens reported in usage",
                                     registry=self.registry)
        self.cached_tokens_by_medium = Counter(
            P + "cached_prompt_tokens_by_medium", "cached_tokens reported in usage, by where they came from: "
            "gpu (prefix-cache hit) or cpu (loaded from the CPU KV tier)", ["medium"], registry=self.registry)

    def count_cached(self, cached: int, loaded: int) -> None:
        """Count one response's ``cached_tokens``, ``loaded`` of them from the CPU tier."""
        self.cached_tokens.inc(cached)
        self.cached_tokens_by_medium.labels("gpu").inc(cached - loaded)
        self.cached_tokens_by_medium.labels("cpu").inc(loaded)

    def render(self) -> bytes:
        """Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
