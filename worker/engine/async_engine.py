"""AsyncLLMEngine: the LLMEngine on one background thread, consumed with ``async for``.

The event loop never touches the engine's state: ``generate``, ``abort`` and
``reset_prefix_cache`` post commands (:data:`EngineCommand`) to the engine thread, which runs
them in order before every step (so an abort frees blocks before the next step runs), steps
while there is work, and hands outputs, KV events and a fresh stats snapshot back to the event
loop with ``call_soon_threadsafe``. A step that fails aborts only that step's requests (they
receive the error); the loop keeps serving everyone else.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Union

from worker.engine.llm_engine import LLMEngine
from worker.engine.errors import DuplicateRequestError, EngineDeadError, EngineStepError
from worker.engine.kv_cache.events import KVCacheEvent
from worker.engine.lora.adapter import LoRAAdapter
from worker.engine.outputs import RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.engine.stats import EngineStats

log = logging.getLogger("prefixlb.worker.engine")

KVEventListener = Callable[[list[KVCacheEvent]], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class AddRequest:
    """Queue a request in the engine (its errors go back to the request's consumer)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: int
    arrival_time: float
    lora: LoRAAdapter | None = None  # the adapter to run with (None: the base model)


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request and free its blocks before the next step."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Forget every cached block if no request holds any; the answer resolves ``done``."""

    done: asyncio.Future


# What the event loop posts to the engine thread; run in order before every step.
EngineCommand = Union[AddRequest, AbortRequest, ResetPrefixCache]


class AsyncLLMEngine:
    """Async front of an :class:`LLMEngine`; one engine thread, any number of consumers."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: deque[EngineCommand] = deque()
        self._wakeup = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._listeners: list[KVEventListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._dead: BaseException | None = None
        self._stats = engine.stats()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent); must be called from the serving event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread after its current step."""
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       namespace: int = 0, lora: LoRAAdapter | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until the finished one; closing the iterator aborts it.

        ``lora``: the adapter to run with (LLMEngine.add_request); its LoRA errors arrive here
        like InvalidRequestError does.

        Raises :class:`~worker.engine.errors.InvalidRequestError` (bad request, before any output),
        :class:`~worker.engine.errors.EngineStepError` (its step failed) or ``EngineDeadError``.
        """
        if self._dead is not None:
            raise EngineDeadError("the engine loop has stopped") from self._dead
        if self._stop:
            raise EngineDeadError("the engine is shut down")
        self.engine.validate_request(prompt_token_ids, params)
        if request_id in self._queues:
            raise DuplicateRequestError(f"request id {request_id!r} is already running")
        self.start()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if self._dead is not None:  # died since the check above: its farewell missed this queue
            del self._queues[request_id]
            raise EngineDeadError("the engine loop has stopped") from self._dead
        self._post(AddRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                              namespace=namespace, arrival_time=time.monotonic(), lora=lora))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._queues.get(request_id) is queue:
                del self._queues[request_id]
            if not finished:
                self._post(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed before the engine's next step)."""
        self._post(AbortRequest(request_id))

    async def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks if no request holds any; True if it did."""
        self.start()
        assert self._loop is not None
        fut: asyncio.Future = self._loop.create_future()
        self._post(ResetPrefixCache(fut))
        return await fut

    def stats(self) -> EngineStats:
        """The snapshot taken after the engine's latest step or command."""
        return self._stats

    def add_kv_event_listener(self, listener: KVEventListener) -> None:
        """Call ``listener(events)`` on the event loop after each step that changed the cache."""
        self._listeners.append(listener)

    # ---- engine thread -----------------------------------------------------------------------
    def _post(self, command: EngineCommand) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _deliver(self, request_id: str, item: object) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out.request_id, out)

    def _emit_events(self, events: list[KVCacheEvent]) -> None:
        for listener in self._listeners:
            try:
                listener(events)
            except Exception:  # a listener bug must not stop the engine
                log.exception("event=kv_listener_failed")

    def _call(self, fn: Callable, *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self._stop = True

    def _run_commands(self) -> None:
        engine = self.engine
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, AddRequest):
                try:
                    engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                       namespace=cmd.namespace, arrival_time=cmd.arrival_time, lora=cmd.lora)
                except Exception as exc:  # delivered to the caller, e.g. InvalidRequestError
                    self._call(self._deliver, cmd.request_id, exc)
            elif isinstance(cmd, AbortRequest):
                engine.abort_request(cmd.request_id)
            elif isinstance(cmd, ResetPrefixCache):
                ok = engine.reset_prefix_cache()
                self._call(lambda f=cmd.done, v=ok: f.done() or f.set_result(v))

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                self._wakeup.clear()
                self._run_commands()
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except EngineStepError as exc:
                        log.error("event=step_failed requests=%d error=%r", len(exc.request_ids), exc.cause)
                        for rid in exc.request_ids:
                            self._call(self._deliver, rid, exc)
                        outputs = []
                else:
                    outputs = []
                # Snapshot first, so a consumer that sees its final output also sees its effect.
                self._stats = engine.stats()
                if outputs:
                    self._call(self._deliver_outputs, outputs)
                events = engine.take_kv_events()
                if events and self._listeners:
                    self._call(self._emit_events, events)
                if not engine.has_unfinished_requests() and not self._commands:
                    self._wakeup.wait(1.0)
        except BaseException as exc:  # a bug in the engine itself: fail everyone, loudly
            log.exception("event=engine_loop_died")
            self._dead = exc
            dead = EngineDeadError(f"the engine loop stopped: {exc!r}")
            for rid in list(self._queues):
                self._call(self._deliver, rid, dead)
