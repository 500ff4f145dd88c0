"""After a real worker evicts a prefix (a tiny KV pool), the router stops predicting hits there.

One tiny-engine worker process with room for about two prompts publishes its KV events to a real
Redis; the router runs in this process so the test can read its index directly.
"""
from __future__ import annotations

import time

import aiohttp
import redis

from router.routing.prompt import prompt_key
from tests.integration.router_harness import running_router, wait_until
from tests.support import free_port, processes, spawn

BLOCKS = 200  # 3,200 tokens: two 1,500-byte prompts fit, a third evicts the oldest


def text(word: str) -> str:
    return "".join(f"{word} line {i} of the log: status nominal, nothing to report. " for i in range(30))[:1500]


async def test_an_evicted_prefix_is_no_longer_predicted_as_a_hit(tmp_path, redis_server_url, redis_prefix):
    port = free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--model", "tiny", "--port", str(port), "--worker-id", "small",
                            "--kv-blocks", str(BLOCKS), "--redis", redis_server_url, "--redis-prefix", redis_prefix,
                            "--advertise", f"http://127.0.0.1:{port}", "--log-level", "warning"],
                           tmp_path, "worker", port, timeout=120))
        async with running_router("--redis", redis_server_url, "--redis-prefix", redis_prefix,
                                  "--registry-interval", "0.2") as (ctx, url):
            await wait_until(lambda: ctx.balancer.routable() == ["small"], timeout=30, what="the worker")
            first = {"model": "tiny", "prompt": text("alpha"), "max_tokens": 1}
            key = prompt_key(first, False, ctx.config.chunk_size, ctx.config.ring_key_chunks)
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/completions", json=first) as resp:
                    assert resp.status == 200
                # The worker confirms the prefix (the optimistic insert would expire by itself).
                await wait_until(lambda: ctx.state.events_applied >= 1 and
                                 ctx.balancer.index.match(key.hashes, time.time()) == {"small": 11},
                                 what="the stored event")
                for word in ("bravo", "charlie"):
                    async with http.post(url + "/v1/completions",
                                         json={"model": "tiny", "prompt": text(word), "max_tokens": 1}) as resp:
                        assert resp.status == 200
                # The worker publishes its KV events after it answers: wait for the removal of the
                # evicted tail of the prefix to reach the router, and for every event published
                # by then to be applied (checking the stream's length alone raced the publisher).
                stream = redis.Redis.from_url(redis_server_url)

                def caught_up() -> bool:
                    return (ctx.balancer.index.match(key.hashes, time.time()).get("small", 0) < 11
                            and ctx.state.events_applied == stream.xlen(redis_prefix + "kv_events"))
                await wait_until(caught_up, what="the router to know the tail of the prefix was evicted")
                stream.close()
                held = ctx.balancer.index.match(key.hashes, time.time()).get("small", 0)
                assert held < 11  # the tail of the prefix was evicted and the router knows it
                async with http.post(url + "/v1/completions", json=first) as resp:
                    predicted = int(resp.headers["X-Prefixlb-Predicted-Cached-Tokens"])
                    cached = (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        # It predicts exactly the chunks still held (whole blocks), and the worker confirms them;
        # it may hold a little more, up to the next chunk boundary (128 bytes + one block).
        assert predicted == held * 128
        assert predicted <= cached < predicted + 128 + 16
