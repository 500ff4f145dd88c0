"""SamplingParams: how one request turns logits into tokens and when it stops."""
from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.errors import InvalidRequestError


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings (vLLM's names and meanings).

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampling reproducible per request. ``stop`` strings end the output *before*
    the match (the match is not returned); ``stop_token_ids`` and EOS end it after the token
    (EOS itself is not shown in the text). ``logprobs``: ``None`` for none, otherwise the number
    of top alternatives per token (0 = only the chosen token's logprob); logprobs are of the
    model's distribution before temperature/top-k/top-p.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the first out-of-range field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise InvalidRequestError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        """True when decoding picks the argmax (temperature 0)."""
        return self.temperature == 0.0
