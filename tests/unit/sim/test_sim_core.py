"""The simulator on crafted small clusters: routing around slow replicas, failures, cold
starts, the late-binding queue, SLO admission, sessions and oversized requests."""

from __future__ import annotations

import itertools
from random import Random

import msgspec
import pytest

from isocost.core.catalog import Catalog
from isocost.core.slo import SloTargets
from isocost.scheduling.policies import build_policy
from isocost.sim import (
    ClusterConfig,
    ClusterEvent,
    ReplicaGroup,
    SimResult,
    Simulator,
    resolve_cluster,
    served_model,
)
from isocost.workload import Segment, WorkloadRequest, multi_turn, poisson_arrivals

CATALOG = Catalog.builtin()


def requests(
    n: int, rate_rps: float, prompt: int = 2000, output: int = 100, seed: int = 1
) -> list[WorkloadRequest]:
    """``n`` requests with unshared prompts, Poisson arrivals."""
    arrivals = poisson_arrivals(Random(seed), rate_rps)
    return [
        WorkloadRequest(i, next(arrivals), prompt, output, (Segment(i, prompt),)) for i in range(n)
    ]


def burst(n: int, prompt: int = 2000, output: int = 100) -> list[WorkloadRequest]:
    return [WorkloadRequest(i, 0.0, prompt, output, (Segment(i, prompt),)) for i in range(n)]


def cluster(*groups: ReplicaGroup, **settings: object) -> ClusterConfig:
    return msgspec.structs.replace(ClusterConfig(replicas=list(groups)), **settings)


def simulate(
    config: ClusterConfig,
    policy: str,
    workload: list[WorkloadRequest],
    slo: SloTargets | None = None,
) -> SimResult:
    return Simulator(
        config,
        resolve_cluster(config, CATALOG),
        build_policy(policy, rng=Random(0)),
        workload,
        model=served_model(config),
        slo=slo,
    ).run()


A100 = {"gpu": "a100-80g", "model": "llama-3.1-8b"}


def share_on(result: SimResult, replica_id: str) -> float:
    return sum(r.replica_id == replica_id for r in result.records) / len(result.records)


def test_equal_cost_routes_around_a_slowed_replica_and_round_robin_does_not() -> None:
    config = cluster(
        ReplicaGroup(**A100, name="fast", count=3), ReplicaGroup(**A100, name="slow", slowdown=4.0)
    )
    workload = requests(200, rate_rps=4.0)
    round_robin = simulate(config, "round_robin", workload)
    equal_cost = simulate(config, "equal_cost", workload)
    assert share_on(round_robin, "slow-0") == 0.25  # every fourth request, blind
    assert share_on(equal_cost, "slow-0") < 0.12
    assert all(r.finished_s is not None for r in equal_cost.records + round_robin.records)

    def p99_ttft(result: SimResult) -> float:
        ttfts = sorted(r.first_token_s - r.request.arrival_s for r in result.records)  # type: ignore[operator]
        return ttfts[int(0.99 * len(ttfts))]

    assert p99_ttft(equal_cost) < 0.5 * p99_ttft(round_robin)


def test_a_failed_replicas_requests_are_retried_elsewhere_and_it_returns_after_cold_start() -> None:
    config = cluster(
        ReplicaGroup(**A100, name="r", count=2, cold_start_s=3.0),
        events=[
            ClusterEvent(at_s=5.0, replica="r-0", action="fail"),
            ClusterEvent(at_s=10.0, replica="r-0", action="recover"),
        ],
        network_delay_ms=2.0,
    )
    workload = requests(120, rate_rps=4.0, output=300)
    result = simulate(config, "round_robin", workload)
    assert all(r.finished_s is not None and r.rejected is None for r in result.records)
    retried = [r for r in result.records if r.attempts == 2]
    assert retried, "requests in flight on r-0 at its failure are dispatched again"
    assert all(r.replica_id == "r-1" for r in retried)
    for r in result.records:
        if 5.0 <= r.request.arrival_s < 13.0:  # down, then cold-starting until 13 s
            assert r.replica_id == "r-1"
    assert any(r.replica_id == "r-0" for r in result.records if r.request.arrival_s > 13.0)


def test_a_late_replica_takes_work_only_once_ready() -> None:
    config = cluster(
        ReplicaGroup(**A100, name="early"),
        ReplicaGroup(**A100, name="late", start_s=10.0, cold_start_s=5.0),
    )
    result = simulate(config, "round_robin", requests(80, rate_rps=2.0))
    late = [r.request.arrival_s for r in result.records if r.replica_id == "late-0"]
    assert late and min(late) >= 15.0


