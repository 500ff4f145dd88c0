"""The worker's HTTP server: one aiohttp app over an AsyncLLMEngine, real or simulated.

Lifecycle of ``serve(config)``::

    build engine (model or latency model) -> start engine thread -> listen
    -> [--redis] register, publish "cleared", heartbeat load, stream KV events
    SIGTERM/SIGINT -> draining: /health 503, new requests 503, registry status "draining"
    -> wait for in-flight requests (--drain-timeout) -> deregister -> close -> exit 0

Routes are in worker/server/api/: openai_routes (completions, chat, models), lora_routes (vLLM's
load/unload adapter endpoints), probes (health, load, metrics, server/model info, tokenize,
render), errors (the worker's exceptions in OpenAI's shape). The error and API-key middlewares
are protocol's, shared with the router; with ``--api-key`` every route but :data:`OPEN_PATHS`
needs the key.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import signal
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from protocol.api_keys import api_key_middleware, every_route_but
from protocol.http_errors import app_runner
from protocol.keys import RedisKeys
from protocol.messages import KV_CLEARED
from protocol.openai_api import RequestLimits
from worker.server.api import lora_routes, openai_routes, probes
from worker.server.api.context import CTX, WorkerContext
from worker.server.api.tool_calls import make_parser
from worker.server.api.errors import error_middleware
from worker.engine.async_engine import AsyncLLMEngine
from worker.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.server.kv_events import KVEventMapper
from worker.server.publisher import RedisPublisher
from worker.server.config import ServerConfig, signing_key
from worker.simulator.profiles import SIM_MAX_NUM_BATCHED_TOKENS, SIM_MAX_NUM_SEQS
from worker.simulator.recorded import RecordedAnswers

log = logging.getLogger("prefixlb.worker.server")
OPEN_PATHS = ("/health", "/load", "/metrics")  # what probes and scrapers read without --api-key


@dataclass(slots=True)
class BuiltEngine:
    """An engine, what /get_server_info says about it, and extra metrics (the simulator's clock)."""

    engine: LLMEngine
    info: dict
    metrics: Callable[[], dict[str, float]] | None = None
    answers: RecordedAnswers | None = None  # the recorded-answer mode's prompts


def build_engine(cfg: ServerConfig) -> BuiltEngine:
    """The engine ``cfg`` asks for, with its ``--lora`` adapters loaded."""
    lora = dict(enable_lora=cfg.lora_enabled, max_loras=cfg.max_loras, max_cpu_loras=cfg.max_cpu_loras,
                max_lora_rank=cfg.max_lora_rank)
    if cfg.simulate:
        from worker.simulator.recorded import RecordedAnswers
        from worker.simulator.runner import build_simulated_engine

        answers = (RecordedAnswers.from_csv(cfg.sim_answers, cfg.sim_answers_model)
                   if cfg.sim_answers and cfg.sim_answers_model else None)
        engine, runner = build_simulated_engine(
            cfg.gpu, cfg.sim_model, tp=cfg.sim_tp, time_scale=cfg.time_scale,
            block_size=cfg.block_size, num_kv_blocks=cfg.kv_blocks, kv_memory_bytes=cfg.kv_memory_bytes,
            max_num_seqs=cfg.max_num_seqs or SIM_MAX_NUM_SEQS,
            max_num_batched_tokens=cfg.max_num_batched_tokens or SIM_MAX_NUM_BATCHED_TOKENS,
            max_model_len=cfg.max_model_len, output_len=cfg.sim_output_len, seed=cfg.seed, answers=answers,
            served_model_names=[cfg.model_name], **lora, **cfg.cpu_kv_settings())
        info = {"gpu": runner.latency.gpu.name, "sim_model": runner.latency.model.name,
                "tp_size": runner.latency.tp, "time_scale": cfg.time_scale}
        if answers is not None:
            info["recorded_answers"] = {"model": answers.model, "prompts": len(answers)}
        built = BuiltEngine(engine, info, lambda: {"sim_modelled_seconds_total": runner.clock.modelled_s,
                                                   "sim_steps_total": runner.steps,
                                                   "sim_behind_seconds": runner.clock.behind_s,
                                                   "sim_behind_max_seconds": runner.clock.behind_max_s}, answers)
    else:
        config = EngineConfig(
            model=cfg.model, tokenizer=cfg.tokenizer, chat_template=cfg.chat_template,
            block_size=cfg.block_size, num_kv_blocks=cfg.kv_blocks,
            kv_memory_bytes=cfg.kv_memory_bytes, max_num_seqs=cfg.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            max_num_batched_tokens=cfg.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_model_len=cfg.max_model_len,
            attention_backend=cfg.attention_backend, device=cfg.device, dtype=cfg.dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization, num_threads=cfg.threads, seed=cfg.seed, **lora,
            **cfg.cpu_kv_settings())
        engine = LLMEngine(config, served_model_names=[cfg.model_name])
        dtype = str(getattr(engine.runner, "dtype", "")).removeprefix("torch.")
        built = BuiltEngine(engine, {"device": cfg.device, "dtype": dtype})
    for name, path in cfg.lora_specs:
        adapter = built.engine.add_lora(name, path)
        log.info("event=lora_loaded lora=%s path=%s digest=%s rank=%d targets=%s", name, path,
                 adapter.short_digest, adapter.rank, ",".join(adapter.target_modules))
    return built


def create_app(ctx: WorkerContext) -> web.Application:
    """The aiohttp application serving ``ctx``."""
    middlewares = [error_middleware(ctx.worker_id, lambda s: ctx.metrics.errors.labels(str(s)).inc())]
    if ctx.api_keys:
        middlewares.append(api_key_middleware(ctx.api_keys, every_route_but(OPEN_PATHS)))
    app = web.Application(middlewares=middlewares, client_max_size=ctx.limits.max_body_bytes + 1)
    app[CTX] = ctx
    r = app.router
    r.add_post("/v1/completions", openai_routes.completions)
    r.add_post("/v1/chat/completions", openai_routes.chat_completions)
    r.add_get("/v1/models", openai_routes.models)
    r.add_post("/v1/load_lora_adapter", lora_routes.load_lora_adapter)
    r.add_post("/v1/unload_lora_adapter", lora_routes.unload_lora_adapter)
    r.add_get("/health", probes.health)
    r.add_get("/health_generate", probes.health_generate)
    r.add_get("/load", probes.load)
    r.add_get("/get_load", probes.get_load)
    r.add_get("/metrics", probes.metrics)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, probes.server_info)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, probes.model_info)
    r.add_post("/tokenize", probes.tokenize)
    r.add_post("/detokenize", probes.detokenize)
    r.add_post("/v1/completions/render", probes.render_completion)
    r.add_post("/v1/chat/completions/render", probes.render_chat)
    return app


