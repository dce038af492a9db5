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

One factor on every step keeps the recorded GPU's ratio of prefill to decode time, which
a replica that is not that GPU does not have (a CPU serving a tiny model: its prefill is
no dearer than a decode step, its time is its framework's). So, when asked
(``fit_prefill``, ``sim --from-record --fit-prefill``), further rounds fit each
replica's prefill overhead (the cost model's fixed time per prefill chunk) beside its
slowdown: the recorded TTFTs of the requests that met their replica least loaded
(``light_requests``: the fewest of its requests in flight when they arrived, so their TTFT
is service, not queueing) against the replay's TTFTs of the same requests; the median gap
moves the overhead along the secant of the last two rounds (``_secant``). A prefill 60 ms
dearer per chunk than the GPU's is found to 1%, an engine that matches its GPU keeps 3 ms
(``tests/unit/sim/test_sim_twin.py``). TTFT under load, the tails and goodput stay
predictions. Not by default: the light requests' TTFT also holds what is not the
engine's (the gateway, HTTP, the client), which the fit turns into engine time that
keeps the replica busy; on a fast rig that flipped a replay's verdict (shadow
evaluation's test: equal_cost predicted +23% and +30% P99 TTFT against round_robin,
where without the fit it predicts -16% to -29%, the live direction).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from random import Random

import msgspec

from isocost.core.bounds import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Bounds, check_fields
from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.errors import ConfigError
from isocost.core.jsontext import UNDECODABLE
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
    "light_requests",
    "load_recording",
    "recorded_cluster",
]


_outcome = msgspec.json.Decoder(RecordedRequest)
# fleet.json's numbers, checked when it is read: a calibration factor below 0 has no square
# root (``calibrated_slowdown``), one of 0 makes a replica that takes no time.
_FLEET_BOUNDS: dict[str, Bounds] = {
    "scrape_interval_ms": NON_NEGATIVE,
    "queue_size": NON_NEGATIVE,
    "queue_timeout_ms": POSITIVE,
    "max_retries": NON_NEGATIVE,
}
_REPLICA_BOUNDS: dict[str, Bounds] = {
    "tp": AT_LEAST_ONE,
    "weight": POSITIVE,
    "max_queue": NON_NEGATIVE,
    "usd_per_hour": NON_NEGATIVE,
    "ttft_factor": POSITIVE,
    "itl_factor": POSITIVE,
}
_FIT_ROUNDS = 3  # slowdowns alone
_PREFILL_ROUNDS = 5  # then slowdowns and prefill overheads
_FIT_STEP = (0.25, 4.0)  # bounds of one round's slowdown correction
_LIGHT_MIN = 3  # light requests per replica, at least (fewer: its whole next load level)


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
    except (*UNDECODABLE, msgspec.ValidationError) as exc:  # nested too deep included
        raise ConfigError(str(fleet_path), str(exc)) from None
    check_fields(fleet, _FLEET_BOUNDS, str(fleet_path))
    for i, recorded_pool in enumerate(fleet.pools):
        for j, replica in enumerate(recorded_pool.replicas):
            check_fields(replica, _REPLICA_BOUNDS, str(fleet_path), f"pools[{i}].replicas[{j}]")
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
            except (*UNDECODABLE, msgspec.ValidationError) as exc:
                raise ConfigError(f"{path}:{number}", str(exc)) from None
            if outcome.model == chosen.model:
                lines.append(line)
                outcomes.append(outcome)
    if not lines:
        raise ConfigError(directory, f"no recorded request of pool {chosen.model}")
    return Recording(parse_trace(lines, directory, "mooncake"), outcomes, chosen, fleet)


def recorded_catalog(recording: Recording, catalog: Catalog, source: str) -> Catalog:
    """``catalog`` with the GPUs the recording's gateway described itself (its
    ``--catalog``, an ``isocost profile`` entry), so a replay prices the replicas as the
    gateway did, unless ``catalog`` describes that id otherwise than isocost ships it
    (the replay's own ``--catalog`` has the last word); ``source``: the recording."""
    if recording.fleet.catalog is None:
        return catalog
    recorded = Catalog().merged(recording.fleet.catalog, f"{source}/{FLEET_FILE}")
    shipped = Catalog.builtin().gpus
    given = {g: spec for g, spec in catalog.gpus.items() if shipped.get(g) != spec}
    return Catalog({**catalog.gpus, **recorded.gpus, **given}, dict(catalog.models))


def calibrated_slowdown(ttft_factor: float, itl_factor: float) -> float:
    return math.sqrt(ttft_factor * itl_factor)


def recorded_cluster(
    recording: Recording,
    catalog: Catalog,
    source: str,
    failures: Sequence[tuple[str, float]] = (),
    *,
    fit: bool = True,
    fit_prefill: bool = False,
    settings: Mapping[str, float] | None = None,
) -> tuple[ClusterConfig, list[SimReplica]]:
    """The recorded pool as a simulated cluster, calibrated (``fit``: refined by
    ``fit_slowdowns``, with prefill overheads too when ``fit_prefill``), by the gateway's
    replica names; ``failures`` are ``(replica, at_s)`` events, checked like a cluster
    file's."""
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
        named = fit_slowdowns(recording, cluster, named, fit_prefill=fit_prefill)
    events = [ClusterEvent(at_s=at_s, replica=name, action="fail") for name, at_s in failures]
    return msgspec.structs.replace(cluster, events=events), named  # by the gateway's names


