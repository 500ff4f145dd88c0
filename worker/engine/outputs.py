"""RequestOutput: what one engine step produced for one request."""
from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.runner import TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    """New tokens and text of one request since its previous output.

    ``new_text`` is incremental and already cut at a stop string; while a request runs, text
    that could be the start of a stop string is held back until it is decided.
    ``finish_reason``: ``stop`` (EOS, stop token or stop string), ``length`` (max_tokens or the
    context limit) or ``abort``. ``token_ids`` are all tokens generated so far.

    Timing (``time.monotonic()`` seconds): ``ttft_s`` is set on the output carrying the first
    token (first token time − arrival); ``itl_s`` holds the gaps between consecutive tokens
    delivered in this output.

    ``num_cached_tokens`` counts every prompt token not recomputed: GPU prefix-cache hits plus
    ``num_loaded_tokens`` loaded from the CPU KV tier.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    arrival_time: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_loaded_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
