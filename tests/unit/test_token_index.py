"""vLLM's KV-event wire format (router/routing/vllm_kv_events.py) and the token-block index.

tests/data/vllm_kv_events.jsonl is a real capture (tests/data/capture_vllm_samples.py): a vLLM
0.32 server with a 16-block pool of 128 tokens ran the requests of vllm_kv_scenario.json, which
store, evict (BlockRemoved) and finally reset the cache (AllBlocksCleared). Replaying it, the
index must predict exactly the ``cached_tokens`` vLLM reported for each request.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest

from router.routing.token_index import Applied, SyncState, TokenBlockIndex, block_extra_key
from router.routing.vllm_kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                           KVEventDecodeError, decode_frames, decode_payload, replay_request)

DATA = Path(__file__).resolve().parent.parent / "data"
B = 4  # block size of the synthetic streams


def _captured() -> list:
    out = []
    for line in (DATA / "vllm_kv_events.jsonl").read_text().splitlines():
        out.append([base64.b64decode(f) for f in json.loads(line)["frames"]])
    return out


def _batches() -> list[KVEventBatch]:
    batches = [decode_frames(frames)[1] for frames in _captured()]
    assert batches[-1] is None  # the replay's end marker
    return batches[:-1]


def stored(seq: int, hashes, tokens, parent=None, **kw) -> KVEventBatch:
    return KVEventBatch(seq=seq, ts=0.0, events=(BlockStored(tuple(hashes), parent, tuple(tokens), B, **kw),))


def batch(seq: int, *events) -> KVEventBatch:
    return KVEventBatch(seq=seq, ts=0.0, events=tuple(events))


# ---- the wire format, on the real capture --------------------------------------------------------
def test_a_captured_message_is_topic_seq_and_a_msgpack_array_of_tagged_event_maps():
    topic, seq, payload = _captured()[0]
    assert (topic, int.from_bytes(seq, "big")) == (b"kv", 0)
    raw = msgpack.unpackb(payload)
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0  # [ts, events, data_parallel_rank]
    event = raw[1][0]
    assert event["type"] == "BlockStored"
    assert {k: event[k] for k in ("block_size", "medium", "lora_id", "lora_name", "group_idx",
                                  "kv_cache_spec_kind")} == {
        "block_size": 128, "medium": "GPU", "lora_id": None, "lora_name": None, "group_idx": 0,
        "kv_cache_spec_kind": "full_attention"}
    assert event["parent_block_hash"] is None and len(event["token_ids"]) == 2 * 128


def test_the_captured_stream_decodes_into_stores_removals_and_a_clear_in_sequence():
    batches = _batches()
    assert [b.seq for b in batches] == list(range(len(batches)))
    kinds = [type(e).__name__ for b in batches for e in b.events]
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(kinds)
    first = batches[0].events[0]
    assert isinstance(first, BlockStored) and first.token_ids[0] == 256 and len(first.block_hashes) == 2
    assert [p for p, *_ in first.blocks()] == [None, first.block_hashes[0]]
    salted = batches[1].events[0]  # the same prompt with cache_salt "tenant-a": other hashes
    assert salted.extra_keys == (("tenant-a",), None) and salted.token_ids == first.token_ids
    assert set(salted.block_hashes).isdisjoint(first.block_hashes)


def test_replaying_the_capture_predicts_the_cached_tokens_vllm_reported_for_every_request():
    scenario = json.loads((DATA / "vllm_kv_scenario.json").read_text())
    batches = _batches()
    # The scenario's requests, and how many batches vLLM had published before each was sent
    # (request 1 stores nothing new; the four concurrent "busy" requests sent batches in between).
    batches_before = [0, 1, 1, 2, 3, 4, len(batches) - 1]
    assert len(scenario) == len(batches_before)
    predicted = []
    for request, before in zip(scenario, batches_before):
        index = TokenBlockIndex()
        for b in batches[:before]:
            assert index.apply("v", b) is Applied.APPLIED
        predicted.append(index.predicted_cached_tokens("v", request["prompt_token_ids"],
                                                       cache_salt=request["request"].get("cache_salt")))
    assert predicted == [r["cached_tokens"] for r in scenario]
    index = TokenBlockIndex()
    for b in batches:
        index.apply("v", b)
    assert index.state("v") is SyncState.SYNCHRONISED and index.num_blocks("v") == 2


def test_the_index_never_holds_more_blocks_than_the_16_block_pool():
    index = TokenBlockIndex()
    held = []
    for b in _batches():
        index.apply("v", b)
        held.append(index.num_blocks("v"))
    assert max(held) <= 15  # vLLM keeps one of the 16 blocks as its null block


@pytest.mark.parametrize("frames, message", [
    ([b"kv", b"\x00" * 8], "3 frames"),
    ([b"kv", b"\x00" * 4, b""], "8 bytes"),
    ([b"kv", (0).to_bytes(8, "big"), b"\xc1"], "not msgpack"),
    ([b"kv", (0).to_bytes(8, "big"), msgpack.packb({"ts": 1})], "array"),
    ([b"kv", (0).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "Nope"}], 0])], "unknown KV event"),
    ([b"kv", (0).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                                          "parent_block_hash": None, "token_ids": [1, 2],
                                                          "block_size": 4}], 0])], "block_size integers"),
    ([b"kv", (0).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}], 0])],
     "list of integers"),
    ([b"\xff", (0).to_bytes(8, "big"), msgpack.packb([1.0, [], 0])], "UTF-8"),
])
def test_malformed_messages_raise_a_decode_error_naming_the_problem(frames, message):
    with pytest.raises(KVEventDecodeError, match=message):
        decode_frames(frames)


def test_the_replay_end_marker_decodes_to_no_batch_and_a_replay_request_is_the_start_seq():
    assert decode_frames([b"", (-1).to_bytes(8, "big", signed=True), b""]) == ("", None)
    assert replay_request(5) == [b"", b"\x00\x00\x00\x00\x00\x00\x00\x05"]
    assert decode_payload(3, msgpack.packb([2.5, [{"type": "AllBlocksCleared"}]])) == KVEventBatch(
        seq=3, ts=2.5, events=(AllBlocksCleared(),), data_parallel_rank=0)


# ---- the index: chains, copies, keys -------------------------------------------------------------
def test_a_prompt_matches_block_by_block_along_the_parent_chain():
    index = TokenBlockIndex()
    index.apply("v", stored(0, [11, 12], [1, 2, 3, 4, 5, 6, 7, 8]))
    index.apply("v", stored(1, [13], [9, 9, 9, 9], parent=12))
    assert index.matched_tokens("v", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 0]) == 12
    assert index.matched_tokens("v", [1, 2, 3, 4, 0, 6, 7, 8]) == 4  # second block differs
    assert index.matched_tokens("v", [9, 9, 9, 9]) == 0  # right tokens, but not under the root
    assert index.matched_tokens("v", [1, 2, 3]) == 0  # no full block
    assert index.matched_tokens("other", [1, 2, 3, 4]) == 0


def test_the_last_prompt_token_is_never_predicted_cached():
    index = TokenBlockIndex()
    index.apply("v", stored(0, [11, 12], [1, 2, 3, 4, 5, 6, 7, 8]))
    assert index.predicted_cached_tokens("v", [1, 2, 3, 4, 5, 6, 7, 8]) == 4
    assert index.predicted_cached_tokens("v", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8


def test_a_hash_stored_twice_lives_until_both_copies_are_removed():
    index = TokenBlockIndex()
    index.apply("v", stored(0, [11], [1, 2, 3, 4]))
    index.apply("v", stored(1, [11], [1, 2, 3, 4]))  # a second physical block, same hash
    index.apply("v", batch(2, BlockRemoved((11,), "GPU")))
    assert index.matched_tokens("v", [1, 2, 3, 4]) == 4
    index.apply("v", batch(3, BlockRemoved((11,), "GPU"), BlockRemoved((99,), "GPU")))  # 99: never seen
    assert index.matched_tokens("v", [1, 2, 3, 4]) == 0 and index.num_blocks("v") == 0


def test_media_are_held_separately_and_the_lookup_names_the_ones_that_count():
    index = TokenBlockIndex()
    index.apply("v", stored(0, [11], [1, 2, 3, 4], medium="CPU"))
    assert index.matched_tokens("v", [1, 2, 3, 4]) == 0  # GPU only by default
    assert index.matched_tokens("v", [1, 2, 3, 4], media=("GPU", "CPU")) == 4


def test_salted_and_adapter_blocks_only_match_requests_with_the_same_salt_and_adapter():
    assert block_extra_key(0, "ad", "salt") == ("ad", "salt")
    assert (block_extra_key(1, "ad", "salt"), block_extra_key(1, None, "salt"), block_extra_key(0)) == (("ad",), None, None)
    index = TokenBlockIndex()
    index.apply("v", stored(0, [11, 12], [1, 2, 3, 4, 5, 6, 7, 8], extra_keys=(("salt",), None)))
    index.apply("v", stored(1, [21], [1, 2, 3, 4], lora_name="ad", extra_keys=(("ad",),)))
    assert index.matched_tokens("v", [1, 2, 3, 4, 5, 6, 7, 8]) == 0
    assert index.matched_tokens("v", [1, 2, 3, 4, 5, 6, 7, 8], cache_salt="salt") == 8
    assert index.matched_tokens("v", [1, 2, 3, 4], lora_name="ad") == 4
    assert index.matched_tokens("v", [1, 2, 3, 4], lora_name="ad", cache_salt="salt") == 0


def test_only_the_full_attention_group_is_indexed():
    index = TokenBlockIndex()
    index.apply("v", stored(0, [11], [1, 2, 3, 4], group_idx=1))
    assert index.num_blocks("v") == 0


# ---- sequence numbers: no phantom hits after lost events -----------------------------------------
def test_a_stream_seen_from_seq_0_is_synchronised_and_one_joined_late_is_not():
    index = TokenBlockIndex()
    assert index.state("a") is SyncState.UNKNOWN
    index.apply("a", stored(0, [11], [1, 2, 3, 4]))
    index.apply("b", stored(7, [11], [1, 2, 3, 4]))
    assert (index.state("a"), index.state("b")) == (SyncState.SYNCHRONISED, SyncState.UNSYNCHRONISED)
    assert index.matched_tokens("b", [1, 2, 3, 4]) == 4  # what it saw is still true


def test_a_gap_drops_the_backends_entries_and_marks_it_unsynchronised():
    index = TokenBlockIndex()
    index.apply("v", stored(0, [11], [1, 2, 3, 4]))
    index.apply("w", stored(0, [11], [1, 2, 3, 4]))
    # seq 1 (say, the removal of 11) was lost
    assert index.apply("v", stored(2, [31], [7, 7, 7, 7])) is Applied.GAP
    assert index.matched_tokens("v", [1, 2, 3, 4]) == 0  # no phantom hit on 11
    assert index.matched_tokens("v", [7, 7, 7, 7]) == 4  # what came after the gap counts
    assert (index.state("v"), index.gaps("v")) == (SyncState.UNSYNCHRONISED, 1)
    assert index.matched_tokens("w", [1, 2, 3, 4]) == 4  # other backends untouched


def test_a_restarted_publisher_starts_over_synchronised_and_old_batches_are_duplicates():
    index = TokenBlockIndex()
    index.apply("v", stored(0, [11], [1, 2, 3, 4]))
    index.apply("v", stored(1, [12], [5, 5, 5, 5]))
    assert index.apply("v", stored(1, [12], [5, 5, 5, 5])) is Applied.DUPLICATE
    assert index.apply("v", stored(0, [41], [6, 6, 6, 6])) is Applied.RESTARTED
    assert index.matched_tokens("v", [1, 2, 3, 4]) == 0 and index.matched_tokens("v", [6, 6, 6, 6]) == 4
    assert index.state("v") is SyncState.SYNCHRONISED


def test_all_blocks_cleared_empties_the_backend_and_makes_it_exact_again():
    index = TokenBlockIndex()
    index.apply("v", stored(5, [11], [1, 2, 3, 4]))
    assert index.state("v") is SyncState.UNSYNCHRONISED
    index.apply("v", batch(6, AllBlocksCleared(), BlockStored((12,), None, (5, 5, 5, 5), B)))
    assert index.state("v") is SyncState.SYNCHRONISED
    assert (index.matched_tokens("v", [1, 2, 3, 4]), index.matched_tokens("v", [5, 5, 5, 5])) == (0, 4)


def test_resynchronising_needs_the_whole_history_from_seq_0():
    index = TokenBlockIndex()
    index.apply("v", stored(3, [11], [1, 2, 3, 4]))
    assert not index.resynchronise("v", [stored(1, [11], [1, 2, 3, 4])])
    assert not index.resynchronise("v", [stored(0, [11], [1, 2, 3, 4]), stored(2, [12], [5, 5, 5, 5], parent=11)])
    assert index.state("v") is SyncState.UNSYNCHRONISED
    assert index.resynchronise("v", [stored(0, [11], [1, 2, 3, 4]), stored(1, [12], [5, 5, 5, 5], parent=11)])
    assert index.state("v") is SyncState.SYNCHRONISED
    assert index.matched_tokens("v", [1, 2, 3, 4, 5, 5, 5, 5]) == 8
    assert index.apply("v", stored(1, [12], [5, 5, 5, 5], parent=11)) is Applied.DUPLICATE
    assert index.apply("v", stored(2, [13], [6, 6, 6, 6], parent=12)) is Applied.APPLIED


def test_a_lost_subscription_and_an_overfull_backend_drop_their_entries():
    index = TokenBlockIndex(max_blocks=2)
    index.apply("v", stored(0, [11], [1, 2, 3, 4]))
    index.mark_unsynchronised("v")
    assert index.num_blocks("v") == 0 and index.state("v") is SyncState.UNSYNCHRONISED
    assert index.apply("v", stored(0, [11], [1, 2, 3, 4])) is Applied.APPLIED  # the publisher's seq 0
    assert index.state("v") is SyncState.SYNCHRONISED
    index.apply("v", stored(1, [12, 13], [5, 5, 5, 5, 6, 6, 6, 6], parent=11))  # 3 > max_blocks
    assert index.num_blocks("v") == 0 and index.state("v") is SyncState.UNSYNCHRONISED
    index.forget("v")
    assert index.backends() == [] and index.state("v") is SyncState.UNKNOWN
