"""PreciseIndex (router/routing/precise.py) and the Balancer's use of it: exact cached tokens for
backends whose KV events the router reads, only while their stream is synchronised."""
from __future__ import annotations

from router.routing.balancer import Balancer
from router.routing.precise import PreciseIndex, PromptTokens
from router.routing.prompt import prompt_key
from router.routing.token_index import SyncState
from router.routing.vllm_kv_events import BlockStored, KVEventBatch

B = 4  # block size of these tests


def _stored(seq: int, tokens: list[int], first_hash: int = 100, parent: int | None = None) -> KVEventBatch:
    n = len(tokens) // B
    return KVEventBatch(seq=seq, ts=float(seq), events=(BlockStored(
        block_hashes=tuple(range(first_hash, first_hash + n)), parent_block_hash=parent, token_ids=tuple(tokens),
        block_size=B, medium="GPU", lora_name=None, extra_keys=(), group_idx=0),))


def test_a_synchronised_backend_predicts_its_full_blocks_less_the_last_token():
    precise = PreciseIndex()
    precise.track("v0")
    precise.index.apply("v0", _stored(0, list(range(12))))
    assert precise.precise("v0")
    # 13 tokens: 12 cached in 3 blocks, the last one recomputed
    assert precise.cached_tokens(PromptTokens(tuple(range(13))), 0.0) == {"v0": 12}
    # exactly 12 tokens: vLLM never serves the last prompt token from cache -> 2 blocks
    assert precise.cached_tokens(PromptTokens(tuple(range(12))), 0.0) == {"v0": 8}
    assert precise.cached_tokens(PromptTokens((9, 9, 9, 9, 9)), 0.0) == {"v0": 0}


def test_an_unsynchronised_backend_is_left_to_the_estimates():
    precise = PreciseIndex()
    precise.track("v0")
    precise.index.apply("v0", _stored(5, list(range(12))))  # joined late: seq 5 first
    assert precise.index.state("v0") is SyncState.UNSYNCHRONISED
    assert precise.cached_tokens(PromptTokens(tuple(range(13))), 0.0) == {}
    precise.index.apply("v1", _stored(0, list(range(12))))  # not tracked: no subscription of ours
    assert precise.cached_tokens(PromptTokens(tuple(range(13))), 0.0) == {}


def test_a_reset_backend_predicts_nothing_until_synchronised_again():
    precise = PreciseIndex()
    precise.track("v0")
    precise.index.apply("v0", _stored(0, list(range(12))))
    precise.reset("v0")
    assert precise.cached_tokens(PromptTokens(tuple(range(13))), 0.0) == {}
    precise.index.apply("v0", _stored(0, list(range(4))))  # the restarted engine's first batch
    assert precise.cached_tokens(PromptTokens(tuple(range(13))), 0.0) == {"v0": 4}


def test_blocks_in_flight_count_until_their_grace_after_the_request_ended():
    precise = PreciseIndex(grace_s=2.0)
    precise.track("v0")
    precise.index.apply("v0", _stored(0, [50, 51, 52, 53]))  # learns the block size
    prompt = PromptTokens(tuple(range(13)))
    record = precise.dispatched("v0", prompt, now=10.0)
    assert record is not None and len(record.keys) == 3
    # a second request sharing the first 8 tokens, sent before any BlockStored came back
    other = PromptTokens(tuple(range(8)) + (99, 98, 97, 96, 95))
    assert precise.cached_tokens(other, 10.5) == {"v0": 8}
    precise.finished(record, now=11.0)
    assert precise.cached_tokens(other, 12.9) == {"v0": 8}
    assert precise.cached_tokens(other, 13.1) == {"v0": 0}


def test_the_balancer_takes_a_precise_backends_exact_count_over_the_byte_estimate():
    balancer = Balancer()
    for w in ("v0", "v1"):
        balancer.add_worker(w, block_size=B)
    balancer.precise.track("v1")
    body = {"model": "m", "prompt": "x" * 2000}
    prompt = prompt_key(body, False, balancer.chunk_size, 8)
    # the byte index believes v0 holds the whole prompt, v1 nothing
    balancer.index.insert(prompt.hashes, "v0", 0.0, confirmed=True)
    tokens = tuple(range(40))
    balancer.precise.index.apply("v1", _stored(0, list(tokens[:36])))
    prompt.tokens = PromptTokens(tokens)
    decision = balancer.decide(prompt, 0.0)
    assert prompt.known_cached == {"v1": 36}
    assert decision.prompt_tokens == 40  # exact, not bytes x ratio
    c = balancer.candidate("v1", 0, prompt, 40, 0.0)
    assert c.cached_tokens == 36
    assert balancer.candidate("v0", len(prompt.hashes), prompt, 40, 0.0).cached_tokens == 36  # byte estimate
    booking = balancer.dispatch(decision, prompt, 0.0)
    # its blocks count as pending only on a backend whose events the router reads
    assert (booking.pending is not None) == (decision.worker_id == "v1")
    balancer.finish(booking, 1.0, (40, decision.predicted_cached_tokens))
    assert booking.pending is None or booking.pending.expires == 1.0 + balancer.precise.grace_s


def test_a_precise_zero_overrides_a_byte_level_phantom():
    balancer = Balancer()
    balancer.add_worker("v0", block_size=B)
    balancer.precise.track("v0")
    balancer.precise.index.apply("v0", _stored(0, [7, 7, 7, 7]))
    prompt = prompt_key({"model": "m", "prompt": "y" * 2000}, False, balancer.chunk_size, 8)
    balancer.index.insert(prompt.hashes, "v0", 0.0, confirmed=False)  # optimistic, but evicted since
    prompt.tokens = PromptTokens(tuple(range(40)))
    decision = balancer.decide(prompt, 0.0)
    assert (decision.worker_id, decision.predicted_cached_tokens) == ("v0", 0)
