"""One attempt's booking of a worker, released exactly once, whichever way the attempt ends.

Acting on a decision books the worker (``Balancer.dispatch``: the optimistic index insert and
the request's work on the worker's load board); its first byte marks the prefill done
(``Balancer.first_byte``); its end releases it (``Balancer.finish``), teaching the balancer the
worker's usage when it answered with one (token ratio, cached-token feedback). An attempt ends
in one of several ways -- an answer returned or streamed to its end, a failure before the first
byte (then retried elsewhere), a client that went away, a worker failing mid-stream, a bug --
and each must release the booking exactly once: a leak leaves the worker looking busy for
good, a second release makes it look idler than it is.

:func:`book` returns the booking as a context manager: leaving the ``with`` block releases it,
by any exit, and nothing else does.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from protocol import untrusted_json
from router.metrics import RouterMetrics
from router.routing.balancer import Balancer, Booking
from router.routing.policy import Decision
from router.routing.prompt import PromptKey
from router.http.sse import usage_numbers

log = logging.getLogger("prefixlb.router.proxy")


@dataclass(slots=True, eq=False)
class BookedAttempt(Booking):
    """A worker booked for one attempt (see the module docstring): the balancer's
    :class:`~router.routing.balancer.Booking` itself (one object an attempt, not a wrapper
    around one), with what releasing it needs. ``usage`` is what the worker reported (its usage
    object), set by whoever read the answer, and learnt from on release."""

    balancer: Balancer | None = None
    metrics: RouterMetrics | None = None
    _usage: dict[str, Any] | None = None
    _answer: bytes | None = None
    release_loop: asyncio.AbstractEventLoop | None = None  # set by release_after_answer: released in its next turn

    @property
    def usage(self) -> dict[str, Any] | None:
        """The worker's usage object (of a whole answer: read from it on first use)."""
        if self._answer is not None:
            self._usage, self._answer = json_usage(self._answer), None
        return self._usage

    @usage.setter
    def usage(self, usage: dict[str, Any] | None) -> None:
        self._usage, self._answer = usage, None

    def answered(self, data: bytes) -> None:
        """The worker's whole (JSON) answer: ``usage`` is its usage object. Read when first asked
        for (by the release, in the loop's next turn): parsing the answer does not delay it."""
        self._usage, self._answer = None, data

    def first_byte(self) -> None:
        """The worker started answering: its prefill of this request is done."""
        self.balancer.first_byte(self, time.time())  # type: ignore[union-attr]

    def __enter__(self) -> "BookedAttempt":
        return self

    def release_after_answer(self, loop: asyncio.AbstractEventLoop) -> None:
        """Leaving the block normally now releases the booking in the event loop's next turn, once
        the answer in hand has been written to its client: the client does not wait for the
        bookkeeping. (The next request that can see the worker arrives in a later turn, so it
        finds the booking released; a failure still releases at once, before any retry.) ``loop``:
        the running loop."""
        self.release_loop = loop

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None and self.release_loop is not None:
            self.release_loop.call_soon(self._release)
        else:
            self._release()

    def _release(self) -> None:
        numbers = usage_numbers(self.usage)
        self.balancer.finish(self, time.time(), numbers)  # type: ignore[union-attr]
        if numbers is not None:
            d = self.decision
            if numbers[1] is not None:
                self.metrics.observe_feedback(d.worker_id, d.predicted_cached_tokens, numbers[0], numbers[1])
            elif self.metrics.count_unreported_cached(d.worker_id):  # type: ignore[union-attr]
                log.warning("event=cached_tokens_unreported worker=%s (its usage has no prompt_tokens_details."
                            "cached_tokens: routing cannot learn from its answers; vLLM needs "
                            "--enable-prompt-tokens-details)", d.worker_id)


def json_usage(data: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a JSON answer, or None."""
    try:
        obj = untrusted_json.loads(data)
    except ValueError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


def book(balancer: Balancer, metrics: RouterMetrics, decision: Decision, prompt: PromptKey) -> BookedAttempt:
    """Book ``decision``'s worker for ``prompt`` now; release it by leaving the returned context."""
    attempt = balancer.dispatch(decision, prompt, time.time(), BookedAttempt)
    attempt.balancer, attempt.metrics = balancer, metrics
    return attempt
