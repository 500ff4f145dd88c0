"""The paged KV cache's bookkeeping: block pool, prefix cache, block hashes, KV events.

Nothing here allocates tensors; the model runner owns the KV tensors and indexes them with the
block ids handed out here.
"""
from worker.engine.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from worker.engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from worker.engine.kv_cache.hashing import hash_block_tokens, hash_request_blocks
from worker.engine.kv_cache.kv_cache_manager import KVCacheManager, KVCacheRequest

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "KVCacheRequest",
    "hash_block_tokens",
    "hash_request_blocks",
]
