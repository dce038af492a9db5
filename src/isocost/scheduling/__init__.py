"""Pure: the scheduling framework (filters -> weighted scorers -> picker), policies, admission.

Start with ``scheduling.contract`` (the contract the gateway and the simulator code against)
and ``state`` (the shadow state, ``ReplicaSet``), then ``framework`` (the pipeline),
``interface`` (what a plugin sees), ``policies`` (named profiles, YAML), ``plugins`` (one
module per plugin, each docstring its reference) and ``dispatch`` (the late-binding
queue that the gateway and the simulator both drive).
"""

from isocost.scheduling.contract import (
    EngineMetrics,
    InFlight,
    ReplicaSpec,
    RequestView,
)
from isocost.scheduling.decision import Decision, Explanation, Outcome, RejectReason
from isocost.scheduling.framework import AdmissionSettings, Policy
from isocost.scheduling.policies import (
    BUILTIN_POLICIES,
    SchedulingConfig,
    build_policy,
    parse_scheduling_yaml,
)
from isocost.scheduling.state import ReplicaSet, ReplicaState

__all__ = [
    "BUILTIN_POLICIES",
    "AdmissionSettings",
    "Decision",
    "EngineMetrics",
    "Explanation",
    "InFlight",
    "Outcome",
    "Policy",
    "RejectReason",
    "ReplicaSet",
    "ReplicaSpec",
    "ReplicaState",
    "RequestView",
    "SchedulingConfig",
    "build_policy",
    "parse_scheduling_yaml",
]
