"""Sampler: logits -> one token per sequence (greedy, temperature, top-k, top-p, seeded).

Greedy rows are an argmax over the whole batch at once. Sampled rows are scaled by their
temperature, filtered by top-k then top-p (the smallest set of tokens whose probability reaches
``top_p``, always keeping the most likely one), and drawn with the request's own
``torch.Generator`` so a seeded request is reproducible whatever else shares its batch.
Logprobs are of the unmodified model distribution (``log_softmax`` of the raw logits).
"""
from __future__ import annotations

import torch

from worker.engine.runner import TokenLogprob
from worker.engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` (1-D) with everything outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly more likely than it already reach top_p.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of ``logits`` ``[rows, vocab]`` (fp32), plus logprobs where asked."""
    tokens = torch.argmax(logits, dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        tokens = tokens.clone()
        for i in sampled_rows:
            p = params[i]
            row = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        # All rows at once: a handful of ops and three host reads per step, not a topk and
        # two reads per row (each read is a device sync on a GPU).
        lp = torch.log_softmax(logits[want], dim=-1)
        chosen = lp.gather(1, tokens[want].unsqueeze(1)).squeeze(1).tolist()
        ks = [min(params[i].logprobs or 0, lp.shape[-1]) for i in want]
        top_values, top_ids = torch.topk(lp, max(ks)) if max(ks) else (lp[:, :0], lp[:, :0].long())
        values, ids = top_values.tolist(), top_ids.tolist()
        for row, (i, k) in enumerate(zip(want, ks)):
            logprobs[i] = TokenLogprob(token_list[i], chosen[row], list(zip(ids[row][:k], values[row][:k])))
    return token_list, logprobs
