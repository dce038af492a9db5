"""The autoscaler's settings (msgspec, unknown keys rejected), checked into one-line errors.

::

    actuator: simulator          # simulator | local | command | kubernetes
    interval_s: 15               # one decision per interval (at least 0.1)
    headroom: 0.2                # capacity kept above the forecast, for bursts
    max_gpus: 256                # budget: GPUs, $ per hour, or both (at least one)
    max_usd_per_hour: 500
    season_s: 86400              # the traffic's period (its daily pattern)
    scale_up_cooldown_s: 60      # least time between two scale-ups
    scale_down_cooldown_s: 300   # least time between two scale-ins (and after a scale-up)
    scale_in_after_s: 600        # demand must stay low this long before a scale-in
    queue_per_replica: 4         # reactive guard: queued requests per ready replica
    guard_window_s: 45           # ... growing for this long scales up at once
    attainment_target: 0.9       # reactive guard: recent SLO attainment surely below this
    drain_deadline_s: 600        # a draining replica is stopped by then, idle or not
    scale_step: 0                # least share of the fleet one scale event adds or removes
    replace_ejected_after_s: 60  # a replica its gateway's breaker holds out this long is replaced
    pools:
      - {gpu: a100-80g, min: 16, max: 64, cold_start_s: 180}  # lead until measured; <= 1 day
"""

from __future__ import annotations

import msgspec

from isocost.core.bounds import (
    AT_LEAST_ONE,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    Bounds,
    check_fields,
)
from isocost.core.errors import ConfigError

__all__ = ["ACTUATORS", "AutoscaleConfig", "PoolConfig", "parse_autoscale_config"]

ACTUATORS = ("simulator", "local", "command", "kubernetes")


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One GPU type's replicas: bounds, and the warm-up lead assumed until one is measured."""

    gpu: str
    max: int
    min: int = 0
    cold_start_s: float = 180.0


class AutoscaleConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pools: list[PoolConfig]
    actuator: str = "simulator"
    interval_s: float = 15.0
    headroom: float = 0.2
    max_gpus: int | None = None
    max_usd_per_hour: float | None = None
    season_s: float = 86_400.0
    scale_up_cooldown_s: float = 60.0
    scale_down_cooldown_s: float = 300.0
    scale_in_after_s: float = 600.0
    queue_per_replica: float = 4.0
    guard_window_s: float = 45.0
    attainment_target: float = 0.9
    drain_deadline_s: float = 600.0
    scale_step: float = 0.0
    replace_ejected_after_s: float = 60.0


def parse_autoscale_config(raw: object, source: str) -> AutoscaleConfig:
    """Decode and check a decoded YAML/JSON document; errors name ``source`` and the key."""
    try:
        config = msgspec.convert(raw, AutoscaleConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(source, str(exc)) from None
    check_fields(config, _BOUNDS, source)
    for i, pool in enumerate(config.pools):
        check_fields(pool, _POOL_BOUNDS, source, f"pools[{i}]")
    gpus = [p.gpu for p in config.pools]
    problems: list[tuple[str, bool, str]] = [
        ("pools", bool(config.pools), "must list at least one GPU pool"),
        ("actuator", config.actuator in ACTUATORS, f"unknown; valid: {', '.join(ACTUATORS)}"),
        (
            "max_gpus",
            config.max_gpus is not None or config.max_usd_per_hour is not None,
            "no budget: set max_gpus, max_usd_per_hour or both",
        ),
        ("pools", len(set(gpus)) == len(gpus), "one pool per GPU type"),
    ]
    for i, pool in enumerate(config.pools):
        problems += [
            (f"pools[{i}]", pool.min <= pool.max, f"min ({pool.min}) > max ({pool.max})"),
            (
                f"pools[{i}].cold_start_s",
                pool.cold_start_s <= _MAX_COLD_START_S,
                f"must be <= {_MAX_COLD_START_S:g} (a day)",
            ),
        ]
    for key, ok, message in problems:
        if not ok:
            raise ConfigError(source, message, key)
    return config


# Every number's range (all finite). A decision loop faster than _MIN_INTERVAL_S outruns the
# scrapes it decides on, and in the simulator only multiplies the ticks; a guard window of
# 0 s holds no sample to compare. The forecast looks one warm-up lead ahead in steps of a
# minute: a lead past _MAX_COLD_START_S (a day) is no warm-up, and an absurd one (1e300 s)
# would stall every decision.
_MIN_INTERVAL_S = 0.1
_MAX_COLD_START_S = 86_400.0
_BOUNDS: dict[str, Bounds] = {
    "interval_s": Bounds(_MIN_INTERVAL_S),
    "headroom": Bounds(0.0, 10.0, high_open=True),
    "max_gpus": AT_LEAST_ONE,
    "max_usd_per_hour": POSITIVE,
    "season_s": POSITIVE,
    "scale_up_cooldown_s": NON_NEGATIVE,
    "scale_down_cooldown_s": NON_NEGATIVE,
    "scale_in_after_s": NON_NEGATIVE,
    "queue_per_replica": POSITIVE,
    "guard_window_s": POSITIVE,
    "attainment_target": FRACTION,
    "drain_deadline_s": POSITIVE,
    "scale_step": Bounds(0.0, 1.0, high_open=True),
    "replace_ejected_after_s": NON_NEGATIVE,
}
_POOL_BOUNDS: dict[str, Bounds] = {
    "min": NON_NEGATIVE,
    "max": AT_LEAST_ONE,
    "cold_start_s": NON_NEGATIVE,
}
