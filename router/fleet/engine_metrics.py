"""The load of a vLLM or SGLang server, read from its Prometheus ``/metrics``, as a LoadReport.

prefixlb workers report their load themselves (``GET /load``); real engines only expose
Prometheus text. This module turns one scrape into an :class:`EngineScrape` and two consecutive
scrapes into the same :class:`~protocol.LoadReport` the policy reads for prefixlb workers. It
does no I/O: the prober fetches the text and keeps the previous scrape (docs/real-engines.md
lists every name read here and what each engine answers).

What each field comes from:

=====================  ==========================================  ==========================================
LoadReport             vLLM 0.32                                   SGLang (source of sglang.srt.metrics)
=====================  ==========================================  ==========================================
running                ``vllm:num_requests_running``               ``sglang:num_running_reqs``
waiting                ``vllm:num_requests_waiting``               ``sglang:num_queue_reqs``
kv_usage               ``vllm:kv_cache_usage_perc`` (0..1)         ``sglang:token_usage`` (0..1)
block_size, blocks     ``vllm:cache_config_info`` labels           1 token per "block", ``max_total_num_tokens``
capacity_tokens        num_gpu_blocks x block_size                 ``sglang:max_total_num_tokens``
prefill_tokens_per_s   Δ prefill-computed tokens / Δ prefill time  Δ ``prompt_tokens - cached_tokens`` / Δt
                       (``request_prefill_kv_computed_tokens``,    while busy (a lower bound: SGLang has
                       ``request_prefill_time_seconds`` sums)      no prefill-time histogram)
decode_step_s          Δ ``inter_token_latency_seconds`` sum/count same names under ``sglang:``
queued_prefill_tokens  waiting x mean prompt tokens per request (an estimate: neither engine exports it)
max_loras, lora_*      ``vllm:lora_requests_info`` (newest          --
                       sample): ``max_lora``; running adapters
                       are in GPU slots (``lora_gpu``), 1 request
                       each in ``lora_running`` / ``lora_waiting``
                       (the gauge names adapters, not counts)
=====================  ==========================================  ==========================================

A rate needs two scrapes with the counter grown in between; until then (or when a counter
went backwards: the engine restarted) the field is 0, which the router reads as "not measured"
and replaces by its configured profile. SGLang labels every scheduler gauge with
``tp_rank``/``pp_rank`` (and ``dp_rank``): tensor-parallel ranks repeat the same value, so only
``tp_rank="0"``, ``pp_rank="0"`` samples count, summed over data-parallel ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from protocol import LoadReport

VLLM = "vllm"
SGLANG = "sglang"
ENGINE_KINDS = (VLLM, SGLANG)


class EngineMetricsError(ValueError):
    """The text is not Prometheus exposition, or it is neither a vLLM nor an SGLang server's."""


@dataclass(slots=True, frozen=True)
class EngineScrape:
    """What one ``/metrics`` scrape of a vLLM or SGLang server says, at time ``ts``.

    Gauges are current values; ``*_total``/``*_sum``/``*_count`` fields are the engine's
    cumulative counters (their differences between two scrapes give rates). ``None`` means the
    engine does not export that metric.
    """

    kind: str
    ts: float
    running: int
    waiting: int
    kv_usage: float
    block_size: int | None = None
    total_blocks: int | None = None
    capacity_tokens: int | None = None
    prompt_tokens_total: float | None = None
    cached_prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    prefill_computed_tokens_sum: float | None = None
    prefill_time_sum: float | None = None
    prompt_requests_count: float | None = None
    inter_token_latency_sum: float | None = None
    inter_token_latency_count: float | None = None
    models: tuple[str, ...] = ()
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_lora: int | None = None


@dataclass(slots=True)
class _Samples:
    """Samples by name: ``name -> [(labels, value)]``."""

    by_name: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def all(self, name: str) -> list[tuple[dict[str, str], float]]:
        return self.by_name.get(name, [])

    def total(self, name: str, **match: str) -> float | None:
        """Sum over the samples of ``name`` whose labels include ``match`` (None: no sample)."""
        values = [v for labels, v in self.all(name)
                  if all(labels.get(k, v0) == v0 for k, v0 in match.items()) and math.isfinite(v)]
        return sum(values) if values else None


def _samples(text: str) -> _Samples:
    out = _Samples()
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.by_name.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError) as exc:  # the parser's errors on malformed lines
        raise EngineMetricsError(f"not Prometheus text: {exc}") from exc
    return out


