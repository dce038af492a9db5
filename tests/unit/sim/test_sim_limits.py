"""The simulator's limits (``sim._limits``): a run that would not end is refused first."""

from __future__ import annotations

import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.core.slo import SloTargets
from isocost.sim import SimPlan, WorkloadChoice, load_requests, resolve_cluster, uniform_cluster
from isocost.sim._limits import check_run_length
from isocost.workload import Segment, SyntheticSpec, WorkloadRequest

WEEK_S = 7 * 86_400


def _at(*times_s: float) -> list[WorkloadRequest]:
    return [WorkloadRequest(i, t, 8, 4, (Segment(i, 8),)) for i, t in enumerate(times_s)]


def test_a_week_of_arrivals_runs_and_more_is_refused() -> None:
    check_run_length(_at(0.0, WEEK_S), None, 200.0, None)
    with pytest.raises(ConfigError, match=r"1e\+06 s of simulated time, beyond .* 604,800 s"):
        check_run_length(_at(0.0, 1e6), None, 200.0, None)  # 1e9 ms read as ms


def test_the_span_counts_at_the_slowest_rate_replayed() -> None:
    requests = _at(0.0, 1.0, 2.0)  # 1 req/s over 2 s
    check_run_length(requests, 1e-5, 200.0, None)  # 200,000 s
    with pytest.raises(ConfigError, match="beyond the limit of 604,800 s"):
        check_run_length(requests, 1e-300, 200.0, None)


@pytest.mark.parametrize(
    ("scrape_ms", "control_s"),
    [(1e-9, None), (0.0, 0.0001), (100.0, 0.1)],
)
def test_scrapes_and_ticks_are_bounded_per_run(scrape_ms: float, control_s: float | None) -> None:
    with pytest.raises(ConfigError, match="beyond the limit of 5,000,000 per run"):
        check_run_length(_at(0.0, WEEK_S), None, scrape_ms, control_s)


def test_a_plan_is_checked_when_made() -> None:
    cluster = uniform_cluster(1, "a100-80g", "llama-3.1-8b", 1)
    replicas = tuple(resolve_cluster(cluster, Catalog.builtin()))
    requests = _at(0.0, 1.0)
    SimPlan(cluster, replicas, requests, ("round_robin",), SloTargets(), jobs=1)
    with pytest.raises(ConfigError, match="simulated time"):
        SimPlan(
            cluster, replicas, requests, ("round_robin",), SloTargets(), rates_rps=(1e-9,), jobs=1
        )


def test_an_endless_mix_is_cut_within_the_synthetic_limit() -> None:
    choice = WorkloadChoice(synthetic=SyntheticSpec("mix"), rate_rps=1000.0, duration_s=WEEK_S)
    with pytest.raises(ConfigError, match=r"about 6\.05e\+08 requests .* limit of 1,000,000"):
        load_requests(choice)
    small = WorkloadChoice(synthetic=SyntheticSpec("mix"), rate_rps=10.0, duration_s=3.0)
    assert 10 <= len(load_requests(small)) <= 60
