"""How much one simulation may be asked to do.

Generous bounds that a real trace, fleet or sweep stays far inside, so that a slip of units
(milliseconds read as seconds, ``1e-9`` for ``1``) is refused at once, naming the limit,
instead of starting a run that takes hours or never ends:

* ``MAX_REPLICAS``: simulated replicas in one cluster (built for 1000-GPU fleets);
* ``MAX_SPAN_S``: simulated time over which requests arrive, at the slowest rate a sweep
  or capacity search replays them (a week-long trace replays at its own speed);
* ``MAX_PERIODIC_EVENTS``: scrapes and autoscaler ticks in that span, per run (a week at
  the default 200 ms scrape); these, not requests, are what a long idle span costs;
* ``MAX_NETWORK_DELAY_MS``: the gateway-replica delay each way; the slowdown of a replica
  is bounded as the engine's (``engine.config.MAX_SLOWDOWN``).
"""

from __future__ import annotations

from collections.abc import Sequence

from isocost.core.errors import ConfigError
from isocost.workload import WorkloadRequest, mean_rate_rps

__all__ = [
    "MAX_NETWORK_DELAY_MS",
    "MAX_PERIODIC_EVENTS",
    "MAX_REPLICAS",
    "MAX_SPAN_S",
    "check_run_length",
]

MAX_REPLICAS = 10_000
MAX_SPAN_S = 7 * 86_400
MAX_PERIODIC_EVENTS = 5_000_000
MAX_NETWORK_DELAY_MS = 60_000.0


def check_run_length(
    requests: Sequence[WorkloadRequest],
    slowest_rate_rps: float | None,
    scrape_interval_ms: float,
    control_interval_s: float | None,
) -> None:
    """A ConfigError when the runs would span more than ``MAX_SPAN_S`` or hold more than
    ``MAX_PERIODIC_EVENTS``; ``slowest_rate_rps``: the lowest rate the requests are
    replayed at (None: only their own)."""
    span_s = max(r.arrival_s for r in requests)
    if slowest_rate_rps is not None:
        span_s = max(span_s, span_s * mean_rate_rps(requests) / slowest_rate_rps)
    if span_s > MAX_SPAN_S:
        raise ConfigError(
            "sim",
            f"the requests arrive over {span_s:.4g} s of simulated time, beyond the limit of "
            f"{MAX_SPAN_S:,} s (7 days): check the trace's time unit, --rate, --speedup "
            "and the lowest rate of a sweep or --capacity",
        )
    periods = [p for p in (scrape_interval_ms / 1000, control_interval_s) if p]
    ticks = sum(span_s / period for period in periods)
    if ticks > MAX_PERIODIC_EVENTS:
        raise ConfigError(
            "sim",
            f"{ticks:.4g} scrapes and autoscaler ticks in {span_s:.4g} s of simulated time, "
            f"beyond the limit of {MAX_PERIODIC_EVENTS:,} per run: raise "
            "--scrape-interval-ms or the autoscaler's interval_s",
        )
