"""What one forward pass needs to read and write the paged KV cache (built by the runner)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionContext:
    """Per-step attention inputs. Tokens are laid out decodes first, then extends.

    The first ``num_decode_tokens`` tokens are one token per decoding sequence (paged decode
    attention); the rest are the new tokens of prefilling sequences, concatenated
    (prefix-extend attention). ``slot_mapping`` covers all tokens.
    """

    backend: object  # kernels.backend.AttentionBackend
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_max_context_len: int = 0
    extend_block_tables: torch.Tensor | None = None
    extend_query_start_loc: torch.Tensor | None = None
    extend_context_lens: torch.Tensor | None = None
    extend_max_query_len: int = 0
