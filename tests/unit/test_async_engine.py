"""AsyncLLMEngine: async generation on the engine thread, abort on close, KV-event listeners,
failures confined to the failing step's requests."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from tests.engine_support import SlotMemoryRunner, reference_continuation
from worker.engine.async_engine import AsyncLLMEngine
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.errors import EngineDeadError, EngineStepError, PromptTooLongError
from worker.engine.kv_cache import BlockStored
from worker.engine.runner import RunnerOutput, ScheduledBatch
from worker.engine.sampling_params import SamplingParams


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def until(predicate, timeout=10.0):
    """Poll ``predicate`` on the event loop until true, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


@pytest.fixture
async def engine():
    runner = SlotMemoryRunner(64, 4)
    async_engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=None, num_kv_blocks=64, block_size=4),
                                            runner=runner))
    yield async_engine
    await async_engine.shutdown()


async def collect(engine, rid, prompt, params, namespace=0):
    outs = []
    async for out in engine.generate(rid, prompt, params, namespace=namespace):
        outs.append(out)
    return outs


async def test_concurrent_generations_each_get_their_reference_tokens(engine):
    prompts = {f"r{i}": list(range(i, i + 5 + 3 * i)) for i in range(6)}
    results = await asyncio.gather(*(collect(engine, rid, p, greedy(7)) for rid, p in prompts.items()))
    for (rid, prompt), outs in zip(prompts.items(), results):
        assert [t for o in outs for t in o.new_token_ids] == reference_continuation(prompt, 7)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
    await until(lambda: engine.stats().requests_finished == 6)


async def test_closing_the_stream_early_aborts_the_request_and_frees_its_blocks(engine):
    stream = engine.generate("a", list(range(40)), greedy(1000))
    async with contextlib.aclosing(stream):
        first = await stream.__anext__()
        assert first.new_token_ids
    await until(lambda: engine.stats().running == 0 and engine.stats().used_blocks == 0)
    assert engine.engine.scheduler.requests == {}


async def test_kv_event_listeners_hear_about_stored_blocks_on_the_event_loop(engine):
    heard = []
    loop = asyncio.get_running_loop()
    engine.add_kv_event_listener(lambda events: heard.append((asyncio.get_running_loop() is loop, events)))
    await collect(engine, "a", list(range(9)), greedy(1))
    await until(lambda: heard)
    on_loop, events = heard[0]
    assert on_loop and isinstance(events[0], BlockStored) and len(events[0].block_hashes) == 2


async def test_an_invalid_request_fails_before_any_output(engine):
    with pytest.raises(PromptTooLongError):
        await collect(engine, "a", [1] * 300, greedy(1))


async def test_reset_prefix_cache_forgets_cached_blocks(engine):
    await collect(engine, "a", list(range(9)), greedy(1))
    assert engine.stats().cached_blocks == 2  # the sampled 10th token has no KV yet
    assert await engine.reset_prefix_cache() is True
    await until(lambda: engine.stats().cached_blocks == 0)


class FailingOnceRunner(SlotMemoryRunner):
    """Raises on the first step that contains request ``bad``."""

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        if any(s.request_id == "bad" for s in batch.seqs) and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("kernel exploded")
        return super().execute(batch)


async def test_a_failing_step_fails_only_its_requests_and_the_engine_keeps_serving():
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=None, num_kv_blocks=64, block_size=4),
                                      runner=FailingOnceRunner(64, 4)))
    try:
        with pytest.raises(EngineStepError) as info:
            await collect(engine, "bad", [1, 2, 3], greedy(3))
        assert info.value.request_ids == ["bad"]
        outs = await collect(engine, "good", [4, 5, 6], greedy(3))
        assert [t for o in outs for t in o.new_token_ids] == reference_continuation([4, 5, 6], 3)
        assert engine.is_running
        await until(lambda: engine.stats().used_blocks == 0)
    finally:
        await engine.shutdown()


async def test_a_shut_down_engine_refuses_new_requests_instead_of_hanging(engine):
    await collect(engine, "a", [1, 2, 3], greedy(1))
    await engine.shutdown()
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        await collect(engine, "b", [1, 2, 3], greedy(1))


class DyingEngine(LLMEngine):
    """An engine whose thread dies (a bug in the engine itself) while a request is being admitted."""

    die = False
    async_engine: AsyncLLMEngine | None = None

    def has_unfinished_requests(self) -> bool:
        if self.die:
            raise RuntimeError("scheduler bug")
        return super().has_unfinished_requests()

    def validate_request(self, prompt_token_ids, params) -> None:
        super().validate_request(prompt_token_ids, params)
        if self.async_engine is not None and not self.die:
            # The engine thread dies between generate()'s liveness check and its registration
            # (a thread switch there is all it takes).
            self.die = True
            self.async_engine._wakeup.set()
            self.async_engine._thread.join(5.0)


async def test_a_request_admitted_while_the_engine_thread_dies_fails_instead_of_hanging():
    inner = DyingEngine(EngineConfig(model=None, num_kv_blocks=64, block_size=4), runner=SlotMemoryRunner(64, 4))
    engine = AsyncLLMEngine(inner)
    engine.start()
    inner.async_engine = engine
    try:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(engine, "a", [1, 2, 3], greedy(3)), 5.0)
        assert not engine.is_running
    finally:
        await engine.shutdown()
