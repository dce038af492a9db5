"""Calibration pooled by hardware class, through the simulator's real engine models."""

from __future__ import annotations

from collections import Counter
from random import Random

from isocost.core.catalog import Catalog
from isocost.scheduling.policies import build_policy
from isocost.sim import ClusterConfig, ReplicaGroup, Simulator, resolve_cluster, served_model
from isocost.workload import Segment, WorkloadRequest, poisson_arrivals

CATALOG = Catalog.builtin()


def _unshared(n: int, rate_rps: float) -> list[WorkloadRequest]:
    """``n`` requests with prompts of 500-4000 tokens shared with nobody."""
    rng = Random(3)
    arrivals = poisson_arrivals(Random(1), rate_rps)
    out = []
    for i in range(n):
        prompt = rng.randint(500, 4000)
        output = rng.randint(20, 200)
        out.append(WorkloadRequest(i, next(arrivals), prompt, output, (Segment(i, prompt),)))
    return out


def test_identical_replicas_faster_than_the_model_all_get_traffic_and_agree() -> None:
    # Four replicas 0.35x the analytic model's time: learned alone, the first ones seen to be
    # fast looked cheapest and took everything while the others kept their prior factors.
    config = ClusterConfig(
        replicas=[
            ReplicaGroup(name="a100", gpu="a100-80g", model="llama-3.1-8b", count=4, slowdown=0.35)
        ]
    )
    sim = Simulator(
        config,
        resolve_cluster(config, CATALOG),
        build_policy("equal_cost", rng=Random(0)),
        _unshared(240, 2.0),
        model=served_model(config),
    )
    result = sim.run()
    shares = Counter(r.replica_id for r in result.records)
    assert min(shares[name] for name in result.replica_ids) >= 0.1 * len(result.records)
    for factors in (sim.shadow.calibration.ttft_factor, sim.shadow.calibration.itl_factor):
        learned = factors[:4]
        assert learned.max() < 0.6  # learned that they are fast
        assert learned.max() / learned.min() <= 1.1
