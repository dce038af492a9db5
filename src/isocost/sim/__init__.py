"""Discrete-event cluster simulator, reports and plots.

Replays a trace or a synthetic workload through the real scheduling brain
(``isocost.scheduling``) onto engine models (``isocost.engine.model``), one per replica,
in simulated time. Start with ``_core`` (the event loop), then ``_run`` (policies side by
side, sweeps, capacity searches), ``_metrics`` (SLOs, the oracle, capacity at SLO over a
sweep), ``_capacity`` (capacity at SLO by bisection), ``_cluster`` (the cluster file, or
one pool of a gateway config), ``_autoscale`` (replicas started and drained by
``control``) and ``_audit`` (SLO-admission rejections replayed as admitted).
"""

from isocost.sim._audit import AdmissionAudit, AdmissionAuditor, ForcedAdmission
from isocost.sim._autoscale import (
    FleetUsage,
    SimAutoscale,
    SimAutoscaler,
    autoscaled_cluster,
    met_slo,
    parse_autoscale_yaml,
    replica_usd_per_hour,
)
from isocost.sim._capacity import CapacityResult, CapacitySpec, CapacityStatus
from isocost.sim._cluster import (
    ClusterConfig,
    ClusterEvent,
    ReplicaGroup,
    SimReplica,
    gateway_cluster,
    gateway_pool,
    lowest_slowdowns,
    parse_cluster_yaml,
    resolve_cluster,
    served_model,
    uniform_cluster,
    with_settings,
)
from isocost.sim._core import SimRecord, SimResult, Simulator, block_hashes
from isocost.sim._fleetplan import FleetPlan, FleetTrial, plan_fleet
from isocost.sim._metrics import (
    DisaggSummary,
    Isolated,
    PolicySummary,
    capacity_at_slo,
    isolated_times,
    oracle_summary,
    reusable_prefix_blocks,
)
from isocost.sim._report import (
    capacity_json,
    json_rows,
    print_capacity,
    print_results,
    sim_command,
    write_json,
)
from isocost.sim._run import (
    CapacityOutput,
    RunOutput,
    SimPlan,
    SweepOutput,
    check_policies,
    run_capacity,
    run_plan,
)
from isocost.sim._twin import (
    Recording,
    calibrated_slowdown,
    light_requests,
    load_recording,
    recorded_catalog,
    recorded_cluster,
)
from isocost.sim._workload import WorkloadChoice, at_rate, load_requests
from isocost.workload import TRACE_FORMATS

__all__ = [
    "TRACE_FORMATS",
    "AdmissionAudit",
    "AdmissionAuditor",
    "CapacityOutput",
    "CapacityResult",
    "CapacitySpec",
    "CapacityStatus",
    "ClusterConfig",
    "ClusterEvent",
    "DisaggSummary",
    "FleetPlan",
    "FleetTrial",
    "FleetUsage",
    "ForcedAdmission",
    "Isolated",
    "PolicySummary",
    "Recording",
    "ReplicaGroup",
    "RunOutput",
    "SimAutoscale",
    "SimAutoscaler",
    "SimPlan",
    "SimRecord",
    "SimReplica",
    "SimResult",
    "Simulator",
    "SweepOutput",
    "WorkloadChoice",
    "at_rate",
    "autoscaled_cluster",
    "block_hashes",
    "calibrated_slowdown",
    "capacity_at_slo",
    "capacity_json",
    "check_policies",
    "gateway_cluster",
    "gateway_pool",
    "isolated_times",
    "json_rows",
    "light_requests",
    "load_recording",
    "load_requests",
    "lowest_slowdowns",
    "met_slo",
    "oracle_summary",
    "parse_autoscale_yaml",
    "parse_cluster_yaml",
    "plan_fleet",
    "print_capacity",
    "print_results",
    "recorded_catalog",
    "recorded_cluster",
    "replica_usd_per_hour",
    "resolve_cluster",
    "reusable_prefix_blocks",
    "run_capacity",
    "run_plan",
    "served_model",
    "sim_command",
    "uniform_cluster",
    "with_settings",
    "write_json",
]
