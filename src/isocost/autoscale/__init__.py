"""``isocost autoscale``: ``control``'s decisions applied to a live gateway's fleet.

``_admin`` reads the gateway (admin API and ``/metrics``) and drains through it;
``_gateways`` makes several gateways in front of one fleet one (read merged, acted on all);
``_actuators`` start and stop replicas (local engine processes, a command hook, a
Kubernetes Deployment's scale); ``_loop`` ties them to the unchanged ``control.Autoscaler``;
``_plan`` reads each pool's capacity per replica from ``isocost plan --json``.
"""

from isocost.autoscale._actuators import (
    Actuator,
    ActuatorError,
    CommandActuator,
    KubernetesActuator,
    LocalActuator,
)
from isocost.autoscale._admin import (
    AdminClient,
    FleetGateway,
    FleetSnapshot,
    GatewayCounters,
    GatewayError,
    ReplicaRow,
    read_counters,
    read_snapshot,
)
from isocost.autoscale._gateways import GatewayAddresses, GatewaySet, merge_snapshots
from isocost.autoscale._loop import AutoscaleLoop, LoopMetrics, Tick
from isocost.autoscale._plan import offers_from_plan

__all__ = [
    "Actuator",
    "ActuatorError",
    "AdminClient",
    "AutoscaleLoop",
    "CommandActuator",
    "FleetGateway",
    "FleetSnapshot",
    "GatewayAddresses",
    "GatewayCounters",
    "GatewayError",
    "GatewaySet",
    "KubernetesActuator",
    "LocalActuator",
    "LoopMetrics",
    "ReplicaRow",
    "Tick",
    "merge_snapshots",
    "offers_from_plan",
    "read_counters",
    "read_snapshot",
]
