"""The block pool: sharing, deduplication, LRU eviction and block conservation."""

from __future__ import annotations

import pytest

from isocost.engine.kvcache import BlockPool


def test_allocation_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3)
    assert not pool.allocate(2)
    assert pool.num_free == 1 and pool.usage == 0.75


def test_committed_blocks_are_shared_and_matched_as_a_chain() -> None:
    pool = BlockPool(8)
    pool.allocate(3)
    pool.commit([11, 12, 13])
    assert pool.match([11, 12, 99, 13], max_blocks=10) == (2, 0)
    assert pool.match([11, 12, 13], max_blocks=2) == (2, 0)
    pool.acquire([11, 12])
    pool.release([11, 12, 13], 0)  # the first request ends: 13 becomes free, still cached
    assert pool.num_used == 2 and pool.match([11, 12, 13], 3) == (3, 1)


def test_commit_of_an_already_cached_hash_frees_the_duplicate() -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    pool.commit([5])
    pool.commit([5])  # a second request computed the same block concurrently
    assert pool.num_used == 3
    pool.commit([6, 6])  # the same within one call: applied in order
    assert pool.num_used == 2
    for block_hash in (5, 5, 6, 6):
        pool.release([block_hash], 0)
    assert pool.num_used == 0 and pool.is_cached(5) and pool.is_cached(6)


def test_eviction_takes_uncached_blocks_first_then_the_least_recent_tail() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    pool.commit([1, 2, 3])
    pool.release([1, 2, 3], 0)  # freed tail first: LRU order is 3, 2, 1
    assert pool.allocate(2)  # one never-cached block, then evicts 3
    assert [pool.is_cached(h) for h in (1, 2, 3)] == [True, True, False]
    assert not pool.allocate(3)


def test_an_empty_pool_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_a_block_held_twice_by_one_request_is_released_twice() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    pool.commit([7, 7, 8])  # one request whose prompt repeats a block hash
    pool.acquire([8])
    pool.release([7, 7, 8], 0)
    assert pool.num_used == 1 and pool.match([8], 1) == (1, 0)
    pool.release([8], 0)
    assert pool.num_used == 0 and pool.match([7, 8], 2) == (2, 2)
