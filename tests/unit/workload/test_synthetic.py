"""Synthetic generators and arrival processes: shapes, shares, rates, determinism."""

from __future__ import annotations

import itertools
import statistics
from random import Random

import pytest

from isocost.workload import (
    SCENARIO_MIX,
    Segment,
    SyntheticSpec,
    WorkloadRequest,
    gamma_arrivals,
    mean_rate_rps,
    multi_turn,
    poisson_arrivals,
    scale_to_rate,
    scenario_mix,
    shared_prefix,
    speedup,
    synthetic_workload,
    with_arrivals,
)


def test_scenario_mix_hits_its_shares_and_means() -> None:
    rng = Random(7)
    requests = list(itertools.islice(scenario_mix(rng, poisson_arrivals(rng, 10.0)), 20_000))
    short = [r for r in requests if r.prompt_tokens < 1500]
    assert len(short) / len(requests) == pytest.approx(0.65, abs=0.02)
    overall = statistics.fmean(r.prompt_tokens for r in requests)
    expected = sum(c.share * c.mean_input_tokens for c in SCENARIO_MIX)
    assert overall == pytest.approx(expected, rel=0.05)
    assert all(len(r.segments) == 1 for r in requests)


def test_scenario_mix_caps_long_prompts() -> None:
    rng = Random(1)
    capped = itertools.islice(
        scenario_mix(rng, poisson_arrivals(rng, 1.0), max_prompt_tokens=8000), 2000
    )
    assert max(r.prompt_tokens for r in capped) == 8000


def test_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    rng = Random(3)
    requests = shared_prefix(rng, poisson_arrivals(rng, 5.0), 4, 5, 1000, 50, 20)
    assert len(requests) == 20
    by_group: dict[int, list[int]] = {}
    for r in requests:
        system, question = r.segments
        assert (system.num_tokens, question.num_tokens, r.prompt_tokens) == (1000, 50, 1050)
        by_group.setdefault(system.seed, []).append(question.seed)
    assert sorted(len(q) for q in by_group.values()) == [5, 5, 5, 5]
    questions = [q for qs in by_group.values() for q in qs]
    assert len(set(questions)) == 20 and not set(questions) & set(by_group)
    groups_in_order = [r.segments[0].seed for r in requests]
    assert groups_in_order != sorted(groups_in_order), "groups must interleave"


def test_multi_turn_resends_the_history() -> None:
    rng = Random(5)
    requests = multi_turn(rng, poisson_arrivals(rng, 1.0), 3, 4, 200, 40, 30, 2.0)
    assert len(requests) == 12
    for session in {r.session_id for r in requests}:
        turns = sorted((r for r in requests if r.session_id == session), key=lambda r: r.turn_index)
        assert [t.turn_index for t in turns] == [0, 1, 2, 3]
        assert [t.arrival_s for t in turns] == sorted(t.arrival_s for t in turns)
        for before, after in itertools.pairwise(turns):
            # the next prompt = previous prompt + previous reply + a new user message
            assert after.segments[: len(before.segments)] == before.segments
            assert after.segments[len(before.segments)].num_tokens == before.output_tokens
            assert len(after.segments) == len(before.segments) + 2
    assert all(r.segments[0].seed == 0 for r in requests), "one system prompt for all"


def test_arrival_processes_hold_their_rate_and_burstiness() -> None:
    rng = Random(11)
    poisson = list(itertools.islice(poisson_arrivals(rng, 4.0), 20_000))
    bursty = list(itertools.islice(gamma_arrivals(rng, 4.0, cv=3.0), 20_000))
    for times in (poisson, bursty):
        assert len(times) / times[-1] == pytest.approx(4.0, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(3.0, rel=0.1)


def test_time_transforms_keep_everything_but_the_clock() -> None:
    rng = Random(2)
    base = list(itertools.islice(scenario_mix(rng, poisson_arrivals(rng, 2.0)), 500))
    fast = list(speedup(base, 4.0))
    assert [r.arrival_s * 4 for r in fast] == pytest.approx([r.arrival_s for r in base])
    assert [r.segments for r in fast] == [r.segments for r in base]
    assert mean_rate_rps(list(scale_to_rate(base, 9.0))) == pytest.approx(9.0)
    fixed = list(with_arrivals(base[:3], iter([1.0, 2.0, 3.0])))
    assert [r.arrival_s for r in fixed] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "call",
    [
        lambda: poisson_arrivals(Random(0), 0.0),
        lambda: gamma_arrivals(Random(0), 1.0, cv=0.0),
        lambda: speedup([], 0.0),
        lambda: shared_prefix(Random(0), iter([]), 0, 1, 1, 1, 1),
        lambda: multi_turn(Random(0), iter([]), 1, 0, 1, 1, 1, 1.0),
    ],
)
def test_bad_parameters_are_refused(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


def test_named_synthetic_workloads_dispatch_to_their_generators() -> None:
    def first(spec: SyntheticSpec, n: int = 4) -> list[WorkloadRequest]:
        rng = Random(9)
        return list(itertools.islice(synthetic_workload(spec, rng, poisson_arrivals(rng, 1)), n))

    groups = first(SyntheticSpec("shared-prefix", num_groups=1, system_tokens=64), 16)
    assert len(groups) == 16 and {r.segments[0] for r in groups} == {Segment(0, 64)}
    turns = first(SyntheticSpec("multi-turn", sessions=1, turns=3), 10)
    assert [r.turn_index for r in turns] == [0, 1, 2]
    mix = first(SyntheticSpec("mix", max_prompt_tokens=100), 50)
    assert len(mix) == 50 and max(r.prompt_tokens for r in mix) <= 100
