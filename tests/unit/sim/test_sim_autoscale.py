"""The simulator actuator: starts pay their cold start, a scale-in drains and kills
nothing, GPU-hours count every replica's time on, and the same inputs give the same run."""

from __future__ import annotations

from pathlib import Path
from random import Random

import pytest

from isocost.control import (
    AutoscaleConfig,
    Autoscaler,
    Observation,
    PoolConfig,
    PoolOffer,
    ScaleDecision,
    plan_changes,
)
from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.core.slo import SloTargets
from isocost.scheduling.policies import build_policy
from isocost.sim import (
    ClusterConfig,
    ReplicaGroup,
    SimAutoscaler,
    Simulator,
    autoscaled_cluster,
    met_slo,
    parse_autoscale_yaml,
    resolve_cluster,
    uniform_cluster,
)
from isocost.workload import WorkloadRequest, segments_for_blocks

GPU, MODEL = "a100-80g", "llama-3.1-8b"
SLO = SloTargets(ttft_s=2.0, tpot_s=0.1)
COLD_START_S = 60.0


class Scripted:
    """Targets by time, so the actuator is tested apart from any forecast."""

    def __init__(self, targets: list[tuple[float, int]]) -> None:
        self.targets = targets
        self.leads: list[float] = []
        self.seen: list[Observation] = []

    def replica_ready(self, gpu: str, lead_s: float) -> None:
        self.leads.append(lead_s)

    def decide(self, observation: Observation) -> ScaleDecision:
        self.seen.append(observation)
        target = [n for at_s, n in self.targets if at_s <= observation.now][-1]
        return plan_changes(observation.now, {GPU: target}, observation.replicas)


def _requests(rate: float, until_s: float, seed: int = 0) -> list[WorkloadRequest]:
    rng = Random(seed)
    out: list[WorkloadRequest] = []
    t = rng.expovariate(rate)
    while t < until_s:
        prompt = rng.randint(200, 1500)
        blocks = range(len(out) * 10, len(out) * 10 + 3)
        out.append(
            WorkloadRequest(
                len(out), t, prompt, rng.randint(50, 400), segments_for_blocks(blocks, prompt)
            )
        )
        t += rng.expovariate(rate)
    return out


def _run(scaler: Scripted | Autoscaler, work: list[WorkloadRequest], max_replicas: int = 6):
    group = ReplicaGroup(gpu=GPU, model=MODEL, count=max_replicas, cold_start_s=COLD_START_S)
    cluster = ClusterConfig(replicas=[group])
    replicas = resolve_cluster(cluster, Catalog.builtin())
    controller = SimAutoscaler(
        scaler, {GPU: replicas}, {GPU: 1}, SLO, interval_s=15.0, drain_deadline_s=600.0
    )
    simulator = Simulator(
        cluster,
        replicas,
        build_policy("equal_cost", rng=Random(0)),
        work,
        model=MODEL,
        controller=controller,
        dormant=controller.dormant,
    )
    return simulator.run(), controller


def test_starts_pay_the_cold_start_and_a_scale_in_kills_nothing() -> None:
    scaler = Scripted([(0.0, 1), (15.0, 4), (150.0, 1)])
    work = _requests(3.0, 240.0)
    result, controller = _run(scaler, work)
    assert scaler.leads == [COLD_START_S] * 3
    assert all(r.settled for r in result.records)
    assert not [r for r in result.records if r.rejected == "failed"]
    usage = controller.usage(240.0)
    assert usage.killed == 0 and usage.scale_events == 2
    by_time = {round(s.at_s): s for s in controller.timeline}
    assert (by_time[30].ready, by_time[30].pending) == (1, 3)
    assert by_time[90].ready == 4  # started at 15, routable at 75
    assert by_time[150].draining + by_time[150].ready == 4
    assert by_time[240].ready == 1 and by_time[240].draining == 0  # drained, then stopped
    # 1 replica all along, 3 more from their start to their stop (after 150, once idle)
    stops = max(s.at_s for s in controller.timeline if s.draining) + 15.0
    assert usage.gpu_hours == pytest.approx((240.0 + 3 * (stops - 15.0)) / 3600)
    assert usage.usd == pytest.approx(usage.gpu_hours * Catalog.builtin().gpu(GPU).usd_per_hour)
    assert usage.cold_gpu_hours == pytest.approx(3 * COLD_START_S / 3600)  # 3 starts, 1 GPU
    assert controller.usage(45.0).cold_gpu_hours == pytest.approx(3 * 30.0 / 3600)
    # drained replicas served work before they stopped: requests really went there
    served = {r.replica_id for r in result.records}
    assert len(served) == 4