def fit_slowdowns(
    recording: Recording,
    cluster: ClusterConfig,
    replicas: list[SimReplica],
    seed: int = 0,
    *,
    fit_prefill: bool = False,
) -> list[SimReplica]:
    """``replicas`` with slowdowns (and, ``fit_prefill``, prefill overheads) fitted to the
    recording (module docstring): replicas that showed no streamed request keep their
    slowdown, those with no light request their prefill overhead. Slowdowns first, alone;
    then both."""
    tried: dict[str, tuple[float, float]] = {}  # replica: (overhead s, its TTFT gap ms)
    outcomes = recording.outcomes
    live = _median_tpot((o.replica, o.e2e_ms, o.ttft_ms, o.output_tokens) for o in outcomes)
    light = light_requests(outcomes) if fit_prefill else {}
    if not live and not light:
        return replicas  # nothing recorded to fit to
    for round_ in range(_FIT_ROUNDS + (_PREFILL_ROUNDS if fit_prefill else 0)):
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
        replayed_ttft_ms = {
            r.request.request_id: 1000 * (r.first_token_s - r.request.arrival_s)
            for r in result.records
            if r.first_token_s is not None
        }
        low, high = _FIT_STEP
        fitted = []
        for r in replicas:
            gaps_ms = [
                ttft_ms - replayed_ttft_ms[i]
                for i in light.get(r.replica_id, ())
                if i in replayed_ttft_ms and (ttft_ms := outcomes[i].ttft_ms) is not None
            ]
            if gaps_ms and round_ >= _FIT_ROUNDS:
                r = _with_prefill_overhead(r, _secant(r, statistics.median(gaps_ms), tried))
            if r.replica_id in live and replayed.get(r.replica_id, 0) > 0:
                ratio = live[r.replica_id] / replayed[r.replica_id]
                r = dataclasses.replace(r, slowdown=r.slowdown * min(high, max(low, ratio)))
            fitted.append(r)
        replicas = fitted
    return replicas


def light_requests(outcomes: Sequence[RecordedRequest]) -> dict[str, list[int]]:
    """Per replica, the indices in ``outcomes`` of its least loaded requests with a
    TTFT. Least loaded: the fewest other requests of the same replica in flight (arrived
    no later, not finished) when each arrived; at least ``_LIGHT_MIN`` of them where the
    replica has as many, taking the next load levels whole."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for o in outcomes:
        if o.replica is not None:
            spans.setdefault(o.replica, []).append((o.timestamp, o.timestamp + o.e2e_ms))
    levels: dict[str, dict[int, list[int]]] = {}
    for index, o in enumerate(outcomes):
        if o.replica is None or o.ttft_ms is None:
            continue
        busy = sum(start <= o.timestamp < end for start, end in spans[o.replica]) - 1
        levels.setdefault(o.replica, {}).setdefault(busy, []).append(index)
    light: dict[str, list[int]] = {}
    for replica, by_busy in levels.items():
        chosen: list[int] = []
        for busy in sorted(by_busy):
            if len(chosen) >= _LIGHT_MIN:
                break
            chosen.extend(by_busy[busy])
        light[replica] = chosen
    return light


def _secant(replica: SimReplica, gap_ms: float, tried: dict[str, tuple[float, float]]) -> float:
    """The next prefill overhead (s) of ``replica``, whose light requests came out
    ``gap_ms`` (median) faster in the replay than live: along the secant through this
    round and the one before it (``tried``, updated); in the first round, or where the
    secant does not fall, along the cost model's own slope (one chunk's overhead,
    stretched by the slowdown)."""
    overhead_s = replica.cost_model.gpu.prefill_overhead_s
    slope = -1000 * replica.slowdown  # gap ms per s of overhead
    if replica.replica_id in tried:
        before_s, before_ms = tried[replica.replica_id]
        if overhead_s != before_s and (gap_ms - before_ms) / (overhead_s - before_s) < 0:
            slope = (gap_ms - before_ms) / (overhead_s - before_s)
    tried[replica.replica_id] = (overhead_s, gap_ms)
    return max(0.0, overhead_s - gap_ms / slope)


def _with_prefill_overhead(replica: SimReplica, overhead_s: float) -> SimReplica:
    cost = replica.cost_model
    gpu = dataclasses.replace(cost.gpu, prefill_overhead_s=overhead_s)
    fitted = CostModel(
        cost.model,
        gpu,
        cost.tensor_parallel,
        weight_dtype=cost.weight_dtype,
        kv_dtype=cost.kv_dtype,
        limits=cost.limits,
    )
    return dataclasses.replace(replica, cost_model=fitted)


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
