"""The simulator actuator: ``control``'s decisions applied to simulated replicas.

Each pool (a GPU type) owns ``max`` replica slots of one cluster replica group; the
group's ``count`` of them run from the start, the rest are dormant. Every interval the
actuator first stops the draining replicas that are idle (nothing in flight, nothing on
its way), so a scale-in kills no request, then shows the scaler the fleet and applies
its decision: a start makes a replica routable after its cold start (the group's
``cold_start_s``, or ``cold_start`` drawn per start), a drain stops new work there, an
undrain takes it back. A replica that is still draining at ``drain_deadline_s`` is stopped
anyway; its requests fail over to others (``killed`` counts them, as every scale-in
should leave it at 0).

GPU-hours and $ count every replica from its start (cold start included: the GPUs are
held while weights load) to its stop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from isocost.control import (
    AutoscaleConfig,
    Autoscaler,
    Observation,
    PoolOffer,
    ReplicaState,
    ReplicaStatus,
    ScaleDecision,
    Scaler,
    parse_autoscale_config,
    planned_capacity_rps,
)
from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.core.slo import SloTargets
from isocost.core.yamltext import load_yaml
from isocost.sim._cluster import ClusterConfig, SimReplica, resolve_cluster, with_settings
from isocost.sim._core import SimRecord, Simulator
from isocost.workload import WorkloadRequest

__all__ = [
    "FleetSample",
    "FleetUsage",
    "SimAutoscale",
    "SimAutoscaler",
    "autoscaled_cluster",
    "met_slo",
    "parse_autoscale_yaml",
    "replica_usd_per_hour",
]


def replica_usd_per_hour(replica: SimReplica) -> float:
    """Its own price, else its GPUs' catalog price."""
    if replica.usd_per_hour is not None:
        return replica.usd_per_hour
    return replica.cost_model.tensor_parallel * replica.cost_model.gpu.usd_per_hour


def met_slo(record: SimRecord, slo: SloTargets) -> bool:
    """Whether ``record`` completed within both SLO targets (a rejection never does), as
    ``sim._metrics`` judges a whole run."""
    if record.finished_s is None or record.first_token_s is None:
        return False
    request = record.request
    ttft_s = record.first_token_s - request.arrival_s
    e2e_s = record.finished_s - request.arrival_s
    return slo.met_answer(request.prompt_tokens, record.output_tokens, ttft_s, e2e_s)


@dataclass(frozen=True, slots=True)
class FleetSample:
    """The fleet after one decision (for timelines)."""

    at_s: float
    ready: int
    pending: int
    draining: int
    forecast_rps: float
    need_rps: float
    reason: str


@dataclass(frozen=True, slots=True)
class FleetUsage:
    gpu_hours: float
    usd: float
    scale_events: int  # decisions that started, undrained or drained replicas
    killed: int  # requests in flight on a replica stopped at its drain deadline
    cold_gpu_hours: float  # of gpu_hours: replicas started and not yet routable


@dataclass(slots=True)
class _Slot:
    replica: SimReplica
    gpu: str
    state: ReplicaState | None = None  # None: off (dormant or stopped)
    started_s: float = 0.0
    on_since_s: float = 0.0
    draining_since_s: float = 0.0


@dataclass(slots=True)
class _Window:
    arrivals: int = 0
    settled: int = 0
    met: int = 0
    completions: dict[str, int] = field(default_factory=dict)


