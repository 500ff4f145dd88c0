"""Breaker: one worker's circuit breaker -- consecutive failures open it, a probe half-opens it.

Fed by two kinds of evidence: *passive* (the outcome of real requests the proxy sent there)
and *active* (the health checker's probes). No I/O and no clock: every method takes ``now``::

               failures >= threshold                 cool-down over + a good probe
    closed ------------------------------> open ---------------------------------> half_open
      ^  ^                                  ^                                          |  |
      |  +--- (a success resets the count)  +------------ any failure -----------------+  |
      +----------------------------- successes >= half_open_successes --------------------+

* **closed**: requests flow; a success resets the consecutive-failure count, so transient
  single errors never open it. A *refused* connection is not transient -- nothing listens at
  the worker's address (its process died, or is restarting) -- and opens it at once.
* **open**: no requests. Entered after ``failure_threshold`` failures in a row; stays open at
  least ``cool_down_s`` (doubling each time it re-opens from half-open, up to
  ``max_cool_down_s``), so a flapping worker is tried less and less often.
* **half_open**: after the cool-down, the next good probe lets a few requests through (the
  caller caps its in-flight count); ``half_open_successes`` successes close it, a single failure
  re-opens it.
"""
from __future__ import annotations

from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Thresholds of every worker's breaker."""

    failure_threshold: int = 2
    cool_down_s: float = 1.0
    max_cool_down_s: float = 30.0
    half_open_successes: int = 3


class Breaker:
    """The breaker state of one worker (see the module docstring)."""

    __slots__ = ("config", "state", "failures", "successes", "opened_at", "cool_down_s", "opens")

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config if config is not None else BreakerConfig()
        self.state = CLOSED
        self.failures = 0  # consecutive
        self.successes = 0  # consecutive, while half-open
        self.opened_at = 0.0
        self.cool_down_s = self.config.cool_down_s
        self.opens = 0

    def record_failure(self, now: float, certain: bool = False) -> bool:
        """A failed request or probe; returns True when this failure opened the breaker.

        ``certain``: the failure proves the worker is down (a refused connection): open now.
        """
        self.failures += 1
        self.successes = 0
        if self.state == HALF_OPEN:
            # The trial failed: back off longer before the next one.
            self._open(now, min(self.config.max_cool_down_s, self.cool_down_s * 2.0))
            return True
        if self.state == CLOSED and (certain or self.failures >= self.config.failure_threshold):
            self._open(now, self.config.cool_down_s)
            return True
        return False

    def record_success(self, now: float) -> bool:
        """A successful request; returns True when it closed a half-open breaker.

        Ignored while open: a request that was sent before the breaker opened proves little.
        """
        if self.state == OPEN:
            return False
        self.failures = 0
        if self.state == HALF_OPEN:
            self.successes += 1
            if self.successes >= self.config.half_open_successes:
                self.state = CLOSED
                self.successes = 0
                self.cool_down_s = self.config.cool_down_s
                return True
        return False

    def record_probe_ok(self, now: float) -> bool:
        """A successful health probe; returns True when it moved the breaker to half-open.

        While open, a probe only counts once the cool-down has passed; while half-open or
        closed it counts like a successful request.
        """
        if self.state == OPEN:
            if now - self.opened_at < self.cool_down_s:
                return False
            self.state = HALF_OPEN
            self.failures = 0
            self.successes = 0
            return True
        self.record_success(now)
        return False

    def _open(self, now: float, cool_down_s: float) -> None:
        self.state = OPEN
        self.opened_at = now
        self.cool_down_s = cool_down_s
        self.successes = 0
        self.opens += 1
