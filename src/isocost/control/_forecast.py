"""Demand ahead: the arrival rate over the next warm-up lead.

A replica started now serves only after its lead, so the fleet must be sized for the
highest demand between now and then. ``DemandForecast`` keeps

* the recent level: an EWMA of the rate measured each interval;
* the season: the mean rate per ``bucket_s`` slot of the period (``season_s``), an EWMA
  over the seasons before the current one (a previous day's history can be fed in
  first), so that today's own rates are never taken for the pattern;
* the trend: the least-squares slope of the last ``trend_window_s`` of rates.

Where the season knows both now and the horizon, the forecast is last season's curve
scaled to today's traffic, plus whatever today runs above that now. The scale is the
median of ``rate / season`` over the trend window (kept within ``[0.5, 2]``), so that a
burst now (shorter than half the window) is not taken for a day that runs higher and
multiplied into the whole ramp ahead; the burst is carried as it is instead, an excess
in requests/s over the scaled curve. Elsewhere the forecast is the level moved along the
trend. The season is read as the median over a ``smooth_s`` window, so that yesterday's
random bursts (shorter than half of it) are not predicted again today.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Protocol

__all__ = ["DemandForecast", "Forecast"]

_LEVEL_ALPHA = 0.3  # EWMA weight of the newest rate
_SEASON_ALPHA = 0.5  # weight of the newest season in each slot
_SCALE_BOUNDS = (0.5, 2.0)


class Forecast(Protocol):
    """What the autoscaler asks of a forecast (``DemandForecast`` is isocost's; another
    can stand in, such as a benchmark's noiseless rate, to measure what forecasting
    costs)."""

    def observe(self, now: float, rate_rps: float) -> None: ...

    def peak(self, now: float, horizon_s: float) -> float: ...

    def slope(self) -> float: ...


class DemandForecast:
    def __init__(
        self,
        season_s: float,
        bucket_s: float = 60.0,
        smooth_s: float = 600.0,
        trend_window_s: float = 600.0,
    ) -> None:
        self.season_s = season_s
        self.bucket_s = bucket_s
        self._slots = max(1, round(season_s / bucket_s))
        self._smooth = max(0, round(smooth_s / bucket_s / 2))
        self._profile: dict[int, float] = {}  # slot -> rate over the past seasons
        self._current: dict[int, tuple[int, float, int]] = {}  # slot -> (season, sum, count)
        self._trend_window_s = trend_window_s
        self._recent: deque[tuple[float, float]] = deque()
        self.level: float | None = None

    def observe(self, now: float, rate_rps: float) -> None:
        """The rate measured over the interval that ends at ``now``. After a gap longer
        than the trend window the level and trend start afresh (a history fed in before
        today, or an outage), the season keeps what it learned."""
        if self._recent and now - self._recent[-1][0] > self._trend_window_s:
            self._recent.clear()
            self.level = None
        self.level = (
            rate_rps
            if self.level is None
            else _LEVEL_ALPHA * rate_rps + (1 - _LEVEL_ALPHA) * self.level
        )
        slot, season = self._slot(now), self._season(now)
        entry = self._current.get(slot)
        if entry is not None and entry[0] < season:
            past = self._past(slot, season)
            assert past is not None  # the entry itself is folded in
            self._profile[slot] = past
            entry = None
        _, total, count = entry or (season, 0.0, 0)
        self._current[slot] = (season, total + rate_rps, count + 1)
        self._recent.append((now, rate_rps))
        while self._recent and self._recent[0][0] < now - self._trend_window_s:
            self._recent.popleft()

    def peak(self, now: float, horizon_s: float) -> float:
        """The highest rate expected in ``[now, now + horizon_s]`` (0 before any
        observation)."""
        if self.level is None:
            return 0.0
        steps = max(1, math.ceil(horizon_s / self.bucket_s))
        times = [now + horizon_s * i / steps for i in range(steps + 1)]
        season = self._season(now)
        base = self._seasonal(now, season)
        scale = self._scale()
        if base is not None and scale is not None:
            curve = [self._seasonal(t, season) for t in times]
            if all(c is not None for c in curve):
                excess = max(self.level - scale * base, 0.0)
                return max(self.level, *(scale * c + excess for c in curve if c is not None))
        slope = self.slope()
        return max(self.level, self.level + slope * horizon_s, 0.0)

    def slope(self) -> float:
        """Rate change per second over the trend window (0 with fewer than 3 points)."""
        points = self._recent
        if len(points) < 3:
            return 0.0
        mean_t = sum(t for t, _ in points) / len(points)
        mean_r = sum(r for _, r in points) / len(points)
        var = sum((t - mean_t) ** 2 for t, _ in points)
        if var == 0:
            return 0.0
        return sum((t - mean_t) * (r - mean_r) for t, r in points) / var

    def _scale(self) -> float | None:
        """Today against the past seasons: the median ``rate / season`` over the trend
        window, within the scale bounds (None where the season knows none of it)."""
        ratios = [
            rate / base
            for t, rate in self._recent
            if (base := self._seasonal(t, self._season(t))) is not None and base > 0
        ]
        if not ratios:
            return None
        low, high = _SCALE_BOUNDS
        return min(max(statistics.median(ratios), low), high)

    def _slot(self, t: float) -> int:
        return int((t % self.season_s) // self.bucket_s) % self._slots

    def _season(self, t: float) -> int:
        return math.floor(t / self.season_s)

    def _past(self, slot: int, season: int) -> float | None:
        """``slot``'s rate over the seasons before ``season``: the profile, with the
        latest season's mean folded in once that season is over."""
        profile = self._profile.get(slot)
        entry = self._current.get(slot)
        if entry is None or entry[0] >= season:
            return profile
        mean = entry[1] / entry[2]
        return mean if profile is None else _SEASON_ALPHA * mean + (1 - _SEASON_ALPHA) * profile

    def _seasonal(self, t: float, season: int) -> float | None:
        """The past seasons' median rate around ``t``'s slot; None if none is known."""
        centre = self._slot(t)
        values = [
            v
            for d in range(-self._smooth, self._smooth + 1)
            if (v := self._past((centre + d) % self._slots, season)) is not None
        ]
        return statistics.median(values) if values else None