class SimAutoscaler:
    """A ``sim._core.Controller`` applying ``scaler``'s decisions (module docstring)."""

    def __init__(
        self,
        scaler: Scaler,
        pools: Mapping[str, Sequence[SimReplica]],
        initial: Mapping[str, int],
        slo: SloTargets,
        *,
        interval_s: float,
        drain_deadline_s: float,
        cold_start: Callable[[SimReplica], float] | None = None,
    ) -> None:
        self.scaler = scaler
        self.slo = slo
        self.interval_s = interval_s
        self.drain_deadline_s = drain_deadline_s
        self._cold_start = cold_start or (lambda replica: replica.cold_start_s)
        self._slots: dict[str, _Slot] = {}
        for gpu, replicas in pools.items():
            for i, replica in enumerate(replicas):
                slot = _Slot(replica, gpu)
                if i < initial.get(gpu, 0):
                    slot.state = "ready"
                self._slots[replica.replica_id] = slot
        self._window = _Window()
        self._usage_s: list[tuple[float, float, SimReplica]] = []  # (from, to, replica)
        self._cold_s: list[tuple[float, float, SimReplica]] = []  # start to routable
        self.decisions: list[ScaleDecision] = []
        self.timeline: list[FleetSample] = []
        self.killed = 0

    @property
    def dormant(self) -> list[str]:
        return [rid for rid, slot in self._slots.items() if slot.state is None]

    # -- Controller hooks ----------------------------------------------------------

    def arrived(self, record: SimRecord) -> None:
        self._window.arrivals += 1

    def settled(self, record: SimRecord) -> None:
        window = self._window
        window.settled += 1
        window.met += met_slo(record, self.slo)
        if record.finished_s is not None and record.replica_id in self._slots:
            gpu = self._slots[record.replica_id].gpu
            window.completions[gpu] = window.completions.get(gpu, 0) + 1

    def ready(self, replica_id: str, now: float) -> None:
        slot = self._slots[replica_id]
        slot.state = "ready"
        self._cold_s.append((slot.started_s, now, slot.replica))
        self.scaler.replica_ready(slot.gpu, now - slot.started_s)

    def tick(self, simulator: Simulator) -> None:
        now = simulator.now
        in_flight = simulator.in_flight_counts()
        for replica_id, slot in self._slots.items():
            busy = in_flight.get(replica_id, 0)
            overdue = now - slot.draining_since_s >= self.drain_deadline_s
            if slot.state == "draining" and (not busy or overdue):
                self.killed += busy
                self._stop(simulator, slot, now)
        window = self._window
        observation = Observation(
            now=now,
            interval_s=self.interval_s,
            arrivals=window.arrivals,
            queued=simulator.queued(),
            attainment=window.met / window.settled if window.settled else None,
            settled=window.settled,
            completions=dict(window.completions),
            replicas=[
                ReplicaStatus(
                    rid,
                    slot.gpu,
                    slot.state,
                    slot.started_s,
                    in_flight.get(rid, 0),
                )
                for rid, slot in self._slots.items()
                if slot.state is not None
            ],
        )
        self._window = _Window()
        decision = self.scaler.decide(observation)
        self._apply(simulator, decision, now)
        states = [slot.state for slot in self._slots.values()]
        self.timeline.append(
            FleetSample(
                now,
                states.count("ready"),
                states.count("pending"),
                states.count("draining"),
                decision.forecast_rps,
                decision.need_rps,
                decision.reason,
            )
        )

    # -- actions ---------------------------------------------------------------------

    def _apply(self, simulator: Simulator, decision: ScaleDecision, now: float) -> None:
        if decision.changes:
            self.decisions.append(decision)
        for gpu, count in decision.start.items():
            off = [s for s in self._slots.values() if s.gpu == gpu and s.state is None]
            for slot in off[:count]:
                slot.state, slot.started_s, slot.on_since_s = "pending", now, now
                simulator.start_replica(slot.replica.replica_id, self._cold_start(slot.replica))
        for replica_id in decision.undrain:
            self._slots[replica_id].state = "ready"
            simulator.set_draining(replica_id, False)
        for replica_id in decision.drain:
            slot = self._slots[replica_id]
            if slot.state == "pending":
                self._cold_s.append((slot.started_s, now, slot.replica))
                self._stop(simulator, slot, now)
            else:
                slot.state, slot.draining_since_s = "draining", now
                simulator.set_draining(replica_id, True)

    def _stop(self, simulator: Simulator, slot: _Slot, now: float) -> None:
        simulator.stop_replica(slot.replica.replica_id)
        self._usage_s.append((slot.on_since_s, now, slot.replica))
        slot.state = None

    def usage(self, until_s: float) -> FleetUsage:
        """GPU-hours and $ of every replica's time on, up to ``until_s``, and how many of
        those GPU-hours were cold starts."""
        on = [*self._usage_s]
        on += [
            (s.on_since_s, until_s, s.replica) for s in self._slots.values() if s.state is not None
        ]
        cold = [*self._cold_s]
        cold += [
            (s.started_s, until_s, s.replica) for s in self._slots.values() if s.state == "pending"
        ]
        held = _held_s(on, until_s)
        usd_s = sum(seconds * replica_usd_per_hour(replica) for seconds, replica in held)
        cold_gpu_s = _gpu_s(_held_s(cold, until_s))
        return FleetUsage(
            _gpu_s(held) / 3600, usd_s / 3600, len(self.decisions), self.killed, cold_gpu_s / 3600
        )


