"""``isocost autoscale``: ``control``'s decisions applied to a live gateway's fleet.

``_admin`` reads the gateway (admin API and ``/metrics``) and drains through it;
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
from isocost.autoscale._admin import AdminClient, GatewayError, ReplicaRow, read_snapshot
from isocost.autoscale._loop import AutoscaleLoop, LoopMetrics, Tick
from isocost.autoscale._plan import offers_from_plan

__all__ = [
    "Actuator",
    "ActuatorError",
    "AdminClient",
    "AutoscaleLoop",
    "CommandActuator",
    "GatewayError",
    "KubernetesActuator",
    "LocalActuator",
    "LoopMetrics",
    "ReplicaRow",
    "Tick",
    "offers_from_plan",
    "read_snapshot",
]
