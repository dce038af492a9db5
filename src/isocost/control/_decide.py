"""Desired replicas per GPU type, and which replicas to start, undrain or drain.

Both scalers see the same ``Observation`` each interval and return a ``ScaleDecision``;
actuators only apply it (DESIGN §7).

``Autoscaler`` (isocost):

1. **Forecast**: the peak arrival rate over the horizon, the longest warm-up lead of any
   pool plus one interval (``DemandForecast.peak``): what is started now serves then.
2. **Need** = forecast x (1 + headroom), in requests/s; a pool's replicas supply their
   capacity each (``CapacityEstimate``). Pending replicas count: they are ready by then.
3. **Reactive guard**: a queue above ``queue_per_replica`` per ready replica that grew
   over ``guard_window_s``, or SLO attainment over that window below target by more than
   chance explains (``attainment_verdict``), raises the need to what the ready replicas
   supply plus headroom, plus enough to clear the queue within one lead.
4. **Up**: replicas are added cheapest $ per unit of goodput first (``usd_per_hour /
   capacity``), within each pool's max and the GPU and $ budgets, at most once per
   ``scale_up_cooldown_s`` (pool minimums apply at once), and at least ``scale_step`` of
   the active fleet at a time: fewer, larger scale events.
5. **In**: only when the need over the last ``scale_in_after_s`` (its maximum) stayed below
   what the fleet minus some replicas supplies, and so does the forecast over the next two
   horizons (a replica removed now could be routable again only a lead after it is
   started again: one the forecast wants back within that is kept, not flapped), and
   neither cool-down is running; the dearest are removed first, never below a pool's min,
   and only once ``scale_step`` of the fleet can go (or what is left above the minimums).

``HpaScaler`` is the reactive baseline: Kubernetes' ``desired = ceil(current x metric /
target)`` on queue length per replica, a 10% tolerance, the default scale-up limit (double
or +4 per 15 s) and a scale-down stabilization window (the highest desire in it wins).

``plan_changes`` turns targets into actions: draining replicas of a pool that must grow are
undrained first (they are warm), then new ones started; a pool that must shrink loses its
pending replicas first (they serve nothing yet), then its ready ones with the least work
in flight, newest first. Ejected replicas (held out by the gateway's
breaker for longer than the loop's ``replace_ejected_after_s``) are neither capacity nor
victims: the pool grows to replace them, within its max counting them, and one that
recovers is ready again, so the scale-in that follows removes the surplus.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from isocost.control._config import AutoscaleConfig
from isocost.control._estimates import CapacityEstimate, WarmupLead
from isocost.control._forecast import DemandForecast, Forecast

__all__ = [
    "Autoscaler",
    "HpaScaler",
    "Observation",
    "PoolOffer",
    "ReplicaState",
    "ReplicaStatus",
    "ScaleDecision",
    "Scaler",
    "attainment_verdict",
    "plan_changes",
]

# ``ejected``: its gateway's breaker has held it out of traffic for a while (the loop
# decides how long): it serves nothing, so it is no capacity and is replaced, but its GPUs
# are still held, so it counts against the pool's max and the budgets.
ReplicaState = Literal["pending", "ready", "ejected", "draining"]
_MIN_SETTLED = 50
_MISS_Z = 1.645  # one-sided 95%: how sure a window's shortfall must be to count as a miss


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    replica_id: str
    gpu: str
    state: ReplicaState
    started_s: float
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    """The fleet and its traffic over the interval that ends at ``now``."""

    now: float
    interval_s: float
    arrivals: int
    queued: int  # waiting at the gateway and in the engines
    attainment: float | None  # share of requests settled in the interval that met the SLO
    settled: int  # how many settled (attainment of a handful says little)
    completions: Mapping[str, int]  # per GPU type
    replicas: Sequence[ReplicaStatus]


@dataclass(frozen=True, slots=True)
class PoolOffer:
    """What one replica of a GPU type costs and gives."""

    gpu: str
    gpus_per_replica: int
    usd_per_hour: float  # per replica
    capacity_rps: float  # the planner's figure at the SLOs


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    now: float
    targets: dict[str, int]  # replicas per GPU type, ready + pending
    start: dict[str, int] = field(default_factory=dict)
    undrain: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()
    forecast_rps: float = 0.0
    need_rps: float = 0.0
    horizon_s: float = 0.0
    reason: str = "hold"

    @property
    def changes(self) -> bool:
        return bool(self.start or self.undrain or self.drain)


class Scaler(Protocol):
    def decide(self, observation: Observation) -> ScaleDecision: ...

    def replica_ready(self, gpu: str, lead_s: float) -> None:
        """A replica of ``gpu`` became routable ``lead_s`` after its start."""
        ...


def _active(replicas: Sequence[ReplicaStatus], gpu: str) -> int:
    """Replicas that serve or will: neither leaving nor held out by their breaker."""
    return sum(1 for r in replicas if r.gpu == gpu and r.state in ("ready", "pending"))


def _count(replicas: Sequence[ReplicaStatus], gpu: str, state: ReplicaState) -> int:
    return sum(1 for r in replicas if r.gpu == gpu and r.state == state)


class Autoscaler:
    """isocost's predictive scaler (see the module docstring)."""

    def __init__(
        self,
        config: AutoscaleConfig,
        offers: Sequence[PoolOffer],
        history: Sequence[tuple[float, float]] = (),
        forecast: Forecast | None = None,
    ) -> None:
        """``history``: earlier (time, rate) measurements, fed to the forecast first;
        ``forecast``: another forecast than ``DemandForecast`` over the config's season."""
        by_gpu = {o.gpu: o for o in offers}
        missing = [p.gpu for p in config.pools if p.gpu not in by_gpu]
        if missing:
            raise ValueError(f"no replica offer for pool {', '.join(missing)}")
        self.config = config
        self.offers = [by_gpu[p.gpu] for p in config.pools]
        self.forecast = DemandForecast(config.season_s) if forecast is None else forecast
        for at_s, rate in history:
            self.forecast.observe(at_s, rate)
        self.lead = WarmupLead({p.gpu: p.cold_start_s for p in config.pools})
        self.capacity = CapacityEstimate({o.gpu: o.capacity_rps for o in self.offers})
        self._queue: deque[tuple[float, int]] = deque()
        self._settled: deque[tuple[float, int, int]] = deque()  # (now, settled, met)
        self._need: deque[tuple[float, float]] = deque()
        self._last_up = -math.inf
        self._last_down = -math.inf

    def replica_ready(self, gpu: str, lead_s: float) -> None:
        self.lead.observe(gpu, lead_s)

    def decide(self, observation: Observation) -> ScaleDecision:
        cfg, now = self.config, observation.now
        active = {o.gpu: _active(observation.replicas, o.gpu) for o in self.offers}
        ready = {o.gpu: _count(observation.replicas, o.gpu, "ready") for o in self.offers}
        ejected = {o.gpu: _count(observation.replicas, o.gpu, "ejected") for o in self.offers}
        self.forecast.observe(now, observation.arrivals / observation.interval_s)
        total_ready = sum(ready.values())
        saturated = observation.queued > cfg.queue_per_replica * max(total_ready, 1)
        met = self._recent_verdict(observation)
        if met is not None:
            self._learn_capacity(observation, ready, met)
        horizon = max(self.lead.lead_s(o.gpu) for o in self.offers) + cfg.interval_s
        forecast = self.forecast.peak(now, horizon)
        need = forecast * (1 + cfg.headroom)
        reason = "forecast"
        if self._guard(observation, saturated, met):
            backlog = observation.queued / horizon
            guarded = (
                self._supply(ready) * (1 + cfg.headroom)
                + backlog
                + max(self.forecast.slope(), 0.0) * horizon
            )
            if guarded > need:
                need, reason = guarded, "guard"
        targets = self._bounded(dict(active), ejected)
        if targets != active:
            reason = "bounds"
        if need > self._supply(targets):
            if now - self._last_up >= cfg.scale_up_cooldown_s:
                targets = self._grow(targets, need, self._least_step(active), ejected)
        elif targets == active:
            ahead = self.forecast.peak(now, 2 * horizon) * (1 + cfg.headroom)
            targets = self._shrink(targets, now, max(need, ahead), self._least_step(active))
            reason = "scale-in"
        self._remember_need(now, need)
        decision = plan_changes(now, targets, observation.replicas)
        if decision.start or decision.undrain:
            self._last_up = now
        if decision.drain:
            self._last_down = now
        return ScaleDecision(
            now,
            targets,
            decision.start,
            decision.undrain,
            decision.drain,
            forecast_rps=forecast,
            need_rps=need,
            horizon_s=horizon,
            reason=reason if decision.changes else "hold",
        )

    def _learn_capacity(
        self, observation: Observation, ready: Mapping[str, int], met: bool
    ) -> None:
        """Teach ``CapacityEstimate`` each pool's load in the interval: what its replicas
        served, or, for a miss, what they were offered where that was more (the arrivals
        shared in proportion to the pools' capacity). Requests that arrive faster than
        the fleet serves queue, and miss later at whatever rate the fleet then serves:
        judged at that rate, a ramp's backlog read as capacity lost, and the estimate,
        which learns upward only from loads above it, stayed low for the rest of the day."""
        interval, supply = observation.interval_s, self._supply(ready)
        for o in self.offers:
            if ready[o.gpu]:
                served = observation.completions.get(o.gpu, 0) / interval / ready[o.gpu]
                share = self.capacity.rps(o.gpu) / supply
                offered = observation.arrivals / interval * share
                self.capacity.observe(o.gpu, served if met else max(served, offered), met)

    def _recent_verdict(self, observation: Observation) -> bool | None:
        """``attainment_verdict`` over the guard window."""
        now = observation.now
        met = round((observation.attainment or 0.0) * observation.settled)
        self._settled.append((now, observation.settled, met))
        while self._settled[0][0] <= now - self.config.guard_window_s:
            self._settled.popleft()
        settled = sum(s for _, s, _ in self._settled)
        met = sum(m for _, _, m in self._settled)
        return attainment_verdict(met, settled, self.config.attainment_target)

    def _guard(self, observation: Observation, saturated: bool, met: bool | None) -> bool:
        """Sustained queue growth, or attainment surely below target: scale up now."""
        cfg, now = self.config, observation.now
        self._queue.append((now, observation.queued))
        while self._queue and self._queue[0][0] < now - cfg.guard_window_s:
            self._queue.popleft()
        first_t, first_q = self._queue[0]
        growing = (
            saturated
            and now - first_t >= cfg.guard_window_s - 1e-9
            and observation.queued > first_q
        )
        return growing or met is False

    def _supply(self, counts: Mapping[str, int]) -> float:
        return sum(counts[o.gpu] * self.capacity.rps(o.gpu) for o in self.offers)

    def _bounded(self, targets: dict[str, int], held: Mapping[str, int]) -> dict[str, int]:
        """Each pool within its min and max. Ejected replicas (``held``) hold GPUs, so
        they count against the max when the pool would grow, but never make it drain a
        replica that serves."""
        for pool in self.config.pools:
            current = targets[pool.gpu]
            ceiling = max(pool.max - held[pool.gpu], min(current, pool.max))
            targets[pool.gpu] = min(max(current, pool.min), ceiling)
        return targets

    def _within_budget(self, targets: Mapping[str, int], held: Mapping[str, int]) -> bool:
        cfg = self.config
        gpus = sum((targets[o.gpu] + held[o.gpu]) * o.gpus_per_replica for o in self.offers)
        usd = sum((targets[o.gpu] + held[o.gpu]) * o.usd_per_hour for o in self.offers)
        return (cfg.max_gpus is None or gpus <= cfg.max_gpus) and (
            cfg.max_usd_per_hour is None or usd <= cfg.max_usd_per_hour + 1e-9
        )

    def _by_value(self) -> list[PoolOffer]:
        """Cheapest $ per unit of goodput first."""
        return sorted(self.offers, key=lambda o: (o.usd_per_hour / self.capacity.rps(o.gpu), o.gpu))

    def _least_step(self, active: Mapping[str, int]) -> int:
        """The fewest replicas one scale event moves (``scale_step`` of the fleet)."""
        return max(1, math.ceil(self.config.scale_step * sum(active.values()) - 1e-9))

    def _grow(
        self, targets: dict[str, int], need: float, least: int, held: Mapping[str, int]
    ) -> dict[str, int]:
        limits = {p.gpu: p.max - held[p.gpu] for p in self.config.pools}
        added = 0
        for offer in self._by_value():
            while targets[offer.gpu] < limits[offer.gpu] and (
                added < least or self._supply(targets) < need
            ):
                targets[offer.gpu] += 1
                added += 1
                if not self._within_budget(targets, held):
                    targets[offer.gpu] -= 1
                    added -= 1
                    break
        return targets

    def _shrink(
        self, targets: dict[str, int], now: float, need: float, least: int
    ) -> dict[str, int]:
        """Remove the dearest replicas that neither ``need`` nor the need of the whole
        scale-in window uses, once at least ``least`` of them can go (or all that are
        above the pools' minimums)."""
        cfg = self.config
        window = [n for t, n in self._need if t >= now - cfg.scale_in_after_s]
        sustained = bool(self._need) and self._need[0][0] <= now - cfg.scale_in_after_s
        if (
            not sustained
            or min(now - self._last_down, now - self._last_up) < cfg.scale_down_cooldown_s
        ):
            return targets
        peak = max([need, *window])
        floors = {p.gpu: p.min for p in cfg.pools}
        shrunk = dict(targets)
        for offer in reversed(self._by_value()):
            while shrunk[offer.gpu] > floors[offer.gpu]:
                shrunk[offer.gpu] -= 1
                if self._supply(shrunk) < peak:
                    shrunk[offer.gpu] += 1
                    break
        removed = sum(targets.values()) - sum(shrunk.values())
        at_floors = shrunk == floors
        return shrunk if removed >= least or at_floors else targets

    def _remember_need(self, now: float, need: float) -> None:
        self._need.append((now, need))
        while len(self._need) > 1 and self._need[1][0] <= now - self.config.scale_in_after_s:
            self._need.popleft()


