"""The block pool: sharing, deduplication, LRU eviction and block conservation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.engine.kvcache import BlockPool
from isocost.engine.records import BlocksEvicted, BlocksStored


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


class _ListPool:
    """The pool's contract spelled out with a plain list as the LRU of free cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.uncached = num_blocks
        self.num_blocks = num_blocks
        self.refs: dict[int, int] = {}
        self.free: list[int] = []  # least recently freed first

    def match(self, hashes: list[int], max_blocks: int) -> tuple[int, int]:
        hits = free_hits = 0
        for block in hashes[:max_blocks]:
            if block not in self.refs and block not in self.free:
                break
            hits += 1
            free_hits += block in self.free
        return hits, free_hits

    def take(self, block: int) -> None:
        """One more reference on a cached block."""
        if block in self.free:
            self.free.remove(block)
        self.refs[block] = self.refs.get(block, 0) + 1

    def allocate(self, num_blocks: int) -> bool:
        if num_blocks > self.uncached + len(self.free):
            return False
        from_uncached = min(num_blocks, self.uncached)
        self.uncached -= from_uncached
        del self.free[: num_blocks - from_uncached]
        return True

    def commit(self, hashes: list[int]) -> None:
        for block in hashes:
            if block in self.refs or block in self.free:
                self.uncached += 1  # its private copy is freed
            self.take(block)

    def release(self, hashes: list[int], num_private: int) -> None:
        self.uncached += num_private
        for block in reversed(hashes):
            self.refs[block] -= 1
            if not self.refs[block]:
                del self.refs[block]
                self.free.append(block)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.uncached - len(self.free)


_pool_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit"] * 3 + ["raw", "commit", "commit", "grow", "release"]),
        st.one_of(  # a prompt as block ids: often one of a few that share prefixes
            st.sampled_from([[0, 1, 2, 3], [0, 1, 2, 4], [0, 1], [3, 3, 1]]),
            st.lists(st.integers(0, 4), min_size=1, max_size=7),
        ),
        st.integers(0, 3),  # which request, or how many blocks
    ),
    min_size=8,
    max_size=60,
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(ops=_pool_ops, num_blocks=st.integers(1, 24))
def test_pool_agrees_with_a_plain_list_model(
    ops: list[tuple[str, list[int], int]], num_blocks: int
) -> None:
    """Requests admitted, committed in chunks, grown and released in any interleaving,
    sharing prefixes (chained ids) or repeating blocks (raw ids): every answer, count and
    eviction is the model's."""
    pool, model = BlockPool(num_blocks), _ListPool(num_blocks)
    running: list[list[int]] = []  # per request: [cached, private, *chain]
    seen: set[int] = set()
    for op, prompt, k in ops:
        if op in ("admit", "raw"):
            chained = [hash(tuple(prompt[: i + 1])) for i in range(len(prompt))]
            chain = prompt if op == "raw" else chained
            seen.update(chain)
            hits, free_hits = pool.match(chain, len(chain) - k % 2)
            assert (hits, free_hits) == model.match(chain, len(chain) - k % 2)
            need = len(chain) - hits + k
            if need > pool.num_free - free_hits:
                continue
            pool.acquire(chain[:hits])
            for block in chain[:hits]:
                model.take(block)
            assert pool.allocate(need) and model.allocate(need)
            running.append([hits, need, *chain])
        elif running:
            request = running[k % len(running)]
            cached, private, chain = request[0], request[1], request[2:]
            if op == "commit":
                full = min(cached + len(prompt), cached + private, len(chain))
                pool.commit(chain[cached:full])
                model.commit(chain[cached:full])
                request[0], request[1] = full, private - (full - cached)
            elif op == "grow":
                grown = pool.allocate(k)
                assert grown == model.allocate(k)
                request[1] += k if grown else 0
            else:
                pool.release(chain[:cached], private)
                model.release(chain[:cached], private)
                running.remove(request)
        assert (pool.num_free, pool.num_used) == (model.uncached + len(model.free), model.num_used)
        assert {b for b in seen if pool.is_cached(b)} == set(model.refs) | set(model.free)
    while model.free:  # what is left is evicted in LRU order, one block at a time
        oldest = model.free[0]
        assert pool.allocate(pool.num_free_uncached + 1) and model.allocate(model.uncached + 1)
        assert not pool.is_cached(oldest)
        assert all(map(pool.is_cached, model.free))


def test_logged_changes_name_new_runs_with_their_parent_and_tokens() -> None:
    pool = BlockPool(8, log_changes=True)
    pool.allocate(2)
    pool.commit([21, 22], None, [1, 2, 3, 4])  # blocks of two tokens
    pool.allocate(3)
    pool.commit([21, 23, 24], None, [1, 2, 5, 6, 7, 8])  # 21 is shared: not new
    assert pool.changes == [
        BlocksStored((21, 22), None, (1, 2, 3, 4)),
        BlocksStored((23, 24), 21, (5, 6, 7, 8)),
    ]
    pool.changes.clear()
    pool.allocate(2)
    pool.commit([31, 22, 33], 7, [9, 9, 3, 4, 0, 0])  # a gap in the middle: two runs
    assert pool.changes == [BlocksStored((31,), 7, (9, 9)), BlocksStored((33,), 22, (0, 0))]


def test_logged_changes_report_evictions_in_order_and_not_a_free_block_reused() -> None:
    pool = BlockPool(3, log_changes=True)
    pool.allocate(3)
    pool.commit([1, 2, 3], None, [])
    pool.release([1, 2, 3], 0)
    pool.acquire([1])  # cached and free, taken again: still cached, nothing to report
    pool.allocate(1)  # evicts the least recent free one: 3
    assert pool.changes == [BlocksStored((1, 2, 3), None, ()), BlocksEvicted((3,))]
    assert BlockPool(2).changes is None  # not kept unless asked
