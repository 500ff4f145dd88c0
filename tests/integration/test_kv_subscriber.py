"""KVEventSubscriber (router/fleet/kv_subscriber.py) against real ZMQ sockets on loopback.

The publisher here speaks vLLM's wire format (docs/real-engines.md, "KV events"): a PUB socket
sending ``[topic, seq (8 bytes, big-endian), msgpack [ts, events, rank]]`` and a ROUTER replay
socket answering ``[b"", start_seq]`` with every buffered batch from there on, then the end
marker. The live suite checks the same subscriber against vLLM itself
(tests/integration/test_vllm_routing.py).
"""
from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from router.fleet.kv_subscriber import KVEventSubscriber
from router.routing.precise import PreciseIndex, PromptTokens
from router.routing.token_index import SyncState
from tests.support import free_port

B = 4


class Publisher:
    """vLLM's KV-event publisher, in miniature: PUB + replay ROUTER, batches numbered from 0."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self._replayer = asyncio.get_running_loop().create_task(self._serve_replay())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def payload(self, tokens: list[int], first_hash: int, parent: int | None) -> bytes:
        n = len(tokens) // B
        event = {"type": "BlockStored", "block_hashes": list(range(first_hash, first_hash + n)),
                 "parent_block_hash": parent, "token_ids": tokens, "block_size": B, "medium": "GPU"}
        return msgpack.packb([time.time(), [event], 0])

    async def publish(self, payload: bytes, send: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= start_seq:
                    await self.router.send_multipart([ident, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._replayer.cancel()
        self.ctx.destroy(linger=0)


async def _until(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture
async def publisher():
    pub = Publisher()
    yield pub
    pub.close()


@pytest.fixture
async def subscriber():
    precise = PreciseIndex()
    sub = KVEventSubscriber(precise, replay_timeout_s=2.0)
    yield sub
    await sub.close()


def _cached(sub: KVEventSubscriber, tokens: list[int]) -> int | None:
    return sub.precise.cached_tokens(PromptTokens(tuple(tokens) + (999,)), time.time()).get("v0")


async def _publish_until_seen(pub: Publisher, sub: KVEventSubscriber, tokens: list[int], first_hash: int,
                              parent: int | None = None) -> None:
    """PUB/SUB drops messages sent before the subscription is up: keep publishing until it lands."""
    before = sub.stats["v0"].batches
    while True:
        await pub.publish(pub.payload(tokens, first_hash, parent))
        try:
            await _until(lambda: sub.stats["v0"].batches > before, 0.3)
            return
        except TimeoutError:
            continue


async def test_a_late_subscriber_replays_the_history_and_is_synchronised(publisher, subscriber):
    # published before anyone listened: only the replay socket has these
    await publisher.publish(publisher.payload([1, 2, 3, 4, 5, 6, 7, 8], 100, None), send=False)
    await publisher.publish(publisher.payload([9, 9, 9, 9], 300, None), send=False)
    subscriber.add("v0", publisher.endpoint, publisher.replay_endpoint)
    await _until(lambda: subscriber.precise.precise("v0"), what="synchronised from the replay")
    assert _cached(subscriber, [1, 2, 3, 4, 5, 6, 7, 8]) == 8
    assert subscriber.stats["v0"].resyncs == 1
    await _publish_until_seen(publisher, subscriber, [10, 11, 12, 13], 102, parent=101)
    assert _cached(subscriber, [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13]) == 12


async def test_a_gap_drops_the_backend_and_the_replay_restores_it(publisher, subscriber):
    subscriber.add("v0", publisher.endpoint, publisher.replay_endpoint)
    await _until(lambda: subscriber.stats["v0"].resync_failures + subscriber.stats["v0"].resyncs, what="first replay")
    await _publish_until_seen(publisher, subscriber, [1, 1, 1, 1], 500)
    await _until(lambda: subscriber.precise.precise("v0"), what="synchronised")
    await publisher.publish(publisher.payload([2, 2, 2, 2], 600, None), send=False)  # lost on the wire
    await _publish_until_seen(publisher, subscriber, [3, 3, 3, 3], 700)
    assert subscriber.stats["v0"].gaps >= 1
    await _until(lambda: subscriber.precise.precise("v0"), what="resynchronised after the gap")
    assert _cached(subscriber, [2, 2, 2, 2]) == 4  # the lost batch, recovered from the replay
    assert _cached(subscriber, [1, 1, 1, 1]) == 4 and _cached(subscriber, [3, 3, 3, 3]) == 4


async def test_without_a_replay_socket_a_late_join_stays_on_estimates(publisher, subscriber):
    await publisher.publish(publisher.payload([1, 2, 3, 4], 100, None), send=False)
    subscriber.add("v0", publisher.endpoint, None)
    await _publish_until_seen(publisher, subscriber, [5, 6, 7, 8], 200)
    assert subscriber.precise.index.state("v0") is SyncState.UNSYNCHRONISED
    assert _cached(subscriber, [5, 6, 7, 8]) is None  # not a precise backend: the router estimates


async def test_malformed_messages_are_counted_and_the_loop_goes_on(publisher, subscriber):
    subscriber.add("v0", publisher.endpoint, publisher.replay_endpoint)
    await _until(lambda: subscriber.stats["v0"].resyncs + subscriber.stats["v0"].resync_failures, what="first replay")
    await _publish_until_seen(publisher, subscriber, [1, 1, 1, 1], 500)
    for frames in ([b"kv", b"short", b"x"], [b"kv", (5).to_bytes(8, "big"), b"\xc1not msgpack"],
                   [b"kv", (5).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [-1]}]])],
                   [b"kv", (5).to_bytes(8, "big"), msgpack.packb("x" * 100)], [b"kv"]):
        await publisher.send_raw(frames)
    await _until(lambda: subscriber.stats["v0"].malformed >= 5, what="five malformed messages counted")
    await _publish_until_seen(publisher, subscriber, [2, 2, 2, 2], 600)
    assert _cached(subscriber, [2, 2, 2, 2]) == 4


async def test_a_restarted_publisher_whose_first_batches_were_missed_is_resynchronised(publisher, subscriber):
    subscriber.add("v0", publisher.endpoint, publisher.replay_endpoint)
    await _until(lambda: subscriber.stats["v0"].resyncs + subscriber.stats["v0"].resync_failures, what="first replay")
    for i in range(5):
        await _publish_until_seen(publisher, subscriber, [i, i, i, i], 100 * (i + 1))
    await _until(lambda: subscriber.precise.precise("v0"), what="synchronised")
    assert _cached(subscriber, [4, 4, 4, 4]) == 4
    # the engine restarts: numbering from 0 again, an empty cache; its seq 0 and 1 never arrive
    publisher.seq, publisher.buffer = 0, []
    await publisher.publish(publisher.payload([7, 7, 7, 7], 900, None), send=False)
    await publisher.publish(publisher.payload([8, 8, 8, 8], 910, None), send=False)
    await _publish_until_seen(publisher, subscriber, [9, 9, 9, 9], 920)
    assert subscriber.stats["v0"].restarts >= 1
    await _until(lambda: subscriber.precise.precise("v0") and _cached(subscriber, [7, 7, 7, 7]) == 4,
                 what="rebuilt from the new publisher's replay")
    assert _cached(subscriber, [4, 4, 4, 4]) == 0  # the old process's blocks are gone


async def test_an_unreachable_replay_socket_is_counted_and_the_backend_stays_on_estimates(publisher, subscriber):
    nobody = f"tcp://127.0.0.1:{free_port()}"  # nothing answers there
    await publisher.publish(publisher.payload([1, 2, 3, 4], 100, None), send=False)  # missed: joined late
    subscriber.replay_timeout_s = 0.3
    subscriber.add("v0", publisher.endpoint, nobody)
    await _until(lambda: subscriber.stats["v0"].resync_failures >= 1, what="the failed replay counted")
    assert subscriber.stats["v0"].resyncs == 0
    assert subscriber.precise.index.state("v0") is SyncState.UNSYNCHRONISED
    await _publish_until_seen(publisher, subscriber, [5, 6, 7, 8], 200)
    assert _cached(subscriber, [5, 6, 7, 8]) is None  # joined late, never replayed: not precise
