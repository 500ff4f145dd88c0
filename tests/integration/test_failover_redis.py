"""Resynchronising with Redis after an outage, against a real Redis (one key prefix per test).

``RedisState`` is driven step by step here (connect, sync, then the outage is staged by editing
the stream as an outage would have left it, then ``resync``), so every case is exact. The real
thing -- Redis stopped for seconds under load -- is in ``test_chaos.py``.
"""
from __future__ import annotations

import time

import pytest
import redis

from protocol import KVEvent, RedisKeys
from router.routing.balancer import Balancer
from router.metrics import RouterMetrics
from router.fleet.registry import WorkerRegistry
from router.snapshot import encode
from router.state import RedisState


@pytest.fixture
def state_and_client(redis_server_url, redis_prefix):
    keys = RedisKeys(redis_prefix)
    balancer = Balancer(chunk_size=128)
    for w in ("w1", "w2"):
        balancer.add_worker(w)
    state = RedisState(redis_server_url, keys, balancer, WorkerRegistry(balancer), RouterMetrics())
    client = redis.Redis.from_url(redis_server_url)
    yield state, client, keys
    client.close()


def _publish(client: redis.Redis, keys: RedisKeys, worker: str, hashes: list[int], seq: int,
             maxlen: int | None = None) -> str:
    event = KVEvent(worker, "stored", hashes, seq=seq, chunk_size=128)
    return client.xadd(keys.kv_events, {"e": event.to_json()}, maxlen=maxlen, approximate=False).decode()


def _holders(state: RedisState, h: int) -> set[str]:
    return set(state.balancer.index.match([h], time.time()))


async def test_nothing_missed_means_reading_simply_goes_on(state_and_client):
    state, client, keys = state_and_client
    state.connect()
    _publish(client, keys, "w1", [1], seq=1)
    await state.sync()
    state.synced = True
    _publish(client, keys, "w2", [2], seq=1)  # published while we were away, still in the stream
    assert await state.resync() == "ok"
    await state.read_events(block_ms=None)
    assert (_holders(state, 1), _holders(state, 2)) == ({"w1"}, {"w2"})
    await state.close()


async def test_a_stream_trimmed_past_our_last_event_is_repaired_from_the_snapshot(state_and_client):
    state, client, keys = state_and_client
    state.connect()
    _publish(client, keys, "w1", [1], seq=1)
    await state.sync()
    state.synced = True
    # While this router was cut off, the fleet went on: events 2..5, the stream trimmed to the last
    # two, and another router snapshotted its index after event 3.
    ids = [_publish(client, keys, "w2", [h], seq=h, maxlen=2) for h in (2, 3, 4, 5)]
    client.set(keys.index_snapshot, encode([(2, "w2", 600.0), (3, "w2", 600.0)], ids[1], time.time(), 128, {}))
    assert await state.resync() == "trimmed"
    assert state.last_id == ids[1]
    await state.read_events(block_ms=None)
    assert [_holders(state, h) for h in (1, 2, 3, 4, 5)] == [{"w1"}, {"w2"}, {"w2"}, {"w2"}, {"w2"}]
    await state.close()


async def test_a_stream_lost_with_redis_is_read_again_from_its_start_and_our_state_shared(state_and_client):
    state, client, keys = state_and_client
    state.connect()
    _publish(client, keys, "w1", [1], seq=1)
    await state.sync()
    state.synced = True
    client.delete(keys.kv_events, keys.index_snapshot)  # Redis restarted without persistence
    assert await state.resync() == "stream_lost"
    assert state.last_id == "0-0"
    await state.write_snapshot()  # what the snapshot task does at once after a loss
    assert client.get(keys.index_snapshot) is not None
    _publish(client, keys, "w2", [2], seq=1)  # new events get new ids: none is skipped
    await state.read_events(block_ms=None)
    assert (_holders(state, 1), _holders(state, 2)) == ({"w1"}, {"w2"})
    await state.close()


async def test_a_router_that_started_without_redis_does_the_full_sync_when_it_returns(state_and_client):
    state, client, keys = state_and_client
    state.connect()
    client.set(keys.index_snapshot, encode([(7, "w1", 600.0)], "0-0", time.time(), 128, {"m": 0.5}))
    _publish(client, keys, "w2", [8], seq=1)
    assert state.synced is False  # as after a failed start-up sync
    assert await state.resync() == "full"
    assert (state.synced, _holders(state, 7), _holders(state, 8)) == (True, {"w1"}, {"w2"})
    assert state.balancer.tokens_per_byte("m") == 0.5
    await state.close()
