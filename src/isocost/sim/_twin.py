"""A recording (``isocost serve --record DIR``) as the simulator's workload and fleet.

The trace is every segment's lines of one pool, in arrival order (the Mooncake loader
reads them). The fleet is ``fleet.json``'s pool as it was when the recording last wrote
it: each replica by its gateway name, GPU, ``tp``, cost model, weight, price, groups and
``max_queue``, with the gateway's queue and retries, and with what calibration learned
applied: a replica's ``slowdown`` is the geometric mean of its TTFT and ITL factors
(observed over predicted; the simulator has one factor for every step, prefill and
decode alike). ``failures`` add what-if events: a replica that fails at a time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import msgspec

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.runtime.recording import FLEET_FILE, FleetFile, FleetPool, segment_paths
from isocost.scheduling.policies import UnknownConfigEntryError
from isocost.sim._cluster import (
    ClusterConfig,
    ClusterEvent,
    ReplicaGroup,
    SimReplica,
    resolve_cluster,
    with_settings,
)
from isocost.workload import WorkloadRequest, parse_trace

__all__ = ["Recording", "calibrated_slowdown", "load_recording", "recorded_cluster"]


class _Pool(msgspec.Struct):
    model: str = ""


_pool_of = msgspec.json.Decoder(_Pool)


@dataclasses.dataclass(frozen=True, slots=True)
class Recording:
    """One pool of a recording: its requests, its fleet and the policy it ran."""

    requests: list[WorkloadRequest]
    pool: FleetPool
    fleet: FleetFile


def load_recording(directory: str, pool: str | None) -> Recording:
    """The recording in ``directory`` for ``pool`` (None: the only one); ConfigError
    naming the directory when it holds no fleet, no segment or no request."""
    root = Path(directory)
    fleet_path = root / FLEET_FILE
    try:
        fleet = msgspec.json.decode(fleet_path.read_bytes(), type=FleetFile)
    except OSError as exc:
        raise ConfigError(str(fleet_path), f"cannot read: {exc.strerror or exc}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(str(fleet_path), str(exc)) from None
    chosen = _pool(fleet, pool, str(fleet_path))
    lines: list[str] = []
    for path in segment_paths(root):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(str(path), f"cannot read: {exc.strerror or exc}") from None
        for line in text.splitlines():
            if line.strip() and _decoded_pool(line, str(path)) in ("", chosen.model):
                lines.append(line)
    if not lines:
        raise ConfigError(directory, f"no recorded request of pool {chosen.model}")
    return Recording(parse_trace(lines, directory, "mooncake"), chosen, fleet)


def _decoded_pool(line: str, source: str) -> str:
    try:
        return _pool_of.decode(line).model
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(source, str(exc)) from None


def _pool(fleet: FleetFile, pool: str | None, source: str) -> FleetPool:
    models = [p.model for p in fleet.pools]
    if pool is None:
        if len(models) != 1:
            found = f"pools {', '.join(models)}" if models else "no pool"
            raise ConfigError(source, f"{found}: name the one to replay with --pool")
        return fleet.pools[0]
    for candidate in fleet.pools:
        if candidate.model == pool:
            return candidate
    raise UnknownConfigEntryError("pool", pool, models, "--pool")


def calibrated_slowdown(ttft_factor: float, itl_factor: float) -> float:
    return math.sqrt(ttft_factor * itl_factor)


def recorded_cluster(
    recording: Recording,
    catalog: Catalog,
    source: str,
    failures: Sequence[tuple[str, float]] = (),
    **settings: float,
) -> tuple[ClusterConfig, list[SimReplica]]:
    """The recorded pool as a simulated cluster, calibrated, by the gateway's replica
    names; ``failures`` are ``(replica, at_s)`` events, checked like a cluster file's."""
    pool, fleet = recording.pool, recording.fleet
    if not pool.replicas:
        raise ConfigError(source, "the recorded pool had no replica", f"pool {pool.model}")
    groups = [
        ReplicaGroup(
            gpu=r.gpu,
            model=r.cost_model,
            tp=r.tp,
            name=r.name,
            slowdown=calibrated_slowdown(r.ttft_factor, r.itl_factor),
            weight=r.weight,
            max_queue=r.max_queue,
            usd_per_hour=r.usd_per_hour,
            groups=r.groups,
        )
        for r in pool.replicas
    ]
    names = {f"{r.name}-0": r.name for r in pool.replicas}  # one replica per group
    for name, at_s in failures:
        if name not in names.values() or at_s < 0:
            valid = ", ".join(names.values())
            raise ConfigError("--fail", f"{name}@{at_s:g}: replicas are {valid}, times >= 0")
    cluster = ClusterConfig(
        replicas=groups,
        served_model=pool.model,
        scrape_interval_ms=fleet.scrape_interval_ms,
        queue_size=fleet.queue_size,
        queue_timeout_ms=fleet.queue_timeout_ms,
        max_retries=fleet.max_retries,
    )
    cluster = with_settings(cluster, source, **settings)
    replicas = resolve_cluster(cluster, catalog)
    named = [dataclasses.replace(r, replica_id=names[r.replica_id]) for r in replicas]
    events = [ClusterEvent(at_s=at_s, replica=name, action="fail") for name, at_s in failures]
    return msgspec.structs.replace(cluster, events=events), named  # by the gateway's names
