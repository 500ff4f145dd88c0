"""Generated workloads, each a common shape of prefix sharing, deterministic given the seed.

- ``system-prompt``: tenants with Zipf popularity, each with its own long system prompt, and
  short distinct questions;
- ``doc-qa``: long documents, several questions each, interleaved;
- ``multi-turn``: chat sessions whose history grows turn by turn, sent with a session header;
- ``conversation``: production-like chat (heavy-tailed turns, a shared first block, no session ids).

Content ids are namespaced by kind (high bits) so that ids of different kinds never collide.
"""
from __future__ import annotations

import itertools
import math
import random

from bench.workloads.base import RequestSpec, Workload, WorkloadError, poisson_arrivals

_SYSTEM, _QUESTION, _DOC, _USER, _ASSISTANT = (k << 40 for k in range(1, 6))


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, n + 1)]


def system_prompt(num_requests: int = 1000, seed: int = 0, tenants: int = 20,
                  zipf: float = 1.1, system_tokens: int = 2048, question_tokens: tuple[int, int] = (64, 256),
                  output_tokens: tuple[int, int] = (32, 128), rate: float = 10.0) -> Workload:
    """Requests of ``tenants`` tenants (Zipf(``zipf``) popularity), each a system prompt + question."""
    if tenants < 1 or num_requests < 0:
        raise WorkloadError("system-prompt needs tenants >= 1 and num_requests >= 0")
    rng = random.Random(seed)
    cum = list(itertools.accumulate(_zipf_weights(tenants, zipf)))  # choices() would redo this per call
    arrivals = poisson_arrivals(num_requests, rate, seed + 1)
    requests = []
    for i in range(num_requests):
        tenant = rng.choices(range(tenants), cum_weights=cum)[0]
        q = rng.randint(*question_tokens)
        segments = ((_SYSTEM + tenant, system_tokens), (_QUESTION + i, q))
        requests.append(RequestSpec(i, arrivals[i], segments, rng.randint(*output_tokens)))
    return Workload("system-prompt", requests, params=dict(
        num_requests=num_requests, seed=seed, tenants=tenants, zipf=zipf, system_tokens=system_tokens,
        question_tokens=list(question_tokens), output_tokens=list(output_tokens), rate=rate))


def doc_qa(num_requests: int = 1000, seed: int = 0, documents: int = 20, questions: int = 10,
           document_tokens: int = 8192, question_tokens: tuple[int, int] = (32, 128),
           output_tokens: tuple[int, int] = (32, 128), rate: float = 4.0) -> Workload:
    """``documents`` × ``questions`` (document + question) requests, interleaved.

    Documents are visited in shuffled rounds, one question per document per round, so each
    document's questions are spread over the run instead of arriving back to back. With
    ``num_requests`` larger than ``documents × questions``, new documents keep coming.
    """
    if documents < 1 or questions < 1:
        raise WorkloadError("doc-qa needs documents >= 1 and questions >= 1")
    rng = random.Random(seed)
    arrivals = poisson_arrivals(num_requests, rate, seed + 1)
    order: list[int] = []
    generation = 0
    while len(order) < num_requests:
        base = generation * documents
        for _ in range(questions):
            round_docs = list(range(base, base + documents))
            rng.shuffle(round_docs)
            order.extend(round_docs)
        generation += 1
    requests = []
    for i in range(num_requests):
        doc = order[i]
        segments = ((_DOC + doc, document_tokens), (_QUESTION + i, rng.randint(*question_tokens)))
        requests.append(RequestSpec(i, arrivals[i], segments, rng.randint(*output_tokens)))
    return Workload("doc-qa", requests, params=dict(
        num_requests=num_requests, seed=seed, documents=documents, questions=questions,
        document_tokens=document_tokens, question_tokens=list(question_tokens),
        output_tokens=list(output_tokens), rate=rate))


def multi_turn(num_requests: int = 1000, seed: int = 0, sessions: int = 50, turns: tuple[int, int] = (4, 12),
               system_tokens: int = 512, user_tokens: tuple[int, int] = (64, 256),
               assistant_tokens: tuple[int, int] = (64, 256), think_s: float = 10.0,
               rate: float = 1.0) -> Workload:
    """Chat sessions: turn ``t`` sends the whole history (system, then user/assistant turns).

    Sessions start as a Poisson process of ``rate`` sessions/s; turns of one session are
    ``think_s`` (exponential mean) apart. The history's assistant turns are generated text of
    the workload (not the model's output) so that the run is deterministic; each turn's
    ``max_tokens`` equals the length of the assistant turn that the next turn's history holds.
    All sessions share one system prompt (one application). ``sessions`` sessions are generated,
    more if ``num_requests`` needs more turns; the list is sorted by arrival and cut there.
    """
    if sessions < 1:
        raise WorkloadError("multi-turn needs sessions >= 1")
    rng = random.Random(seed)
    specs: list[tuple[float, tuple, int, str]] = []
    starts = poisson_arrivals(max(sessions, num_requests), rate, seed + 1)
    s = 0
    while s < sessions or len(specs) < num_requests:
        t = starts[s]
        history: list[tuple[int, int]] = [(_SYSTEM, system_tokens)]  # one app, one system prompt
        for turn in range(rng.randint(*turns)):
            history.append((_USER + (s << 8) + turn, rng.randint(*user_tokens)))
            answer = rng.randint(*assistant_tokens)
            specs.append((t, tuple(history), answer, f"session-{s}"))
            history.append((_ASSISTANT + (s << 8) + turn, answer))
            t += rng.expovariate(1.0 / think_s)
        s += 1
    specs.sort(key=lambda x: x[0])
    requests = [RequestSpec(i, t, segs, out, session) for i, (t, segs, out, session)
                in enumerate(specs[:num_requests])]
    return Workload("multi-turn", requests, params=dict(
        num_requests=num_requests, seed=seed, sessions=sessions, turns=list(turns),
        system_tokens=system_tokens, user_tokens=list(user_tokens),
        assistant_tokens=list(assistant_tokens), think_s=think_s, rate=rate))


