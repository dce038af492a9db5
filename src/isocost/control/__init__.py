"""Pure: autoscaling decisions (forecast, capacity, desired replicas, drain plan).

No I/O, no clock: every call gets ``now`` in its ``Observation``, so the simulator and the
live ``isocost autoscale`` run the very same decisions. Start with ``_decide``.
"""

from isocost.control._config import (
    ACTUATORS,
    AutoscaleConfig,
    PoolConfig,
    parse_autoscale_config,
)
from isocost.control._decide import (
    Autoscaler,
    HpaScaler,
    Observation,
    PoolOffer,
    ReplicaState,
    ReplicaStatus,
    ScaleDecision,
    Scaler,
    attainment_verdict,
    plan_changes,
)
from isocost.control._estimates import CapacityEstimate, WarmupLead, planned_capacity_rps
from isocost.control._forecast import DemandForecast, Forecast

__all__ = [
    "ACTUATORS",
    "AutoscaleConfig",
    "Autoscaler",
    "CapacityEstimate",
    "DemandForecast",
    "Forecast",
    "HpaScaler",
    "Observation",
    "PoolConfig",
    "PoolOffer",
    "ReplicaState",
    "ReplicaStatus",
    "ScaleDecision",
    "Scaler",
    "WarmupLead",
    "attainment_verdict",
    "parse_autoscale_config",
    "plan_changes",
    "planned_capacity_rps",
]
