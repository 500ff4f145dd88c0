"""The load generator: sends a workload to an OpenAI-compatible endpoint and records each request.

Open loop (default): each request leaves at its arrival time, ``arrival_s / (speedup ×
time_scale)`` seconds of wall time after the start, whether or not earlier ones finished.
Closed loop (``concurrency``): that many requests are kept in flight, arrivals ignored.
Every request streams (``/v1/completions``, or ``/v1/chat/completions`` with ``chat``: the prompt
as one user message; ``stream_options.include_usage``), so the time to the first chunk that
carries output is the TTFT (a chat stream's opening role-only chunk does not count); the final usage chunk carries prompt, cached and completion tokens,
and ``system_fingerprint`` (or the ``X-Prefixlb-Worker-Id`` header) names the worker.
Measured times are multiplied by ``time_scale`` (the simulated workers ran that much faster).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from bench.records import RequestRecord
from bench.workloads import RequestSpec, TextSource, Workload

log = logging.getLogger("prefixlb.bench")

WORKER_HEADERS = ("X-Prefixlb-Worker-Id", "X-Prefixlb-Worker")


@dataclass(slots=True)
class LoadConfig:
    """How to drive the target."""

    target: str
    model: str | None = None  # None: the first model the target lists at /v1/models
    time_scale: float = 1.0
    speedup: float = 1.0
    concurrency: int | None = None
    duration_s: float | None = None
    request_timeout_s: float = 600.0
    session_header: str = "x-session-id"
    headers: dict[str, str] = field(default_factory=dict)  # sent with every call (Authorization, ...)
    progress: bool = True
    seed: int = 0
    chat: bool = False  # /v1/chat/completions instead of /v1/completions


class _Stream:
    """Parses an SSE completion stream without decoding every chunk (the bench shares the CPU)."""

    def __init__(self, chat: bool = False) -> None:
        self.chat = chat
        self.first_at: float | None = None
        self.worker_id: str | None = None
        self.usage: dict | None = None
        self.error: str | None = None

    def feed(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]" or not payload:
            return
        first = self.first_at is None
        has_usage = b'"usage"' in payload and b'"usage":null' not in payload and b'"usage": null' not in payload
        if first or has_usage or b'"error"' in payload:
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                self.error = "malformed stream chunk"
                return
            if "error" in chunk and chunk["error"]:
                err = chunk["error"]
                self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                return
            self.worker_id = self.worker_id or chunk.get("system_fingerprint")
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            if first and chunk.get("choices") and (not self.chat or _has_output(chunk)):
                self.first_at = now
        elif first:
            self.first_at = now


def _has_output(chunk: dict) -> bool:
    delta = (chunk["choices"][0] or {}).get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))


async def send_one(session: aiohttp.ClientSession, cfg: LoadConfig, spec: RequestSpec, prompt: str,
                   start: float) -> RequestRecord:
    """Send one streaming completion and record what happened (never raises)."""
    # A request for a LoRA adapter names it as its model (vLLM's convention).
    body = {"model": spec.adapter or cfg.model, "max_tokens": spec.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    headers = dict(cfg.headers)
    if spec.session:
        headers[cfg.session_header] = spec.session
    sent = time.perf_counter()
    rec = RequestRecord(index=spec.index, sent_s=(sent - start) * cfg.time_scale, session=spec.session)
    stream = _Stream(cfg.chat)
    path = "/v1/chat/completions" if cfg.chat else "/v1/completions"
    try:
        async with session.post(cfg.target.rstrip("/") + path, json=body, headers=headers) as resp:
            for name in WORKER_HEADERS:
                rec.worker_id = rec.worker_id or resp.headers.get(name)
            if resp.status >= 400:
                text = await resp.text()
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text[:200]
                rec.error = f"http {resp.status}: {message}"
                return rec
            async for line in resp.content:
                stream.feed(line, time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        return rec
    done = time.perf_counter()
    rec.worker_id = stream.worker_id or rec.worker_id
    if stream.error:
        rec.error = stream.error
    elif stream.usage is None or stream.first_at is None:
        rec.error = "stream ended without tokens or usage"
    else:
        usage = stream.usage
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.completion_tokens = int(usage.get("completion_tokens") or 0)
        rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        rec.ttft_ms = (stream.first_at - sent) * 1000.0 * cfg.time_scale
        rec.e2e_ms = (done - sent) * 1000.0 * cfg.time_scale
    return rec


async def served_model(session: aiohttp.ClientSession, target: str, headers: dict[str, str] | None = None) -> str:
    """The first model id ``target`` lists at ``/v1/models``."""
    try:
        async with session.get(target.rstrip("/") + "/v1/models", headers=headers) as resp:
            if resp.status >= 400:
                raise LoadError(f"{target}/v1/models answered {resp.status}"
                                + (" (give the API key with --api-key or OPENAI_API_KEY)" if resp.status == 401 else ""))
            data = await resp.json(content_type=None)
        return str(data["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise LoadError(f"cannot read the served model from {target}/v1/models: {exc}") from exc


class LoadError(RuntimeError):
    """The target cannot be driven (unreachable, no model listed)."""


async def run_load(workload: Workload, cfg: LoadConfig, text: TextSource | None = None) -> list[RequestRecord]:
    """Send every request of ``workload`` to ``cfg.target``; records come back in request order."""
    text = text or TextSource(cfg.seed)
    specs = list(workload.requests)
    if cfg.duration_s is not None and cfg.concurrency is None:
        specs = [s for s in specs if s.arrival_s / cfg.speedup <= cfg.duration_s]
    records: list[RequestRecord | None] = [None] * len(specs)
    bar = tqdm(total=len(specs), disable=not cfg.progress, unit="req", desc=workload.name, leave=False)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    wall_per_unit = 1.0 / (cfg.speedup * cfg.time_scale)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if cfg.model is None:
            cfg.model = await served_model(session, cfg.target, cfg.headers)
        start = time.perf_counter()

        async def one(i: int) -> None:
            rec = await send_one(session, cfg, specs[i], text.prompt(specs[i]), start)
            if not cfg.concurrency:  # open loop: how far the generator fell behind the schedule
                rec.send_lag_ms = (rec.sent_s - specs[i].arrival_s / cfg.speedup) * 1000.0
            records[i] = rec
            bar.update(1)

        if cfg.concurrency:
            deadline = start + cfg.duration_s / cfg.time_scale if cfg.duration_s else None
            cursor = iter(range(len(specs)))

            async def closed_loop() -> None:
                for i in cursor:
                    if deadline is not None and time.perf_counter() > deadline:
                        return
                    await one(i)

            await asyncio.gather(*(closed_loop() for _ in range(cfg.concurrency)))
        else:
            tasks = []
            for i, spec in enumerate(specs):
                delay = start + spec.arrival_s * wall_per_unit - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
    bar.close()
    done = [r for r in records if r is not None]
    lags = [r.send_lag_ms for r in done if r.send_lag_ms is not None]
    log.info("event=bench_done workload=%s requests=%d errors=%d max_send_lag_ms=%.1f", workload.name, len(done),
             sum(1 for r in done if not r.ok), max(lags, default=0.0))
    return done
