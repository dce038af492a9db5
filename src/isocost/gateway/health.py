"""Per-replica health: a circuit breaker fed by active checks and by live traffic.

Algorithm. Every outcome is recorded at time ``now``: proxied requests as success or
failure, active checks (``/health`` probes, ``/metrics`` scrapes) only as failures while
the breaker is closed (a passing check must not hide failing requests); the breaker keeps
the consecutive failure count and the last ``window_size`` outcomes.

* closed -> open when ``failure_threshold`` failures come in a row, or when the success
  rate over a full window falls below ``min_success_rate``, or at once on a *hard* failure
  (connection refused or reset: the process is gone, waiting for more evidence only loses
  requests). One slow answer among successes therefore never opens it. A *soft* failure
  (an engine's 429, overloaded) counts in the success rate only, not in the run of
  failures: a replica that refuses everything still opens within one window.
* open: no traffic, and no active checks either (the monitor waits for ``probe_due_at``).
  After the cool-down (``open_ms``, doubled for each failed probe, at most 30 s) the
  breaker is half-open.
* half-open: no live traffic either; the next active probe decides: success closes the
  breaker and clears the window, failure opens it again with the longer cool-down. When
  live requests opened it (5xx, broken bodies: ``needs_live_probe``) a ``/health`` answer
  proves little, so the gateway probes with a real one-token completion instead.

The clock is passed in, so the state machine is tested without waiting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Breaker", "BreakerState", "StatusFault", "status_fault"]

_MAX_OPEN_S = 30.0
_NOT_SERVED_HERE = frozenset({401, 403, 404})  # the replica, not the client, is wrong
_OVERLOADED = 429
_FULL = 503
_LOOP_DETECTED = 508  # from a gateway down the line


@dataclass(frozen=True, slots=True)
class StatusFault:
    """A replica's answer that is its failure, not the client's."""

    busy: bool = False  # 503: full, not broken; the breaker is not told
    soft: bool = False  # 429: overloaded; counts in the success rate only


def status_fault(status: int) -> StatusFault | None:
    """Whether an upstream status is the replica's fault, and how; None when it is not
    (a success, the client's error, or a loop a gateway down the line found)."""
    if status == _LOOP_DETECTED:
        return None  # relayed as is: retrying would loop again
    if status >= 500:
        return StatusFault(busy=status == _FULL)
    if status == _OVERLOADED:
        return StatusFault(soft=True)
    if status in _NOT_SERVED_HERE:
        return StatusFault()
    return None


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    """One replica's circuit breaker; see the module docstring for the transitions."""

    def __init__(
        self,
        *,
        failure_threshold: int,
        min_success_rate: float,
        window_size: int,
        open_s: float,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.min_success_rate = min_success_rate
        self.open_s = open_s
        self._window: deque[bool] = deque(maxlen=window_size)
        self._consecutive_failures = 0
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._cooldown_s = open_s
        self.last_error: str | None = None
        self.needs_live_probe = False
        self.ejections = 0  # closed -> open, ever: the monitor logs and counts each

    def configure(
        self, *, failure_threshold: int, min_success_rate: float, window_size: int, open_s: float
    ) -> None:
        """New thresholds (a config reload); the state and the latest outcomes stay."""
        self.failure_threshold = failure_threshold
        self.min_success_rate = min_success_rate
        if self._cooldown_s == self.open_s:  # not lengthened by failed probes
            self._cooldown_s = open_s
        self.open_s = open_s
        self._window = deque(self._window, maxlen=window_size)

    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now - self._opened_at >= self._cooldown_s:
            self._state = BreakerState.HALF_OPEN
        return self._state

    def probe_due_at(self, now: float) -> float | None:
        """When an open breaker turns half-open and wants its probe; None unless open."""
        if self.state(now) is not BreakerState.OPEN:
            return None
        return self._opened_at + self._cooldown_s

    def allows_traffic(self, now: float) -> bool:
        return self.state(now) is BreakerState.CLOSED

    def success_rate(self) -> float:
        return sum(self._window) / len(self._window) if self._window else 1.0

    def record_success(self, now: float, *, probe_started_at: float | None = None) -> None:
        """A successful request, or an active probe sent at ``probe_started_at``."""
        state = self.state(now)
        if state is BreakerState.OPEN:
            return  # a late answer from before the opening proves nothing
        if state is BreakerState.HALF_OPEN:
            if probe_started_at is None or probe_started_at < self._opened_at + self._cooldown_s:
                return  # only a probe sent while half-open may close it
            self._state = BreakerState.CLOSED
            self._cooldown_s = self.open_s
            self._window.clear()
            self.needs_live_probe = False
        elif probe_started_at is not None:
            return  # a passing probe says nothing about failing requests: no masking
        self._consecutive_failures = 0
        self._window.append(True)

    def record_failure(
        self,
        now: float,
        reason: str,
        *,
        hard: bool = False,
        probe: bool = False,
        soft: bool = False,
    ) -> None:
        """A failed request (``probe=False``) or active check (``probe=True``); a ``soft``
        one counts in the success rate only."""
        self.last_error = reason
        state = self.state(now)
        if state is BreakerState.OPEN:
            return
        if state is BreakerState.HALF_OPEN:
            self._open(now, min(self._cooldown_s * 2, _MAX_OPEN_S))
            return
        if not soft:
            self._consecutive_failures += 1
        self._window.append(False)
        window_full = len(self._window) == self._window.maxlen
        if (
            hard
            or self._consecutive_failures >= self.failure_threshold
            or (window_full and self.success_rate() < self.min_success_rate)
        ):
            self.needs_live_probe = not hard and not probe
            self.ejections += 1
            self._open(now, self.open_s)

    def _open(self, now: float, cooldown_s: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._cooldown_s = cooldown_s
        self._consecutive_failures = 0
