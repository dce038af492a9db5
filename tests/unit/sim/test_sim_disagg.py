"""Prefill/decode disaggregation in the simulator: the two legs, their KV hand-off, and
fleets without roles left as they were."""

from __future__ import annotations

from random import Random

import msgspec
import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.core.slo import SloTargets
from isocost.scheduling.policies import build_policy
from isocost.sim import (
    ClusterConfig,
    ClusterEvent,
    ReplicaGroup,
    SimResult,
    Simulator,
    parse_cluster_yaml,
    resolve_cluster,
    served_model,
)
from isocost.workload import Segment, WorkloadRequest, poisson_arrivals

CATALOG = Catalog.builtin()
A100 = {"gpu": "a100-80g", "model": "llama-3.1-8b"}
SLO = SloTargets(ttft_s=2.0, ttft_per_1k_s=0.2, tpot_s=0.05)


def _requests(n: int, rate_rps: float, seed: int = 3) -> list[WorkloadRequest]:
    """Long and short unshared prompts, alternating, Poisson arrivals."""
    arrivals = poisson_arrivals(Random(seed), rate_rps)
    prompts = [12_000 if i % 2 else 300 for i in range(n)]
    return [
        WorkloadRequest(i, next(arrivals), p, 120, (Segment(i, p),)) for i, p in enumerate(prompts)
    ]


def _run(config: ClusterConfig, workload: list[WorkloadRequest]) -> SimResult:
    return Simulator(
        config,
        resolve_cluster(config, CATALOG),
        build_policy("equal_cost", rng=Random(0)),
        workload,
        model=served_model(config),
        slo=SLO,
    ).run()


def _pd(mode: str | None, **settings: object) -> ClusterConfig:
    groups = [
        ReplicaGroup(name="p", count=2, role="prefill", **A100),  # type: ignore[arg-type]
        ReplicaGroup(name="d", count=4, role="decode", **A100),  # type: ignore[arg-type]
    ]
    config = ClusterConfig(replicas=groups, disaggregation=mode)  # type: ignore[arg-type]
    return msgspec.structs.replace(config, **settings)


def test_split_requests_prefill_on_p_then_decode_on_d_after_the_transfer() -> None:
    workload = _requests(120, 3.0)
    result = _run(_pd("pd"), workload)

    assert all(r.settled for r in result.records)
    split = [r for r in result.records if r.disaggregated]
    assert len(split) > 100
    for record in split:
        assert record.prefill_replica_id is not None and record.prefill_replica_id[0] == "p"
        assert record.replica_id is not None and record.replica_id[0] == "d"
        assert record.transfer_s > 0
        if record.first_token_s is not None:  # D's first token: after P's prefill and the KV
            assert record.first_token_s - record.request.arrival_s > record.transfer_s
    assert not any(r.replica_id and r.replica_id[0] == "p" for r in result.records)


def test_conditional_splits_long_prompts_more_than_short_ones() -> None:
    result = _run(_pd("conditional"), _requests(160, 4.0))
    long_share = [r.disaggregated for r in result.records if r.request.prompt_tokens > 1000]
    short_share = [r.disaggregated for r in result.records if r.request.prompt_tokens < 1000]
    assert sum(long_share) / len(long_share) > sum(short_share) / len(short_share)


def test_a_slower_link_makes_every_transfer_longer() -> None:
    workload = _requests(40, 1.0)
    fast = _run(_pd("pd", link="nvlink"), workload)
    slow = _run(_pd("pd", link="tcp"), workload)
    pairs = zip(fast.records, slow.records, strict=True)
    assert all(s.transfer_s > 50 * f.transfer_s for f, s in pairs if f.disaggregated)


def test_a_failed_prefill_replica_retries_the_request_elsewhere() -> None:
    config = _pd("pd", events=[ClusterEvent(at_s=5.0, replica="p-0", action="fail")])
    result = _run(config, _requests(80, 4.0))
    assert all(r.settled for r in result.records)
    assert any("p-0" in r.failed_on for r in result.records)


def test_an_all_both_fleet_declared_colocated_runs_as_one_without_the_setting() -> None:
    workload = _requests(60, 3.0)
    plain = ClusterConfig(replicas=[ReplicaGroup(count=4, **A100)])  # type: ignore[arg-type]
    declared = msgspec.structs.replace(plain, disaggregation="colocated")
    a, b = _run(plain, workload), _run(declared, workload)
    assert [(r.replica_id, r.first_token_s, r.finished_s) for r in a.records] == [
        (r.replica_id, r.first_token_s, r.finished_s) for r in b.records
    ]


def test_cluster_yaml_takes_roles_and_names_an_unknown_link() -> None:
    text = "link: roce\nreplicas:\n  - {gpu: a100-80g, model: llama-3.1-8b, role: prefill}\n"
    config = parse_cluster_yaml(text, "c.yaml")
    assert config.link == "roce"
    assert resolve_cluster(config, CATALOG)[0].role == "prefill"
    with pytest.raises(ConfigError, match="link"):
        parse_cluster_yaml(text.replace("roce", "smoke-signals"), "c.yaml")
