"""The agent's judgement of its engine's recent success rate (pure: time comes in).

The field notes judge a replica by process, port and the recent success rate of real
requests, so that one slow or failed answer does not flap it out of rotation. Here the
rate is that of the requests the engine finished within the last ``window_s`` (from its
own cumulative counters), and the replica counts as failing only once that rate has
stayed below ``min_rate`` — over at least ``min_requests`` requests — for a whole
``window_s``; it is healthy again as soon as the rate recovers.
"""

from __future__ import annotations

from collections import deque

__all__ = ["SuccessWindow"]


class SuccessWindow:
    def __init__(self, window_s: float, min_rate: float, min_requests: int = 10) -> None:
        self.window_s = window_s
        self.min_rate = min_rate
        self.min_requests = min_requests
        self._samples: deque[tuple[float, int, int]] = deque()  # (now, ok, failed) totals
        self._bad_since: float | None = None

    def observe(self, now: float, ok_total: int, failed_total: int) -> None:
        """Record the engine's cumulative finished-ok and failed counts at ``now``."""
        last = self._samples[-1] if self._samples else None
        if last is not None and (ok_total < last[1] or failed_total < last[2]):
            self._samples.clear()  # counters went back: the engine restarted
        self._samples.append((now, ok_total, failed_total))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        rate = self.rate()
        if rate is None or rate >= self.min_rate:
            self._bad_since = None
        elif self._bad_since is None:
            self._bad_since = now

    def rate(self) -> float | None:
        """Success rate over the window; None with too few requests to tell."""
        if len(self._samples) < 2:
            return None
        _, ok0, failed0 = self._samples[0]
        _, ok1, failed1 = self._samples[-1]
        ok, failed = ok1 - ok0, failed1 - failed0
        if ok + failed < self.min_requests:
            return None
        return ok / (ok + failed)

    def failing(self, now: float) -> bool:
        """Whether the rate has been bad for a whole window."""
        return self._bad_since is not None and now - self._bad_since >= self.window_s
