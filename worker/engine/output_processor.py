"""Turns sampled tokens into RequestOutputs: detokenizing, stop rules, finish reasons."""
from __future__ import annotations

from worker.engine.outputs import RequestOutput
from worker.engine.runner import TokenLogprob
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestState:
    """Per-request text state: the detokenizer, the text so far, how much was emitted."""

    __slots__ = ("detok", "text", "emitted", "hold", "stops", "stop_ids", "eos_ids")

    def __init__(self, seq: Sequence, tokenizer: Tokenizer, eos_ids: list[int]) -> None:
        params = seq.sampling_params
        self.detok: IncrementalDetokenizer = tokenizer.incremental_detokenizer()
        self.text = ""
        self.emitted = 0
        self.stops = params.stop
        # Hold back the longest text that could still become a stop string.
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.stop_ids = set(params.stop_token_ids)
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)


def process_token(seq: Sequence, state: RequestState, token_id: int,
                  logprob: TokenLogprob | None, now: float) -> RequestOutput:
    """Append ``token_id`` to ``seq``, apply the stop rules, and build its RequestOutput.

    Sets ``seq.status`` to a finished status when the request ends; the caller frees it.
    Order of checks: EOS / stop token id, then stop strings, then max_tokens and the
    context limit (so a token that both matches a stop string and reaches max_tokens is
    ``stop``). EOS and stop-token text is not shown.
    """
    seq.append_token(token_id)
    params = seq.sampling_params
    stop_reason: str | int | None = None
    status: SequenceStatus | None = None
    if token_id in state.eos_ids or token_id in state.stop_ids:
        status = SequenceStatus.FINISHED_STOPPED
        stop_reason = token_id if token_id in state.stop_ids else None
    else:
        piece = state.detok.add(token_id)
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= seq.max_total_tokens:
            piece += state.detok.flush()
            status = SequenceStatus.FINISHED_LENGTH
        if piece:
            start = len(state.text)
            state.text += piece
            if state.stops:
                matched = _find_stop(state.text, start, state.stops, state.hold)
                if matched is not None:
                    pos, stop = matched
                    state.text = state.text[:pos]
                    status = SequenceStatus.FINISHED_STOPPED
                    stop_reason = stop
    if status is not None:
        seq.status = status
        end = len(state.text)
    else:
        end = max(state.emitted, len(state.text) - state.hold)
    new_text = state.text[state.emitted:end]
    state.emitted = end

    ttft = None
    itl: list[float] = []
    if seq.first_token_time is None:
        seq.first_token_time = now
        ttft = now - seq.arrival_time
    elif seq.last_token_time is not None:
        itl.append(now - seq.last_token_time)
    seq.last_token_time = now
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=[token_id],
        new_text=new_text,
        finished=status is not None,
        finish_reason=status.value if status is not None else None,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=max(seq.num_cached_tokens, 0),
        num_loaded_tokens=seq.num_loaded_tokens,
        token_ids=seq.output_token_ids,
        logprobs=[logprob] if logprob is not None else None,
        stop_reason=stop_reason,
        arrival_time=seq.arrival_time,
        ttft_s=ttft,
        itl_s=itl,
        num_preemptions=seq.num_preemptions,
    )


def _find_stop(text: str, new_start: int, stops: list[str], hold: int) -> tuple[int, str] | None:
    """Earliest stop string in ``text`` overlapping the text added at ``new_start``."""
    search_from = max(0, new_start - hold)
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, search_from)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def abort_output(seq: Sequence, state: RequestState | None) -> RequestOutput:
    """The final output of an aborted request (no new tokens; pending held-back text flushed)."""
    new_text = ""
    if state is not None:
        new_text = state.text[state.emitted:]
        state.emitted = len(state.text)
    return RequestOutput(
        request_id=seq.request_id, new_token_ids=[], new_text=new_text, finished=True,
        finish_reason="abort", num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=max(seq.num_cached_tokens, 0), token_ids=seq.output_token_ids,
        arrival_time=seq.arrival_time, num_preemptions=seq.num_preemptions,
        num_loaded_tokens=seq.num_loaded_tokens)
