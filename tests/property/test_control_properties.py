"""control/: whatever the traffic, decisions stay within the pools' bounds and the
budgets, and applying one reaches its targets exactly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.control import (
    AutoscaleConfig,
    Autoscaler,
    Observation,
    PoolConfig,
    PoolOffer,
    ReplicaStatus,
    ScaleDecision,
)

POOLS = [PoolConfig(gpu="cheap", min=1, max=6), PoolConfig(gpu="dear", min=0, max=10)]
OFFERS = [PoolOffer("cheap", 1, 1.0, 1.0), PoolOffer("dear", 2, 3.0, 2.0)]

ticks = st.lists(
    st.tuples(
        st.floats(0.0, 40.0),  # arrival rate
        st.integers(0, 200),  # queued
        st.one_of(st.none(), st.floats(0.0, 1.0)),  # attainment
        st.integers(0, 3),  # pending replicas that become ready this tick
    ),
    min_size=1,
    max_size=40,
)


def _apply(fleet: list[ReplicaStatus], decision: ScaleDecision, now: float) -> list[ReplicaStatus]:
    drained = set(decision.drain)
    back = set(decision.undrain)
    out = []
    for r in fleet:
        if r.replica_id in drained:
            if r.state == "ready":
                out.append(ReplicaStatus(r.replica_id, r.gpu, "draining", r.started_s))
        elif r.replica_id in back:
            out.append(ReplicaStatus(r.replica_id, r.gpu, "ready", r.started_s))
        else:
            out.append(r)
    for gpu, count in decision.start.items():
        out += [ReplicaStatus(f"{gpu}@{now}#{i}", gpu, "pending", now) for i in range(count)]
    return out


@settings(max_examples=60, deadline=None)
@given(ticks, st.integers(4, 30), st.floats(5.0, 60.0))
def test_decisions_respect_bounds_and_budgets(
    traffic: list[tuple[float, int, float | None, int]], max_gpus: int, max_usd: float
) -> None:
    config = AutoscaleConfig(
        pools=POOLS,
        max_gpus=max_gpus,
        max_usd_per_hour=max_usd,
        scale_in_after_s=30.0,
        scale_down_cooldown_s=15.0,
        scale_up_cooldown_s=0.0,
    )
    scaler = Autoscaler(config, OFFERS)
    fleet: list[ReplicaStatus] = []
    for i, (rate, queued, attainment, readied) in enumerate(traffic, start=1):
        now = 15.0 * i
        pending = [r for r in fleet if r.state == "pending"][:readied]
        fleet = [
            ReplicaStatus(r.replica_id, r.gpu, "ready", r.started_s) if r in pending else r
            for r in fleet
        ]
        fleet = [r for r in fleet if r.state != "draining" or i % 2]  # drains finish
        observation = Observation(
            now, 15.0, round(rate * 15), queued, attainment, 100, {}, list(fleet)
        )
        decision = scaler.decide(observation)
        fleet = _apply(fleet, decision, now)
        active = {
            g: sum(1 for r in fleet if r.gpu == g and r.state != "draining")
            for g in ("cheap", "dear")
        }
        assert active == decision.targets
        for pool in POOLS:
            assert pool.min <= active[pool.gpu] <= pool.max
        gpus = active["cheap"] * 1 + active["dear"] * 2
        usd = active["cheap"] * 1.0 + active["dear"] * 3.0
        floor_gpus, floor_usd = POOLS[0].min, POOLS[0].min * 1.0  # the minimums come first
        assert gpus <= max(max_gpus, floor_gpus) and usd <= max(max_usd, floor_usd) + 1e-9
        assert not (set(decision.drain) & set(decision.undrain))
