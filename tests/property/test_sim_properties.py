"""Invariants of the cluster simulator over random workloads, clusters and faults."""

from __future__ import annotations

from random import Random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.slo import SloTargets
from isocost.engine import EngineModel, RequestSpec
from isocost.sim import (
    ClusterConfig,
    ClusterEvent,
    ReplicaGroup,
    SimPlan,
    isolated_times,
    json_rows,
    lowest_slowdowns,
    resolve_cluster,
    run_plan,
)
from isocost.workload import Segment, WorkloadRequest

CATALOG = Catalog.builtin()
POLICIES = ("round_robin", "least_request", "power_of_two", "sglang_cache_aware", "equal_cost")

# (gap s, shared prefix group or -1, prefix tokens, own prompt tokens, output tokens)
request_specs = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.01, 0.2, 1.0]),
        st.integers(-1, 2),
        st.integers(16, 3000),
        st.integers(1, 3000),
        st.integers(1, 300),
    ),
    min_size=1,
    max_size=30,
)


def workload(specs: list[tuple[float, int, int, int, int]]) -> list[WorkloadRequest]:
    out, now = [], 0.0
    for i, (gap, group, prefix, own, output) in enumerate(specs):
        now += gap
        segments = (Segment(i + 100, own),)
        if group >= 0:
            segments = (Segment(group, prefix), *segments)
        prompt = sum(s.num_tokens for s in segments)
        out.append(WorkloadRequest(i, now, prompt, output, segments))
    return out


def cluster(
    count: int, slowdown: float, max_queue: int, fail_at: float | None, delay_ms: float
) -> ClusterConfig:
    groups = [
        ReplicaGroup(
            gpu="a100-80g", model="llama-3.1-8b", name="a", count=count, max_queue=max_queue
        ),
        ReplicaGroup(gpu="l20-48g", model="llama-3.1-8b", name="b", slowdown=slowdown),
    ]
    events = []
    if fail_at is not None:
        events = [
            ClusterEvent(at_s=fail_at, replica="a-0", action="fail"),
            ClusterEvent(at_s=fail_at + 0.5, replica="a-0", action="recover"),
        ]
    return ClusterConfig(
        replicas=groups,
        events=events,
        network_delay_ms=delay_ms,
        scrape_interval_ms=100,
        queue_size=4,
        max_retries=1,
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    specs=request_specs,
    policy=st.sampled_from(POLICIES),
    count=st.integers(1, 3),
    slowdown=st.sampled_from([0.5, 1.0, 3.0]),
    max_queue=st.sampled_from([1, 128]),
    fail_at=st.sampled_from([None, 0.05, 0.7]),
    delay_ms=st.sampled_from([0.0, 2.0]),
)
def test_every_arrival_ends_once_completed_or_rejected_and_runs_repeat_exactly(
    specs: list[tuple[float, int, int, int, int]],
    policy: str,
    count: int,
    slowdown: float,
    max_queue: int,
    fail_at: float | None,
    delay_ms: float,
) -> None:
    requests = workload(specs)
    cluster_config = cluster(count, slowdown, max_queue, fail_at, delay_ms)
    plan = SimPlan(
        cluster=cluster_config,
        replicas=tuple(resolve_cluster(cluster_config, CATALOG)),
        requests=requests,
        policies=(policy,),
        slo=SloTargets(ttft_s=0.5, tpot_s=0.05, ttft_per_1k_s=0.2),
        jobs=1,
    )
    first = run_plan(plan)
    (row,) = [r for r in json_rows(first) if r["policy"] == policy]
    assert row["completed"] + row["rejected"] == len(requests)
    run = first.runs[0]
    completed = ~np.isnan(run.ttft_s)
    assert int(completed.sum()) == row["completed"]
    # no request beats its isolated bound (the best prefix cache, the fastest replica)
    isolated = isolated_times(
        requests,
        [r.cost_model for r in plan.replicas],
        delay_ms / 1000,
        lowest_slowdowns(cluster_config, plan.replicas),
    )
    assert np.all(run.ttft_s[completed] >= isolated.ttft_s[completed] * (1 - 1e-9))
    assert json_rows(run_plan(plan)) == json_rows(first)  # deterministic for a seed


# (gap s, prompt tokens, output tokens)
engine_specs = st.lists(
    st.tuples(st.sampled_from([0.0, 0.005, 0.05, 0.5]), st.integers(1, 400), st.integers(1, 200)),
    min_size=1,
    max_size=20,
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(specs=engine_specs, num_blocks=st.integers(30, 200))
def test_the_engine_emits_nothing_before_it_says_it_is_quiet(
    specs: list[tuple[float, int, int]], num_blocks: int
) -> None:
    cost = CostModel(CATALOG.model("qwen2.5-7b"), CATALOG.gpu("a100-80g"), 1)
    model = EngineModel(cost, num_blocks=num_blocks)
    rng = Random(len(specs))
    arrivals = []
    now = 0.0
    for gap, prompt, output in specs:
        now += gap
        arrivals.append((now, prompt, min(output, num_blocks * 16 - prompt)))
    pending = list(reversed(arrivals))
    i = 0
    clock = 0.0
    while pending or model.next_event_time() is not None:
        quiet = model.quiet_until()
        next_arrival = pending[-1][0] if pending else None
        if quiet is not None and (next_arrival is None or quiet <= next_arrival):
            # somewhere before the quiet time: nothing happens there
            probe = clock + rng.random() * (quiet - clock)
            if probe < quiet:
                assert model.advance_to(probe) == []
            model.advance_to(quiet)
            clock = quiet
            continue
        assert next_arrival is not None
        at, prompt, output = pending.pop()
        model.advance_to(at)
        clock = at
        model.submit(RequestSpec(f"r{i}", prompt, output), at)
        i += 1
    assert model.pool.num_used == 0