def test_a_start_cancelled_while_pending_never_serves() -> None:
    scaler = Scripted([(0.0, 1), (15.0, 3), (30.0, 1)])
    result, controller = _run(scaler, _requests(1.0, 200.0))
    assert scaler.leads == []
    assert {r.replica_id for r in result.records} == {f"{MODEL}-{GPU}-tp1-0"}
    usage = controller.usage(200.0)
    assert usage.gpu_hours == pytest.approx((200.0 + 2 * 15.0) / 3600)
    assert usage.cold_gpu_hours == pytest.approx(2 * 15.0 / 3600)  # cold until cancelled


def test_the_autoscaler_follows_a_load_step_and_back_deterministically() -> None:
    low, high = _requests(0.5, 300.0, seed=1), _requests(6.0, 300.0, seed=2)
    work = [
        *low,
        *(
            WorkloadRequest(
                len(low) + r.request_id,
                300.0 + r.arrival_s,
                r.prompt_tokens,
                r.output_tokens,
                r.segments,
            )
            for r in high
        ),
    ]
    work += [
        WorkloadRequest(
            len(work) + i, 600.0 + r.arrival_s, r.prompt_tokens, r.output_tokens, r.segments
        )
        for i, r in enumerate(low)
    ]

    def once() -> tuple[object, ...]:
        config = AutoscaleConfig(
            pools=[PoolConfig(gpu=GPU, min=1, max=6, cold_start_s=COLD_START_S)],
            max_gpus=6,
            scale_in_after_s=60.0,
            scale_down_cooldown_s=30.0,
        )
        scaler = Autoscaler(config, [PoolOffer(GPU, 1, 1.6, 1.5)])
        result, controller = _run(scaler, work)
        usage = controller.usage(900.0)
        peak = max(s.ready for s in controller.timeline)
        assert peak > 1 and controller.timeline[-1].ready < peak  # up, then back in
        assert usage.killed == 0 and all(r.settled for r in result.records)
        assert scaler.lead.measured(GPU)
        met = sum(met_slo(r, SLO) for r in result.records) / len(result.records)
        return usage, peak, met

    assert once() == once()


EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "autoscale.yaml"


def test_the_example_grows_its_pool_to_max_slots_with_count_running() -> None:
    config = parse_autoscale_yaml(EXAMPLE.read_text(), str(EXAMPLE))
    cluster = uniform_cluster(2, GPU, MODEL, 1)
    work = _requests(1.0, 60.0)
    grown, replicas, scaling = autoscaled_cluster(
        config, cluster, Catalog.builtin(), work, SLO, str(EXAMPLE)
    )
    assert grown.replicas[0].count == len(replicas) == config.pools[0].max
    assert scaling.initial == {GPU: 2}
    assert scaling.controller(SLO).dormant == [r.replica_id for r in replicas[2:]]
    (offer,) = scaling.offers
    assert offer.capacity_rps > 0 and offer.usd_per_hour == Catalog.builtin().gpu(GPU).usd_per_hour
    elsewhere = uniform_cluster(2, "h100-80g", MODEL, 1)
    with pytest.raises(ConfigError, match=r"pools\[0\]\.gpu: no replica group on a100-80g"):
        autoscaled_cluster(config, elsewhere, Catalog.builtin(), work, SLO, "autoscale.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_autoscale_yaml("pools: [", "autoscale.yaml")
