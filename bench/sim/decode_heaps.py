"""The two heaps of :class:`~bench.sim.aggregate.AggregateWorker`'s decoding requests, read and popped.

``finish_at`` holds ``(tick, dseq, req)``: the decode clock value at which ``req`` has its last
token; ``block_at`` holds ``(tick, dseq, nblocks, req)``: the value at which its context outgrows
its ``nblocks`` blocks. An entry is stale once ``req.dseq`` changed (it finished or was
preempted) or, for a block entry, once the request holds another number of blocks; stale entries
are dropped as they reach the top. (Compiled in ``_simloop.c``: :mod:`bench.sim.simloop` picks.)
"""
from __future__ import annotations

import heapq
from typing import Any


def next_finish(heap: list[tuple[int, int, Any]]) -> int:
    """The earliest tick at which a decoding request finishes (stale entries dropped); the heap is not empty."""
    while heap[0][2].dseq != heap[0][1]:
        heapq.heappop(heap)
    return heap[0][0]


def next_block_need(heap: list[tuple[int, int, int, Any]]) -> int:
    """The earliest tick at which a decoding request needs a new block (stale entries dropped)."""
    while True:
        _, dseq, nblocks, req = heap[0]
        if req.dseq == dseq and len(req.blocks) == nblocks:
            return heap[0][0]
        heapq.heappop(heap)


def pop_finished(heap: list[tuple[int, int, Any]], tick: int) -> list:
    """Decoding requests whose last token is out at ``tick``, in running order (their entries popped)."""
    done = []
    while heap and heap[0][0] <= tick:
        _, dseq, req = heapq.heappop(heap)
        if req.dseq == dseq:
            done.append(req)
    return done


def pop_block_needs(heap: list[tuple[int, int, int, Any]], tick: int) -> list:
    """Decoding requests that need a new block at ``tick``, in running order (their entries popped)."""
    needy = []
    while heap and heap[0][0] <= tick:
        _, dseq, nblocks, req = heapq.heappop(heap)
        if req.dseq == dseq and len(req.blocks) == nblocks:
            needy.append(req)
    return needy