_SHARED, _MESSAGE, _ANSWER = (k << 40 for k in range(8, 11))


def _lognormal_tokens(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(median * math.exp(rng.gauss(0.0, sigma))))))


def conversation(num_requests: int = 3000, seed: int = 0, rate: float = 2.4, shared_tokens: int = 512,
                 first_median: int = 4800, first_sigma: float = 1.25, message_median: int = 1000,
                 message_sigma: float = 1.6, answer_median: int = 250, answer_sigma: float = 0.7,
                 continue_p: float = 0.3, long_lived: float = 0.02, long_continue_p: float = 0.8,
                 think_s: float = 40.0, read_s: float = 5.0, max_prompt_tokens: int = 120_000,
                 session_header: bool = False) -> Workload:
    """Multi-turn chat traffic like a production conversation trace, with no session ids by default.

    Sessions arrive as a Poisson process of ``rate`` sessions/s. Every prompt starts with the same
    ``shared_tokens`` (one application's preamble); a session's first prompt adds a heavy-tailed
    (log-normal) first message, and each next turn extends the previous prompt with the previous
    answer and a new heavy-tailed message, ``read_s`` (the answer streams and is read) plus an
    exponential think time of mean ``think_s`` later. A session goes on after each turn with probability ``continue_p`` (``long_continue_p`` for
    the ``long_lived`` share of sessions), and ends when its prompt would pass
    ``max_prompt_tokens``. ``session_header`` sends the session id as ``x-session-id`` (a
    production trace has none: the router sees only the prompts).

    The defaults give ~3.5 requests/s, prompts of mean ~12K tokens (p50 ~7K, p99 ~80K), ~310
    output tokens, and ~38% of the 512-token prompt blocks reusable with one infinite cache.
    """
    if rate <= 0 or not 0 <= continue_p < 1 or not 0 <= long_continue_p < 1 or not 0 <= long_lived <= 1:
        raise WorkloadError("conversation needs rate > 0 and probabilities in [0, 1)")
    rng = random.Random(seed)
    starts = poisson_arrivals(max(1, num_requests), rate, seed + 1)
    specs: list[tuple[float, tuple, int, str]] = []
    # One session per slot: the n-th request by time is never later than the n-th session's start,
    # so the first ``num_requests`` requests by time come from sessions generated here.
    for s, t in enumerate(starts):
        keep = long_continue_p if rng.random() < long_lived else continue_p
        history: list[tuple[int, int]] = [(_SHARED, shared_tokens)]
        message = _lognormal_tokens(rng, first_median, first_sigma, 16, max_prompt_tokens)
        turn = 0
        while True:
            cid = (s << 12) + turn
            history.append((_MESSAGE + cid, message))
            if sum(n for _, n in history) > max_prompt_tokens:
                break
            answer = _lognormal_tokens(rng, answer_median, answer_sigma, 1, 4096)
            specs.append((t, tuple(history), answer, f"conv-{s}"))
            history.append((_ANSWER + cid, answer))
            turn += 1
            if rng.random() >= keep or turn >= 4095:
                break
            t += read_s + rng.expovariate(1.0 / think_s)
            message = _lognormal_tokens(rng, message_median, message_sigma, 1, max_prompt_tokens)
    specs.sort(key=lambda x: x[0])
    requests = [RequestSpec(i, t, segs, out, session if session_header else None)
                for i, (t, segs, out, session) in enumerate(specs[:num_requests])]
    return Workload("conversation", requests, params=dict(
        num_requests=num_requests, seed=seed, rate=rate, shared_tokens=shared_tokens,
        first_median=first_median, first_sigma=first_sigma, message_median=message_median,
        message_sigma=message_sigma, answer_median=answer_median, answer_sigma=answer_sigma,
        continue_p=continue_p, long_lived=long_lived, long_continue_p=long_continue_p, think_s=think_s,
        read_s=read_s, max_prompt_tokens=max_prompt_tokens, session_header=session_header))
