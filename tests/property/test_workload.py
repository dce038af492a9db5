"""Invariants of workload generation: determinism for a seed, prefixes shared end to end."""

from __future__ import annotations

import itertools
from random import Random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.workload import (
    Segment,
    TextRenderer,
    mean_rate_rps,
    multi_turn,
    poisson_arrivals,
    prefix_block_keys,
    scale_to_rate,
    scenario_mix,
)

segments = st.lists(
    st.builds(Segment, st.integers(0, 6), st.integers(1, 1200)), min_size=1, max_size=5
)
RENDERER = TextRenderer()


@settings(max_examples=60, deadline=None)
@given(a=segments, b=segments, block_tokens=st.sampled_from([1, 16, 512]))
def test_equal_block_keys_mean_equal_rendered_blocks(
    a: list[Segment], b: list[Segment], block_tokens: int
) -> None:
    words_a = RENDERER.render(a).split(" ")
    words_b = RENDERER.render(b).split(" ")
    keys_a = prefix_block_keys(a, block_tokens)
    keys_b = prefix_block_keys(b, block_tokens)
    assert len(keys_a) == len(words_a) // block_tokens
    for i, (ka, kb) in enumerate(zip(keys_a, keys_b, strict=False)):
        block = slice(i * block_tokens, (i + 1) * block_tokens)
        if ka == kb:
            assert words_a[block] == words_b[block]


@settings(max_examples=30, deadline=None)
@given(shared=segments, tail_a=segments, tail_b=segments)
def test_a_shared_segment_prefix_is_a_shared_text_prefix(
    shared: list[Segment], tail_a: list[Segment], tail_b: list[Segment]
) -> None:
    text_a = RENDERER.render(shared + tail_a)
    text_b = RENDERER.render(shared + tail_b)
    assert text_a.startswith(RENDERER.render(shared))
    assert text_b.startswith(RENDERER.render(shared))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_generators_are_deterministic_for_a_seed(seed: int) -> None:
    def mix(s: int) -> list[object]:
        rng = Random(s)
        return list(itertools.islice(scenario_mix(rng, poisson_arrivals(rng, 3.0)), 50))

    def sessions(s: int) -> list[object]:
        rng = Random(s)
        return list(multi_turn(rng, poisson_arrivals(rng, 1.0), 3, 3, 100, 20, 20, 1.0))

    assert mix(seed) == mix(seed)
    assert sessions(seed) == sessions(seed)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), rate=st.floats(0.1, 1000.0))
def test_rate_scaling_hits_the_target_and_keeps_order(seed: int, rate: float) -> None:
    rng = Random(seed)
    base = list(itertools.islice(scenario_mix(rng, poisson_arrivals(rng, 2.0)), 40))
    scaled = list(scale_to_rate(base, rate))
    assert mean_rate_rps(scaled) == pytest.approx(rate)
    assert [r.request_id for r in scaled] == [r.request_id for r in base]
    assert [r.prompt_tokens for r in scaled] == [r.prompt_tokens for r in base]
