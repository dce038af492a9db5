"""The per-replica prefix index: contiguous matches, LRU bounds, removal."""

from __future__ import annotations

from isocost.prefix.hashing import token_block_hashes
from isocost.prefix.index import PrefixIndex


def _blocks(tokens: list[int]) -> list[int]:
    return token_block_hashes(tokens, 4)


def test_match_reports_contiguous_blocks_per_replica() -> None:
    index = PrefixIndex()
    for replica in (0, 1, 2):
        index.add_replica(replica, 100)
    shared = list(range(16))  # 4 blocks
    index.insert(0, _blocks(shared))
    index.insert(1, _blocks(shared[:8]))
    index.insert(2, _blocks([99] * 16))
    query = _blocks([*shared, 1, 2, 3, 4])
    replicas, matched = index.match(query)
    assert dict(zip(replicas.tolist(), matched.tolist(), strict=True)) == {0: 4, 1: 2}
    assert index.match_replica(0, query) == 4
    assert index.match_replica(2, query) == 0


def test_capacity_evicts_deepest_blocks_first() -> None:
    index = PrefixIndex()
    index.add_replica(0, 3)
    index.insert(0, _blocks(list(range(20))))  # 5 blocks, room for 3
    assert index.num_blocks(0) == 3
    assert index.match_replica(0, _blocks(list(range(20)))) == 3  # the first three remain
    assert int(index.block_counts[0]) == 3


def test_gap_stops_the_match() -> None:
    index = PrefixIndex()
    index.add_replica(0, 10)
    blocks = _blocks(list(range(16)))
    index.insert(0, [blocks[0], blocks[2], blocks[3]])  # block 1 missing
    replicas, matched = index.match(blocks)
    assert replicas.tolist() == [0] and matched.tolist() == [1]


def test_evict_and_remove_replica() -> None:
    index = PrefixIndex()
    index.add_replica(0, 10)
    index.add_replica(1, 10)
    blocks = _blocks(list(range(16)))
    index.insert(0, blocks)
    index.insert(1, blocks)
    assert index.evict(0, 3) == 3
    assert index.match_replica(0, blocks) == 1
    index.remove_replica(1)
    replicas, matched = index.match(blocks)
    assert replicas.tolist() == [0] and matched.tolist() == [1]
    assert index.num_blocks(1) == 0


def test_shrinking_capacity_evicts() -> None:
    index = PrefixIndex()
    index.add_replica(0, 10)
    index.insert(0, _blocks(list(range(40))))
    index.add_replica(0, 4)
    assert index.num_blocks(0) == 4