def attainment_verdict(met: int, settled: int, target: float) -> bool | None:
    """Whether ``met`` of ``settled`` requests met the attainment ``target`` (True),
    missed it (False), or cannot tell (None): fewer than ``_MIN_SETTLED`` settled, or
    below the target by no more than chance explains.

    A miss must be sure: the Wilson score bound of the true attainment (one-sided 95%)
    lies below the target. At a 98% target, a fleet that truly meets 98.5% shows 3 or
    more misses in one window of 100 requests in five. Taken as misses, those scaled
    quiet fleets up and ratcheted the capacity estimate down, which learns from misses
    below it and seldom sees the fleet run above it to undo that: on a four-hour day of
    ``benchmarks/autoscale.py``, 0.138 req/s per replica where 0.168 is sustained.
    """
    if settled < _MIN_SETTLED:
        return None
    share = met / settled
    if share >= target:
        return True
    z2 = _MISS_Z * _MISS_Z
    spread = _MISS_Z * math.sqrt(share * (1 - share) / settled + z2 / (4 * settled * settled))
    upper = (share + z2 / (2 * settled) + spread) / (1 + z2 / settled)
    return False if upper < target else None


class HpaScaler:
    """Kubernetes' HorizontalPodAutoscaler on queue length (see the module docstring)."""

    TOLERANCE = 0.1
    UP_PERIOD_S = 15.0

    def __init__(
        self,
        gpu: str,
        min_replicas: int,
        max_replicas: int,
        queue_target_per_replica: float,
        stabilization_s: float = 300.0,
    ) -> None:
        self.gpu = gpu
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.target = queue_target_per_replica
        self.stabilization_s = stabilization_s
        self._desires: deque[tuple[float, int]] = deque()
        self._last_up = -math.inf

    def replica_ready(self, gpu: str, lead_s: float) -> None:
        """HPA does not learn from warm-up times."""

    def decide(self, observation: Observation) -> ScaleDecision:
        now = observation.now
        current = _active(observation.replicas, self.gpu)
        ratio = observation.queued / max(current, 1) / self.target
        desired = current
        if abs(ratio - 1) > self.TOLERANCE:
            desired = math.ceil(current * ratio - 1e-9)
        desired = min(max(desired, self.min_replicas), self.max_replicas)
        self._desires.append((now, desired))
        while self._desires[0][0] < now - self.stabilization_s:
            self._desires.popleft()
        if desired > current:
            if now - self._last_up < self.UP_PERIOD_S:
                desired = current
            else:
                desired = min(desired, max(2 * current, current + 4))
        else:
            desired = min(current, max(d for _, d in self._desires))  # stabilized
        decision = plan_changes(now, {self.gpu: desired}, observation.replicas)
        if decision.start or decision.undrain:
            self._last_up = now
        return ScaleDecision(
            now,
            decision.targets,
            decision.start,
            decision.undrain,
            decision.drain,
            reason="hpa" if decision.changes else "hold",
        )


def plan_changes(
    now: float, targets: Mapping[str, int], replicas: Sequence[ReplicaStatus]
) -> ScaleDecision:
    """The actions that take the fleet to ``targets`` (see the module docstring)."""
    start: dict[str, int] = {}
    undrain: list[str] = []
    drain: list[str] = []
    for gpu, target in targets.items():
        mine = [r for r in replicas if r.gpu == gpu]
        active = [r for r in mine if r.state in ("ready", "pending")]
        gap = target - len(active)
        if gap > 0:
            warm = sorted((r for r in mine if r.state == "draining"), key=lambda r: r.in_flight)
            back = [r.replica_id for r in warm[::-1][:gap]]
            undrain += back
            if gap > len(back):
                start[gpu] = gap - len(back)
        elif gap < 0:
            order = sorted(
                active,
                key=lambda r: (r.state != "pending", r.in_flight, -r.started_s, r.replica_id),
            )
            drain += [r.replica_id for r in order[:-gap]]
    return ScaleDecision(now, dict(targets), start, tuple(undrain), tuple(drain))
