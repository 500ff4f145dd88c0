"""worker.server.kv_events: engine block events become exactly the router chunk events they imply."""
from __future__ import annotations

from protocol import chunk_hashes, namespace_seed
from worker.engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from worker.engine.kv_cache.hashing import adapter_namespace, hash_block_tokens, hash_request_blocks
from worker.server.kv_events import ChunkEvent, KVEventMapper, RequestChunks, chunk_blocks, request_chunks

BOS = 256
NS = namespace_seed("tiny")


def _byte_tokens(text: str) -> list[int]:
    return [BOS, *text.encode()]


def _block_hashes(tokens: list[int], bs: int = 16) -> list[int]:
    out, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], NS)
        out.append(parent)
    return out


def test_chunks_map_to_the_block_holding_their_last_byte_after_bos():
    # 300 bytes + BOS = 301 tokens, 18 full blocks. Chunk 1 ends at byte 128 = token index 128
    # (BOS shifts by one): block 8; chunk 2 ends at token index 256: block 16.
    assert chunk_blocks(2, 128, 300, 301, 16) == [8, 16]


def test_a_chunk_ending_in_the_partial_last_block_is_not_attached():
    # 260 bytes + BOS = 261 tokens: 16 full blocks (0..15); chunk 2 ends at token 256, block 16.
    assert chunk_blocks(2, 128, 260, 261, 16) == [8, -1]


def test_chunks_map_proportionally_when_tokens_are_not_bytes():
    # 1000 rendered bytes, 100 tokens (6 full blocks): chunk i ends after token ceil(12.8 i)
    # = 13, 26, 39, 52, 64, 77, 90, in blocks ceil(p / 16) - 1.
    assert chunk_blocks(7, 128, 1000, 100, 16) == [0, 1, 2, 3, 3, 4, 5]
    # 72 tokens (4 full blocks): ceil(9.216 i) = 10, 19, 28, 37, 47, 56, 65.
    assert chunk_blocks(7, 128, 1000, 72, 16) == [0, 1, 1, 2, 2, 3, -1]


def test_request_chunks_are_the_router_chain_on_the_engine_chain():
    text = "x" * 300
    rc = request_chunks(text.encode(), _byte_tokens(text), NS, 128, 16)
    assert rc.chunk_hashes == chunk_hashes(text.encode(), 128, NS)
    assert rc.chunk_block_ids == [8, 16]
    assert rc.block_hashes == _block_hashes(_byte_tokens(text))[:17]


def test_stored_then_evicted_blocks_announce_exactly_their_chunks():
    text = "The quick brown fox jumps over the lazy dog. " * 7  # 315 bytes
    tokens = _byte_tokens(text)
    h1, h2 = chunk_hashes(text.encode(), 128, NS)
    blocks = _block_hashes(tokens)
    mapper = KVEventMapper()
    assert mapper.register(request_chunks(text.encode(), tokens, NS, 128, 16)) == []

    assert mapper.translate([BlockStored(blocks)]) == [ChunkEvent("stored", [h1, h2])]
    # The engine evicts the tail first: the longer prefix is forgotten, the shorter one stays.
    assert mapper.translate([BlockRemoved(blocks[16:])]) == [ChunkEvent("removed", [h2])]
    assert mapper.translate([BlockRemoved(blocks[9:16])]) == []
    assert mapper.translate([BlockRemoved(blocks[8:9])]) == [ChunkEvent("removed", [h1])]


def test_blocks_without_chunks_produce_no_events():
    mapper = KVEventMapper()
    assert mapper.translate([BlockStored([1, 2, 3]), BlockRemoved([2])]) == []


def test_cleared_forgets_everything_and_is_announced():
    text = "y" * 200
    mapper = KVEventMapper()
    mapper.register(request_chunks(text.encode(), _byte_tokens(text), NS, 128, 16))
    assert mapper.translate([AllBlocksCleared()]) == [ChunkEvent("cleared", [])]
    assert len(mapper) == 0


def test_chunks_newly_attached_to_an_already_stored_block_are_announced_at_once():
    mapper = KVEventMapper()
    tokens = list(range(64))
    blocks = _block_hashes(tokens)
    mapper.register(RequestChunks([11], [1], blocks))
    assert mapper.translate([BlockStored(blocks[:2])]) == [ChunkEvent("stored", [11])]
    assert mapper.register(RequestChunks([11, 22], [1, 1], blocks)) == [ChunkEvent("stored", [22])]
    assert mapper.chunks_of(blocks[1]) == [11, 22]


def test_the_table_is_bounded_and_counts_what_it_forgot():
    mapper = KVEventMapper(max_blocks=3)
    for i in range(5):
        mapper.register(RequestChunks([100 + i], [0], [i]))
    assert len(mapper) == 3
    assert mapper.forgotten == 2
    assert mapper.chunks_of(0) == [] and mapper.chunks_of(4) == [104]