def _held_s(
    spans: list[tuple[float, float, SimReplica]], until_s: float
) -> list[tuple[float, SimReplica]]:
    """Each (from, to, replica) span's seconds up to ``until_s``."""
    return [(max(0.0, min(stop, until_s) - start), replica) for start, stop, replica in spans]


def _gpu_s(held: list[tuple[float, SimReplica]]) -> float:
    return sum(seconds * replica.cost_model.tensor_parallel for seconds, replica in held)


@dataclass(frozen=True, slots=True)
class SimAutoscale:
    """``isocost sim --autoscale``: the pools' replica slots, how many run at first, and
    what one replica of each pool costs and gives; ``controller`` builds each run's own."""

    config: AutoscaleConfig
    pools: dict[str, tuple[SimReplica, ...]]
    initial: dict[str, int]
    offers: tuple[PoolOffer, ...]

    def controller(self, slo: SloTargets) -> SimAutoscaler:
        return SimAutoscaler(
            Autoscaler(self.config, self.offers),
            self.pools,
            self.initial,
            slo,
            interval_s=self.config.interval_s,
            drain_deadline_s=self.config.drain_deadline_s,
        )


def parse_autoscale_yaml(text: str, source: str) -> AutoscaleConfig:
    """Decode and check an autoscale file (``control.AutoscaleConfig``)."""
    raw = load_yaml(text, source)
    return parse_autoscale_config(raw, source)


def autoscaled_cluster(
    config: AutoscaleConfig,
    cluster: ClusterConfig,
    catalog: Catalog,
    requests: Sequence[WorkloadRequest],
    slo: SloTargets,
    source: str,
) -> tuple[ClusterConfig, list[SimReplica], SimAutoscale]:
    """``cluster`` with each pool's replica group (the one on the pool's GPU) grown to the
    pool's max slots, its ``count`` (within min and max) running at first; the planner's
    capacity per replica at the requests' mean lengths."""
    groups = list(cluster.replicas)
    counts: dict[str, int] = {}
    for i, pool in enumerate(config.pools):
        matching = [j for j, g in enumerate(groups) if g.gpu == pool.gpu]
        if len(matching) != 1:
            found = "no replica group" if not matching else "several replica groups"
            raise ConfigError(source, f"{found} on {pool.gpu} in the cluster", f"pools[{i}].gpu")
        group = groups[matching[0]]
        counts[pool.gpu] = min(max(group.count, pool.min), pool.max)
        groups[matching[0]] = msgspec.structs.replace(group, count=pool.max)
    grown = with_settings(msgspec.structs.replace(cluster, replicas=groups), source)  # limits
    replicas = resolve_cluster(grown, catalog)
    prompt = round(sum(r.prompt_tokens for r in requests) / len(requests))
    output = round(sum(r.output_tokens for r in requests) / len(requests))
    pools: dict[str, tuple[SimReplica, ...]] = {}
    offers: list[PoolOffer] = []
    for i, pool in enumerate(config.pools):
        members = tuple(r for r in replicas if r.cost_model.gpu.id == pool.gpu)
        cost = members[0].cost_model
        try:
            capacity = planned_capacity_rps(cost, prompt, output, slo)
        except ValueError as exc:
            raise ConfigError(source, str(exc), f"pools[{i}]") from None
        pools[pool.gpu] = members
        usd = replica_usd_per_hour(members[0])
        offers.append(PoolOffer(pool.gpu, cost.tensor_parallel, usd, capacity))
    return grown, replicas, SimAutoscale(config, pools, counts, tuple(offers))
