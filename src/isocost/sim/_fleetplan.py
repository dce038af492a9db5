"""The cheapest fleet for a recording's traffic (``isocost plan --from-record``).

For each GPU type of the catalog (or those named) the smallest tensor parallelism that
holds the model, then the fewest replicas of it whose simulated replay of the recorded
traffic (times ``growth``: its time compressed) meets the SLOs for the target share of
requests, found by doubling and then bisection (more replicas never make it worse in
this model). The fleets found are priced per hour (a recorded replica's price for its GPU
type, else the catalog's) and the cheapest wins; the fleet one replica smaller of the
same type is reported beside it, as evidence that it does not meet them.

Calibration carries over: each candidate replica runs at the slowdown the recorded
replicas of its GPU type learned (``recorded_cluster``: the gateway's factors, fitted to
the recorded outcomes; their geometric mean), else at the recorded fleet's
(an engine the cost model misjudges everywhere, CPU vLLM say, is misjudged here too).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.errors import ConfigError
from isocost.core.planner import valid_tp_degrees
from isocost.core.slo import SloTargets
from isocost.files import resolve_model
from isocost.sim._cluster import ClusterConfig, ReplicaGroup, resolve_cluster
from isocost.sim._limits import MAX_REPLICAS
from isocost.sim._metrics import PolicySummary
from isocost.sim._run import SimPlan, run_plan
from isocost.sim._twin import Recording, recorded_cluster
from isocost.workload import speedup

__all__ = ["FleetPlan", "FleetTrial", "plan_fleet"]


@dataclass(frozen=True, slots=True)
class FleetTrial:
    """One simulated fleet: ``count`` replicas of ``tp`` x ``gpu``."""

    gpu: str
    tp: int
    count: int
    slowdown: float  # the learned one each replica runs at
    usd_per_hour: float
    summary: PolicySummary
    meets: bool
    tokens_per_s: float  # the replayed traffic's, prompt and output

    @property
    def usd_per_million_tokens(self) -> float | None:
        """$ per million tokens (prompt and output) of the replayed traffic."""
        per_hour = self.tokens_per_s * 3600 / 1e6
        return self.usd_per_hour / per_hour if per_hour > 0 else None


@dataclass(frozen=True, slots=True)
class FleetPlan:
    policy: str
    growth: float
    cheapest: FleetTrial | None  # None: no GPU type meets the SLOs within max_replicas
    smaller: FleetTrial | None  # the cheapest's type, one replica fewer
    best_per_gpu: list[FleetTrial]  # each type's smallest fleet meeting them, cheapest first
    unmet: list[str]  # GPU types that hold the model but miss the SLOs at max_replicas


def plan_fleet(
    recording: Recording,
    catalog: Catalog,
    slo: SloTargets,
    *,
    growth: float = 1.0,
    policy: str | None = None,
    gpus: Sequence[str] = (),
    max_replicas: int = 64,
    seed: int = 0,
    on_trial: Callable[[FleetTrial], None] | None = None,
) -> FleetPlan:
    """Sweep fleets (module docstring); ``on_trial`` sees each simulated one."""
    if not growth > 0 or not 1 <= max_replicas <= MAX_REPLICAS:
        raise ConfigError(
            "plan", f"--growth must be positive and --max-replicas in [1, {MAX_REPLICAS:,}]"
        )
    if not recording.pool.replicas:
        raise ConfigError("plan", "the recorded pool had no replica to learn a model from")
    name = policy or recording.pool.policy
    model_id = recording.pool.replicas[0].cost_model
    model = resolve_model(model_id, catalog)
    requests = list(speedup(recording.requests, growth))
    span_s = max(requests[-1].arrival_s - requests[0].arrival_s, 1e-9)
    tokens_per_s = sum(r.prompt_tokens + r.output_tokens for r in requests) / span_s
    slowdown = _learned_slowdowns(recording, catalog)
    prices = _recorded_prices(recording)
    trials: dict[tuple[str, int], FleetTrial] = {}

    def trial(gpu: str, tp: int, count: int) -> FleetTrial:
        if (gpu, count) not in trials:
            factor = slowdown.get(gpu, slowdown[""])
            group = ReplicaGroup(gpu=gpu, model=model_id, tp=tp, count=count, slowdown=factor)
            cluster = ClusterConfig(replicas=[group], served_model=recording.pool.model)
            plan = SimPlan(
                cluster=cluster,
                replicas=tuple(resolve_cluster(cluster, catalog)),
                requests=requests,
                policies=(name,),
                slo=slo,
                seed=seed,
                deadlines=recording.has_deadlines,
                jobs=1,
            )
            summary = run_plan(plan).runs[0].summary
            price = count * tp * prices.get(gpu, catalog.gpu(gpu).usd_per_hour)
            meets = summary.slo_attainment >= slo.share
            found = FleetTrial(gpu, tp, count, factor, price, summary, meets, tokens_per_s)
            trials[(gpu, count)] = found
            if on_trial is not None:
                on_trial(found)
        return trials[(gpu, count)]

    best: list[FleetTrial] = []
    unmet: list[str] = []
    for gpu in gpus or sorted(catalog.gpus):
        spec = catalog.gpu(gpu)
        tp = next(
            (
                t
                for t in valid_tp_degrees(model, spec)
                if CostModel(model, spec, t).kv_capacity_tokens > 0
            ),
            None,
        )
        if tp is None:
            continue
        found = _fewest(functools.partial(trial, spec.id, tp), max_replicas)
        if found is None:
            unmet.append(spec.id)
        else:
            best.append(found)
    best.sort(key=lambda t: (t.usd_per_hour, t.gpu))
    cheapest = best[0] if best else None
    smaller = None
    if cheapest is not None and cheapest.count > 1:
        smaller = trial(cheapest.gpu, cheapest.tp, cheapest.count - 1)
    return FleetPlan(name, growth, cheapest, smaller, best, unmet)


def _fewest(trial: Callable[[int], FleetTrial], max_replicas: int) -> FleetTrial | None:
    """The smallest count meeting the SLOs: doubling to a fleet that does, then bisection."""
    low, high = 0, 1  # low fails (0 replicas serve nothing), high is probed
    while not trial(high).meets:
        if high >= max_replicas:
            return None
        low, high = high, min(2 * high, max_replicas)
    while high - low > 1:
        middle = (low + high) // 2
        if trial(middle).meets:
            high = middle
        else:
            low = middle
    return trial(high)


def _learned_slowdowns(recording: Recording, catalog: Catalog) -> dict[str, float]:
    """Per recorded GPU type the geometric mean of its replicas' learned slowdowns; under
    ``""`` the whole recorded fleet's."""
    _, fitted = recorded_cluster(recording, catalog, "fleet.json")
    logs: dict[str, list[float]] = {"": []}
    for r, sim in zip(recording.pool.replicas, fitted, strict=True):
        value = math.log(sim.slowdown)
        logs.setdefault(r.gpu, []).append(value)
        logs[""].append(value)
    return {gpu: math.exp(sum(v) / len(v)) for gpu, v in logs.items() if v}


def _recorded_prices(recording: Recording) -> dict[str, float]:
    """$ per GPU-hour of each recorded GPU type, from what the gateway priced it at."""
    return {r.gpu: r.usd_per_hour / r.tp for r in recording.pool.replicas if r.usd_per_hour}