def test_different_namespaces_give_disjoint_chains():
    text = "z" * 256
    a = request_chunks(text.encode(), _byte_tokens(text), namespace_seed("tiny"), 128, 16)
    b = request_chunks(text.encode(), _byte_tokens(text), namespace_seed("tiny", cache_salt="s"), 128, 16)
    assert set(a.chunk_hashes).isdisjoint(b.chunk_hashes)
    assert set(a.block_hashes).isdisjoint(b.block_hashes)


def test_a_block_recomputed_after_its_eviction_is_announced_stored_again():
    # A second request with the same prompt registers while the block is cached (nothing new to
    # attach), the block is evicted before that request runs, and the request computes it again:
    # the engine holds the prefix, so the router must be told (not only after yet another request).
    mapper = KVEventMapper()
    tokens = list(range(64))
    blocks = _block_hashes(tokens)
    rc = RequestChunks([11], [1], blocks)
    mapper.register(rc)
    assert mapper.translate([BlockStored(blocks[:2])]) == [ChunkEvent("stored", [11])]
    assert mapper.register(rc) == []
    assert mapper.translate([BlockRemoved(blocks[1:2]), BlockStored(blocks[1:2])]) == [
        ChunkEvent("removed", [11]), ChunkEvent("stored", [11])]
    assert mapper.translate([BlockRemoved(blocks[1:2])]) == [ChunkEvent("removed", [11])]


def test_a_lora_requests_chunks_keep_the_routers_seed_and_attach_to_the_engines_identity_keyed_blocks(tmp_path):
    # The router seeds chunks with the name it sees ("model": "sql"); the engine seeds blocks with
    # the base model's namespace mixed with the adapter's identity. A stored event names the adapter.
    from tests.engine_support import SlotMemoryRunner
    from tests.lora_support import write_adapter
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=None, num_kv_blocks=64, block_size=16, enable_lora=True),
                       runner=SlotMemoryRunner(64, 16))
    sql = engine.add_lora("sql", str(write_adapter(tmp_path / "sql")))
    text = "y" * 300
    router_ns = namespace_seed("sql")
    rc = request_chunks(text.encode(), _byte_tokens(text), router_ns, 128, 16,
                        block_namespace=engine.block_namespace(NS, sql), lora_name="sql")
    engine.add_request("r", _byte_tokens(text), SamplingParams(max_tokens=1), namespace=NS, lora=sql)
    engine.step()
    events = engine.take_kv_events()

    engine_blocks = hash_request_blocks(_byte_tokens(text), 16, adapter_namespace(NS, sql.identity))
    assert rc.chunk_hashes == chunk_hashes(text.encode(), 128, router_ns)
    assert rc.block_hashes == engine_blocks[:17]  # up to the block completing the last chunk
    assert events == [BlockStored(engine_blocks, "sql")]  # 301 tokens: 18 full blocks
    assert not set(engine_blocks) & set(_block_hashes(_byte_tokens(text)))  # never the base model's
    mapper = KVEventMapper()
    mapper.register(rc)
    assert mapper.translate(events) == [ChunkEvent("stored", rc.chunk_hashes, "sql")]


def test_a_shared_prefix_chunk_is_removed_only_when_the_last_block_completing_it_is_evicted():
    # Two requests share a 256-byte system prompt. Chunk 2 ends at byte 256 = token index 257
    # (the BOS shifts by one), so it completes in block 16, which also holds each request's own
    # first 15 bytes: a different block per request. Evicting one request's block 16 must not
    # tell the router the shared prompt is gone from the worker while the other's still holds it.
    system = "s" * 256
    texts = [system + "first user question, long enough", system + "second one, a different text!!"]
    mapper = KVEventMapper()
    blocks = []
    for text in texts:
        tokens = _byte_tokens(text)
        rc = request_chunks(text.encode(), tokens, NS, 128, 16)
        assert rc.chunk_block_ids[:2] == [8, 16]
        mapper.register(rc)
        blocks.append(_block_hashes(tokens)[:17])
    shared = chunk_hashes(system.encode(), 128, NS)
    assert blocks[0][:16] == blocks[1][:16] and blocks[0][16] != blocks[1][16]
    mapper.translate([BlockStored(blocks[0]), BlockStored(blocks[1][16:])])
    assert mapper.translate([BlockRemoved([blocks[0][16]])]) == []  # block 16 of request 2 still holds it
    assert mapper.translate([BlockRemoved([blocks[1][16]])]) == [ChunkEvent("removed", [shared[1]])]
    # Stored again, then a duplicate eviction of the same block: announced once, not twice.
    mapper.translate([BlockStored([blocks[0][16]])])
    assert mapper.translate([BlockRemoved([blocks[0][16]])]) == [ChunkEvent("removed", [shared[1]])]
    assert mapper.translate([BlockRemoved([blocks[0][16]])]) == []
