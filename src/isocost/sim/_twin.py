"""A recording (``isocost serve --record DIR``) as the simulator's workload and fleet.

The trace is every segment's lines of one pool, in arrival order (the Mooncake loader
reads them). The fleet is ``fleet.json``'s pool as it was when the recording last wrote
it: each replica by its gateway name, GPU, ``tp``, cost model, weight, price, groups and
``max_queue``, with the gateway's queue and retries. ``failures`` add what-if events: a
replica that fails at a time.

Calibration: each replica's ``slowdown`` (the simulator's one factor on every step time)
is learned from the recording. It starts from the gateway's factors (the geometric mean of
its TTFT and ITL factors, observed over predicted), then ``fit_slowdowns`` replays the
recording with the policy it ran and scales each replica's slowdown by the ratio of the
median TPOT it showed live to the one it shows in the replay, a few rounds. Why not the
gateway's factors alone: they are ratios to the gateway's own predictions (its shadow
state included), not step times. An engine slowed 2x on purpose was learned as 1.46
(TTFT) and 1.63 (ITL), its twin as 1.09 and 0.70; replayed at those speeds TTFT p50 came
out 36% low, while the fit found 2.00 and 1.00 and matched live to 3%
(``benchmarks/twin.py``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from random import Random

import msgspec

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.runtime.recording import (
    FLEET_FILE,
    FleetFile,
    FleetPool,
    RecordedRequest,
    segment_paths,
)
from isocost.scheduling.policies import build_policy
from isocost.sim._cluster import (
    ClusterConfig,
    ClusterEvent,
    ReplicaGroup,
    SimReplica,
    named_pool,
    resolve_cluster,
    served_model,
    with_settings,
)
from isocost.sim._core import Simulator
from isocost.workload import WorkloadRequest, parse_trace

__all__ = [
    "Recording",
    "calibrated_slowdown",
    "fit_slowdowns",
    "load_recording",
    "recorded_cluster",
]


_outcome = msgspec.json.Decoder(RecordedRequest)
_FIT_ROUNDS = 3
_FIT_STEP = (0.25, 4.0)  # bounds of one round's correction


@dataclasses.dataclass(frozen=True, slots=True)
class Recording:
    """One pool of a recording: its requests, what became of them live, its fleet and
    the policy it ran."""

    requests: list[WorkloadRequest]
    outcomes: list[RecordedRequest]
    pool: FleetPool
    fleet: FleetFile

    @property
    def has_deadlines(self) -> bool:
        """Whether clients sent deadlines or TPOT targets (SLO admission saw them)."""
        return any(o.deadline_ms is not None or o.tpot_ms is not None for o in self.outcomes)


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
    chosen = named_pool(fleet.pools, pool, str(fleet_path), "replay")
    lines: list[str] = []
    outcomes: list[RecordedRequest] = []
    for path in segment_paths(root):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(str(path), f"cannot read: {exc.strerror or exc}") from None
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                outcome = _outcome.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ConfigError(f"{path}:{number}", str(exc)) from None
            if outcome.model == chosen.model:
                lines.append(line)
                outcomes.append(outcome)
    if not lines:
        raise ConfigError(directory, f"no recorded request of pool {chosen.model}")
    return Recording(parse_trace(lines, directory, "mooncake"), outcomes, chosen, fleet)


def calibrated_slowdown(ttft_factor: float, itl_factor: float) -> float:
    return math.sqrt(ttft_factor * itl_factor)


def recorded_cluster(
    recording: Recording,
    catalog: Catalog,
    source: str,
    failures: Sequence[tuple[str, float]] = (),
    *,
    fit: bool = True,
    settings: Mapping[str, float] | None = None,
) -> tuple[ClusterConfig, list[SimReplica]]:
    """The recorded pool as a simulated cluster, calibrated (``fit``: refined by
    ``fit_slowdowns``), by the gateway's replica names; ``failures`` are ``(replica,
    at_s)`` events, checked like a cluster file's."""
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
    cluster = with_settings(cluster, source, **(settings or {}))
    replicas = resolve_cluster(cluster, catalog)
    named = [dataclasses.replace(r, replica_id=names[r.replica_id]) for r in replicas]
    if fit:
        named = fit_slowdowns(recording, cluster, named)
    events = [ClusterEvent(at_s=at_s, replica=name, action="fail") for name, at_s in failures]
    return msgspec.structs.replace(cluster, events=events), named  # by the gateway's names


def fit_slowdowns(
    recording: Recording, cluster: ClusterConfig, replicas: list[SimReplica], seed: int = 0
) -> list[SimReplica]:
    """``replicas`` with slowdowns fitted to the recording (module docstring): replicas
    that showed no streamed request keep theirs."""
    live = _median_tpot(
        (o.replica, o.e2e_ms, o.ttft_ms, o.output_tokens) for o in recording.outcomes
    )
    for _ in range(_FIT_ROUNDS):
        policy = build_policy(recording.pool.policy, rng=Random(seed), source="fleet.json")
        served = served_model(cluster)
        result = Simulator(cluster, replicas, policy, recording.requests, model=served).run()
        replayed = _median_tpot(
            (
                r.replica_id,
                None if r.finished_s is None else 1000 * (r.finished_s - r.request.arrival_s),
                None if r.first_token_s is None else 1000 * (r.first_token_s - r.request.arrival_s),
                r.output_tokens,
            )
            for r in result.records
        )
        low, high = _FIT_STEP
        replicas = [
            dataclasses.replace(
                r,
                slowdown=r.slowdown
                * min(high, max(low, live[r.replica_id] / replayed[r.replica_id])),
            )
            if r.replica_id in live and replayed.get(r.replica_id, 0) > 0
            else r
            for r in replicas
        ]
    return replicas


def _median_tpot(
    rows: Iterable[tuple[str | None, float | None, float | None, int]],
) -> dict[str, float]:
    """Per replica, the median time per output token after the first, of its requests
    with a first token and more than one token."""
    tpots: dict[str, list[float]] = {}
    for replica, e2e_ms, ttft_ms, tokens in rows:
        if replica is None or e2e_ms is None or ttft_ms is None or tokens < 2:
            continue
        tpots.setdefault(replica, []).append((e2e_ms - ttft_ms) / (tokens - 1))
    return {name: statistics.median(values) for name, values in tpots.items()}
