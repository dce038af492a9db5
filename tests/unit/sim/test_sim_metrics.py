"""Isolated service times against the engine model itself; SLO accounting; capacity."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.slo import SloTargets
from isocost.engine import (
    EngineEvent,
    EngineModel,
    Finished,
    FirstToken,
    RequestSpec,
    prefill_floor_s,
)
from isocost.sim import (
    ClusterConfig,
    ClusterEvent,
    ReplicaGroup,
    block_hashes,
    capacity_at_slo,
    isolated_times,
    lowest_slowdowns,
    resolve_cluster,
    reusable_prefix_blocks,
)
from isocost.sim._metrics import summarize_sim
from isocost.workload import Segment, WorkloadRequest

CATALOG = Catalog.builtin()


def request(i: int, prompt: int, output: int, arrival_s: float = 0.0) -> WorkloadRequest:
    return WorkloadRequest(i, arrival_s, prompt, output, (Segment(i, prompt),))


@pytest.mark.parametrize(("prompt", "output"), [(1, 1), (700, 2), (5000, 300), (20_000, 64)])
def test_isolated_times_equal_the_engine_running_the_request_alone(
    prompt: int, output: int
) -> None:
    cost = CostModel(CATALOG.model("llama-3.1-8b"), CATALOG.gpu("a100-80g"), 1)
    engine = EngineModel(cost)
    engine.submit(RequestSpec("r", prompt, output), 0.0)
    events = []
    while (t := engine.next_event_time()) is not None:
        events += engine.advance_to(t)
    first = next(e for e in events if isinstance(e, FirstToken))
    done = next(e for e in events if isinstance(e, Finished))
    isolated = isolated_times([request(0, prompt, output)], [cost], delay_s=0.01)
    assert isolated.ttft_s[0] == pytest.approx(first.ttft_s + 0.02, rel=1e-9)
    assert isolated.e2e_s[0] == pytest.approx(done.e2e_s + 0.02, rel=1e-9)


def test_isolated_times_take_the_fastest_kind_and_nan_when_nothing_fits() -> None:
    a100 = CostModel(CATALOG.model("llama-3.1-8b"), CATALOG.gpu("a100-80g"), 1)
    h100 = CostModel(CATALOG.model("llama-3.1-8b"), CATALOG.gpu("h100-80g"), 1)
    requests = [request(0, 3000, 100), request(1, 500_000, 10)]
    both = isolated_times(requests, [a100, h100], 0.0)
    alone = isolated_times(requests, [h100], 0.0)
    assert both.e2e_s[0] == alone.e2e_s[0] < isolated_times(requests, [a100], 0.0).e2e_s[0]
    assert math.isnan(both.e2e_s[1]) and math.isnan(both.ttft_s[1])


def test_a_prompt_reuses_the_blocks_of_prompts_arriving_before_it_never_replies() -> None:
    system, user, reply = Segment(7, 1000), Segment(8, 40), Segment(9, 300)
    first = WorkloadRequest(0, 0.0, 1040, 300, (system, user))
    second = WorkloadRequest(1, 5.0, 1380, 10, (system, user, reply, Segment(10, 40)))
    same_time = WorkloadRequest(2, 5.0, 1040, 10, (system, user))  # after `second` in the list
    unrelated = WorkloadRequest(3, 6.0, 500, 10, (Segment(11, 500),))
    requests = [first, second, same_time, unrelated]
    # the engine caches prompt blocks only: `second` finds `first`'s 65 full blocks, not
    # the reply's; `same_time` could hit all of `first` but computes its last token
    assert reusable_prefix_blocks(requests) == [0, 65, 65, 0]
    cost = CostModel(CATALOG.model("llama-3.1-8b"), CATALOG.gpu("a100-80g"), 1)
    isolated = isolated_times(requests, [cost], 0.0)
    assert list(isolated.cached_tokens) == [0, 1040, 1024, 0]
    assert isolated.ttft_s[1] == prefill_floor_s(cost, 1380 - 1040, 1040)
    assert isolated.ttft_s[2] == prefill_floor_s(cost, 16, 1024)
    # the order, not the times, decides: a rate sweep keeps the bound's reuse
    faster = [dataclasses.replace(r, arrival_s=r.arrival_s / 3) for r in requests]
    assert reusable_prefix_blocks(faster) == reusable_prefix_blocks(requests)


def test_the_bound_is_the_engine_alone_after_the_prefix_donor() -> None:
    """Tight: on an empty replica right after the prompt that cached its prefix, a request
    takes exactly its bound (compute-bound prefill)."""
    cost = CostModel(CATALOG.model("llama-3.1-8b"), CATALOG.gpu("a100-80g"), 1)
    requests = [
        WorkloadRequest(0, 0.0, 6100, 1, (Segment(1, 6000), Segment(2, 100))),
        WorkloadRequest(1, 1.0, 9000, 50, (Segment(1, 6000), Segment(3, 3000))),
    ]
    engine = EngineModel(cost)
    events: list[EngineEvent] = []
    for r in requests:
        spec = RequestSpec(str(r.request_id), r.prompt_tokens, r.output_tokens, block_hashes(r))
        engine.submit(spec, events[-1].time_s if events else 0.0)
        while (t := engine.next_event_time()) is not None:
            events += engine.advance_to(t)
    first = next(e for e in events if isinstance(e, FirstToken) and e.request_id == "1")
    done = next(e for e in events if isinstance(e, Finished) and e.request_id == "1")
    isolated = isolated_times(requests, [cost], 0.0)
    assert isolated.cached_tokens[1] == 6000
    assert isolated.ttft_s[1] == pytest.approx(first.ttft_s, rel=1e-12)
    assert isolated.e2e_s[1] == pytest.approx(done.e2e_s, rel=1e-9)


def test_only_replicas_faster_than_their_kind_lower_the_bound() -> None:
    cluster = ClusterConfig(
        replicas=[
            ReplicaGroup(gpu="a100-80g", model="llama-3.1-8b", name="a", count=2),
            ReplicaGroup(gpu="a100-80g", model="llama-3.1-8b", name="slow", slowdown=3.0),
        ],
        events=[ClusterEvent(at_s=50, replica="a-1", action="slowdown", factor=0.8)],
    )
    replicas = resolve_cluster(cluster, CATALOG)
    assert lowest_slowdowns(cluster, replicas) == [1.0, 0.8, 3.0]
    requests = [request(0, 3000, 100)]
    costs = [r.cost_model for r in replicas]
    healthy = isolated_times(requests, costs, 0.0)
    assert isolated_times(requests, costs, 0.0, [1.0, 1.0, 3.0]).e2e_s == healthy.e2e_s
    faster = isolated_times(requests, costs, 0.0, lowest_slowdowns(cluster, replicas))
    assert faster.e2e_s[0] == pytest.approx(0.8 * healthy.e2e_s[0], rel=1e-12)


def test_slo_accounting_scales_ttft_with_prompt_length() -> None:
    requests = [request(0, 1000, 11, 0.0), request(1, 9000, 11, 1.0), request(2, 100, 1, 2.0),
                request(3, 100, 5, 3.0)]  # fmt: skip
    ttft = np.array([0.9, 2.5, 0.1, math.nan])
    e2e = np.array([1.9, 3.0, 0.1, math.nan])  # TPOT 100 ms, 50 ms, none
    slo = SloTargets(ttft_s=0.5, tpot_s=0.1, ttft_per_1k_s=0.25)  # limits 0.75 s, 2.75 s, 0.525 s
    isolated = isolated_times(requests, [CostModel(CATALOG.model("llama-3.1-8b"),
                                                   CATALOG.gpu("a100-80g"), 1)], 0.0)  # fmt: skip
    s = summarize_sim("p", requests, ttft, e2e, [None, None, None, "deadline"], slo, isolated, 5.0)
    assert (s.completed, s.rejected, s.rejected_by_reason) == (3, 1, {"deadline": 1})
    assert s.slo_attainment == 0.5  # request 1 (long prompt, late but within) and 2
    assert s.goodput_rps == pytest.approx(2 / 5.0)
    assert s.tpot_p50_s == pytest.approx(0.05)
    assert s.offered_rps == pytest.approx(1.0)


def test_capacity_is_the_highest_rate_meeting_the_target() -> None:
    points = [(1.0, 0.99), (2.0, 0.95), (4.0, 0.91), (8.0, 0.6)]
    assert capacity_at_slo(points, 0.9) == 4.0
    assert capacity_at_slo(points, 0.999) is None