def make_context(cfg: ServerConfig, engine: AsyncLLMEngine, built: BuiltEngine) -> WorkerContext:
    """The shared server state for ``cfg`` (the publisher too, when ``--redis`` is given)."""
    table = cfg.kv_event_table or max(1024, 4 * engine.engine.num_kv_blocks)
    publisher = None
    if cfg.redis:
        publisher = functools.partial(RedisPublisher, cfg.redis, RedisKeys(cfg.redis_prefix),
                                      heartbeat_interval=cfg.heartbeat_interval, ttl=cfg.registry_ttl,
                                      stream_maxlen=cfg.kv_stream_maxlen, queue_size=cfg.publish_queue,
                                      signing_key=signing_key(cfg))
    return WorkerContext(engine=engine, model_name=cfg.model_name, worker_id=cfg.resolved_worker_id,
                         url=cfg.advertise_url, chunk_size=cfg.chunk_size,
                         limits=RequestLimits(max_body_bytes=cfg.max_body_bytes), simulated=cfg.simulate,
                         info_extra=built.info, extra_metrics=built.metrics,
                         body_timeout=cfg.body_timeout, mapper=KVEventMapper(max_blocks=table),
                         api_keys=tuple(cfg.api_keys), recorded=built.answers, publisher_factory=publisher,
                         tool_parser=make_parser(cfg.tool_call_parser) if cfg.tool_call_parser else None)


async def serve(cfg: ServerConfig, ready: asyncio.Event | None = None) -> int:
    """Run the worker until SIGTERM/SIGINT, then drain, deregister and return 0."""
    if cfg.redis:
        signing_key(cfg)  # an unreadable key file stops the worker before the engine loads
    built = build_engine(cfg)
    engine = built.engine
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()
    ctx = make_context(cfg, async_engine, built)
    async_engine.add_kv_event_listener(ctx.on_kv_events)
    runner = await app_runner(create_app(ctx))  # malformed HTTP gets OpenAI-shaped JSON errors too
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
    await site.start()
    if ctx.publisher is not None:
        ctx.publisher.publish(KV_CLEARED, [])  # whatever routers believed about us is void
        ctx.publisher.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("event=worker_ready worker=%s model=%s url=%s simulated=%s dtype=%s kv_blocks=%d redis=%s",
             ctx.worker_id, ctx.model_name, ctx.url, cfg.simulate, built.info.get("dtype", "-"),
             engine.num_kv_blocks, bool(cfg.redis))
    if ready is not None:
        ready.set()
    await stop.wait()
    await drain_and_stop(ctx, runner, async_engine, cfg.drain_timeout)
    return 0


async def drain_and_stop(ctx: WorkerContext, runner: web.AppRunner, engine: AsyncLLMEngine,
                         drain_timeout: float) -> None:
    """Refuse new work, let in-flight requests finish, deregister, and shut everything down."""
    ctx.draining = True
    if ctx.publisher is not None:
        ctx.publisher.set_status("draining")
    log.info("event=draining worker=%s inflight=%d", ctx.worker_id, ctx.inflight)
    if not await ctx.wait_idle(drain_timeout):
        log.warning("event=drain_timeout worker=%s inflight=%d", ctx.worker_id, ctx.inflight)
    if ctx.publisher is not None:
        await ctx.publisher.stop()
    await runner.cleanup()
    await engine.shutdown()
    log.info("event=stopped worker=%s", ctx.worker_id)
