"""Invariants of the engine model over random workloads and KV-cache sizes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import astuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel, EngineLimits
from isocost.engine import (
    EngineEvent,
    EngineModel,
    EngineObservation,
    Finished,
    FirstToken,
    RequestSpec,
)
from isocost.prefix.hashing import token_block_hashes

CATALOG = Catalog.builtin()

# (gap to previous arrival s, shared-prefix group, prefix blocks, own prompt tokens, output)
requests = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.001, 0.02, 0.3]),
        st.integers(0, 2),
        st.integers(0, 6),
        st.integers(1, 150),
        st.integers(1, 120),
    ),
    min_size=1,
    max_size=25,
)


def _run(
    workload: list[tuple[float, int, int, int, int]],
    num_blocks: int,
    max_num_seqs: int,
    budget: int,
    jump: bool,
    advance: Callable[[EngineModel, float], list[EngineEvent]] = EngineModel.advance_to,
) -> tuple[list[EngineEvent], EngineModel]:
    limits = EngineLimits(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    cost = CostModel(CATALOG.model("qwen2.5-7b"), CATALOG.gpu("a100-80g"), 1, limits=limits)
    model = EngineModel(cost, num_blocks=num_blocks, jump=jump)
    events: list[EngineEvent] = []
    now = 0.0
    for i, (gap, group, prefix_blocks, own, output) in enumerate(workload):
        now += gap
        events += advance(model, now)
        tokens = [*range(group * 10_000, group * 10_000 + 16 * prefix_blocks)]
        tokens += range(1_000_000 * (i + 1), 1_000_000 * (i + 1) + own)
        output = min(output, num_blocks * 16 - len(tokens))
        hashes = tuple(token_block_hashes(tokens, 16))
        model.submit(RequestSpec(f"r{i}", len(tokens), output, hashes), now)
    while (t := model.next_event_time()) is not None:
        events += advance(model, t)
        _check_blocks(model, len(workload))
    return events, model


def _check_blocks(model: EngineModel, num_requests: int) -> None:
    """Blocks in use = every live request's private blocks + each distinct cached block
    some request holds; each request holds enough blocks for its computed tokens."""
    states = [s for i in range(num_requests) if (s := model.request(f"r{i}")) is not None]
    private = sum(s.num_blocks - s.num_cached_blocks for s in states)
    cached = {h for s in states for h in s.spec.block_hashes[: s.num_cached_blocks]}
    assert model.pool.num_used == private + len(cached)
    assert all(s.num_blocks * 16 >= s.num_computed_tokens for s in states)
    assert 0.0 <= model.kv_usage <= 1.0


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    workload=requests,
    num_blocks=st.integers(20, 80),
    max_num_seqs=st.integers(1, 6),
    budget=st.sampled_from([64, 256, 8192]),
)
def test_every_request_finishes_once_with_its_tokens_and_blocks_return(
    workload: list[tuple[float, int, int, int, int]],
    num_blocks: int,
    max_num_seqs: int,
    budget: int,
) -> None:
    events, model = _run(workload, num_blocks, max_num_seqs, budget, jump=True)
    finished = [e for e in events if isinstance(e, Finished)]
    first = {e.request_id: e for e in events if isinstance(e, FirstToken)}
    assert sorted(e.request_id for e in finished) == sorted(f"r{i}" for i in range(len(workload)))
    assert len(first) == len(finished)
    for e in finished:
        assert 0 < first[e.request_id].time_s <= e.time_s
        assert e.ttft_s <= e.e2e_s
    assert [e.time_s for e in events] == sorted(e.time_s for e in events)
    assert model.pool.num_used == 0
    # preempted requests keep their tokens: recompute generates none twice
    assert model.counters.num_generation_tokens == sum(e.num_output_tokens for e in finished)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(workload=requests, num_blocks=st.integers(20, 80), max_num_seqs=st.integers(1, 6))
def test_jumps_and_single_steps_agree_on_every_event(
    workload: list[tuple[float, int, int, int, int]], num_blocks: int, max_num_seqs: int
) -> None:
    jumped, a = _run(workload, num_blocks, max_num_seqs, 256, jump=True)
    stepped, b = _run(workload, num_blocks, max_num_seqs, 256, jump=False)
    # decode runs are priced in closed form: times agree to ~1e-12, the rest exactly
    jumped_rows, stepped_rows = (
        [(type(e).__name__, *astuple(e)) for e in x] for x in (jumped, stepped)
    )
    assert [[v for v in r if not isinstance(v, float)] for r in jumped_rows] == [
        [v for v in r if not isinstance(v, float)] for r in stepped_rows
    ]
    assert [v for r in jumped_rows for v in r if isinstance(v, float)] == pytest.approx(
        [v for r in stepped_rows for v in r if isinstance(v, float)], rel=1e-9, abs=1e-9
    )
    assert a.counters.num_steps == b.counters.num_steps
    assert a.counters.prefix_cache_hits == b.counters.prefix_cache_hits
    assert a.counters.num_preemptions == b.counters.num_preemptions
    assert a.counters.num_generation_tokens == b.counters.num_generation_tokens


def _observing(fractions: list[float]) -> Callable[[EngineModel, float], list[EngineEvent]]:
    """``advance_to`` that crosses each quiet window in one jump and first, at the given
    fractions of the window, checks ``observe`` against a copy advanced there."""

    clock = 0.0  # the model's: every call ends advanced to ``until``

    def advance(model: EngineModel, until: float) -> list[EngineEvent]:
        nonlocal clock
        events: list[EngineEvent] = []
        while True:
            quiet = model.quiet_until()
            end = until if quiet is None else min(quiet, until)
            for fraction in fractions:
                t = clock + fraction * (end - clock)
                if t < end or quiet is None:
                    future = copy.deepcopy(model)
                    assert future.advance_to(t) == []
                    counters = future.counters
                    assert model.observe(t) == EngineObservation(
                        future.num_running,
                        future.num_waiting,
                        future.kv_usage,
                        counters.prefix_cache_queries,
                        counters.prefix_cache_hits,
                        counters.num_preemptions,
                    )
            if quiet is None or quiet > until:
                clock = until
                return events + model.advance_to(until)
            events += model.advance_to(quiet)
            clock = quiet

    return advance


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    workload=requests,
    num_blocks=st.integers(20, 80),
    max_num_seqs=st.integers(1, 6),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3),
)
def test_observe_inside_a_quiet_window_reads_what_advancing_there_would(
    workload: list[tuple[float, int, int, int, int]],
    num_blocks: int,
    max_num_seqs: int,
    fractions: list[float],
) -> None:
    observed, _ = _run(workload, num_blocks, max_num_seqs, 256, True, _observing(fractions))
    plain, _ = _run(workload, num_blocks, max_num_seqs, 256, jump=True)
    assert [(type(e), e.request_id) for e in observed] == [(type(e), e.request_id) for e in plain]
