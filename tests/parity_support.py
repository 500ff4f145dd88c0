"""Comparing the engine's outputs with a transformers reference, position by position.

At every generated position the engine's log-probabilities over the whole vocabulary
(``logprobs=vocab_size``) must be within ``atol`` of the reference's ``log_softmax``, and its
greedy token must be the reference's argmax, except where the reference's top-2 are closer than
``tie_tol`` (near-ties: counted in a :class:`ParityLog` and bounded by the caller).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

ATOL = 2e-4  # fp32; observed max |Δ logprob| is ~2e-5
TIE_TOL = 1e-3


@dataclass
class ParityLog:
    """Positions compared and near-ties seen, over a test module."""

    positions: int = 0
    near_ties: list[tuple[int, float]] = field(default_factory=list)


def assert_matches_reference(reference, prompt: list[int], outs, log: ParityLog, vocab: int,
                             atol: float = ATOL, tie_tol: float = TIE_TOL) -> list[int]:
    """Check ``outs`` (one request's RequestOutputs) against ``reference`` teacher-forced on
    ``prompt`` + the engine's tokens; return those tokens."""
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(logprobs) == len(tokens) > 0
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
        row = ref[len(prompt) - 1 + i]
        engine_row = torch.full((vocab,), float("nan"))
        for tid, value in lp.top:
            engine_row[tid] = value
        assert not torch.isnan(engine_row).any()
        diff = (engine_row - row).abs().max().item()
        assert diff < atol, f"position {i}: max |Δ logprob| = {diff}"
        log.positions += 1
        top2 = torch.topk(row, 2).values
        gap = (top2[0] - top2[1]).item()
        if gap < tie_tol:
            log.near_ties.append((i, gap))
        else:
            assert tok == int(row.argmax()), f"position {i}: engine {tok} vs reference {int(row.argmax())}"
    return tokens
