"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

Same request shapes as vLLM (``vllm/entrypoints/serve/lora/protocol.py``)::

    {"lora_name": "sql", "lora_path": "/adapters/sql", "load_inplace": false}    # load
    {"lora_name": "sql"}                                                          # unload ("lora_int_id" ignored)

and the same answers: 200 with the text ``Success: LoRA adapter 'sql' added successfully.``
(``removed`` for unload); errors in OpenAI's JSON shape: 400 for a missing name or path, a name
already loaded without ``load_inplace``, the base model's name, or an adapter the engine cannot
serve (format, targets, rank, shapes); 404 for no adapter at the path or no adapter by that name.
Both are under ``/v1/``, so ``--api-key`` guards them. The adapter is read and validated in a
thread; the engine keeps stepping meanwhile.
"""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from protocol.openai_api import bad_request
from worker.server.api.body import read_json
from worker.server.api.context import CTX

log = logging.getLogger("prefixlb.worker.server")
_SHAPE = "Both 'lora_name' and 'lora_path' must be provided."


def _string(body: dict, key: str, limit: int) -> str | None:
    value = body.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string", key)
    if len(value) > limit:
        raise bad_request(f"'{key}' is longer than {limit} characters", key)
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Load (or, with ``load_inplace``, replace) a PEFT adapter and serve it as ``lora_name``."""
    ctx = request.app[CTX]
    body = await read_json(request, ctx.limits, ctx.body_timeout)
    name = _string(body, "lora_name", ctx.limits.max_name_chars)
    path = _string(body, "lora_path", 4096)
    if name is None or path is None:
        raise bad_request(_SHAPE, "lora_name" if name is None else "lora_path")
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise bad_request("'load_inplace' must be a boolean", "load_inplace")
    engine = ctx.engine.engine
    adapter = await asyncio.get_running_loop().run_in_executor(None, engine.add_lora, name, path, inplace)
    log.info("event=lora_loaded worker=%s lora=%s digest=%s rank=%d targets=%s inplace=%s", ctx.worker_id,
             name, adapter.short_digest, adapter.rank, ",".join(adapter.target_modules), inplace)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Stop serving ``lora_name``; its requests in flight finish with it."""
    ctx = request.app[CTX]
    body = await read_json(request, ctx.limits, ctx.body_timeout)
    name = _string(body, "lora_name", ctx.limits.max_name_chars)
    if name is None:
        raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    ctx.engine.engine.remove_lora(name)
    log.info("event=lora_unloaded worker=%s lora=%s", ctx.worker_id, name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
