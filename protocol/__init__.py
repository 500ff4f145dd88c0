"""The contract router and worker share: prompt rendering, prefix hashing, messages, Redis keys.

This package imports nothing of ours; both ``router`` and ``worker`` import it.
"""
from protocol.hashing import DEFAULT_CHUNK_SIZE, chunk_hashes, namespace_seed, session_hash
from protocol.keys import DEFAULT_PREFIX, RedisKeys
from protocol.messages import ATTENTION_KNEE_TOKENS, KVEvent, LoadReport, MessageError, WorkerInfo
from protocol.render import RenderError, render_chat, render_completion, render_request

__all__ = [
    "ATTENTION_KNEE_TOKENS",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PREFIX",
    "KVEvent",
    "LoadReport",
    "MessageError",
    "RedisKeys",
    "RenderError",
    "WorkerInfo",
    "chunk_hashes",
    "namespace_seed",
    "render_chat",
    "render_completion",
    "render_request",
    "session_hash",
]