def test_full_replicas_queue_requests_and_a_full_queue_rejects_the_rest() -> None:
    config = cluster(ReplicaGroup(**A100, count=2, max_queue=1), queue_size=5)
    result = simulate(config, "least_request", burst(20))
    rejected = [r for r in result.records if r.rejected is not None]
    completed = [r for r in result.records if r.finished_s is not None]
    # 2 admitted at once, 5 wait in the queue (late binding), 13 find it full
    assert len(completed) == 7
    assert {r.rejected for r in rejected} == {"queue_full"} and len(rejected) == 13
    assert sorted(r.request.request_id for r in completed) == [0, 1, 2, 3, 4, 5, 6]


def test_a_queued_request_times_out() -> None:
    config = cluster(ReplicaGroup(**A100, max_queue=1), queue_timeout_ms=500.0)
    result = simulate(config, "least_request", burst(3, output=400))
    # request 0 streams from 0.22 s; the 0.4 s scrape lets request 1 in (late binding);
    # request 2 would wait for request 1's first token, after its 0.5 s limit
    assert [r.rejected for r in result.records] == [None, None, "queue_timeout"]
    assert 0.4 <= result.records[1].first_token_s - 0.22 <= 0.5  # type: ignore[operator]


def test_equal_cost_rejects_what_would_miss_its_deadline_round_robin_serves_everything() -> None:
    config = cluster(ReplicaGroup(**A100, count=2))
    slo = SloTargets(ttft_s=1.0, tpot_s=0.1)
    workload = burst(40, prompt=6000)
    equal_cost = simulate(config, "equal_cost", workload, slo)
    round_robin = simulate(config, "round_robin", workload, slo)
    reasons = {r.rejected for r in equal_cost.records}
    assert "deadline" in reasons
    assert all(r.rejected is None for r in round_robin.records)
    served = [r for r in equal_cost.records if r.finished_s is not None]
    assert served
    late = [r for r in served if r.first_token_s - r.request.arrival_s > 1.0]  # type: ignore[operator]
    assert len(late) <= len(served) // 4


def test_a_session_turn_waits_for_the_previous_reply() -> None:
    config = cluster(ReplicaGroup(**A100, count=2))
    workload = multi_turn(Random(3), poisson_arrivals(Random(4), 5.0), 6, 4, 500, 100, 200, 0.1)
    result = simulate(config, "round_robin", workload)
    by_session: dict[str, list[tuple[int, float, float]]] = {}
    for r in result.records:
        assert r.finished_s is not None and r.first_token_s is not None
        assert r.request.session_id is not None
        by_session.setdefault(r.request.session_id, []).append(
            (r.request.turn_index, r.first_token_s, r.finished_s)
        )
    for turns in by_session.values():
        turns.sort()
        for (_, _, previous_done), (_, first_token, _) in itertools.pairwise(turns):
            assert first_token > previous_done


@pytest.mark.parametrize("policy", ["round_robin", "equal_cost"])
def test_a_request_longer_than_the_context_is_rejected_too_long(policy: str) -> None:
    config = cluster(ReplicaGroup(**A100))
    workload = [
        WorkloadRequest(0, 0.0, 200_000, 10, (Segment(0, 200_000),)),
        WorkloadRequest(1, 0.1, 100, 10, (Segment(1, 100),)),
    ]
    result = simulate(config, policy, workload)
    assert result.records[0].rejected == "too_long"
    assert result.records[1].finished_s is not None


def test_network_delay_is_paid_on_both_legs() -> None:
    workload = burst(1, prompt=1000, output=1)
    near = simulate(cluster(ReplicaGroup(**A100), network_delay_ms=0.0), "round_robin", workload)
    far = simulate(cluster(ReplicaGroup(**A100), network_delay_ms=50.0), "round_robin", workload)
    near_ttft, far_ttft = near.records[0].first_token_s, far.records[0].first_token_s
    assert near_ttft is not None and far_ttft is not None
    assert far_ttft - near_ttft == pytest.approx(0.1)


def test_shared_prefixes_hit_the_engine_cache() -> None:
    config = cluster(ReplicaGroup(**A100))
    shared = Segment(10_000, 4096)
    workload = [
        WorkloadRequest(i, 2.0 * i, 4096 + 64, 20, (shared, Segment(i, 64))) for i in range(5)
    ]
    result = simulate(config, "round_robin", workload)
    assert [r.prefix_hit_tokens for r in result.records] == [0, 4096, 4096, 4096, 4096]
    assert result.prefix_hits == 4 * 4096
