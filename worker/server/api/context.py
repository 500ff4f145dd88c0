"""WorkerContext: what every handler of one worker server shares.

The engine (real or simulated, behind the same AsyncLLMEngine), its tokenizer, the served
model name and worker id, request limits, metrics, the KV-event mapper and the optional Redis
publisher, and the drain state. Handlers read it; only the lifecycle in worker/server/app.py
changes ``draining``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web

from protocol.hashing import DEFAULT_CHUNK_SIZE, namespace_seed
from protocol.messages import LoadReport, WorkerInfo
from protocol.openai_api import RequestLimits
from worker.engine.async_engine import AsyncLLMEngine
from worker.engine.kv_cache.events import KVCacheEvent
from worker.engine.errors import LoRAAdapterNotFoundError
from worker.engine.lora.adapter import LoRAAdapter
from worker.server.kv_events import KVEventMapper, request_chunks
from worker.server.metrics import WorkerMetrics
from worker.server.publisher import RedisPublisher
from worker.engine.tokenizer import Tokenizer
from worker.server.api.tool_calls import ToolCallParser
from worker.simulator.recorded import RecordedAnswers

log = logging.getLogger("prefixlb.worker.server")

# (registry entry, load-report provider) -> publisher: RedisPublisher with its settings bound.
PublisherFactory = Callable[[WorkerInfo, Callable[[], LoadReport]], RedisPublisher]


@dataclass(slots=True)
class WorkerContext:
    """Shared state of one worker server (see module docstring)."""

    engine: AsyncLLMEngine
    model_name: str
    worker_id: str
    url: str
    chunk_size: int = DEFAULT_CHUNK_SIZE
    limits: RequestLimits = field(default_factory=RequestLimits)
    simulated: bool = False
    info_extra: dict = field(default_factory=dict)  # shown by /get_server_info
    extra_metrics: Callable[[], dict[str, float]] | None = None  # e.g. the simulator's clock
    body_timeout: float = 30.0
    api_keys: tuple[str, ...] = ()  # required on /v1/* when set (protocol/api_keys.py)
    recorded: RecordedAnswers | None = None  # the simulator's recorded-answer mode: prompts it can answer
    mapper: KVEventMapper = field(default_factory=KVEventMapper)
    tool_parser: ToolCallParser | None = None  # --tool-call-parser: turns the model's text into tool_calls
    # With --redis: builds the publisher from this worker's registry entry and load reports.
    publisher_factory: PublisherFactory | None = None
    publisher: RedisPublisher | None = field(init=False, default=None)
    metrics: WorkerMetrics = field(init=False)
    draining: bool = False
    inflight: int = 0
    started_at: float = field(default_factory=time.time)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _next_id: int = 0

    def __post_init__(self) -> None:
        self.metrics = WorkerMetrics(self.engine.stats, self._extra_metrics)
        if self.publisher_factory is not None:
            self.publisher = self.publisher_factory(self.worker_info(), self.load_report)
        self._idle.set()

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer."""
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output this worker serves."""
        return min(self.engine.engine.max_model_len, self.engine.engine.capacity_tokens)

    @property
    def loras(self) -> list[LoRAAdapter]:
        """The LoRA adapters served (current versions, by name)."""
        return self.engine.engine.list_loras()

    def find_lora(self, name: str) -> LoRAAdapter | None:
        """The adapter served as ``name``, if any."""
        registry = self.engine.engine.lora
        if registry is None or name not in registry:
            return None
        try:
            return registry.get(name)
        except LoRAAdapterNotFoundError:  # unloaded since the check
            return None

    async def prefetch_lora(self, lora: LoRAAdapter) -> None:
        """Bring ``lora``'s weights into host memory in a thread (no-op when resident)."""
        registry = self.engine.engine.lora
        if registry is not None and not registry.is_resident(lora):
            await asyncio.get_running_loop().run_in_executor(None, registry.prefetch, lora)

    def served_models(self) -> list[str]:
        """The base model's name, then every adapter's."""
        return [self.model_name] + [a.name for a in self.loras]

    def new_request_id(self, prefix: str) -> str:
        """A unique id like ``cmpl-<worker>-<n>``."""
        self._next_id += 1
        return f"{prefix}-{self.worker_id}-{self._next_id}"

    # ------------------------------------------------------------------ in-flight accounting

    def request_started(self) -> None:
        """Count a generation request in flight (drain waits for these)."""
        self.inflight += 1
        self._idle.clear()

    def request_finished(self) -> None:
        """Uncount a generation request."""
        self.inflight -= 1
        if self.inflight <= 0:
            self.inflight = 0
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ------------------------------------------------------------------ reports

    @property
    def status(self) -> str:
        """``ready`` or ``draining``."""
        return "draining" if self.draining else "ready"

    def load_report(self) -> LoadReport:
        """This worker's LoadReport right now (served at /load and heartbeated to Redis)."""
        return LoadReport(worker_id=self.worker_id, status=self.status,
                          **self.engine.stats().load_report_fields())

    def worker_info(self) -> WorkerInfo:
        """This worker's registry entry."""
        s = self.engine.stats()
        return WorkerInfo(worker_id=self.worker_id, url=self.url, model=self.model_name,
                          block_size=s.block_size, chunk_size=self.chunk_size,
                          capacity_tokens=s.capacity_tokens, max_num_seqs=s.max_num_seqs,
                          status=self.status, simulated=self.simulated)

    def _extra_metrics(self) -> dict[str, float]:
        extra: dict[str, float] = {
            "requests_inflight": self.inflight,
            "draining": float(self.draining),
            "kv_event_table_entries": len(self.mapper),
            "kv_event_table_forgotten_total": self.mapper.forgotten,
        }
        if self.extra_metrics is not None:
            extra.update(self.extra_metrics())
        if self.publisher is not None:
            st = self.publisher.stats
            extra.update({
                "kv_events_published_total": st.published,
                "kv_events_dropped_total": st.dropped,
                "kv_events_pending": self.publisher.pending,
                "redis_failures_total": st.failures,
                "redis_heartbeats_total": st.heartbeats,
                "redis_connected": float(st.connected),
            })
        return extra

    # ------------------------------------------------------------------ KV events

    def namespace(self, model: str, adapter: str | None, cache_salt: str | None) -> int:
        """The shared router/engine namespace seed of a request."""
        return namespace_seed(model, adapter, cache_salt)

    def track_prompt(self, rendered: bytes, prompt_token_ids: list[int], namespace: int,
                     block_namespace: int | None = None, lora_name: str | None = None) -> None:
        """Attach the request's router chunks (``namespace``) to its prompt blocks (the engine's
        ``block_namespace``), only when publishing."""
        if self.publisher is None:
            return
        rc = request_chunks(rendered, prompt_token_ids, namespace, self.chunk_size,
                            self.engine.engine.config.block_size, block_namespace, lora_name)
        for event in self.mapper.register(rc):
            self.publisher.publish(event.kind, event.hashes, event.lora_name, event.medium)

    def on_kv_events(self, events: list[KVCacheEvent]) -> None:
        """Engine listener (on the event loop): translate and queue for Redis."""
        if self.publisher is None:
            return
        for event in self.mapper.translate(events):
            self.publisher.publish(event.kind, event.hashes, event.lora_name, event.medium)


CTX: web.AppKey[WorkerContext] = web.AppKey("ctx", WorkerContext)