def detect_kind(text: str) -> str | None:
    """``"vllm"`` or ``"sglang"`` from the metric names in ``text``; None when it is neither."""
    if "vllm:num_requests_running" in text:
        return VLLM
    if "sglang:num_running_reqs" in text:
        return SGLANG
    return None


def parse_engine_metrics(text: str, ts: float, kind: str | None = None) -> EngineScrape:
    """One scrape of a vLLM or SGLang server's ``/metrics`` text (``kind`` detected if None)."""
    kind = kind or detect_kind(text)
    if kind not in ENGINE_KINDS:
        raise EngineMetricsError("neither vllm:num_requests_running nor sglang:num_running_reqs "
                                 "in the metrics")
    samples = _samples(text)
    return _vllm(samples, ts) if kind == VLLM else _sglang(samples, ts)


def _int(value: float | None) -> int:
    return int(value) if value is not None and value > 0 else 0


def _label_int(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


# Cumulative counters per engine: EngineScrape field -> metric (summed over its samples).
_COUNTERS = {
    VLLM: {
        "prompt_tokens_total": "vllm:prompt_tokens_total",
        "cached_prompt_tokens_total": "vllm:prefix_cache_hits_total",
        "generation_tokens_total": "vllm:generation_tokens_total",
        "prefill_computed_tokens_sum": "vllm:request_prefill_kv_computed_tokens_sum",
        "prefill_time_sum": "vllm:request_prefill_time_seconds_sum",
        "prompt_requests_count": "vllm:request_prompt_tokens_count",
        "inter_token_latency_sum": "vllm:inter_token_latency_seconds_sum",
        "inter_token_latency_count": "vllm:inter_token_latency_seconds_count",
    },
    SGLANG: {
        "prompt_tokens_total": "sglang:prompt_tokens_total",
        "cached_prompt_tokens_total": "sglang:cached_tokens_total",
        "generation_tokens_total": "sglang:generation_tokens_total",
        "prompt_requests_count": "sglang:num_requests_total",
        "inter_token_latency_sum": "sglang:inter_token_latency_seconds_sum",
        "inter_token_latency_count": "sglang:inter_token_latency_seconds_count",
    },
}
# Load gauges per engine: (running, waiting, kv usage).
_GAUGES = {
    VLLM: ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    SGLANG: ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
}
# SGLang's scheduler gauges repeat per tensor/pipeline-parallel rank: count rank 0 only.
_GAUGE_LABELS = {VLLM: {}, SGLANG: {"tp_rank": "0", "pp_rank": "0"}}


def _scrape(kind: str, s: _Samples, ts: float, **pool: object) -> EngineScrape:
    match = _GAUGE_LABELS[kind]
    running, waiting, usage = (s.total(name, **match) for name in _GAUGES[kind])
    models = sorted({labels["model_name"] for labels, _ in s.all(_GAUGES[kind][0]) if "model_name" in labels})
    counters = {field_: s.total(name) for field_, name in _COUNTERS[kind].items()}
    return EngineScrape(kind=kind, ts=ts, running=_int(running), waiting=_int(waiting),
                        kv_usage=_clamp01(usage), models=tuple(models), **counters, **pool)  # type: ignore[arg-type]


def _vllm(s: _Samples, ts: float) -> EngineScrape:
    block_size = total_blocks = None
    for labels, _ in s.all("vllm:cache_config_info"):
        block_size = _label_int(labels, "block_size")
        total_blocks = _label_int(labels, "num_gpu_blocks")
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_lora = None
    # vllm:lora_requests_info (only with --enable-lora): one sample per change, the value is its
    # time; the newest one is the current state. Adapters are comma-separated label values.
    newest = max(s.all("vllm:lora_requests_info"), key=lambda lv: lv[1], default=None)
    if newest is not None:
        labels = newest[0]
        running_loras = tuple(a for a in labels.get("running_lora_adapters", "").split(",") if a)
        waiting_loras = tuple(a for a in labels.get("waiting_lora_adapters", "").split(",") if a)
        max_lora = _label_int(labels, "max_lora")
    return _scrape(VLLM, s, ts, block_size=block_size, total_blocks=total_blocks,
                   capacity_tokens=block_size * total_blocks if block_size and total_blocks else None,
                   lora_running=running_loras, lora_waiting=waiting_loras, max_lora=max_lora)


def _sglang(s: _Samples, ts: float) -> EngineScrape:
    capacity = _int(s.total("sglang:max_total_num_tokens", **_GAUGE_LABELS[SGLANG])) or None
    # SGLang's radix cache pages tokens one by one (page size 1 by default).
    return _scrape(SGLANG, s, ts, block_size=1 if capacity else None, total_blocks=capacity,
                   capacity_tokens=capacity)


def _clamp01(value: float | None) -> float:
    if value is None or not math.isfinite(value):
        return 0.0
    return min(1.0, max(0.0, value))


def _delta(prev: float | None, cur: float | None) -> float | None:
    """Counter growth; None when unknown or when it went backwards (the engine restarted)."""
    if prev is None or cur is None or cur < prev:
        return None
    return cur - prev


def _ratio(num: float | None, den: float | None) -> float:
    if num is None or den is None or den <= 0 or num <= 0:
        return 0.0
    return num / den


def prefill_tokens_per_s(prev: EngineScrape, cur: EngineScrape) -> float:
    """Measured prefill speed between two scrapes (tokens computed per second of prefill); 0 if unknown."""
    if cur.prefill_time_sum is not None:  # vLLM: per-request prefill time, summed
        return _ratio(_delta(prev.prefill_computed_tokens_sum, cur.prefill_computed_tokens_sum),
                      _delta(prev.prefill_time_sum, cur.prefill_time_sum))
    # SGLang: computed prompt tokens over the wall time between scrapes, only if it was busy
    # throughout (both scrapes saw running requests): otherwise idle time would dilute it.
    if prev.running == 0 or cur.running == 0:
        return 0.0
    prompt = _delta(prev.prompt_tokens_total, cur.prompt_tokens_total)
    cached = _delta(prev.cached_prompt_tokens_total, cur.cached_prompt_tokens_total) or 0.0
    return _ratio(None if prompt is None else prompt - cached, cur.ts - prev.ts)


def decode_step_s(prev: EngineScrape, cur: EngineScrape) -> float:
    """Mean time between two output tokens of a request between two scrapes; 0 if unknown."""
    return _ratio(_delta(prev.inter_token_latency_sum, cur.inter_token_latency_sum),
                  _delta(prev.inter_token_latency_count, cur.inter_token_latency_count))


def mean_prompt_tokens(prev: EngineScrape, cur: EngineScrape) -> float:
    """Mean prompt length of the requests that arrived between two scrapes; 0 if none did."""
    return _ratio(_delta(prev.prompt_tokens_total, cur.prompt_tokens_total),
                  _delta(prev.prompt_requests_count, cur.prompt_requests_count))


def load_report(worker_id: str, cur: EngineScrape, prev: EngineScrape | None = None,
                mean_prompt: float = 0.0) -> LoadReport:
    """The LoadReport the policy reads, from the latest scrape and (for speeds) the one before.

    ``mean_prompt`` is the caller's remembered mean prompt length, used for the queued-prefill
    estimate when no request arrived between the two scrapes.
    """
    prefill = decode = 0.0
    if prev is not None:
        prefill = prefill_tokens_per_s(prev, cur)
        decode = decode_step_s(prev, cur)
        mean_prompt = mean_prompt_tokens(prev, cur) or mean_prompt
    total = cur.total_blocks or 0
    used = int(round(cur.kv_usage * total))
    return LoadReport(
        worker_id=worker_id, running=cur.running, waiting=cur.waiting,
        queued_prefill_tokens=int(cur.waiting * mean_prompt),
        running_tokens=used * (cur.block_size or 0),
        kv_usage=cur.kv_usage, free_blocks=total - used, total_blocks=total,
        block_size=cur.block_size or 0, capacity_tokens=cur.capacity_tokens or 0,
        prefill_tokens_per_s=prefill, decode_step_s=decode, ts=cur.ts,
        # vLLM names its running and waiting adapters: running ones hold GPU slots. It lists
        # neither the adapters it could load nor host-memory residents (lora_adapters, lora_cpu
        # stay empty: the router takes it as able to load any adapter).
        max_loras=min(cur.max_lora or 0, 1 << 16), lora_gpu=list(cur.lora_running),
        lora_running=dict.fromkeys(cur.lora_running, 1), lora_waiting=dict.fromkeys(cur.lora_waiting, 1))
