"""Chained block hashes from segments: equal exactly where the whole prefix is equal."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.workload import Segment, prefix_block_hashes, prefix_block_keys

ROOT = 12345
# Few seeds and short segments, lengths often multiples of the block: many prompts share
# prefixes, cut them at block edges or not, and reuse a seed in another segment.
_segment = st.builds(
    Segment, st.integers(0, 3), st.one_of(st.integers(1, 40), st.sampled_from([4, 16, 32]))
)
_segments = st.lists(_segment, min_size=1, max_size=6)


@st.composite
def _case(draw: st.DrawFn) -> tuple[list[Segment], list[Segment], int]:
    """Two prompts and a block size: leading segments shared, then middles of whole
    blocks (so that what follows is cut alike), then tails that are often equal too, so
    that equal blocks follow unequal prefixes."""
    block_tokens = draw(st.sampled_from([1, 4, 16]))
    whole = st.builds(
        lambda seed, n: Segment(seed, n * block_tokens), st.integers(0, 3), st.integers(1, 3)
    )
    shared = draw(st.lists(_segment, max_size=3))
    mid_a, mid_b = draw(st.lists(whole, max_size=2)), draw(st.lists(whole, max_size=2))
    tail_a = draw(_segments)
    tail_b = tail_a if draw(st.booleans()) else draw(_segments)
    return shared + mid_a + tail_a, shared + mid_b + tail_b, block_tokens


@settings(max_examples=500, derandomize=True, deadline=None)
@given(case=_case())
def test_equal_hash_exactly_where_the_block_keys_so_far_are_equal(
    case: tuple[list[Segment], list[Segment], int],
) -> None:
    a, b, block_tokens = case
    keys_a, keys_b = prefix_block_keys(a, block_tokens), prefix_block_keys(b, block_tokens)
    hashes_a = prefix_block_hashes(a, block_tokens, ROOT)
    hashes_b = prefix_block_hashes(b, block_tokens, ROOT)
    assert len(hashes_a) == len(keys_a) == sum(s.num_tokens for s in a) // block_tokens
    for i in range(min(len(keys_a), len(keys_b))):
        assert (hashes_a[i] == hashes_b[i]) == (keys_a[: i + 1] == keys_b[: i + 1])
    assert all(0 <= h < 2**63 for h in hashes_a)


def test_same_block_content_after_a_different_prefix_hashes_differently() -> None:
    a = [Segment(1, 16), Segment(2, 32)]
    b = [Segment(3, 16), Segment(2, 32)]
    assert prefix_block_keys(a, 16)[1:] == prefix_block_keys(b, 16)[1:]
    hashes_a, hashes_b = prefix_block_hashes(a, 16, ROOT), prefix_block_hashes(b, 16, ROOT)
    assert all(x != y for x, y in zip(hashes_a, hashes_b, strict=True))


def test_a_segment_cut_in_two_is_other_content() -> None:
    # Seed 1 restarts its stream in the second segment: block 1 is tokens 16..20 then 0..12.
    cut = prefix_block_hashes([Segment(1, 20), Segment(1, 44)], 16, ROOT)
    whole = prefix_block_hashes([Segment(1, 64)], 16, ROOT)
    assert cut[0] == whole[0]
    assert cut[1] != whole[1] and cut[2] != whole[2]


def test_root_and_block_size_name_the_chain() -> None:
    segments = [Segment(7, 64)]
    assert prefix_block_hashes(segments, 16, ROOT) != prefix_block_hashes(segments, 16, 1)
    assert len(prefix_block_hashes(segments, 16, ROOT)) == 4
    assert prefix_block_hashes([Segment(7, 15)], 16, ROOT) == ()
